"""Started with this folder on ``PYTHONPATH`` (tests/row_invariant/row_invariance.py
puts it there), a test's child process runs vLLM's CPU linear layers row-invariant."""

import importlib.util
import os

if os.environ.get("VLLM_FAFO_TEST_ROW_INVARIANT") == "1" and importlib.util.find_spec("vllm") is not None:
    from row_invariance import run_single_rows_as_two

    run_single_rows_as_two()
