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
from vllm_fafo.lanes.compression import FullCachePolicy, QuestPolicy, SnapKVPolicy, StreamingPolicy
from vllm_fafo.lanes.compression.base import LayerShape
from vllm_fafo.lanes.compression.quest import QuestSettings
from vllm_fafo.lanes.compression.snapkv import SnapKVSettings
from vllm_fafo.lanes.planner import BatchView, FumbleLanes

HQ, HK, D = 4, 2, 8
SCALE = D**-0.5


class Request:
    def __init__(self, req_id: str, prompt_len: int, seed: int, cached: int = 0):
        """``cached``: prompt positions a prefix-cache hit gives it (the engine never computes them)."""
        gen = torch.Generator().manual_seed(seed)
        self.req_id = req_id
        self.prompt_len = prompt_len
        self.true_k = torch.randn(600, HK, D, generator=gen)
        self.true_v = torch.randn(600, HK, D, generator=gen)
        self.computed = cached  # positions whose true KV the engine has
        self.prefill_q = {}  # position -> query the prompt token had

    @property
    def prefilling(self) -> bool:
        return self.computed < self.prompt_len


def dense_lane_reference(q, visible, req, lane_k, lane_v, lane_allowed):
    """Per lane token and query head: softmax over exactly the allowed keys.

    ``visible[h]``: region positions KV head h sees; lane tokens see the
    ``lane_allowed[i]`` tail indices.
    """
    out = torch.zeros(q.shape[0], HQ, D)
    for i in range(q.shape[0]):
        own = torch.tensor(lane_allowed[i])
        for h in range(HQ):
            kv = h // (HQ // HK)
            pos = torch.tensor(sorted(visible[kv]), dtype=torch.long)
            keys = torch.cat([req.true_k[pos, kv], lane_k[own, kv]])
            values = torch.cat([req.true_v[pos, kv], lane_v[own, kv]])
            out[i, h] = torch.softmax((keys @ q[i, h]) * SCALE, dim=0) @ values
    return out


class FakePagedKV:
    """The paged cache as the simulated engine has it: true KV of final positions."""

    def __init__(self, batch: list[Request], final: list[int]):
        self.batch, self.final = batch, final

    def read(self, batch_row, positions):
        req = self.batch[batch_row]
        per_head = positions if positions.dim() == 2 else positions[None].expand(HK, -1)
        assert int(per_head.max()) < self.final[batch_row], "policy read a non-final position"
        heads = torch.arange(HK)[:, None].expand_as(per_head)
        return req.true_k[per_head, heads].transpose(0, 1), req.true_v[per_head, heads].transpose(0, 1)


def quest_reference(req, num_final, lane_q, layout, page):
    """Quest's page choice recomputed from scratch, per KV head (positions)."""
    first, last = -(-layout.sink_tokens // page), layout.oldest_in_ring(num_final) // page
    if last <= first:
        return None
    count = min(layout.selected_slots // page, last - first)
    chosen = []
    for kv in range(HK):
        scores = []
        for j in range(first, last):
            keys = req.true_k[j * page : (j + 1) * page, kv]
            kmin, kmax = keys.min(dim=0).values, keys.max(dim=0).values
            score = 0.0
            for h in range(kv * (HQ // HK), (kv + 1) * (HQ // HK)):
                score += max(float(torch.maximum(q[h] * kmin, q[h] * kmax).sum()) for q in lane_q)
            scores.append(score)
        top = sorted(np.argsort(scores)[::-1][:count] + first)
        chosen.append([p for j in top for p in range(j * page, (j + 1) * page)])
    return chosen


def snapkv_reference(req, num_final, layout, window, kernel):
    """SnapKV's choice recomputed with loops, per KV head (positions)."""
    prompt_len = req.prompt_len
    end = min(prompt_len, layout.oldest_in_ring(num_final))
    if end <= layout.sink_tokens:
        return None
    obs = range(max(0, prompt_len - window), prompt_len)
    group = HQ // HK
    chosen = []
    for kv in range(HK):
        votes = torch.zeros(prompt_len)
        for h in range(kv * group, (kv + 1) * group):
            for p in obs:
                q = req.prefill_q[p][h]
                weights = torch.softmax((req.true_k[: p + 1, kv] @ q) * SCALE, dim=0)
                votes[: p + 1] += weights / group
        radius = kernel // 2
        pooled = torch.stack([votes[max(0, j - radius) : j + radius + 1].mean() for j in range(prompt_len)])
        count = min(layout.selected_slots, end - layout.sink_tokens)
        top = pooled[layout.sink_tokens : end].topk(count).indices + layout.sink_tokens
        chosen.append(sorted(top.tolist()))
    return chosen


def default_reference(policy):
    """reference(req, num_final, lane_query, lane_step) -> positions per KV head,
    or None to keep the previous choice."""
    if policy.name == "quest":
        def quest(req, num_final, lane_q, lane_step):
            if (lane_step - 1) % policy.settings.refresh_steps:
                return None
            return quest_reference(req, num_final, lane_q, policy.layout, policy.settings.page_size)
        return quest
    if policy.name == "snapkv":
        def snapkv(req, num_final, lane_q, lane_step):
            if lane_step != 1:
                return None
            return snapkv_reference(req, num_final, policy.layout, policy.settings.window,
                                    policy.settings.kernel)
        return snapkv
    return lambda *args: None


class DirectLayer:
    """One attention layer as the region alone: the policy reads the fake paged cache."""

    def __init__(self, requests):
        self.requests = requests
        self.region = None

    def allocate(self, policy, rows, staged_slots, dtype):
        shape = LayerShape(rows, HQ, HK, D, 4096, dtype, torch.device("cpu"))
        self.region = CompressedRegion.allocate(policy, staged_slots, shape)

    def step(self, plan, query, key, value, output, final, writes):
        if plan is not None:  # None: the runner attaches no plan, the region is not touched
            self.region.run_step(plan, query, key, value, output, SCALE, FakePagedKV(self.requests, final))


def run_simulation(policy, requests, chunk, num_lanes, lane_len, max_drafts, steps, seed,
                   reference=None, layer=None, dtype=torch.float32, lanes_for=None, branch_share=0.0):
    """``branch_share``: in that share of decode steps with rejected drafts, a draft
    tree's branch wins instead and the request advances past the spine's accepted
    prefix (the paged cache holds the branch tokens' true KV).
    ``lanes_for`` chooses the lanes of each step as the goodput controller would;
    with it, steps that run no lanes skip the region's upkeep (``park_when_off``) and
    a region is only checked in the steps its lanes run.
    ``layer`` runs one attention layer's step (``DirectLayer`` by default);
    ``writes`` tells it which batch tokens are real: (batch row, batch start,
    first position, count). With a 16-bit ``dtype`` every input is rounded to
    it first, so references and policies see the same values, and only the
    lane outputs' arithmetic is at that precision."""
    reference = reference or default_reference(policy)
    layer = layer or DirectLayer(requests)
    rounded = lambda t: t.to(dtype).float()
    for req in requests:
        req.true_k, req.true_v = rounded(req.true_k), rounded(req.true_v)
    tolerance = 1e-5 if dtype == torch.float32 else 3e-2
    rng = np.random.default_rng(seed)
    layout = policy.layout
    lanes = FumbleLanes(
        num_lanes=num_lanes, lane_len=lane_len, max_key_len=3, max_drafts=max_drafts,
        max_model_len=4096, region_rows=len(requests) + 1, policy=policy, park_when_off=lanes_for is not None,
        paged_cache_readable=True,
    )
    layer.allocate(policy, lanes.region_rows, max_drafts, dtype)
    checked_lane_tokens = 0
    lane_steps = {r.req_id: 0 for r in requests}
    selected = {r.req_id: None for r in requests}  # expected positions per KV head
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
                branch = 0
                if accepted < num_drafts and rng.random() < branch_share:
                    branch = int(rng.integers(1, num_drafts - accepted + 1))
                step_k = req.true_k[first : first + 1 + num_drafts].clone()
                step_v = req.true_v[first : first + 1 + num_drafts].clone()
                step_k[1 + accepted :] = torch.randn_like(step_k[1 + accepted :])  # rejected
                step_v[1 + accepted :] = torch.randn_like(step_v[1 + accepted :])
                keys.append(step_k)
                values.append(step_v)
                drafts.append(num_drafts)
                plan_rows.append((req, first, 1 + num_drafts, (accepted, branch)))
            qsl.append(qsl[-1] + len(keys[-1]))
            firsts.append(first)
        num_real = qsl[-1]
        plan = lanes.plan_step(BatchView(
            req_ids=[r.req_id for r in requests], query_start_loc=np.array(qsl),
            num_computed_tokens=np.array(firsts), num_drafts=drafts,
            num_tokens=num_real, capacity=10_000,
        ), lanes_for)
        ids = plan.tail_ids if plan is not None else np.zeros(0, dtype=np.int64)  # None: lanes parked, nothing to do
        key = rounded(torch.cat(keys + [torch.randn(len(ids), HK, D)]))
        value = rounded(torch.cat(values + [torch.randn(len(ids), HK, D)]))
        query = rounded(torch.randn(key.shape[0], HQ, D))
        output = torch.zeros(key.shape[0], HQ, D, dtype=dtype)
        for (req, first, size, _), start in zip(plan_rows, qsl):
            if req.prefilling:
                for i in range(size):
                    req.prefill_q[first + i] = query[start + i]
        final = [first + size if req.prefilling else first + 1 for req, first, size, _ in plan_rows]
        writes = [(i, start, first, size) for i, ((_, first, size, _), start) in enumerate(zip(plan_rows, qsl))]
        layer.step(plan, query.to(dtype), key.to(dtype), value.to(dtype), output, final, writes)
        output = output.float()
        region = layer.region

        tails = {t.region_row: t for t in plan.tails} if plan is not None else {}
        for req, first, size, accepted in plan_rows:
            row = lanes._requests[req.req_id].region_row
            last = first if not req.prefilling else first + size - 1
            tail = tails.get(row)
            if tail is not None:
                lane_steps[req.req_id] += 1
                rows = slice(tail.tail_start, tail.tail_start + tail.num_tokens)
                chosen = reference(req, last + 1, query[rows], lane_steps[req.req_id])
                if chosen is not None:
                    selected[req.req_id] = chosen
            parked = lanes.park_when_off and tail is None and not req.prefilling
            # Sink and ring == sinks + latest window of the true KV up to `last`.
            ring_and_sink = {}
            for p in range(last + 1):
                ring_and_sink[int(layout.slots([p])[0])] = p
            base = row * layout.kv_budget
            for slot, p in ([] if parked else ring_and_sink.items()):
                torch.testing.assert_close(region.key[base + slot].float(), req.true_k[p], rtol=0, atol=0)
                torch.testing.assert_close(region.value[base + slot].float(), req.true_v[p], rtol=0, atol=0)
            # Selected part == the reference's choice, per KV head.
            chosen = selected[req.req_id]
            assert region.selected_count[row] == (len(chosen[0]) if chosen else 0)
            for kv in range(HK):
                for i, p in enumerate(chosen[kv] if chosen else []):
                    slot = base + layout.sink_tokens + i
                    torch.testing.assert_close(region.key[slot, kv].float(), req.true_k[p, kv], rtol=0, atol=0)
            if tail is not None:
                if policy.attends_full_cache:  # lanes read the whole context from the paged cache
                    visible = [set(range(last + 1)) for _ in range(HK)]
                else:
                    visible = [set(ring_and_sink.values()) | set(chosen[kv] if chosen else ()) for kv in range(HK)]
                lane_allowed = [
                    [j for j in range(tail.num_tokens)
                     if j % tail.active_lanes == i % tail.active_lanes
                     and j // tail.active_lanes <= i // tail.active_lanes]
                    for i in range(tail.num_tokens)
                ]
                want = dense_lane_reference(query[rows], visible, req, key[rows], value[rows], lane_allowed)
                torch.testing.assert_close(output[rows], want, rtol=tolerance, atol=tolerance)
                checked_lane_tokens += tail.num_tokens
            was_prefilling = req.prefilling
            if not was_prefilling and accepted[1]:
                lanes.spine_accepted(req.req_id, accepted[0])
            req.computed = first + size if was_prefilling else first + 1 + sum(accepted)
            if was_prefilling and not req.prefilling:
                lanes.start_lanes(req.req_id, list(range(req.prompt_len)))
        if plan is not None:
            lanes.consume_tail(plan, torch.zeros(key.shape[0], 5), lambda h: h)  # advance lanes
    return checked_lane_tokens, selected


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
    policy = StreamingPolicy(sink, budget, StreamingPolicy.Settings())
    requests = [Request(f"r{i}", n, seed=i) for i, n in enumerate(prompt_lens)]
    checked, _ = run_simulation(policy, requests, chunk, num_lanes=3, lane_len=2,
                                max_drafts=4, steps=25, seed=len(prompt_lens))
    assert checked > 0


@pytest.mark.parametrize(
    "sink, budget, settings, prompt_lens, chunk",
    [
        (4, 40, QuestSettings(page_size=4, refresh_steps=1, recent_tokens=8), [60], 512),
        (2, 26, QuestSettings(page_size=4, refresh_steps=3, recent_tokens=8), [9, 70, 33], 512),
        (0, 20, QuestSettings(page_size=4, refresh_steps=2, recent_tokens=8), [45, 6], 7),
        (4, 200, QuestSettings(page_size=4, refresh_steps=1, recent_tokens=8), [30], 512),  # budget > sequence
    ],
)
def test_quest_region_matches_dense_reference(sink, budget, settings, prompt_lens, chunk):
    policy = QuestPolicy(sink, budget, settings)
    requests = [Request(f"r{i}", n, seed=10 + i) for i, n in enumerate(prompt_lens)]
    checked, selected = run_simulation(policy, requests, chunk, num_lanes=3, lane_len=2,
                                       max_drafts=4, steps=25, seed=3)
    assert checked > 0 and any(chosen for chosen in selected.values())


@pytest.mark.parametrize(
    "sink, budget, settings, prompt_lens, chunk",
    [
        (4, 32, SnapKVSettings(window=6, kernel=3, recent_tokens=10), [50], 512),
        (2, 24, SnapKVSettings(window=4, kernel=1, recent_tokens=8), [9, 40, 23], 512),
        (0, 20, SnapKVSettings(window=8, kernel=5, recent_tokens=8), [45, 6], 7),  # window across chunks
        (4, 300, SnapKVSettings(window=6, kernel=3, recent_tokens=10), [30], 512),  # budget > sequence
    ],
)
def test_snapkv_region_matches_dense_reference(sink, budget, settings, prompt_lens, chunk):
    policy = SnapKVPolicy(sink, budget, settings)
    requests = [Request(f"r{i}", n, seed=20 + i) for i, n in enumerate(prompt_lens)]
    checked, selected = run_simulation(policy, requests, chunk, num_lanes=3, lane_len=2,
                                       max_drafts=4, steps=20, seed=4)
    assert checked > 0 and any(chosen for chosen in selected.values())


def test_full_cache_lanes_match_dense_reference():
    """The ``none`` policy (Lookahead mode): lanes see every final position, read from the cache."""
    policy = FullCachePolicy(4, 256, FullCachePolicy.Settings())
    requests = [Request(f"r{i}", n, seed=50 + i) for i, n in enumerate([9, 40, 23])]
    checked, _ = run_simulation(policy, requests, chunk=16, num_lanes=3, lane_len=2,
                                max_drafts=4, steps=20, seed=11)
    assert checked > 0


def off_and_on(seed: int, on_share: float = 0.4):
    """A lane chooser that turns lanes off and on at random, as the goodput controller may."""
    rng = np.random.default_rng(seed)
    return lambda real, lane_requests, decoding, most: most if rng.random() < on_share else 0


CATCH_UP_POLICIES = pytest.mark.parametrize(
    "policy",
    [
        StreamingPolicy(4, 32, StreamingPolicy.Settings()),
        StreamingPolicy(0, 12, StreamingPolicy.Settings()),
        QuestPolicy(2, 26, QuestSettings(page_size=4, refresh_steps=3, recent_tokens=8)),
        SnapKVPolicy(2, 24, SnapKVSettings(window=4, kernel=1, recent_tokens=8)),
    ],
    ids=["streaming", "streaming-no-sinks", "quest", "snapkv"],
)
"""Every policy, and sinks of 0: regions that read positions back from the paged cache."""


@CATCH_UP_POLICIES
def test_region_caught_up_from_the_paged_cache_after_steps_without_lanes(policy):
    # Sinks longer than some prompts: positions decoded while parked can fall in the sink.
    requests = [Request(f"r{i}", n, seed=70 + i) for i, n in enumerate([3, 40, 23])]
    checked, _ = run_simulation(policy, requests, chunk=16, num_lanes=3, lane_len=2, max_drafts=4,
                                steps=60, seed=12, lanes_for=off_and_on(5))
    assert checked > 0


@CATCH_UP_POLICIES
@pytest.mark.parametrize("lanes_for", [None, off_and_on(9)], ids=["lanes on", "lanes off and on"])
def test_region_after_a_prefix_cache_hit_matches_dense_reference(policy, lanes_for):
    """A request whose first chunk starts after a prefix-cache hit (hits shorter than
    the sinks, inside the ring, longer than the region; chunked) reads the hit back."""
    requests = [Request(f"r{i}", n, seed=110 + i, cached=hit)
                for i, (n, hit) in enumerate([(40, 1), (30, 20), (80, 64), (9, 3)])]
    checked, _ = run_simulation(policy, requests, chunk=8, num_lanes=3, lane_len=2, max_drafts=4,
                                steps=50, seed=14, lanes_for=lanes_for)
    assert checked > 0


def test_only_a_first_chunk_takes_a_row_and_a_hit_is_read_back_when_the_cache_is_readable():
    policy = StreamingPolicy(2, 8, StreamingPolicy.Settings())  # ring of 6 slots
    make = lambda readable: FumbleLanes(num_lanes=2, lane_len=2, max_key_len=2, max_drafts=2,
                                        max_model_len=4096, region_rows=1, policy=policy,
                                        paged_cache_readable=readable)
    lanes = make(readable=True)
    # "a" starts after a 20-token hit and takes the only row; "b" finds none.
    plan = lanes.plan_step(BatchView(["a", "b"], np.array([0, 5, 9]), np.array([20, 0]), [0, 0], 9, 100))
    (catch_up,) = plan.catch_up
    assert catch_up.positions.tolist() == [0, 1, 15, 16, 17, 18, 19]  # sinks + ring up to the chunk
    assert plan.new_rows == (0,) and lanes.num_regions_in_use == 1
    lanes.remove_requests(["a"])  # a row is free again, but "b" is past its first chunk
    plan = lanes.plan_step(BatchView(["b"], np.array([0, 4]), np.array([4]), [0], 4, 100))
    assert plan.new_rows == () and lanes.num_regions_in_use == 0
    unreadable = make(readable=False)
    plan = unreadable.plan_step(BatchView(["a"], np.array([0, 5]), np.array([20]), [0], 5, 100))
    assert plan.new_rows == () and plan.catch_up == ()  # runs pool-only


@pytest.mark.parametrize(
    "policy",
    [
        StreamingPolicy(4, 32, StreamingPolicy.Settings()),
        QuestPolicy(2, 26, QuestSettings(page_size=4, refresh_steps=3, recent_tokens=8)),
    ],
    ids=["streaming", "quest"],
)
@pytest.mark.parametrize("lanes_for", [None, off_and_on(7)], ids=["lanes on", "lanes off and on"])
def test_region_after_draft_tree_branches_won_matches_dense_reference(policy, lanes_for):
    """Only the spine's accepted drafts are committed from staging; the branch tokens
    after them are caught up from the paged cache."""
    requests = [Request(f"r{i}", n, seed=90 + i) for i, n in enumerate([6, 40])]
    checked, _ = run_simulation(policy, requests, chunk=16, num_lanes=3, lane_len=2, max_drafts=4,
                                steps=60, seed=13, lanes_for=lanes_for, branch_share=0.5)
    assert checked > 0


def test_steps_without_lanes_skip_the_region_and_the_next_lane_step_catches_up():
    policy = StreamingPolicy(2, 8, StreamingPolicy.Settings())  # ring of 6 slots
    lanes = FumbleLanes(num_lanes=2, lane_len=2, max_key_len=2, max_drafts=2,
                        max_model_len=4096, region_rows=2, policy=policy, park_when_off=True)
    lanes.plan_step(BatchView(["a"], np.array([0, 5]), np.array([0]), [0], 5, 100))  # prompt 0..4
    lanes.start_lanes("a", [1, 2, 3, 4, 5])
    off, on = (lambda *args: 0), (lambda *args: 2)
    for first_pos in range(5, 14):  # nine decode steps without lanes
        plan = lanes.plan_step(BatchView(["a"], np.array([0, 1]), np.array([first_pos]), [0], 1, 100), off)
        assert plan is None  # no region work and no lanes: nothing rides on the step
    plan = lanes.plan_step(BatchView(["a"], np.array([0, 1]), np.array([14]), [0], 1, 100), on)
    (catch_up,) = plan.catch_up
    assert catch_up.positions.tolist() == [9, 10, 11, 12, 13]  # 14 takes the oldest ring slot
    assert catch_up.dst.tolist() == policy.layout.slots(np.arange(9, 14)).tolist()
    assert plan.write_dst.tolist() == policy.layout.slots(np.array([14])).tolist()
    assert plan.num_tail_tokens == 2 * 2
    plan = lanes.plan_step(BatchView(["a"], np.array([0, 1]), np.array([15]), [0], 1, 100), on)
    assert plan.catch_up == ()  # in step again


def test_lanes_shrink_to_fit_the_free_token_slots():
    policy = StreamingPolicy(2, 16, StreamingPolicy.Settings())
    lanes = FumbleLanes(num_lanes=8, lane_len=2, max_key_len=2, max_drafts=2,
                        max_model_len=4096, region_rows=4, policy=policy)
    req_ids = ["a", "b"]
    # Prefill both (positions 0..4), then start their lanes.
    lanes.plan_step(BatchView(req_ids, np.array([0, 5, 10]), np.array([0, 0]), [0, 0], 10, 100))
    for r in req_ids:
        lanes.start_lanes(r, [1, 2, 3, 4, 5])
    plan = lanes.plan_step(BatchView(req_ids, np.array([0, 1, 2]), np.array([5, 5]), [0, 0], 2, 100))
    assert plan.num_tail_tokens == 2 * 8 * 2  # room for all lanes
    plan = lanes.plan_step(BatchView(req_ids, np.array([0, 1, 2]), np.array([6, 6]), [0, 0], 2, 14))
    assert plan.num_tail_tokens == 2 * 3 * 2  # 12 free slots: 3 lanes of 2 tokens per request
    plan = lanes.plan_step(BatchView(req_ids, np.array([0, 1, 2]), np.array([7, 7]), [0, 0], 2, 5))
    assert plan.num_tail_tokens == 0 and plan.has_region_work  # no lanes, region still updated


def test_batched_lane_attention_equals_one_call_per_request():
    from vllm_fafo.attention.lane_attention import batched_lane_attention, lane_attention

    gen = torch.Generator().manual_seed(7)
    rows, slots, lanes, lane_len = 3, 10, 4, 3
    n = lanes * lane_len
    q = torch.randn(rows * n, HQ, D, generator=gen)
    k, v = torch.randn(rows * n, HK, D, generator=gen), torch.randn(rows * n, HK, D, generator=gen)
    rk, rv = torch.randn(rows, slots, HK, D, generator=gen), torch.randn(rows, slots, HK, D, generator=gen)
    valid = torch.rand(rows, slots, generator=gen) < 0.6
    valid[:, 0] = True
    got = batched_lane_attention(q, k, v, rk, rv, valid, lanes, lane_len, SCALE)
    for r in range(rows):
        t = slice(r * n, (r + 1) * n)
        want = lane_attention(q[t], k[t], v[t], rk[r][valid[r]], rv[r][valid[r]], lanes, lane_len, SCALE)
        torch.testing.assert_close(got[t], want, rtol=1e-5, atol=1e-6)


class _RowsEveryStep(FumbleLanes):
    """Plans every step from its rows (the parked steps' shortcut taken out)."""

    def plan_step(self, batch, lanes_for=None):
        self._parked = None
        return super().plan_step(batch, lanes_for)


def test_parked_steps_planned_without_their_rows_plan_as_with_them():
    """Requests joining (prompt chunks) and leaving, decoding with random drafts, lanes off
    for stretches and on now and then: the planner that skips the rows of a step whose
    requests all decoded parked last step asks the lane chooser the same questions and
    plans the same steps as one that reads every step's rows, and it did skip some."""
    policy = StreamingPolicy(2, 8, StreamingPolicy.Settings())
    planners = [cls(num_lanes=2, lane_len=2, max_key_len=2, max_drafts=3, max_model_len=4096, region_rows=3,
                    policy=policy, park_when_off=True) for cls in (FumbleLanes, _RowsEveryStep)]
    rng = np.random.default_rng(4)
    questions: list[list[tuple]] = [[], []]
    skipped, positions, running = 0, {}, []
    for step in range(120):
        if step % 25 == 0:  # a request joins with a 5-token prompt
            running.append(f"r{step}")
        if step % 40 == 39:
            for lanes in planners:
                lanes.remove_requests([running[0]])
            running = running[1:]
        sizes, drafts, firsts = [], [], []
        for req_id in running:
            first = positions.get(req_id, 0)
            drafted = 0 if first == 0 else int(rng.integers(0, 4))
            sizes.append(5 if first == 0 else 1 + drafted)
            drafts.append(drafted)
            firsts.append(first)
        batch = BatchView(list(running), np.concatenate([[0], np.cumsum(sizes)]), np.array(firsts), drafts,
                          int(sum(sizes)), 100)
        on = rng.random() < 0.1
        plans = []
        for lanes, asked in zip(planners, questions):
            before = lanes._parked
            plans.append(lanes.plan_step(batch, lambda *question, asked=asked, on=on: asked.append(question) or
                                         (question[3] if on else 0)))
            skipped += lanes is planners[0] and before is not None and lanes._parked is before
        assert questions[0] == questions[1], f"step {step}"
        if plans[0] is None or plans[1] is None:
            assert plans[0] is plans[1] is None, f"step {step}"
        else:
            for name in ("commit_dst", "write_dst", "stage_dst", "tail_ids", "tail_positions"):
                assert getattr(plans[0], name).tolist() == getattr(plans[1], name).tolist(), f"step {step}: {name}"
            assert [c.positions.tolist() for c in plans[0].catch_up] == [c.positions.tolist() for c in plans[1].catch_up]
        for req_id, first, size in zip(running, firsts, sizes):
            if first == 0:
                for lanes in planners:
                    lanes.start_lanes(req_id, list(range(1, 6)))
            positions[req_id] = first + (size if first == 0 else 1 + int(rng.integers(0, size)))
    assert skipped > 20, skipped
