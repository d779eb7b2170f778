"""CPU_ATTN wrapper: vLLM's CPU attention for real tokens, lanes for the tail.

Registered over ``AttentionBackendEnum.CPU_ATTN`` (the only path the CPU
platform honours) by ``vllm_fafo.patches.attention_backend``. Without a step
plan (no lanes configured, warm-up, profiling) it is exactly vLLM's backend.
"""

from __future__ import annotations

import torch

from vllm.v1.attention.backend import AttentionType
from vllm.v1.attention.backends.cpu_attn import (
    CPUAttentionBackend,
    CPUAttentionBackendImpl,
)

from vllm_fafo.attention.paged_kv import CPUPagedKV
from vllm_fafo.attention.region import CompressedRegion
from vllm_fafo.compression.base import LayerShape
from vllm_fafo.step_plan import StepPlan, current_plan


class FafoCPUAttentionBackendImpl(CPUAttentionBackendImpl):
    """Runs the base impl, then maintains the region and runs the lanes."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.region: CompressedRegion | None = None
        self._layout_checked = False

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
        paged_kv = None  # streaming never reads the cache: no reader per layer and step
        if plan.policy.reads_paged_kv:
            paged_kv = CPUPagedKV(kv_cache, attn_metadata.block_table, layer.isa)
            if not self._layout_checked and plan.tails:
                self._check_layout(plan, paged_kv, key, value)
        self.region.run_step(plan, query, key, value, output, self.scale, paged_kv)
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

    def _check_layout(self, plan: StepPlan, paged_kv: CPUPagedKV, key, value) -> None:
        """Read this step's input token back from the cache: it must be what was written."""
        tail = plan.tails[0]
        x = slice(tail.x_index, tail.x_index + 1)
        position = torch.tensor([tail.num_final - 1], device=key.device)
        paged_kv.check(tail.batch_row, position, key[x], value[x])
        self._layout_checked = True


class FafoCPUAttentionBackend(CPUAttentionBackend):
    @staticmethod
    def get_impl_cls() -> type[CPUAttentionBackendImpl]:
        return FafoCPUAttentionBackendImpl
