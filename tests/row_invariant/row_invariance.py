"""The test settings under which vLLM 0.32.0's CPU forward gives a token's row the
same bits whatever batch it runs in, so that an identity test's reference (plain
vLLM) cannot move with the batch, the prefix cache or what ran before it.

Two of the forward's kernels break that in vLLM's defaults (measured by
tests/test_row_invariance.py, which fails if either setting stops doing its job):

- CPU attention splits long key ranges into pieces sized by the whole batch's
  work (``VLLM_CPU_ATTN_SPLIT_KV``, on by default): a row's softmax is summed in
  another order beside other requests. Off, a row's result depends only on its
  query and keys within the engine tests' bounds (contexts of up to 768 tokens,
  steps of up to 256 tokens: tests/engine_utils.py); beyond them it can still
  move on two threads.
- oneDNN's matrix product (vLLM's CPU linear layers, ``_custom_ops.onednn_mm``)
  takes another kernel for a single row: at SmolLM2's down projection (K = 1536)
  an M = 1 product differs from the same row in any M >= 2 product. A one-row
  input is run as two rows here (the row twice), so every step runs the M >= 2
  kernel; the output is the first row.

Applied by the test process itself (tests/conftest.py) and, through this
folder's ``sitecustomize.py`` on ``PYTHONPATH``, by every Python process a test
starts (engines in their own process, tensor-parallel workers, ``vllm serve``).
"""

from __future__ import annotations

import os

ENV = {"VLLM_CPU_ATTN_SPLIT_KV": "0", "VLLM_FAFO_TEST_ROW_INVARIANT": "1"}
"""What a process needs in its environment; the second name switches the GEMM
wrapper on in processes that start with this folder on ``PYTHONPATH``."""

FOLDER = os.path.dirname(os.path.abspath(__file__))


def apply_environment() -> None:
    """This process and every process it starts: the settings above."""
    os.environ.update(ENV)
    paths = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    if FOLDER not in paths:
        os.environ["PYTHONPATH"] = os.pathsep.join([FOLDER, *paths])


def run_single_rows_as_two() -> None:
    """Wrap ``vllm._custom_ops.onednn_mm`` (vLLM 0.32.0; the CPU linear layers call it
    by attribute at every forward) so that a one-row input runs as two rows."""
    import torch
    from vllm import _custom_ops as ops

    original = ops.onednn_mm
    if getattr(original, "row_invariant", False):
        return

    def onednn_mm(handler, x: torch.Tensor, bias):
        if x.dim() == 2 and x.shape[0] == 1:
            return original(handler, x.expand(2, -1).contiguous(), bias)[:1]
        return original(handler, x, bias)

    onednn_mm.row_invariant = True
    onednn_mm.original = original
    ops.onednn_mm = onednn_mm
