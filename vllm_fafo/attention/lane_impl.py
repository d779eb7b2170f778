"""The part of the attention wrapper that does not depend on the base backend.

Each wrapper (``cpu.py`` over ``CPU_ATTN``, ``cuda.py`` over ``FLASH_ATTN``)
is this mixin placed before vLLM's impl class: the base impl computes the
real tokens (the tail is padding to it: beyond ``num_actual_tokens``, slot
mapping -1), then this maintains the layer's compressed region and writes
the lane tokens' outputs. A wrapper only says how to read its base's paged
KV cache. Without a step plan (no lanes configured, warm-up, profiling) the
wrapper is exactly the base backend.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from vllm.v1.attention.backend import AttentionType

from vllm_fafo.attention.paged_kv import PagedKVReader
from vllm_fafo.attention.region import CompressedRegion
from vllm_fafo.compression.base import LayerShape
from vllm_fafo.step_plan import StepPlan, current_plan


class LaneAttentionMixin(ABC):
    """Runs the base impl, then maintains the region and runs the lanes."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.region: CompressedRegion | None = None
        self._layout_checked = False

    @abstractmethod
    def paged_kv(self, layer: torch.nn.Module, kv_cache: torch.Tensor, attn_metadata) -> PagedKVReader:
        """A reader of this layer's paged cache in the base backend's layout."""

    def forward(
        self,
        layer,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata,
        output: torch.Tensor,
        output_scale: torch.Tensor | None = None,
        output_block_scale: torch.Tensor | None = None,
    ) -> torch.Tensor:
        output = super().forward(
            layer, query, key, value, kv_cache, attn_metadata, output,
            output_scale, output_block_scale,
        )
        plan = current_plan()
        if plan is None or attn_metadata is None or self.attn_type != AttentionType.DECODER:
            return output
        if self.region is None:
            self.region = CompressedRegion.allocate(plan, self._layer_shape(plan, query, key))
        reader = None  # streaming never reads the cache: no reader per layer and step
        if plan.policy.reads_paged_kv:
            reader = self.paged_kv(layer, kv_cache, attn_metadata)
            if not self._layout_checked and plan.tails:
                self._check_layout(plan, reader, key, value)
        self.region.run_step(plan, query, key, value, output, self.scale, reader)
        return output

    @staticmethod
    def _layer_shape(plan: StepPlan, query: torch.Tensor, key: torch.Tensor) -> LayerShape:
        return LayerShape(
            rows=plan.region_rows,
            num_heads=query.shape[1],
            num_kv_heads=key.shape[1],
            head_size=key.shape[2],
            max_model_len=plan.max_model_len,
            dtype=key.dtype,
            device=key.device,
        )

    def _check_layout(self, plan: StepPlan, reader: PagedKVReader, key, value) -> None:
        """Read this step's input token back from the cache: it must be what was written."""
        tail = plan.tails[0]
        x = slice(tail.x_index, tail.x_index + 1)
        position = torch.tensor([tail.num_final - 1], device=key.device)
        reader.check(tail.batch_row, position, key[x], value[x])
        self._layout_checked = True
