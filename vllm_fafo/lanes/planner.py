"""FumbleLanes: plans each step's tail and region updates, consumes lane logits.

Owned by :class:`vllm_fafo.proposer.FafoProposer` when ``num_lanes > 0``;
the proposer's step calls :meth:`plan_step` after vLLM prepared the batch
(the returned :class:`~vllm_fafo.lanes.step_plan.StepPlan` holds the tail's token
ids and positions and what the attention wrapper does) and
:meth:`consume_tail` with that plan and the forward's hidden states before
drafting, so lane n-grams are in the pool when this step's draft is chosen.
Between steps it keeps only per-request state (region rows, lanes).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from vllm_fafo.lanes.compression import CompressionPolicy
from vllm_fafo.lanes.graph_buffers import LaneStepBuffers, LaneTier, RegionGeometry
from vllm_fafo.lanes.state import LaneState
from vllm_fafo.lanes.step_plan import PrefillChunk, RegionCatchUp, RequestTail, StepPlan
from vllm_fafo.log import init_logger

logger = init_logger(__name__)


@dataclass
class BatchView:
    """What the planner reads of vLLM's prepared batch (CPU arrays)."""

    req_ids: Sequence[str]
    query_start_loc: np.ndarray  # (num_reqs + 1,)
    num_computed_tokens: np.ndarray  # (num_reqs,) tokens computed before this step
    num_drafts: Sequence[int]  # scheduled draft tokens per row
    num_tokens: int  # real tokens in the batch
    capacity: int  # token slots the runner's buffers hold


LaneChooser = Callable[[int, int, int, int], int]
"""(real tokens, requests with lanes, decoding requests, most lanes) -> lanes per request."""


@dataclass
class _RequestLanes:
    region_row: int
    lanes: LaneState | None = None
    num_drafts_staged: int = 0  # drafts of the last decode step, staged
    staged_x_pos: int = -1  # position of that step's input token
    region_end: int = 0  # positions before it are in the region's sink and ring parts


@dataclass
class _Row:
    """One request of the batch that holds a region."""

    row: int
    start: int  # batch index of its first token
    end: int
    first_pos: int  # position of its first token
    state: _RequestLanes
    is_decode: bool  # one known token plus drafts (else: a prompt chunk, all known)


@dataclass
class FumbleLanes:
    num_lanes: int
    lane_len: int
    max_key_len: int
    max_drafts: int
    max_model_len: int
    region_rows: int
    policy: CompressionPolicy
    stagger_lanes: bool = False
    park_when_off: bool = False
    """In steps that run no lanes, decoding requests skip the region's upkeep, and
    the positions missed are read back from the paged cache when lanes run again
    (needs a paged-KV reader; the goodput controller keeps lanes off for long
    stretches where they do not pay)."""
    paged_cache_readable: bool = False
    """The paged cache can be read back (:func:`~vllm_fafo.attention.paged_kv.paged_kv_readable`):
    a request whose first chunk starts after a prefix-cache hit takes a row and
    its region reads the hit's positions back; without it such a request runs pool-only."""
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    _requests: dict[str, _RequestLanes] = field(default_factory=dict)
    _free_rows: list[int] = field(default_factory=list)
    _seen: set[str] = field(default_factory=set)
    """Requests planned at least once: only a request's first chunk may take a row."""
    _step_buffers: dict[LaneTier, LaneStepBuffers] = field(default_factory=dict)
    """Device buffers of each tier a step has needed, kept for the engine's life."""
    _parked: tuple[list[str], int] | None = None
    """The requests of the last step, if every one of them decoded and the step parked
    its regions (no new row, no prompt chunk, no lanes), with how many hold a region:
    while the same requests decode and lanes stay off, nothing of theirs changes and a
    step is planned without looking at its rows (None: plan from the rows)."""

    def __post_init__(self) -> None:
        self._free_rows = list(range(self.region_rows - 1, -1, -1))

    # Request life --------------------------------------------------------------------
    @property
    def num_regions_in_use(self) -> int:
        """Requests holding a region row (at most ``region_rows``)."""
        return len(self._requests)

    def remove_requests(self, req_ids) -> None:
        for req_id in req_ids:
            self._parked = None
            self._seen.discard(req_id)
            state = self._requests.pop(req_id, None)
            if state is not None:
                self._free_rows.append(state.region_row)

    def spine_accepted(self, req_id: str, num_accepted: int) -> None:
        """A draft tree's branch won: only the first ``num_accepted`` staged drafts are the
        request's text; the positions after them are read back from the paged cache."""
        state = self._requests.get(req_id)
        if state is not None:
            state.num_drafts_staged = min(state.num_drafts_staged, num_accepted)

    def start_lanes(self, req_id: str, prompt: Sequence[int]) -> None:
        """Called once the prompt is known (first sampled token)."""
        state = self._requests.get(req_id)
        if state is not None and state.lanes is None:
            state.lanes = LaneState(prompt, self.num_lanes, self.lane_len, self.max_key_len, self.stagger_lanes)

    # Per step ----------------------------------------------------------------------------
    def plan_step(self, batch: BatchView, lanes_for: LaneChooser | None = None) -> StepPlan | None:
        """This step's region updates and tail (token ids and positions included); None
        where the step has neither (every request with a region decodes and its lanes are
        parked: the attention layers then run vLLM's own attention alone).

        ``lanes_for`` (the goodput controller) picks the lanes per request, at
        most what the free token slots allow; None: that maximum."""
        parked, self._parked, active = self._parked, None, -1
        if parked is not None and parked[0] == batch.req_ids and \
                batch.num_tokens == len(batch.req_ids) + sum(batch.num_drafts):
            # the requests of the last step, parked, decode again (a request that decoded
            # is scheduled one token and its drafts): ask for lanes first
            active = self._active_lanes(batch, parked[1], len(batch.req_ids), lanes_for)
            if active == 0:  # still parked: their staging was reset when they parked
                self._parked = parked
                return None
        rows, new_rows, num_decoding = self._rows_with_region(batch)
        decode_rows = [r for r in rows if r.is_decode]
        if active < 0:
            active = self._active_lanes(batch, len(decode_rows), num_decoding, lanes_for)
        park = self.park_when_off and active == 0
        if park and not new_rows and len(decode_rows) == len(rows):  # no region work, no lanes: no plan
            for r in rows:
                r.state.num_drafts_staged, r.state.staged_x_pos = 0, -1
            if num_decoding == len(batch.req_ids):
                self._parked = (list(batch.req_ids), len(decode_rows))
            return None
        layout = self.policy.layout
        commit_src, commit_dst, write_src, write_dst, stage_src, stage_dst = ([] for _ in range(6))
        prefill_chunks, catch_up = [], []
        for r in rows:
            state = r.state
            base = state.region_row * layout.kv_budget
            staged_base = state.region_row * self.max_drafts
            if r.is_decode and park:  # no upkeep; caught up when lanes run again
                state.num_drafts_staged, state.staged_x_pos = 0, -1
                continue
            if r.is_decode:
                # Drafts of the last decode step that vLLM accepted: the request
                # advanced by 1 + accepted tokens since then (further where a draft
                # tree's branch won: its tokens are caught up from the paged cache).
                accepted = min(max(r.first_pos - state.staged_x_pos - 1, 0), state.num_drafts_staged)
                if accepted:
                    committed = state.staged_x_pos + 1 + np.arange(accepted)
                    commit_src.extend(range(staged_base, staged_base + accepted))
                    commit_dst.extend((base + layout.slots(committed)).tolist())
                    state.region_end = state.staged_x_pos + 1 + accepted
            if state.region_end < r.first_pos:
                # Computed without the region: while parked, a won branch, or a
                # prefix-cache hit (vLLM computed them for an earlier request).
                missed = self._catch_up(r, base)
                if missed.positions.numel():  # a one-slot ring may keep none of them
                    catch_up.append(missed)
            if r.is_decode:
                known = 1  # x; the drafts behind it are only staged
                num_drafts = r.end - r.start - 1
                stage_src.extend(range(r.start + 1, r.end))
                stage_dst.extend(range(staged_base, staged_base + num_drafts))
                state.num_drafts_staged, state.staged_x_pos = num_drafts, r.first_pos
            else:
                known = r.end - r.start
                state.num_drafts_staged, state.staged_x_pos = 0, -1
                prefill_chunks.append(PrefillChunk(state.region_row, r.start, r.end, r.first_pos))
            positions = r.first_pos + np.arange(known)
            keep = layout.surviving_writes(positions)
            write_src.extend((r.start + keep).tolist())
            write_dst.extend((base + layout.slots(positions[keep])).tolist())
            state.region_end = r.first_pos + known

        tails, ids, positions = self._layout_tails(batch, decode_rows, active)
        as_index = lambda xs: torch.tensor(xs, dtype=torch.long)  # host: `buffers` holds the device copy
        sink_ring_valid = layout.filled_sink_and_ring([tail.num_final for tail in tails])
        tier = LaneTier.fitting(len(tails), active, self.lane_len, len(commit_dst), len(write_dst), len(stage_dst))
        plan = StepPlan(
            commit_src=as_index(commit_src), commit_dst=as_index(commit_dst),
            write_src=as_index(write_src), write_dst=as_index(write_dst),
            stage_src=as_index(stage_src), stage_dst=as_index(stage_dst),
            new_rows=tuple(new_rows),
            prefill_chunks=tuple(prefill_chunks),
            tails=tuple(tails),
            tail_region_rows=as_index([tail.region_row for tail in tails]),
            tail_sink_ring_valid=torch.from_numpy(sink_ring_valid),
            tail_ids=ids,
            tail_positions=positions,
            buffers=self._buffers_of(tier),
            catch_up=tuple(catch_up),
        )
        plan.buffers.load(plan)
        return plan

    def _buffers_of(self, tier: LaneTier) -> LaneStepBuffers:
        """The tier's device buffers, allocated the first time a step needs them."""
        buffers = self._step_buffers.get(tier)
        if buffers is None:
            geometry = RegionGeometry(self.region_rows, self.policy.layout.kv_budget, self.max_drafts)
            buffers = self._step_buffers[tier] = LaneStepBuffers.allocate(tier, geometry, self.device)
        return buffers

    def _rows_with_region(self, batch: BatchView) -> tuple[list[_Row], list[int], int]:
        """The batch's requests that hold a region (a new one takes a free row at
        its first chunk, which starts after any prefix-cache hit), the region
        rows taken this step, and the rows that decode (one token plus their drafts,
        not a prompt chunk), with a region or not."""
        rows, new_rows, num_decoding = [], [], 0
        starts, firsts = batch.query_start_loc.tolist(), batch.num_computed_tokens.tolist()
        for row, req_id in enumerate(batch.req_ids):
            start, end, first_pos = starts[row], starts[row + 1], firsts[row]
            num_decoding += end - start == batch.num_drafts[row] + 1
            state = self._requests.get(req_id)
            if state is None:
                first_chunk = req_id not in self._seen
                self._seen.add(req_id)
                if not first_chunk or not self._free_rows or (first_pos and not self.paged_cache_readable):
                    continue  # no region for it: the request runs pool-only
                state = self._requests[req_id] = _RequestLanes(self._free_rows.pop())
                new_rows.append(state.region_row)
            is_decode = state.lanes is not None and batch.num_drafts[row] + 1 == end - start
            rows.append(_Row(row, start, end, first_pos, state, is_decode))
        return rows, new_rows, num_decoding

    def _catch_up(self, r: _Row, base: int) -> RegionCatchUp:
        """The sink and ring slots of positions region_end..first_pos-1, which the
        region missed (first_pos is written this step and takes the oldest ring slot)."""
        layout = self.policy.layout
        lo, hi = r.state.region_end, r.first_pos
        sinks = np.arange(lo, min(hi, layout.sink_tokens))
        ring = np.arange(max(lo, layout.sink_tokens, hi - layout.ring_slots + 1), hi)
        positions = np.concatenate([sinks, ring])
        as_index = lambda xs: torch.as_tensor(xs, dtype=torch.long, device=self.device)
        return RegionCatchUp(r.row, as_index(positions), as_index(base + layout.slots(positions)))

    def _active_lanes(self, batch: BatchView, num_decode_rows: int, num_decoding: int,
                      lanes_for: LaneChooser | None) -> int:
        """Lanes per request (``num_decode_rows`` of the ``num_decoding`` decoding requests
        hold a region): at most min(num_lanes, free token slots / requests with lanes)."""
        free = batch.capacity - batch.num_tokens
        if not num_decode_rows or free < self.lane_len:
            return 0
        active = min(self.num_lanes, free // (num_decode_rows * self.lane_len))
        if lanes_for is not None and active > 0:
            active = min(active, lanes_for(batch.num_tokens, num_decode_rows, num_decoding, active))
        return active

    def _layout_tails(
        self, batch: BatchView, decode_rows: list[_Row], active: int
    ) -> tuple[list[RequestTail], np.ndarray, np.ndarray]:
        """``active`` lanes for every decoding request with a region, back to back behind the batch."""
        if active == 0:
            return [], np.zeros(0, np.int64), np.zeros(0, np.int64)
        tails, all_ids, all_pos = [], [], []
        offset = batch.num_tokens
        for r in decode_rows:
            ids, pos = r.state.lanes.tail(active, r.first_pos, self.max_model_len - 1)
            tail = RequestTail(
                req_id=batch.req_ids[r.row],
                region_row=r.state.region_row,
                batch_row=r.row,
                x_index=r.start,
                tail_start=offset,
                active_lanes=active,
                lane_len=self.lane_len,
                num_final=r.first_pos + 1,
            )
            tails.append(tail)
            all_ids.append(ids)
            all_pos.append(pos)
            offset += tail.num_tokens
        return tails, np.concatenate(all_ids), np.concatenate(all_pos)

    def consume_tail(
        self,
        plan: StepPlan,
        hidden_states: torch.Tensor,
        compute_logits: Callable[[torch.Tensor], torch.Tensor],
    ) -> list[tuple[str, list[tuple[list[int], tuple[int, ...]]]]]:
        """Advance every lane that ran in ``plan``'s forward; return (req_id, n-grams) pairs."""
        if not plan.tails:
            return []
        # The tails lie back to back with the same layout: each lane's last token,
        # request by request, is one strided pick out of the tail.
        first = plan.tails[0]
        per_request = first.num_tokens
        offsets = np.arange(len(plan.tails))[:, None] * per_request + first.last_level.start - first.tail_start
        index = first.tail_start + (offsets + np.arange(first.active_lanes)[None, :]).reshape(-1)
        rows = torch.from_numpy(index).to(hidden_states.device)
        next_tokens = compute_logits(hidden_states[rows]).argmax(dim=-1).tolist()
        results, used = [], 0
        for tail in plan.tails:
            lanes = self._requests[tail.req_id].lanes
            active = tail.active_lanes
            results.append((tail.req_id, lanes.advance(active, next_tokens[used : used + active])))
            used += active
        return results
