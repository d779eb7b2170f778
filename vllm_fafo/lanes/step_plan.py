"""What the attention wrapper must do in one forward pass, and how it gets there.

Built on the CPU by :class:`vllm_fafo.lanes.planner.FumbleLanes` after vLLM prepared
the batch. It reaches the attention layers through vLLM's per-forward
channel: the runner patch attaches it to this forward's attention metadata
(:func:`attach_plan`), every layer reads it back (:func:`plan_of`), and it
is gone with the metadata when the forward ends. Each layer owns its own
region buffers, so the plan carries flat indices, not tensors of K/V: host
tensors here, and their padded copy on the device that the layers read
(:class:`~vllm_fafo.lanes.graph_buffers.LaneStepBuffers`, loaded once per forward).
Forwards without a plan (warm-up, profiling, steps without lanes) pass
through the base backend untouched. Engine constants (policy, region rows,
``max_model_len``) are not here: the attention impl takes them from
``vllm_config`` when it is built (:class:`vllm_fafo.config.RegionSpec`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from vllm_fafo.lanes.graph_buffers import LaneStepBuffers
from vllm_fafo.verification.draft_tree import BRANCH_PLAN_ATTRIBUTE, BranchPlan

PLAN_ATTRIBUTE = "vllm_fafo_plan"
"""Name of the attribute that carries the plan on vLLM's attention metadata."""


@dataclass(frozen=True)
class RequestTail:
    """One request's lanes inside the batch's tail."""

    req_id: str
    region_row: int
    batch_row: int  # the request's row in vLLM's batch (and block table)
    x_index: int  # batch index of this step's input token x
    tail_start: int  # batch index of the request's first tail token
    active_lanes: int
    lane_len: int
    num_final: int  # positions 0..num_final-1 are final, this step's token included

    @property
    def num_tokens(self) -> int:
        return self.active_lanes * self.lane_len

    @property
    def tokens(self) -> slice:
        """Batch indices of this request's tail tokens."""
        return slice(self.tail_start, self.tail_start + self.num_tokens)

    @property
    def last_level(self) -> slice:
        """Batch indices of the last token of each lane (column-wise layout)."""
        start = self.tail_start + (self.lane_len - 1) * self.active_lanes
        return slice(start, start + self.active_lanes)


@dataclass(frozen=True)
class PrefillChunk:
    """A prompt chunk of a request with a region (its queries feed the policy)."""

    region_row: int
    start: int  # batch index of the chunk's first token
    end: int
    first_pos: int


@dataclass(frozen=True)
class RegionCatchUp:
    """Positions a request's region missed while its lanes were off, read back
    from vLLM's paged cache (where they are final) into their region slots."""

    batch_row: int  # the request's row in vLLM's batch (block table)
    positions: torch.Tensor  # (n,) absolute positions, each slot once
    dst: torch.Tensor  # (n,) flat region index of each


@dataclass(frozen=True)
class StepPlan:
    """Region updates and lane layout of one forward pass.

    Region and staging buffers are addressed flat: ``row * slots + slot``.
    Order inside a layer: catch up the positions a region missed while its
    lanes were off, reset the policy's state of rows that a new request took,
    show it the prefill chunks, let it select for each request with lanes
    (host-driven work, on the paged cache and the selected part), then, on
    ``buffers``: commit accepted drafts staged last step, write this step's
    known tokens, stage this step's drafts and run the lanes.
    """

    commit_src: torch.Tensor  # (host) flat staging index
    commit_dst: torch.Tensor  # (host) flat region index
    write_src: torch.Tensor  # (host) batch token index
    write_dst: torch.Tensor  # (host) flat region index
    stage_src: torch.Tensor  # (host) batch token index
    stage_dst: torch.Tensor  # (host) flat staging index
    new_rows: tuple[int, ...]
    prefill_chunks: tuple[PrefillChunk, ...]
    tails: tuple[RequestTail, ...]
    # Every tail has the same lanes and lane length, and the tails lie back to
    # back, so the lanes of all requests run as one batched attention call.
    tail_region_rows: torch.Tensor  # (host, R) region row of each tail's request
    tail_sink_ring_valid: torch.Tensor  # (host, R, region_slots) bool: filled sink and ring slots
    tail_ids: np.ndarray  # token ids of the tail, written behind the real tokens
    tail_positions: np.ndarray
    buffers: LaneStepBuffers  # all of the above that a layer reads, on the device, at fixed shapes
    catch_up: tuple[RegionCatchUp, ...] = ()

    @property
    def tail_tokens(self) -> slice:
        """Batch indices of all tail tokens."""
        if not self.tails:
            return slice(0, 0)
        return slice(self.tails[0].tokens.start, self.tails[-1].tokens.stop)

    @property
    def num_tail_tokens(self) -> int:
        return len(self.tail_ids)

    @property
    def has_region_work(self) -> bool:
        """Whether the attention layers have anything to do in this forward."""
        return bool(self.write_dst.numel() or self.commit_dst.numel() or self.catch_up)


def _attach(attn_metadata: dict[str, Any] | list[dict[str, Any]], attribute: str, value: Any,
            feature: str, turn_off: str) -> None:
    """Hang ``value`` on every layer's metadata object of this forward."""
    if not isinstance(attn_metadata, dict):
        raise RuntimeError(
            f"vllm-fafo {feature} index the whole batch, but vLLM split this forward into "
            f"micro-batches (dual-batch overlap); turn micro-batching off or {turn_off}"
        )
    for metadata in attn_metadata.values():
        setattr(metadata, attribute, value)


def attach_plan(attn_metadata: dict[str, Any] | list[dict[str, Any]], plan: StepPlan) -> None:
    """Hang the lanes' ``plan`` on every layer's metadata object of this forward."""
    _attach(attn_metadata, PLAN_ATTRIBUTE, plan, "lanes", "set num_lanes to 0")


def attach_branches(attn_metadata: dict[str, Any] | list[dict[str, Any]], branches: BranchPlan) -> None:
    """Hang the draft tree's ``branches`` on every layer's metadata object of this forward."""
    _attach(attn_metadata, BRANCH_PLAN_ATTRIBUTE, branches, "draft trees", "set num_candidates to 1")


def branches_of(attn_metadata: Any) -> BranchPlan | None:
    """The draft tree's branches attached to one layer's metadata, if any."""
    return getattr(attn_metadata, BRANCH_PLAN_ATTRIBUTE, None)


def plan_of(attn_metadata: Any) -> StepPlan | None:
    """The plan attached to one layer's metadata, if this forward has one."""
    return getattr(attn_metadata, PLAN_ATTRIBUTE, None)
