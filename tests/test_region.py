"""Compressed region and lane attention against dense references.

A simulated engine drives FumbleLanes (the planner) and CompressedRegion (one
attention layer) through prefill chunks and decode steps with varying
accepted counts. Every token position has a "true" key/value; rejected drafts
and lane tokens get random ones. After every step the region must hold
exactly the sinks and latest window of the true KV, and every lane token's
output must equal softmax attention over exactly the keys it may see.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from vllm_fafo.attention.region import CompressedRegion
from vllm_fafo.compression import StreamingPolicy
from vllm_fafo.fumble import BatchView, FumbleLanes
from vllm_fafo.step_plan import current_plan

HQ, HK, D = 4, 2, 8
SCALE = D**-0.5


class Request:
    def __init__(self, req_id: str, prompt_len: int, seed: int):
        gen = torch.Generator().manual_seed(seed)
        self.req_id = req_id
        self.prompt_len = prompt_len
        self.true_k = torch.randn(600, HK, D, generator=gen)
        self.true_v = torch.randn(600, HK, D, generator=gen)
        self.computed = 0  # positions whose true KV the engine has

    @property
    def prefilling(self) -> bool:
        return self.computed < self.prompt_len


def dense_lane_reference(q, keys, values, allowed):
    """Per query row: softmax over exactly the allowed key rows (GQA)."""
    out = torch.zeros(q.shape[0], HQ, D)
    for i in range(q.shape[0]):
        idx = torch.tensor(allowed[i])
        for h in range(HQ):
            kv = h // (HQ // HK)
            scores = (keys[idx, kv] @ q[i, h]) * SCALE
            out[i, h] = torch.softmax(scores, dim=0) @ values[idx, kv]
    return out


def run_simulation(policy, requests, chunk, num_lanes, lane_len, max_drafts, steps, seed):
    rng = np.random.default_rng(seed)
    lanes = FumbleLanes(
        num_lanes=num_lanes, lane_len=lane_len, max_key_len=3, max_drafts=max_drafts,
        max_model_len=4096, region_rows=len(requests) + 1, policy=policy,
    )
    region = None
    checked_lane_tokens = 0
    for _ in range(steps):
        keys, values, qsl, firsts, drafts, plan_rows = [], [], [0], [], [], []
        for req in requests:
            first = req.computed
            if req.prefilling:
                size = min(chunk, req.prompt_len - first)
                keys.append(req.true_k[first : first + size])
                values.append(req.true_v[first : first + size])
                drafts.append(0)
                plan_rows.append((req, first, size, 0))
            else:
                num_drafts = int(rng.integers(0, max_drafts + 1))
                accepted = int(rng.integers(0, num_drafts + 1))
                step_k = req.true_k[first : first + 1 + num_drafts].clone()
                step_v = req.true_v[first : first + 1 + num_drafts].clone()
                step_k[1 + accepted :] = torch.randn_like(step_k[1 + accepted :])  # rejected
                step_v[1 + accepted :] = torch.randn_like(step_v[1 + accepted :])
                keys.append(step_k)
                values.append(step_v)
                drafts.append(num_drafts)
                plan_rows.append((req, first, 1 + num_drafts, accepted))
            qsl.append(qsl[-1] + len(keys[-1]))
            firsts.append(first)
        num_real = qsl[-1]
        ids, _ = lanes.plan_step(BatchView(
            req_ids=[r.req_id for r in requests], query_start_loc=np.array(qsl),
            num_computed_tokens=np.array(firsts), num_drafts=drafts,
            num_tokens=num_real, capacity=10_000,
        ))
        plan = current_plan()
        key = torch.cat(keys + [torch.randn(len(ids), HK, D)])
        value = torch.cat(values + [torch.randn(len(ids), HK, D)])
        query = torch.randn(key.shape[0], HQ, D)
        output = torch.zeros(key.shape[0], HQ, D)
        if region is None:
            region = CompressedRegion.allocate(plan, key)
        region.run_step(plan, query, key, value, output, SCALE)

        tails = {t.region_row: t for t in plan.tails}
        for req, first, size, accepted in plan_rows:
            row = lanes._requests[req.req_id].region_row
            last = first if not req.prefilling else first + size - 1
            # Region == sinks + latest window of the true KV up to `last`.
            expected_pos = {}
            for p in range(last + 1):
                expected_pos[int(policy.slots([p])[0])] = p
            base = row * policy.kv_budget
            for slot, p in expected_pos.items():
                torch.testing.assert_close(region.key[base + slot], req.true_k[p], rtol=0, atol=0)
                torch.testing.assert_close(region.value[base + slot], req.true_v[p], rtol=0, atol=0)
            tail = tails.get(row)
            if tail is not None:
                rows = slice(tail.tail_start, tail.tail_start + tail.num_tokens)
                visible = sorted(expected_pos.values())
                keys_all = torch.cat([req.true_k[visible], key[rows]])
                values_all = torch.cat([req.true_v[visible], value[rows]])
                allowed = []
                for i in range(tail.num_tokens):
                    own = [len(visible) + j for j in range(tail.num_tokens)
                           if j % tail.active_lanes == i % tail.active_lanes
                           and j // tail.active_lanes <= i // tail.active_lanes]
                    allowed.append(list(range(len(visible))) + own)
                want = dense_lane_reference(query[rows], keys_all, values_all, allowed)
                torch.testing.assert_close(output[rows], want, rtol=1e-5, atol=1e-5)
                checked_lane_tokens += tail.num_tokens
            was_prefilling = req.prefilling
            req.computed = first + size if was_prefilling else first + 1 + accepted
            if was_prefilling and not req.prefilling:
                lanes.start_lanes(req.req_id, list(range(req.prompt_len)))
        lanes.consume_tail(torch.zeros(key.shape[0], 5), lambda h: h)  # advance lanes
    return checked_lane_tokens


@pytest.mark.parametrize(
    "sink, budget, prompt_lens, chunk",
    [
        (4, 32, [50], 512),  # one request, prompt longer than the budget
        (4, 32, [10], 512),  # prompt shorter than the budget
        (2, 16, [9, 40, 23], 512),  # several requests of different lengths
        (0, 12, [30, 5], 7),  # chunked prefill, no sinks
    ],
)
def test_region_and_lane_attention_match_dense_reference(sink, budget, prompt_lens, chunk):
    policy = StreamingPolicy(sink, budget)
    requests = [Request(f"r{i}", n, seed=i) for i, n in enumerate(prompt_lens)]
    checked = run_simulation(policy, requests, chunk, num_lanes=3, lane_len=2,
                             max_drafts=4, steps=25, seed=len(prompt_lens))
    assert checked > 0


def test_lanes_shrink_to_fit_the_free_token_slots():
    policy = StreamingPolicy(2, 16)
    lanes = FumbleLanes(num_lanes=8, lane_len=2, max_key_len=2, max_drafts=2,
                        max_model_len=4096, region_rows=4, policy=policy)
    req_ids = ["a", "b"]
    # Prefill both (positions 0..4), then start their lanes.
    lanes.plan_step(BatchView(req_ids, np.array([0, 5, 10]), np.array([0, 0]), [0, 0], 10, 100))
    for r in req_ids:
        lanes.start_lanes(r, [1, 2, 3, 4, 5])
    ids, _ = lanes.plan_step(BatchView(req_ids, np.array([0, 1, 2]), np.array([5, 5]), [0, 0], 2, 100))
    assert len(ids) == 2 * 8 * 2  # room for all lanes
    ids, _ = lanes.plan_step(BatchView(req_ids, np.array([0, 1, 2]), np.array([6, 6]), [0, 0], 2, 14))
    assert len(ids) == 2 * 3 * 2  # 12 free slots: 3 lanes of 2 tokens per request
    ids, _ = lanes.plan_step(BatchView(req_ids, np.array([0, 1, 2]), np.array([7, 7]), [0, 0], 2, 5))
    assert len(ids) == 0 and current_plan() is not None  # no lanes, region still updated
