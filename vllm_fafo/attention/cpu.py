"""CPU_ATTN wrapper: vLLM's CPU attention for real tokens, lanes for the tail.

Registered over ``AttentionBackendEnum.CPU_ATTN`` (the only path the CPU
platform honours) by ``vllm_fafo.patches.attention_backend``.
"""

from __future__ import annotations

import torch
from vllm.v1.attention.backends.cpu_attn import (
    CPUAttentionBackend,
    CPUAttentionBackendImpl,
)

from vllm_fafo.attention.lane_impl import LaneAttentionMixin
from vllm_fafo.attention.paged_kv import CPUPagedKV


class FafoCPUAttentionBackendImpl(LaneAttentionMixin, CPUAttentionBackendImpl):
    def paged_kv(self, layer: torch.nn.Module, kv_cache: torch.Tensor, attn_metadata) -> CPUPagedKV:
        return CPUPagedKV(kv_cache, attn_metadata.block_table, layer.isa)


class FafoCPUAttentionBackend(CPUAttentionBackend):
    @staticmethod
    def get_impl_cls() -> type[CPUAttentionBackendImpl]:
        return FafoCPUAttentionBackendImpl
