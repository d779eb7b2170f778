"""The lane step a CUDA graph can replay, proxied on the CPU.

:func:`~vllm_fafo.attention.region.lane_step` must trace into one graph
(``torch.compile(fullgraph=True)`` raises on a graph break) without reading
a tensor's value on the host (which dynamo would keep in the graph), give what a dense
loop over the plan's real entries gives, padded entries included, and run a
second plan of the same tier without recompiling; loading a plan into its
tier's buffers must reuse the same device tensors.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
import torch._dynamo.testing

from vllm_fafo.attention.lane_attention import lane_attention
from vllm_fafo.attention.region import CompressedRegion, lane_step
from vllm_fafo.lanes.compression import SnapKVPolicy, StreamingPolicy
from vllm_fafo.lanes.compression.base import LayerShape
from vllm_fafo.lanes.compression.snapkv import SnapKVSettings
from vllm_fafo.lanes.graph_buffers import LaneStepBuffers, LaneTier, RegionGeometry
from vllm_fafo.lanes.step_plan import RequestTail, StepPlan

HQ, HK, D = 4, 2, 8
SCALE = D**-0.5
ROWS, STAGED = 4, 3
LANES, LANE_LEN = 2, 3
REAL_TOKENS = 10  # the batch's real tokens; the tails lie behind them
TIER = LaneTier(requests=4, lanes=LANES, lane_len=LANE_LEN, commits=8, writes=8, stages=8)

POLICIES = {
    "streaming": lambda: StreamingPolicy(2, 12, StreamingPolicy.Settings()),  # sink 2, ring 10
    "selected": lambda: SnapKVPolicy(2, 16, SnapKVSettings(recent_tokens=6)),  # sink 2, selected 8, ring 6
}


def make_region(policy, gen: torch.Generator) -> CompressedRegion:
    """A region full of random KV (padding slots included) and random selected counts."""
    shape = LayerShape(ROWS, HQ, HK, D, 4096, torch.float32, torch.device("cpu"))
    region = CompressedRegion.allocate(policy, STAGED, shape)
    for tensor in (region.key, region.value, region.staged_key, region.staged_value):
        tensor.copy_(torch.randn(tensor.shape, generator=gen))
    if policy.layout.selected_slots:
        region.selected_count.copy_(torch.randint(1, policy.layout.selected_slots + 1, (ROWS,), generator=gen))
    return region


def random_plan(layout, buffers: LaneStepBuffers, gen: torch.Generator, tail_rows: list[int],
                commits: int, writes: int, stages: int) -> StepPlan:
    """A plan of random entries, at most the tier's: distinct targets within each copy, sink
    and ring slots only; a write may overwrite a commit, a stage the slot a commit reads."""
    rng = np.random.default_rng(int(torch.randint(0, 2**31, (1,), generator=gen)))
    sink_ring = [s for s in range(layout.kv_budget) if not layout.sink_tokens <= s < layout.ring_start]
    targets = [row * layout.kv_budget + s for row in range(ROWS) for s in sink_ring]
    dst = np.concatenate([rng.choice(targets, commits, replace=False), rng.choice(targets, writes, replace=False)])
    staged = np.concatenate([rng.choice(ROWS * STAGED, commits, replace=False),
                             rng.choice(ROWS * STAGED, stages, replace=False)])
    as_index = lambda xs: torch.as_tensor(np.asarray(xs, dtype=np.int64))
    n = LANES * LANE_LEN
    tails = tuple(
        RequestTail(f"r{row}", row, i, i, REAL_TOKENS + i * n, LANES, LANE_LEN, num_final=20)
        for i, row in enumerate(tail_rows)
    )
    plan = StepPlan(
        commit_src=as_index(staged[:commits]), commit_dst=as_index(dst[:commits]),
        write_src=as_index(rng.choice(REAL_TOKENS, writes, replace=False)), write_dst=as_index(dst[commits:]),
        stage_src=as_index(rng.choice(REAL_TOKENS, stages, replace=False)), stage_dst=as_index(staged[commits:]),
        new_rows=(), prefill_chunks=(), tails=tails,
        tail_region_rows=as_index(tail_rows),
        tail_sink_ring_valid=torch.as_tensor(rng.random((len(tail_rows), layout.kv_budget)) < 0.6),
        tail_ids=np.zeros(len(tail_rows) * n, np.int64), tail_positions=np.zeros(len(tail_rows) * n, np.int64),
        buffers=buffers,
    )
    buffers.load(plan)
    return plan


def step_inputs(plan: StepPlan, gen: torch.Generator) -> tuple[torch.Tensor, ...]:
    tokens = REAL_TOKENS + TIER.tail_tokens  # room for a full tier, as a padded batch has
    make = lambda heads: torch.randn(tokens, heads, D, generator=gen)
    return make(HQ), make(HK), make(HK), make(HQ)


def dense_reference(region: CompressedRegion, plan: StepPlan, query, key, value, output):
    """Region, staging and output after the step, by a loop over the plan's real entries."""
    region_k, region_v = region.key.clone(), region.value.clone()
    staged_k, staged_v = region.staged_key.clone(), region.staged_value.clone()
    out = output.clone()
    for src, dst in zip(plan.commit_src.tolist(), plan.commit_dst.tolist()):
        region_k[dst], region_v[dst] = staged_k[src], staged_v[src]
    for src, dst in zip(plan.write_src.tolist(), plan.write_dst.tolist()):
        region_k[dst], region_v[dst] = key[src], value[src]
    for src, dst in zip(plan.stage_src.tolist(), plan.stage_dst.tolist()):
        staged_k[dst], staged_v[dst] = key[src], value[src]
    layout, slots = region.policy.layout, region.slots
    for tail, valid in zip(plan.tails, plan.tail_sink_ring_valid):
        valid = valid.clone()
        valid[layout.sink_tokens : layout.sink_tokens + int(region.selected_count[tail.region_row])] = True
        visible = tail.region_row * slots + valid.nonzero()[:, 0]
        rows = tail.tokens
        out[rows] = lane_attention(query[rows], key[rows], value[rows], region_k[visible], region_v[visible],
                                   tail.active_lanes, tail.lane_len, SCALE)
    return region_k, region_v, staged_k, staged_v, out


def check_step(region: CompressedRegion, plan: StepPlan, inputs, run) -> None:
    query, key, value, output = inputs
    before = region.key.clone()
    want_k, want_v, want_staged_k, want_staged_v, want_out = dense_reference(region, plan, *inputs)
    run(region, plan.buffers, query, key, value, output, SCALE)
    real, real_staged = ROWS * region.slots, ROWS * STAGED
    torch.testing.assert_close(region.key[:real], want_k[:real], rtol=0, atol=0)
    torch.testing.assert_close(region.value[:real], want_v[:real], rtol=0, atol=0)
    torch.testing.assert_close(region.staged_key[:real_staged], want_staged_k[:real_staged], rtol=0, atol=0)
    torch.testing.assert_close(region.staged_value[:real_staged], want_staged_v[:real_staged], rtol=0, atol=0)
    written = torch.zeros(real, dtype=torch.bool)
    written[torch.cat([plan.commit_dst, plan.write_dst])] = True
    assert torch.equal(region.key[:real][~written], before[:real][~written])  # nothing else touched
    tails = plan.tail_tokens
    torch.testing.assert_close(output[tails], want_out[tails], rtol=1e-5, atol=1e-5)
    assert torch.equal(output[: tails.start], want_out[: tails.start])  # padded tails wrote back token 0's
    assert torch.equal(output[tails.stop :], want_out[tails.stop :])


HOST_READS = {"item", "tolist", "nonzero", "unique", "masked_select"}
"""Tensor methods that bring a value to the host: dynamo keeps them in the graph (no break), but a
CUDA graph cannot replay them."""


class GraphCounter(torch._dynamo.testing.CompileCounterWithBackend):
    """Counts the graphs dynamo compiles and fails on any that reads a tensor's value on the host."""

    def __call__(self, gm: torch.fx.GraphModule, example_inputs):
        host_reads = [
            str(node.target) for node in gm.graph.nodes
            if node.op in ("call_method", "call_function")
            and (getattr(node.target, "__name__", node.target) in HOST_READS or "_assert_scalar" in str(node.target))
        ]
        assert not host_reads, f"the lane step reads tensor values on the host: {host_reads}"
        return super().__call__(gm, example_inputs)


def compiled(backend: str, counter: GraphCounter | None = None):
    torch._dynamo.reset()
    counter = counter or GraphCounter(backend)
    return torch.compile(lane_step, fullgraph=True, dynamic=False, backend=counter)


@pytest.mark.parametrize("layout", POLICIES)
@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_lane_step_compiles_whole_and_matches_dense_loops(layout, backend):
    gen = torch.Generator().manual_seed(0)
    policy = POLICIES[layout]()
    region = make_region(policy, gen)
    assert bool((region.selected_count > 0).all()) == bool(policy.layout.selected_slots)
    buffers = LaneStepBuffers.allocate(TIER, RegionGeometry(ROWS, region.slots, STAGED), torch.device("cpu"))
    plan = random_plan(policy.layout, buffers, gen, tail_rows=[3, 1], commits=3, writes=5, stages=4)
    check_step(region, plan, step_inputs(plan, gen), compiled(backend))


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_a_second_plan_of_the_tier_reuses_the_graph(backend):
    gen = torch.Generator().manual_seed(1)
    policy = POLICIES["selected"]()
    region = make_region(policy, gen)
    buffers = LaneStepBuffers.allocate(TIER, RegionGeometry(ROWS, region.slots, STAGED), torch.device("cpu"))
    counter = GraphCounter(backend)
    step = compiled(backend, counter)
    first = random_plan(policy.layout, buffers, gen, tail_rows=[0, 2, 3], commits=2, writes=7, stages=1)
    check_step(region, first, step_inputs(first, gen), step)
    second = random_plan(policy.layout, buffers, gen, tail_rows=[1], commits=8, writes=1, stages=8)
    check_step(region, second, step_inputs(second, gen), step)
    assert counter.frame_count == 1


def test_loading_a_plan_reuses_the_buffers():
    gen = torch.Generator().manual_seed(2)
    policy = POLICIES["streaming"]()
    geometry = RegionGeometry(ROWS, policy.layout.kv_budget, STAGED)
    buffers = LaneStepBuffers.allocate(TIER, geometry, torch.device("cpu"))
    tensors = lambda: {f.name: getattr(buffers, f.name) for f in dataclasses.fields(buffers)
                       if isinstance(getattr(buffers, f.name), torch.Tensor)}
    pointers = {name: t.data_ptr() for name, t in tensors().items()}
    for tail_rows, commits in (([2], 1), ([0, 1, 2, 3], 6)):
        plan = random_plan(policy.layout, buffers, gen, tail_rows, commits=commits, writes=3, stages=2)
        assert {name: t.data_ptr() for name, t in tensors().items()} == pointers
        assert buffers.commit_dst[:commits].tolist() == plan.commit_dst.tolist()
        assert set(buffers.commit_dst[commits:].tolist()) == {geometry.padding_slot}
        assert set(buffers.stage_dst[2:].tolist()) == {geometry.padding_staged_slot}
        assert buffers.tail_is_real.tolist() == [i < plan.num_tail_tokens for i in range(TIER.tail_tokens)]


def test_tiers_round_copy_counts_up_to_powers_of_two_and_keep_tail_requests_exact():
    tier = LaneTier.fitting(3, LANES, LANE_LEN, commits=0, writes=5, stages=8)
    assert tier == LaneTier(requests=3, lanes=LANES, lane_len=LANE_LEN, commits=1, writes=8, stages=8)
    assert LaneTier.fitting(0, LANES, LANE_LEN, 1, 1, 1).tail_tokens == 0
