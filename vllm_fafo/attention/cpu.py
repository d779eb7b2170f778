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

from vllm_fafo.attention.region import CompressedRegion
from vllm_fafo.step_plan import current_plan


class FafoCPUAttentionBackendImpl(CPUAttentionBackendImpl):
    """Runs the base impl, then maintains the region and runs the lanes."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.region: CompressedRegion | None = None

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
            self.region = CompressedRegion.allocate(plan, key)
        self.region.run_step(plan, query, key, value, output, self.scale)
        return output


class FafoCPUAttentionBackend(CPUAttentionBackend):
    @staticmethod
    def get_impl_cls() -> type[CPUAttentionBackendImpl]:
        return FafoCPUAttentionBackendImpl
