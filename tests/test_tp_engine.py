"""Tensor parallel 2 (vLLM's CPU backend, two worker processes): FAFO's tokens equal
plain vLLM's at TP 2, and both ranks' proposers did the same thing.

Each engine runs in its own process (tests/engine_process.py) on SmolLM2 with its
heads padded to a multiple of two (vllm_fafo.assets.smollm2_tp2_dir).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from .conftest import LANES_SPEC
from .engine_utils import assert_same_tokens

pytestmark = pytest.mark.engine

ROOT = Path(__file__).resolve().parents[1]


def run_case(case: str, spec: dict | None, tmp_path: Path) -> dict:
    """tests/engine_process.py's ``case`` with ``spec`` (None: plain vLLM), in its own process."""
    out = tmp_path / "out.json"
    result = subprocess.run(
        [sys.executable, "-m", "tests.engine_process", case, "none" if spec is None else json.dumps(spec), str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=1800,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def plain_tp2_tokens(tmp_path_factory) -> list[list[int]]:
    return run_case("tp2", None, tmp_path_factory.mktemp("plain"))["tokens"]


@pytest.mark.parametrize("spec", [{"method": "fafo"}, LANES_SPEC], ids=["default", "lanes"])
def test_tp2_identical_to_plain_and_ranks_agree(spec, plain_tp2_tokens, tmp_path):
    result = run_case("tp2", spec, tmp_path)
    assert_same_tokens(plain_tp2_tokens, result["tokens"])
    rank0, rank1 = result["snapshots"]
    # Same drafts (per origin), lookups, lanes, tree tokens and controller state (its
    # cost curve included: rank 0's step time is shared) on both ranks.
    assert rank0 == rank1
    assert sum(rank0["accepted_tokens"].values()) > 0
    if spec is LANES_SPEC:
        assert rank0["tail_tokens"] > 0 and rank0["proposed_tokens"]["lane"] > 0
