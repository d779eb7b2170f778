"""Quest (Tang et al., 2024): query-aware selection of KV pages.

Each page of ``page_size`` positions keeps the element-wise min and max of its
keys, folded in as tokens become final (never recomputed over the sequence),
in the keys' own dtype (a min or max of keys is one of them: exact), so the
metadata takes ``2 / page_size`` of a row's keys.
A page's score for a query q is ``sum_c max(q_c * kmin_c, q_c * kmax_c)``, an
upper bound of q.k over the page. The queries are the lanes' own: for each
KV head, a page scores the max over lane tokens of that bound, summed over
the head's query group; the top pages fill the region's selected part, which
is re-chosen every ``refresh_steps`` lane steps. Pages that overlap the
sinks or the recent ring (the "most recent page" Quest always keeps) are not
candidates, so no key is seen twice.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vllm_fafo.errors import FafoConfigError, check_int
from vllm_fafo.lanes.compression.base import (
    CompressionPolicy,
    LaneStep,
    LayerShape,
    PagedKV,
    RegionLayout,
    Selection,
)


@dataclass(frozen=True)
class QuestSettings:
    page_size: int = 16
    """Positions per page (Quest's paper uses 16)."""
    refresh_steps: int = 4
    """Re-choose the pages every this many lane steps (1: every step)."""
    recent_tokens: int = 32
    """Ring of the most recent tokens (at least one page)."""

    def validate(self, sink_tokens: int, kv_budget: int, num_speculative_tokens: int) -> None:
        check_int("quest_page_size", self.page_size, 1, 1024)
        check_int("quest_refresh_steps", self.refresh_steps, 1, 1 << 20)
        check_int("quest_recent_tokens", self.recent_tokens,
                  max(self.page_size, num_speculative_tokens + 2), kv_budget)
        if kv_budget - sink_tokens - self.recent_tokens < self.page_size:
            raise FafoConfigError(
                f"speculative_config['kv_budget']={kv_budget} leaves "
                f"{kv_budget - sink_tokens - self.recent_tokens} slots after "
                f"sink_tokens={sink_tokens} and quest_recent_tokens={self.recent_tokens}; "
                f"Quest needs room for at least one page of quest_page_size={self.page_size}"
            )


@dataclass
class _QuestLayerState:
    kmin: torch.Tensor  # (rows, max_pages, Hk, D)
    kmax: torch.Tensor
    folded: list[int]  # positions folded into the page metadata
    steps: list[int]  # lane steps seen


class QuestPolicy(CompressionPolicy):
    name = "quest"
    Settings = QuestSettings
    reads_paged_kv = True

    def make_layout(self, sink_tokens: int, kv_budget: int, settings: QuestSettings) -> RegionLayout:
        page = settings.page_size
        selected = (kv_budget - sink_tokens - settings.recent_tokens) // page * page
        return RegionLayout(sink_tokens, selected, kv_budget - sink_tokens - selected)

    def new_layer_state(self, shape: LayerShape) -> _QuestLayerState:
        pages = -(-shape.max_model_len // self.settings.page_size)
        size = (shape.rows, pages, shape.num_kv_heads, shape.head_size)
        kmin = torch.full(size, float("inf"), dtype=shape.dtype, device=shape.device)
        return _QuestLayerState(kmin, -kmin.clone(), [0] * shape.rows, [0] * shape.rows)

    def reset_row(self, state: _QuestLayerState, row: int) -> None:
        state.kmin[row] = float("inf")
        state.kmax[row] = float("-inf")
        state.folded[row] = state.steps[row] = 0

    def select(self, state: _QuestLayerState, step: LaneStep, kv: PagedKV) -> Selection | None:
        row = step.row
        self._fold(state, step, kv)
        state.steps[row] += 1
        if (state.steps[row] - 1) % self.settings.refresh_steps:
            return None
        page = self.settings.page_size
        first = -(-self.layout.sink_tokens // page)
        last = self.layout.oldest_in_ring(step.num_final) // page  # pages wholly before the ring
        if last <= first:
            return None
        scores = quest_scores(step.lane_query, state.kmin[row, first:last], state.kmax[row, first:last])
        count = min(self.layout.selected_slots // page, last - first)
        pages = scores.topk(count, dim=1).indices.sort(dim=1).values + first  # (Hk, count)
        offsets = torch.arange(page, device=pages.device)
        positions = (pages[:, :, None] * page + offsets).reshape(pages.shape[0], -1)
        return Selection(*kv.read(step.batch_row, positions))

    def _fold(self, state: _QuestLayerState, step: LaneStep, kv: PagedKV) -> None:
        """Fold the keys that became final since the last step into page min/max."""
        start, end = state.folded[step.row], step.num_final
        if end <= start:
            return
        positions = torch.arange(start, end, device=state.kmin.device)
        keys, _ = kv.read(step.batch_row, positions)
        index = (positions // self.settings.page_size)[:, None, None].expand_as(keys)
        state.kmin[step.row].scatter_reduce_(0, index, keys, "amin")
        state.kmax[step.row].scatter_reduce_(0, index, keys, "amax")
        state.folded[step.row] = end


def quest_scores(query: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor) -> torch.Tensor:
    """(Hk, pages) Quest bound: max over query tokens, summed over each KV head's group.

    query (T, Hq, D); kmin, kmax (pages, Hk, D).
    """
    num_heads, num_kv_heads = query.shape[1], kmin.shape[1]
    group = num_heads // num_kv_heads
    q = query.float()
    # max(q*kmin, q*kmax) is q*kmax where q > 0, else q*kmin: two matmuls.
    lo = kmin.float().repeat_interleave(group, dim=1)  # (P, Hq, D)
    hi = kmax.float().repeat_interleave(group, dim=1)
    bound = torch.einsum("thd,phd->thp", q.clamp(min=0), hi) + torch.einsum(
        "thd,phd->thp", q.clamp(max=0), lo
    )  # (T, Hq, P)
    return bound.amax(dim=0).view(num_kv_heads, group, -1).sum(dim=1)
