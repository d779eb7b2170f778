"""What the attention wrapper must do in this step's forward pass.

Built on the CPU by :class:`vllm_fafo.fumble.FumbleLanes` after vLLM prepared
the batch, read by every attention layer (each layer owns its own region
buffers, so the plan carries flat indices, not tensors of K/V), and cleared
once the step's outputs are consumed. Forwards without a plan (warm-up,
profiling, steps without lanes) pass through the base backend untouched.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vllm_fafo.compression import CompressionPolicy


@dataclass(frozen=True)
class RequestTail:
    """One request's lanes inside the batch's tail."""

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


@dataclass(frozen=True)
class PrefillChunk:
    """A prompt chunk of a request with a region (its queries feed the policy)."""

    region_row: int
    start: int  # batch index of the chunk's first token
    end: int
    first_pos: int


@dataclass(frozen=True)
class StepPlan:
    """Region updates and lane layout of one forward pass.

    Region and staging buffers are addressed flat: ``row * slots + slot``.
    Order inside a layer: commit accepted drafts staged last step, write this
    step's known tokens, stage this step's drafts, reset the policy's state of
    rows that a new request took, show it the prefill chunks, let it select
    for each request with lanes, then run the lanes.
    """

    policy: CompressionPolicy
    max_model_len: int

    region_rows: int
    staged_slots: int
    commit_src: torch.Tensor  # flat staging index
    commit_dst: torch.Tensor  # flat region index
    write_src: torch.Tensor  # batch token index
    write_dst: torch.Tensor  # flat region index
    stage_src: torch.Tensor  # batch token index
    stage_dst: torch.Tensor  # flat staging index
    new_rows: tuple[int, ...]
    prefill_chunks: tuple[PrefillChunk, ...]
    tails: tuple[RequestTail, ...]
    # Every tail has the same lanes and lane length, and the tails lie back to
    # back, so the lanes of all requests run as one batched attention call.
    tail_region_rows: torch.Tensor  # (R,) region row of each tail's request
    tail_sink_ring_valid: torch.Tensor  # (R, region_slots) bool: filled sink and ring slots

    @property
    def tail_tokens(self) -> slice:
        """Batch indices of all tail tokens."""
        if not self.tails:
            return slice(0, 0)
        return slice(self.tails[0].tokens.start, self.tails[-1].tokens.stop)

    @property
    def region_slots(self) -> int:
        return self.policy.layout.kv_budget

    @property
    def num_tail_tokens(self) -> int:
        return sum(t.num_tokens for t in self.tails)


_current: StepPlan | None = None


def set_current_plan(plan: StepPlan | None) -> None:
    global _current
    _current = plan


def current_plan() -> StepPlan | None:
    return _current
