"""The lane step's device buffers: one forward's plan at fixed shapes.

A CUDA graph replays the kernels it captured on the tensors it captured, so
everything a lane step reads on the device lives in tensors that outlive the
step and keep their shapes. A :class:`LaneTier` fixes those shapes (tail
requests, lanes per request, lane length, index-copy entries); the planner
copies each step's plan into its tier's :class:`LaneStepBuffers` once per
forward, before any layer runs, and every layer reads them
(:func:`vllm_fafo.attention.region.lane_step`). Entries beyond the plan's are
padding that changes nothing real: index copies go to the padding slot each
layer appends to its region and staging area, padded tails read token 0 and
region row 0, and their output is dropped.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from vllm_fafo.lanes.state import lane_mask

if TYPE_CHECKING:
    from vllm_fafo.lanes.step_plan import StepPlan


@dataclass(frozen=True)
class RegionGeometry:
    """Engine constants of every layer's region: where its padding slots are."""

    rows: int
    slots: int  # per row (the layout's kv_budget)
    staged_slots: int  # per row

    @property
    def padding_slot(self) -> int:
        """Flat region index of the slot behind the last row: padded copies land there."""
        return self.rows * self.slots

    @property
    def padding_staged_slot(self) -> int:
        return self.rows * self.staged_slots


@dataclass(frozen=True)
class LaneTier:
    """The shapes of one lane step; a step fits every tier at least its size."""

    requests: int  # tail requests
    lanes: int  # per request
    lane_len: int
    commits: int
    writes: int
    stages: int

    @property
    def tail_tokens(self) -> int:
        return self.requests * self.lanes * self.lane_len

    @classmethod
    def fitting(cls, num_tails: int, lanes: int, lane_len: int, commits: int, writes: int, stages: int) -> LaneTier:
        """The tier of a step: index-copy counts rounded up to powers of two (a padded copy
        costs next to nothing), tail requests exact: a padded tail costs its lanes'
        attention, which lanes run eager pay in full. Graphed lanes will round requests
        too, to bound the graphs captured."""
        lanes, lane_len = (lanes, lane_len) if num_tails else (0, 0)
        return cls(num_tails, lanes, lane_len, _power_of_two(commits), _power_of_two(writes), _power_of_two(stages))


def _power_of_two(count: int) -> int:
    """Smallest power of two >= count (1 for 0: an index copy of one padded entry)."""
    return 1 << max(count - 1, 0).bit_length()


@dataclass
class LaneStepBuffers:
    """A plan's indices on the device, padded to a tier; the same tensors every step,
    so they hold the latest plan of their tier."""

    tier: LaneTier
    geometry: RegionGeometry
    commit_src: torch.Tensor  # (commits,) flat staging index
    commit_dst: torch.Tensor  # (commits,) flat region index
    write_src: torch.Tensor  # (writes,) batch token index
    write_dst: torch.Tensor  # (writes,) flat region index
    stage_src: torch.Tensor  # (stages,) batch token index
    stage_dst: torch.Tensor  # (stages,) flat staging index
    tail_tokens: torch.Tensor  # (tail tokens,) batch index of each tail token
    tail_is_real: torch.Tensor  # (tail tokens,) bool: False for padding, whose output is dropped
    tail_region_rows: torch.Tensor  # (requests,) region row of each tail's request
    tail_sink_ring_valid: torch.Tensor  # (requests, slots) bool: filled sink and ring slots
    own_lane: torch.Tensor  # (n, n) bool, n = lanes * lane_len: the lane-to-lane mask, fixed per tier
    slot_index: torch.Tensor  # (slots,) 0..slots-1, for the selected part's mask

    @classmethod
    def allocate(cls, tier: LaneTier, geometry: RegionGeometry, device: torch.device) -> LaneStepBuffers:
        index = lambda size: torch.zeros(size, dtype=torch.long, device=device)
        flags = lambda *size: torch.zeros(size, dtype=torch.bool, device=device)
        return cls(
            tier, geometry,
            index(tier.commits), index(tier.commits), index(tier.writes), index(tier.writes),
            index(tier.stages), index(tier.stages),
            index(tier.tail_tokens), flags(tier.tail_tokens), index(tier.requests),
            flags(tier.requests, geometry.slots),
            torch.from_numpy(lane_mask(tier.lanes, tier.lane_len)).to(device),
            torch.arange(geometry.slots, device=device),
        )

    def load(self, plan: StepPlan) -> None:
        """Copy ``plan`` (host tensors) into the buffers, padding included: once per
        forward for every layer, into the same tensors every step."""
        geometry = self.geometry
        _copy_padded(self.commit_src, plan.commit_src, geometry.padding_staged_slot)
        _copy_padded(self.commit_dst, plan.commit_dst, geometry.padding_slot)
        _copy_padded(self.write_src, plan.write_src, 0)
        _copy_padded(self.write_dst, plan.write_dst, geometry.padding_slot)
        _copy_padded(self.stage_src, plan.stage_src, 0)
        _copy_padded(self.stage_dst, plan.stage_dst, geometry.padding_staged_slot)
        tail = plan.tail_tokens
        _copy_padded(self.tail_tokens, torch.arange(tail.start, tail.stop), 0)
        _copy_padded(self.tail_is_real, torch.ones(tail.stop - tail.start, dtype=torch.bool), False)
        _copy_padded(self.tail_region_rows, plan.tail_region_rows, 0)
        _copy_padded(self.tail_sink_ring_valid, plan.tail_sink_ring_valid, False)


def _copy_padded(buffer: torch.Tensor, values: torch.Tensor, padding: int | bool) -> None:
    """``values`` then ``padding`` into ``buffer``, in one host-to-device copy."""
    if len(values) > len(buffer):
        raise ValueError(f"a step plan has {len(values)} entries for a tier of {len(buffer)}")
    host = torch.full(buffer.shape, padding, dtype=buffer.dtype)
    host[: len(values)] = values
    buffer.copy_(host)
