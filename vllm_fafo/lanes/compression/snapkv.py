"""SnapKV (Li et al., 2024): keep the prompt tokens the prompt's end attends to.

At prefill, the queries of an observation window at the end of the prompt
vote for prompt tokens with their attention weights (summed over the window,
averaged over the query heads of each KV head group, smoothed by a 1-D
average pool); each KV head keeps its top tokens in the region's selected
part, once. Generated tokens enter the recent ring like StreamingLLM's.
Tokens the ring or the sinks already hold are not candidates, so no key is
seen twice.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

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
class SnapKVSettings:
    window: int = 32
    """Observation window: the last prompt tokens whose queries vote."""
    kernel: int = 5
    """Width of the average pool over the votes (odd; 1 = none)."""
    recent_tokens: int = 64
    """Ring of the most recent tokens (generated ones enter here)."""

    def validate(self, sink_tokens: int, kv_budget: int, num_speculative_tokens: int) -> None:
        check_int("snapkv_window", self.window, 1, 1024)
        check_int("snapkv_kernel", self.kernel, 1, 63)
        if self.kernel % 2 == 0:
            raise FafoConfigError(
                f"speculative_config['snapkv_kernel']={self.kernel} must be odd "
                "(the pool is centred on each token)"
            )
        check_int("snapkv_recent_tokens", self.recent_tokens, num_speculative_tokens + 2,
                  kv_budget - sink_tokens - 1)


@dataclass
class _SnapKVLayerState:
    queries: torch.Tensor  # (rows, window, Hq, D): the latest prefill queries
    num_queries: list[int]
    queries_end: list[int]  # position after the last stored query (= prompt length)
    done: list[bool]


class SnapKVPolicy(CompressionPolicy):
    name = "snapkv"
    Settings = SnapKVSettings
    reads_paged_kv = True

    def make_layout(self, sink_tokens: int, kv_budget: int, settings: SnapKVSettings) -> RegionLayout:
        ring = settings.recent_tokens
        return RegionLayout(sink_tokens, kv_budget - sink_tokens - ring, ring)

    def new_layer_state(self, shape: LayerShape) -> _SnapKVLayerState:
        queries = torch.zeros(
            shape.rows, self.settings.window, shape.num_heads, shape.head_size,
            dtype=shape.dtype, device=shape.device,
        )
        return _SnapKVLayerState(queries, [0] * shape.rows, [0] * shape.rows, [False] * shape.rows)

    def reset_row(self, state: _SnapKVLayerState, row: int) -> None:
        state.num_queries[row] = state.queries_end[row] = 0
        state.done[row] = False

    def observe_prefill(self, state: _SnapKVLayerState, row: int, first_pos: int, query: torch.Tensor) -> None:
        window = self.settings.window
        kept = min(state.num_queries[row], max(window - query.shape[0], 0))
        new = query[-window:]
        buffer = state.queries[row]
        if kept:
            buffer[:kept] = buffer[state.num_queries[row] - kept : state.num_queries[row]].clone()
        buffer[kept : kept + new.shape[0]] = new
        state.num_queries[row] = kept + new.shape[0]
        state.queries_end[row] = first_pos + query.shape[0]

    def select(self, state: _SnapKVLayerState, step: LaneStep, kv: PagedKV) -> Selection | None:
        if state.done[step.row]:
            return None
        state.done[step.row] = True
        prompt_len = state.queries_end[step.row]
        num_queries = state.num_queries[step.row]
        candidates_end = min(prompt_len, self.layout.oldest_in_ring(step.num_final))
        sink = self.layout.sink_tokens
        if candidates_end <= sink or num_queries == 0:
            return None
        device = state.queries.device
        keys, _ = kv.read(step.batch_row, torch.arange(prompt_len, device=device))
        votes = snapkv_votes(
            state.queries[step.row, :num_queries], keys, prompt_len - num_queries,
            step.scale, self.settings.kernel,
        )
        count = min(self.layout.selected_slots, candidates_end - sink)
        chosen = votes[:, sink:candidates_end].topk(count, dim=1).indices + sink  # (Hk, count)
        return Selection(*kv.read(step.batch_row, chosen.sort(dim=1).values))


def snapkv_votes(
    query: torch.Tensor,  # (w, Hq, D) the observation window, positions first_query_pos..
    keys: torch.Tensor,  # (L, Hk, D) every prompt key
    first_query_pos: int,
    scale: float,
    kernel: int,
) -> torch.Tensor:
    """(Hk, L) pooled attention each prompt token receives from the window."""
    num_queries, num_heads = query.shape[0], query.shape[1]
    group = num_heads // keys.shape[1]
    k = keys.repeat_interleave(group, dim=1).transpose(0, 1).float()  # (Hq, L, D)
    logits = torch.einsum("whd,hld->hwl", query.float(), k) * scale  # (Hq, w, L)
    query_pos = first_query_pos + torch.arange(num_queries, device=query.device)
    causal = torch.arange(keys.shape[0], device=query.device)[None, :] <= query_pos[:, None]
    weights = logits.masked_fill(~causal, float("-inf")).softmax(dim=-1).sum(dim=1)  # (Hq, L)
    per_group = weights.view(keys.shape[1], group, -1).mean(dim=1)  # (Hk, L)
    return F.avg_pool1d(per_group[:, None], kernel, stride=1, padding=kernel // 2,
                        count_include_pad=False)[:, 0]
