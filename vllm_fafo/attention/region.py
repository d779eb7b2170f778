"""One attention layer's fixed compressed region and its draft staging area.

Shapes are fixed for the engine's life (``rows`` request slots x
``kv_budget`` tokens), so no step allocates and kernels see static shapes
(FAFO Sec. 4.4, ``B_fixed``). The attention impl allocates it when vLLM
builds the layer, before vLLM sizes the KV cache, so vLLM's memory
accounting sees it (bytes per layer: docs/configuration.md, "Memory"). Rejected drafts never enter the region: drafts
are staged and only the accepted ones are committed, one step later. The
sink and ring parts are written by position (the plan's flat indices); the
selected part is whatever the compression policy chose. The region and the
staging area each end in one padding slot, where a fixed-shape step's padded
index copies land (:mod:`vllm_fafo.lanes.graph_buffers`). The index copies
and the lanes run in :func:`lane_step`, on the plan's device buffers: no host
synchronisation, allocation or branch on a step's values, so a CUDA graph can
replay it; the policy's per-request work stays host-driven around it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from vllm_fafo.attention.lane_attention import lane_attention, masked_lane_attention
from vllm_fafo.lanes.compression.base import CompressionPolicy, LaneStep, LayerShape, PagedKV, RegionLayout
from vllm_fafo.lanes.graph_buffers import LaneStepBuffers
from vllm_fafo.lanes.step_plan import StepPlan


@dataclass
class CompressedRegion:
    policy: CompressionPolicy
    key: torch.Tensor  # (rows * slots + 1, Hk, D): the last slot takes padded copies
    value: torch.Tensor
    staged_key: torch.Tensor  # (rows * staged_slots + 1, Hk, D)
    staged_value: torch.Tensor
    rows: int
    slots: int
    policy_state: Any
    selected_count: torch.Tensor  # (rows,) filled slots of each row's selected part, on the device

    @classmethod
    def allocate(cls, policy: CompressionPolicy, staged_slots: int, shape: LayerShape) -> CompressedRegion:
        heads, dim, slots = shape.num_kv_heads, shape.head_size, policy.layout.kv_budget
        region = (shape.rows * slots + 1, heads, dim)
        staged = (shape.rows * staged_slots + 1, heads, dim)
        make = lambda size: torch.zeros(size, dtype=shape.dtype, device=shape.device)
        return cls(
            policy, make(region), make(region), make(staged), make(staged), shape.rows, slots,
            policy.new_layer_state(shape),
            torch.zeros(shape.rows, dtype=torch.long, device=shape.device),
        )

    @property
    def dtype(self) -> torch.dtype:
        return self.key.dtype

    def run_step(
        self,
        plan: StepPlan,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        output: torch.Tensor,
        scale: float,
        kv: PagedKV | None,
    ) -> None:
        """``kv`` is None when neither the policy nor a catch-up reads the paged cache.

        The policy's work comes before the index copies of :func:`lane_step`: it
        reads the paged cache and writes the selected part, which they never touch."""
        for catch_up in plan.catch_up:
            missed_key, missed_value = kv.read(catch_up.batch_row, catch_up.positions)
            self.key.index_copy_(0, catch_up.dst, missed_key.to(self.key.dtype))
            self.value.index_copy_(0, catch_up.dst, missed_value.to(self.value.dtype))
        policy = self.policy
        for row in plan.new_rows:
            policy.reset_row(self.policy_state, row)
            self.selected_count[row] = 0
        for chunk in plan.prefill_chunks:
            policy.observe_prefill(
                self.policy_state, chunk.region_row, chunk.first_pos, query[chunk.start : chunk.end]
            )
        if policy.layout.selected_slots:  # a layout without selected slots has nothing to select
            for tail in plan.tails:
                step = LaneStep(tail.region_row, tail.batch_row, tail.num_final, query[tail.tokens], scale)
                selection = policy.select(self.policy_state, step, kv)
                if selection is not None:
                    self._write_selected(policy.layout, tail.region_row, selection.key, selection.value)
        if plan.tails and not policy.attends_full_cache:
            lane_step(self, plan.buffers, query, key, value, output, scale)
            return
        update_region(self, plan.buffers, key, value)
        if plan.tails:
            self._full_cache_lanes(plan, query, key, value, output, scale, kv)

    def row_view(self, flat: torch.Tensor) -> torch.Tensor:
        """(rows, slots, Hk, D) view of the flat region ``flat`` (key or value), padding slot left out."""
        return flat[: self.rows * self.slots].view(self.rows, self.slots, *flat.shape[1:])

    def _full_cache_lanes(self, plan, query, key, value, output, scale, kv: PagedKV) -> None:
        """The ``none`` policy: each request's lanes see its whole context, read from the paged cache."""
        for tail in plan.tails:
            rows = tail.tokens
            final = torch.arange(tail.num_final, device=query.device)
            region_key, region_value = kv.read(tail.batch_row, final)
            output[rows] = lane_attention(
                query[rows], key[rows], value[rows], region_key, region_value,
                tail.active_lanes, tail.lane_len, scale,
            ).to(output.dtype)

    def _write_selected(self, layout: RegionLayout, row: int, key: torch.Tensor, value: torch.Tensor) -> None:
        count = key.shape[0]
        if count > layout.selected_slots:
            raise ValueError(f"policy selected {count} tokens for {layout.selected_slots} slots")
        first = row * self.slots + layout.sink_tokens
        self.key[first : first + count] = key
        self.value[first : first + count] = value
        self.selected_count[row] = count


def update_region(region: CompressedRegion, step: LaneStepBuffers, key: torch.Tensor, value: torch.Tensor) -> None:
    """Commit the drafts accepted since last step, write this step's known tokens, stage
    its drafts; padded entries copy into the padding slots."""
    region.key.index_copy_(0, step.commit_dst, region.staged_key.index_select(0, step.commit_src))
    region.value.index_copy_(0, step.commit_dst, region.staged_value.index_select(0, step.commit_src))
    region.key.index_copy_(0, step.write_dst, key.index_select(0, step.write_src))
    region.value.index_copy_(0, step.write_dst, value.index_select(0, step.write_src))
    region.staged_key.index_copy_(0, step.stage_dst, key.index_select(0, step.stage_src))
    region.staged_value.index_copy_(0, step.stage_dst, value.index_select(0, step.stage_src))


def lane_step(
    region: CompressedRegion,
    step: LaneStepBuffers,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    output: torch.Tensor,
    scale: float,
) -> None:
    """One layer's region update and lanes, on the step's persistent buffers.

    Shapes are the tier's and every index comes from ``step``, so this traces
    into one graph (no host synchronisation, no branch on a step's values);
    padded tails attend to region row 0 and write back the output they read.
    """
    update_region(region, step, key, value)
    layout = region.policy.layout
    rows = step.tail_region_rows
    valid = step.tail_sink_ring_valid
    if layout.selected_slots:  # the engine's layout, the same every step
        counts = region.selected_count.index_select(0, rows)[:, None]
        slot = step.slot_index
        valid = valid | ((slot >= layout.sink_tokens) & (slot < layout.sink_tokens + counts))
    tails = step.tail_tokens
    lanes = masked_lane_attention(
        query.index_select(0, tails), key.index_select(0, tails), value.index_select(0, tails),
        region.row_view(region.key).index_select(0, rows), region.row_view(region.value).index_select(0, rows),
        valid, step.own_lane, scale,
    )
    before = output.index_select(0, tails)
    is_real = step.tail_is_real.view(-1, *([1] * (before.dim() - 1)))
    output.index_copy_(0, tails, torch.where(is_real, lanes.reshape(before.shape).to(output.dtype), before))
