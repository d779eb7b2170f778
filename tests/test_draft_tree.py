"""Draft trees: branch growth, branch attention against a dense reference, greedy
acceptance against a direct reference, the paged-cache write of an accepted branch."""

import random

import numpy as np
import pytest
import torch

from vllm_fafo.attention.branch_attention import request_branch_attention
from vllm_fafo.config import FafoConfig, FafoConfigError
from vllm_fafo.drafting.pool import NgramPool, Origin, RequestPool
from vllm_fafo.verification.draft_tree import (
    PLACEHOLDER,
    Branch,
    accept_greedy,
    attention_bias,
    branch_positions,
    greedy_matches,
    grow_branches,
    layout_request,
)


def test_branches_take_other_first_tokens_node_by_node_within_the_spine_and_budget():
    pool = NgramPool(max_key_len=2, capacity=8)
    pool.add([1, 2], (3, 4, 5), Origin.OUTPUT)  # the spine's own candidate
    pool.add([1, 2], (6, 7, 8), Origin.OUTPUT)  # same first token as a newer one: skipped
    pool.add([1, 2], (6, 9, 9), Origin.PROMPT)
    pool.add([2], (10, 11), Origin.OUTPUT)  # shorter key, still an alternative
    pool.add([2, 3], (12, 13, 14, 15), Origin.OUTPUT)  # off spine node 1 (after token 3)
    spine = [3, 4, 5]
    branches = grow_branches(RequestPool(pool, -1), [0, 1, 2], spine, max_branches=8, max_tokens=64)
    assert branches == [Branch(0, (6, 9, 9), rank=0), Branch(0, (10, 11), rank=1), Branch(1, (12, 13), rank=0)]
    firsts = [(b.node, b.tokens[0]) for b in branches]
    assert len(set(firsts)) == len(firsts)  # one branch per (node, first token)
    assert all(first != spine[node] for node, first in firsts)
    assert all(b.node + len(b.tokens) <= len(spine) for b in branches)
    assert len(grow_branches(RequestPool(pool, -1), [0, 1, 2], spine, max_branches=1, max_tokens=64)) == 1
    assert sum(len(b.tokens) for b in grow_branches(RequestPool(pool, -1), [0, 1, 2], spine, 8, max_tokens=4)) <= 4


def _dense_reference(q, k, v, visible_keys, scale):
    """Softmax over exactly the allowed keys, one query at a time, GQA by head groups."""
    out = torch.zeros_like(q)
    group = q.shape[1] // k.shape[1]
    for t in range(q.shape[0]):
        keys = k[visible_keys[t]]
        values = v[visible_keys[t]]
        for h in range(q.shape[1]):
            scores = (keys[:, h // group] @ q[t, h]) * scale
            out[t, h] = torch.softmax(scores, 0) @ values[:, h // group]
    return out


def _as_tiles(keys: torch.Tensor, values: torch.Tensor, block_size: int, gen: torch.Generator):
    """(n, Hk, D) keys and values as paged blocks (keys (blocks, Hk, D, block_size),
    values (blocks, Hk, block_size, D)), the last block's unused slots random."""
    n, hk, d = keys.shape
    padded = -(-n // block_size) * block_size
    keys = torch.cat([keys, torch.randn(padded - n, hk, d, generator=gen)]).view(-1, block_size, hk, d)
    values = torch.cat([values, torch.randn(padded - n, hk, d, generator=gen)]).view(-1, block_size, hk, d)
    return keys.permute(0, 2, 3, 1), values.permute(0, 2, 1, 3)


@pytest.mark.parametrize("x_position", [0, 5, 17])
def test_branch_attention_matches_dense_reference(x_position):
    gen = torch.Generator().manual_seed(x_position)
    hq, hk, d = 4, 2, 16
    spine_len = 3
    context = x_position + 1 + spine_len  # paged positions written this step: x and the spine
    branches = [Branch(0, (1, 2, 3)), Branch(1, (4, 5)), Branch(2, (6,))]
    request = layout_request("r", 0, 0, x_position, 0, branches)
    t = request.num_tokens
    q = torch.randn(t, hq, d, generator=gen)
    k, v = torch.randn(t, hk, d, generator=gen), torch.randn(t, hk, d, generator=gen)
    paged_k, paged_v = torch.randn(context, hk, d, generator=gen), torch.randn(context, hk, d, generator=gen)
    scale = d ** -0.5
    got = request_branch_attention(q, k, v, *_as_tiles(paged_k, paged_v, block_size=4, gen=gen), request, scale,
                                   torch.from_numpy(attention_bias(request)))
    all_k, all_v = torch.cat([paged_k, k]), torch.cat([paged_v, v])
    visible, token = [], 0
    positions = branch_positions(request)
    for branch in branches:
        for i in range(len(branch.tokens)):
            own = [context + token - i + j for j in range(i + 1)]
            visible.append(list(range(x_position + branch.node + 1)) + own)
            assert positions[token] == x_position + branch.node + 1 + i
            token += 1
    torch.testing.assert_close(got, _dense_reference(q, all_k, all_v, visible, scale))


def _target(prefix: tuple[int, ...]) -> int:
    """A deterministic greedy 'model' over a 3-token vocabulary."""
    return random.Random(hash(prefix)).randrange(3)


def _greedy_path(text, draft):
    """Tokens the target accepts along ``draft`` after ``text``, then its own next token."""
    out = []
    for token in draft:
        if _target(tuple(text) + tuple(out)) != token:
            break
        out.append(token)
    return out + [_target(tuple(text) + tuple(out))]


def test_greedy_acceptance_is_the_longest_accepted_root_to_leaf_path():
    rng = random.Random(0)
    wins = 0
    for _ in range(400):
        text = [rng.randrange(3) for _ in range(5)]
        spine = [rng.randrange(3) for _ in range(4)]
        branches = []
        for node in range(4):
            for _ in range(rng.randrange(3)):
                branches.append(Branch(node, tuple(rng.randrange(3) for _ in range(rng.randint(1, 4 - node)))))
        request = layout_request("r", 0, 0, 10, 0, branches)
        spine_row = _greedy_path(text, spine)
        row = np.full(5, PLACEHOLDER)
        row[: len(spine_row)] = spine_row
        argmax = np.array([
            _target(tuple(text) + tuple(spine[: b.node]) + b.tokens[: i + 1])
            for b in branches for i in range(len(b.tokens))
        ])
        best = spine_row
        for branch in branches:
            if list(spine[: branch.node]) == spine_row[: branch.node]:
                path = spine_row[: branch.node] + _greedy_path(text + spine[: branch.node], branch.tokens)
                if len(path) > len(best):
                    best = path
        got = accept_greedy(row, request, greedy_matches(row, request, argmax), argmax)
        if best is spine_row:
            assert got is None
        else:
            wins += 1
            assert got[2] == best and got[1] == len(best) - 1 - branches[got[0]].node
    assert wins > 40


def _target_probs(context: tuple[int, ...], vocab: int = 4) -> np.ndarray:
    """A fixed, uneven distribution per context (the 'model' of the sampled test)."""
    weights = np.random.default_rng(hash(context) % 2**32).random(vocab) ** 2 + 0.05
    return weights / weights.sum()


def _draw(probs: np.ndarray, rng: np.random.Generator) -> int:
    return int(rng.choice(len(probs), p=probs / probs.sum()))


def test_sampled_acceptance_keeps_the_target_distribution():
    """vLLM's one-hot rejection sampling of the spine, then accept_sampled on the
    branches, then the rest sampled from the target: every 3-token sequence comes out
    with its probability under the target (binned exactly: 64 sequences)."""
    from vllm_fafo.verification.draft_tree import accept_sampled

    rng = np.random.default_rng(0)
    torch.manual_seed(0)
    text, spine = (1, 2), [0, 1, 2]
    branches = [Branch(0, (1, 0, 3)), Branch(0, (2, 2)), Branch(0, (3,)), Branch(1, (0, 0)), Branch(1, (3, 1))]
    request = layout_request("r", 0, 0, 10, 0, branches)
    probs = torch.tensor(np.array([
        _target_probs(text + tuple(spine[: b.node]) + b.tokens[: i + 1])
        for b in branches for i in range(len(b.tokens))
    ]), dtype=torch.float32)
    length, trials, branch_wins = 3, 20_000, 0
    counts = np.zeros((4,) * length)
    for _ in range(trials):
        row = np.full(len(spine) + 1, PLACEHOLDER)
        for i, token in enumerate(spine):  # vLLM: accept with p(token), else draw the residual
            target = _target_probs(text + tuple(spine[:i]))
            if rng.random() < target[token]:
                row[i] = token
                continue
            target[token] = 0.0
            row[i] = _draw(target, rng)
            break
        else:
            row[len(spine)] = _draw(_target_probs(text + tuple(spine)), rng)
        win = accept_sampled(row, request, probs, None)
        out = [int(t) for t in row if t != PLACEHOLDER] if win is None else win[2]
        branch_wins += win is not None
        while len(out) < length:
            out.append(_draw(_target_probs(text + tuple(out)), rng))
        counts[tuple(out[:length])] += 1
    exact = np.array([[[_target_probs(text)[a] * _target_probs(text + (a,))[b] * _target_probs(text + (a, b))[c]
                        for c in range(4)] for b in range(4)] for a in range(4)])
    total_variation = 0.5 * np.abs(counts / trials - exact).sum()
    assert branch_wins > trials // 10
    assert total_variation < 0.04, total_variation


def test_which_requests_get_branches():
    from vllm import SamplingParams

    from vllm_fafo.verification.draft_tree import keeps_exact_with_branches

    assert keeps_exact_with_branches(SamplingParams(temperature=0.0))
    assert keeps_exact_with_branches(SamplingParams(temperature=0.8, top_p=0.9, top_k=20))
    assert keeps_exact_with_branches(SamplingParams(temperature=0.8, seed=3))  # its own generator
    for refused in (dict(temperature=0.8, min_p=0.1), dict(temperature=0.0, logprobs=1),
                    dict(temperature=0.8, repetition_penalty=1.1), dict(temperature=0.0, min_tokens=4)):
        assert not keeps_exact_with_branches(SamplingParams(**refused)), refused


def test_sampling_probs_are_temperature_top_k_top_p_then_softmax():
    """Against the filters written out: top-k keeps the k largest logits; top-p (vLLM)
    keeps the largest tokens whose probabilities sum to at least p."""
    from vllm import SamplingParams

    from vllm_fafo.verification.draft_tree import sampling_probs

    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, 3.0], [0.0, 0.1, 0.2, 0.3, 0.4, 0.5]])
    got = sampling_probs(logits, SamplingParams(temperature=0.5, top_k=3))
    expected = torch.softmax(torch.where(logits >= logits.topk(3).values[:, -1:], logits / 0.5, -torch.inf), -1)
    torch.testing.assert_close(got, expected)
    got = sampling_probs(logits, SamplingParams(temperature=2.0, top_p=0.6))
    for row, probs in zip(logits, got):
        full = torch.softmax(row / 2.0, -1)
        order = full.argsort(descending=True)
        keep = order[: int((full[order].cumsum(0) < 0.6).sum()) + 1]
        torch.testing.assert_close(probs, torch.zeros(6).index_put((keep,), full[keep] / full[keep].sum()))


def test_paged_cache_write_is_read_back_and_is_what_vllm_would_have_written():
    from vllm import _custom_ops as ops

    from vllm_fafo.attention.paged_kv import CPUPagedKV

    gen = torch.Generator().manual_seed(1)
    blocks, hk, block_size, d, n = 6, 2, 16, 32, 40
    key, value = torch.randn(n, hk, d, generator=gen), torch.randn(n, hk, d, generator=gen)
    block_table = torch.tensor([[4, 1, 5]], dtype=torch.int32)
    positions = torch.arange(n)
    slots = block_table[0, positions // block_size].long() * block_size + positions % block_size

    def vllm_cache(k, v):
        cache = torch.zeros(blocks, hk, block_size, 2 * d)
        key_cache, value_cache = cache.view(blocks, hk, 2 * block_size, d).chunk(2, dim=2)
        ops.cpu_attn_reshape_and_cache(k, v, key_cache, value_cache, slots, "vec",
                                       k_scale=1.0, v_scale=1.0, kv_cache_dtype="auto")
        return cache

    replaced = torch.tensor([14, 15, 16, 33])
    new_key, new_value = key.clone(), value.clone()
    new_key[replaced] = torch.randn(len(replaced), hk, d, generator=gen)
    new_value[replaced] = torch.randn(len(replaced), hk, d, generator=gen)
    cache = vllm_cache(key, value)
    CPUPagedKV(cache, block_table, "vec").write(0, replaced, new_key[replaced], new_value[replaced])
    assert torch.equal(cache, vllm_cache(new_key, new_value))


def test_cacheback_passes_its_tree_keys_on():
    from vllm_fafo.modes import parse_speculative_config

    config = parse_speculative_config({"method": "cacheback", "num_candidates": 3, "max_tree_tokens": 12})
    assert (config.num_candidates, config.tree_tokens, config.num_lanes) == (3, 12, 0)
    with pytest.raises(FafoConfigError, match="max_tree_tokens"):
        parse_speculative_config({"method": "cacheback", "num_candidates": 3, "max_tree_tokens": 2})


def test_tree_keys_are_validated():
    k4 = {"method": "fafo", "num_speculative_tokens": 4}
    assert FafoConfig.from_user_dict({**k4, "num_lanes": 0, "num_candidates": 4}).tree_tokens == 16
    assert FafoConfig.from_user_dict({**k4, "num_candidates": 2, "max_tree_tokens": 6}).tree_tokens == 6
    with pytest.raises(FafoConfigError, match="max_tree_tokens"):
        FafoConfig.from_user_dict({**k4, "num_lanes": 0, "num_candidates": 2, "max_tree_tokens": 2})
    with pytest.raises(FafoConfigError, match="num_candidates"):
        FafoConfig.from_user_dict({"method": "fafo", "num_lanes": 0, "num_candidates": 0})
