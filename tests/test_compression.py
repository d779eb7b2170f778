"""Policy building blocks against loop-written references on small random
tensors (GQA included), the CPU paged-KV reader against vLLM's own cache
writer, and the policy registry's config keys."""

from __future__ import annotations

import pytest
import torch

from vllm_fafo.config import FafoConfig, FafoConfigError
from vllm_fafo.lanes.compression.quest import QuestPolicy, QuestSettings, quest_scores
from vllm_fafo.lanes.compression.snapkv import SnapKVPolicy, SnapKVSettings, snapkv_votes


@pytest.mark.parametrize("hq, hk", [(4, 4), (6, 2), (4, 1)])
def test_quest_scores_match_loop_reference(hq, hk):
    gen = torch.Generator().manual_seed(hq * 10 + hk)
    d, pages, tokens = 5, 7, 3
    query = torch.randn(tokens, hq, d, generator=gen)
    a, b = torch.randn(pages, hk, d, generator=gen), torch.randn(pages, hk, d, generator=gen)
    kmin, kmax = torch.minimum(a, b), torch.maximum(a, b)
    got = quest_scores(query, kmin, kmax)
    group = hq // hk
    for kv in range(hk):
        for page in range(pages):
            want = 0.0
            for h in range(kv * group, (kv + 1) * group):
                per_token = []
                for t in range(tokens):
                    per_token.append(sum(
                        max(float(query[t, h, c] * kmin[page, kv, c]), float(query[t, h, c] * kmax[page, kv, c]))
                        for c in range(d)
                    ))
                want += max(per_token)
            assert got[kv, page].item() == pytest.approx(want, rel=1e-5, abs=1e-5)


def test_quest_bound_is_an_upper_bound_of_every_key_in_the_page():
    gen = torch.Generator().manual_seed(0)
    keys = torch.randn(16, 1, 8, generator=gen)
    query = torch.randn(1, 1, 8, generator=gen)
    bound = quest_scores(query, keys.min(dim=0, keepdim=True).values, keys.max(dim=0, keepdim=True).values)
    assert bound.item() >= (keys[:, 0] @ query[0, 0]).max().item() - 1e-6


@pytest.mark.parametrize("hq, hk, kernel", [(2, 2, 1), (6, 2, 3), (4, 1, 5)])
def test_snapkv_votes_match_loop_reference(hq, hk, kernel):
    gen = torch.Generator().manual_seed(hq + hk + kernel)
    d, length, window, scale = 4, 11, 3, 0.5
    query = torch.randn(window, hq, d, generator=gen)
    keys = torch.randn(length, hk, d, generator=gen)
    first = length - window
    got = snapkv_votes(query, keys, first, scale, kernel)
    group = hq // hk
    for kv in range(hk):
        votes = torch.zeros(length)
        for h in range(kv * group, (kv + 1) * group):
            for i in range(window):
                pos = first + i
                votes[: pos + 1] += torch.softmax(keys[: pos + 1, kv] @ query[i, h] * scale, dim=0) / group
        r = kernel // 2
        pooled = torch.stack([votes[max(0, j - r) : j + r + 1].mean() for j in range(length)])
        torch.testing.assert_close(got[kv], pooled, rtol=1e-5, atol=1e-6)


def assert_reader_returns(reader, batch_row, key, value, per_head):
    """The reader gives back ``key``/``value`` (positions 0..n-1), all heads and per KV head."""
    got_key, got_value = reader.read(batch_row, torch.arange(key.shape[0]))
    assert torch.equal(got_key, key) and torch.equal(got_value, value)
    for length in (1, 16, 17, key.shape[0]):
        key_tiles, value_tiles = reader.read_tiles(batch_row, length)  # (blocks, Hk, D, bs), (blocks, Hk, bs, D)
        num_blocks, heads, dim, block_size = key_tiles.shape
        assert num_blocks == -(-length // block_size)
        prefix_key = key_tiles.permute(0, 3, 1, 2).reshape(num_blocks * block_size, heads, dim)
        prefix_value = value_tiles.transpose(1, 2).reshape(num_blocks * block_size, heads, dim)
        assert torch.equal(prefix_key[:length], key[:length])
        assert torch.equal(prefix_value[:length], value[:length])
    got_key, got_value = reader.read(batch_row, per_head)
    for h in range(key.shape[1]):
        assert torch.equal(got_key[:, h], key[per_head[h], h])
        assert torch.equal(got_value[:, h], value[per_head[h], h])


def test_paged_kv_reader_matches_vllm_cache_writer():
    from vllm import _custom_ops as ops

    from vllm_fafo.attention.paged_kv import CPUPagedKV

    gen = torch.Generator().manual_seed(0)
    blocks, hk, block_size, d, n = 8, 2, 32, 64, 90
    kv_cache = torch.zeros(blocks, hk, block_size, 2 * d)
    key_cache, value_cache = kv_cache.view(blocks, hk, 2 * block_size, d).chunk(2, dim=2)
    key, value = torch.randn(n, hk, d, generator=gen), torch.randn(n, hk, d, generator=gen)
    block_table = torch.tensor([[5, 2, 7, 1], [0, 3, 4, 6]], dtype=torch.int32)
    positions = torch.arange(n)
    slots = block_table[1, positions // block_size].long() * block_size + positions % block_size
    ops.cpu_attn_reshape_and_cache(key, value, key_cache, value_cache, slots, "vec",
                                   k_scale=1.0, v_scale=1.0, kv_cache_dtype="auto")
    reader = CPUPagedKV(kv_cache, block_table, "vec")
    assert_reader_returns(reader, 1, key, value, torch.tensor([[3, 80, 7], [1, 2, 89]]))
    reader.check(1, positions[:5], key[:5], value[:5])
    with pytest.raises(RuntimeError, match="layout changed"):
        reader.check(0, positions[:5], key[:5], value[:5])


def test_policy_keys_are_validated_and_reach_the_policy():
    config = FafoConfig.from_user_dict(
        {"method": "fafo", "compression": "quest", "quest_page_size": 8, "quest_refresh_steps": 2}
    )
    policy = config.make_policy()
    assert isinstance(policy, QuestPolicy)
    assert policy.settings == QuestSettings(page_size=8, refresh_steps=2)
    assert FafoConfig.from_dict(config.to_dict()) == config
    snap = FafoConfig.from_user_dict({"method": "fafo", "compression": "snapkv"}).make_policy()
    assert isinstance(snap, SnapKVPolicy) and snap.settings == SnapKVSettings()
    layout = snap.layout
    assert layout.kv_budget == 256 and layout.ring_slots == SnapKVSettings().recent_tokens


@pytest.mark.parametrize(
    "raw, message",
    [
        ({"compression": "h2o"}, "'compression'\\]='h2o' is not a known policy; allowed: 'streaming', 'quest', 'snapkv'"),
        ({"quest_page_size": 8}, "'quest_page_size'\\] belongs to compression 'quest', but compression is 'streaming'"),
        ({"compression": "quest", "snapkv_window": 8}, "belongs to compression 'snapkv'"),
        ({"compression": "quest", "quest_page_sise": 8}, "unknown key 'quest_page_sise'.*quest_page_size"),
        ({"compression": "quest", "quest_page_size": 0}, "'quest_page_size'\\]=0 is out of range"),
        ({"compression": "quest", "quest_refresh_steps": "4"}, "'quest_refresh_steps'\\]='4' must be an integer"),
        ({"compression": "quest", "kv_budget": 48, "quest_recent_tokens": 32},
         "Quest needs room for at least one page"),
        ({"compression": "snapkv", "snapkv_kernel": 4}, "'snapkv_kernel'\\]=4 must be odd"),
        ({"compression": "snapkv", "snapkv_recent_tokens": 3}, "'snapkv_recent_tokens'\\]=3 is out of range"),
        ({"compression": "snapkv", "kv_budget": 64, "snapkv_recent_tokens": 60}, "'snapkv_recent_tokens'\\]=60 is out of range"),
    ],
)
def test_bad_policy_keys_name_key_value_and_allowed(raw, message):
    with pytest.raises(FafoConfigError, match=message):
        FafoConfig.from_user_dict({"method": "fafo", **raw})
