"""A 16k-token context (vllm_fafo.tools.assets ``long16k``): FAFO's tokens equal plain vLLM's
for each compression policy, and each policy's lane state holds the bytes the documented
formula says at this max_model_len (Quest's page metadata grows with it).

Slow (a 16k-token prefill per engine on CPU): skipped in CI, run by hand; each
engine runs in its own process (tests/engine_process.py).
"""

from __future__ import annotations

import pytest

from .engine_configs import LANES_SPEC
from .engine_process import LONG_MODEL_LEN, run_case
from .engine_utils import assert_same_tokens
from .test_memory import documented_formula

pytestmark = [pytest.mark.engine, pytest.mark.slow]

LONG_LANES = {**LANES_SPEC, "num_lanes": 8, "kv_budget": 256}
LONG_SPECS = {
    "streaming": LONG_LANES,
    "quest": {**LONG_LANES, "compression": "quest"},
    "snapkv": {**LONG_LANES, "compression": "snapkv"},
}
"""Eight lanes pinned on over a 256-token region: 1.5 % of the context (the setting
docs/results/lanes.md's measurement ran)."""


@pytest.fixture(scope="module")
def plain_long_tokens(tmp_path_factory) -> list[list[int]]:
    return run_case("long16k", None, tmp_path_factory.mktemp("plain"))["tokens"]


@pytest.mark.parametrize("policy", sorted(LONG_SPECS))
def test_long_context_identical_to_plain_and_memory_as_formula(policy, plain_long_tokens, tmp_path):
    spec = LONG_SPECS[policy]
    result = run_case("long16k", spec, tmp_path)
    assert_same_tokens(plain_long_tokens, result["tokens"])
    rows = min(spec.get("max_lane_requests", 8), result["max_num_seqs"])
    for held, num_heads, num_kv_heads, head_size in result["layer_bytes"]:
        assert held == documented_formula(spec, rows, num_heads, num_kv_heads, head_size, LONG_MODEL_LEN, 4)
    assert result["metrics"]["tail_tokens"] > 0
    tokens = sum(map(len, result["tokens"]))
    print(f"{policy}: tau {tokens / (tokens - result['accepted']):.3f}, "
          f"accepted by origin {result['metrics']['accepted_tokens']}")
