"""One attention layer's fixed compressed region and its draft staging area.

Shapes are fixed for the engine's life (``rows`` request slots x
``kv_budget`` tokens), so no step allocates and kernels see static shapes
(FAFO Sec. 4.4, ``B_fixed``). The attention impl allocates it when vLLM
builds the layer, before vLLM sizes the KV cache, so vLLM's memory
accounting sees it (bytes per layer: docs/configuration.md, "Memory"). Rejected drafts never enter the region: drafts
are staged and only the accepted ones are committed, one step later. The
sink and ring parts are written by position (the plan's flat indices); the
selected part is whatever the compression policy chose.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from vllm_fafo.attention.lane_attention import batched_lane_attention, lane_attention
from vllm_fafo.lanes.compression.base import CompressionPolicy, LaneStep, LayerShape, PagedKV, RegionLayout
from vllm_fafo.lanes.step_plan import StepPlan


@dataclass
class CompressedRegion:
    policy: CompressionPolicy
    key: torch.Tensor  # (rows * slots, Hk, D)
    value: torch.Tensor
    staged_key: torch.Tensor  # (rows * staged_slots, Hk, D)
    staged_value: torch.Tensor
    slots: int
    policy_state: Any
    selected_count: torch.Tensor  # (rows,) filled slots of each row's selected part, on the device

    @classmethod
    def allocate(cls, policy: CompressionPolicy, staged_slots: int, shape: LayerShape) -> CompressedRegion:
        heads, dim, slots = shape.num_kv_heads, shape.head_size, policy.layout.kv_budget
        region = (shape.rows * slots, heads, dim)
        staged = (shape.rows * staged_slots, heads, dim)
        make = lambda size: torch.zeros(size, dtype=shape.dtype, device=shape.device)
        return cls(
            policy, make(region), make(region), make(staged), make(staged), slots,
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
        """``kv`` is None when neither the policy nor a catch-up reads the paged cache."""
        for catch_up in plan.catch_up:
            missed_key, missed_value = kv.read(catch_up.batch_row, catch_up.positions)
            self.key.index_copy_(0, catch_up.dst, missed_key.to(self.key.dtype))
            self.value.index_copy_(0, catch_up.dst, missed_value.to(self.value.dtype))
        self._update(plan, key, value)
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
        if not plan.tails:
            return
        if policy.attends_full_cache:
            self._full_cache_lanes(plan, query, key, value, output, scale, kv)
            return
        tails = plan.tail_tokens
        rows = plan.tail_region_rows
        shape = (-1, self.slots, *self.key.shape[1:])
        output[tails] = batched_lane_attention(
            query[tails], key[tails], value[tails],
            self.key.view(shape).index_select(0, rows), self.value.view(shape).index_select(0, rows),
            self._valid_slots(plan), plan.tails[0].active_lanes, plan.tails[0].lane_len, scale,
        ).to(output.dtype)

    def _valid_slots(self, plan: StepPlan) -> torch.Tensor:
        """(R, slots) filled slots of the tails' rows: sinks and ring (planned), selected (this layer's)."""
        layout = self.policy.layout
        if layout.selected_slots == 0:
            return plan.tail_sink_ring_valid
        counts = self.selected_count.index_select(0, plan.tail_region_rows)
        slot = torch.arange(self.slots, device=counts.device)
        selected = (slot >= layout.sink_tokens) & (slot < layout.sink_tokens + counts[:, None])
        return plan.tail_sink_ring_valid | selected

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

    def _update(self, plan: StepPlan, key: torch.Tensor, value: torch.Tensor) -> None:
        if plan.commit_dst.numel():
            self.key.index_copy_(0, plan.commit_dst, self.staged_key[plan.commit_src])
            self.value.index_copy_(0, plan.commit_dst, self.staged_value[plan.commit_src])
        if plan.write_dst.numel():
            self.key.index_copy_(0, plan.write_dst, key[plan.write_src])
            self.value.index_copy_(0, plan.write_dst, value[plan.write_src])
        if plan.stage_dst.numel():
            self.staged_key.index_copy_(0, plan.stage_dst, key[plan.stage_src])
            self.staged_value.index_copy_(0, plan.stage_dst, value[plan.stage_src])
