"""One attention layer's fixed compressed region and its draft staging area.

Shapes are fixed for the engine's life (``region_rows`` request slots x
``region_slots`` tokens), so no step allocates and kernels see static shapes
(FAFO Sec. 4.4, ``B_fixed``). Rejected drafts never enter the region: drafts
are staged and only the accepted ones are committed, one step later.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vllm_fafo.attention.lane_attention import lane_attention
from vllm_fafo.step_plan import StepPlan


@dataclass
class CompressedRegion:
    key: torch.Tensor  # (rows * slots, Hk, D)
    value: torch.Tensor
    staged_key: torch.Tensor  # (rows * staged_slots, Hk, D)
    staged_value: torch.Tensor
    slots: int

    @classmethod
    def allocate(cls, plan: StepPlan, like: torch.Tensor) -> CompressedRegion:
        heads, dim = like.shape[1], like.shape[2]
        region = (plan.region_rows * plan.region_slots, heads, dim)
        staged = (plan.region_rows * plan.staged_slots, heads, dim)
        make = lambda shape: torch.zeros(shape, dtype=like.dtype, device=like.device)  # noqa: E731
        return cls(make(region), make(region), make(staged), make(staged), plan.region_slots)

    def run_step(
        self,
        plan: StepPlan,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        output: torch.Tensor,
        scale: float,
    ) -> None:
        self._update(plan, key, value)
        for tail in plan.tails:
            tail_rows = slice(tail.tail_start, tail.tail_start + tail.num_tokens)
            first = tail.region_row * self.slots
            output[tail_rows] = lane_attention(
                query[tail_rows], key[tail_rows], value[tail_rows],
                self.key[first : first + tail.num_valid],
                self.value[first : first + tail.num_valid],
                tail.active_lanes, tail.lane_len, scale,
            ).to(output.dtype)

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
