"""Started with this folder on ``PYTHONPATH`` (tests/row_invariant/row_invariance.py
puts it there), a test's child process runs vLLM's CPU linear layers row-invariant."""

import os

if os.environ.get("VLLM_FAFO_TEST_ROW_INVARIANT") == "1":
    try:
        import vllm._custom_ops  # noqa: F401  (only where vLLM is installed)
    except ImportError:
        pass
    else:
        from row_invariance import run_single_rows_as_two

        run_single_rows_as_two()
