"""Tensor parallel 2 (vLLM's CPU backend, two worker processes): FAFO's tokens equal
plain vLLM's at TP 2, and both ranks' proposers did the same thing.

Each engine runs in its own process (tests/engine_process.py) on SmolLM2 with its
heads padded to a multiple of two (vllm_fafo.tools.assets.smollm2_tp2_dir).
"""

from __future__ import annotations

import pytest

from .engine_configs import LANES_SPEC
from .engine_process import run_case
from .engine_utils import assert_same_tokens

pytestmark = pytest.mark.engine


@pytest.fixture(scope="module")
def plain_tp2_tokens(tmp_path_factory) -> list[list[int]]:
    return run_case("tp2", None, tmp_path_factory.mktemp("plain"))["tokens"]


def test_tp2_identical_to_plain_and_ranks_agree(plain_tp2_tokens, tmp_path):
    """Lanes pinned on: regions, lane attention and drafts on both ranks."""
    result = run_case("tp2", LANES_SPEC, tmp_path)
    assert_same_tokens(plain_tp2_tokens, result["tokens"])
    rank0, rank1 = result["snapshots"]
    # Same drafts (per origin), lookups, lanes, tree tokens and controller state (its
    # cost curve included: rank 0's step time is shared) on both ranks.
    assert rank0 == rank1
    assert sum(rank0["accepted_tokens"].values()) > 0
    assert rank0["tail_tokens"] > 0 and rank0["proposed_tokens"]["lane"] > 0
