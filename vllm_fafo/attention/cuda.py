"""FLASH_ATTN wrapper for CUDA: vLLM's FlashAttention for real tokens, lanes for the tail.

Registered as ``AttentionBackendEnum.CUSTOM`` by
``vllm_fafo.patches.attention_backend``; the engine-args patch selects
``CUSTOM`` when lanes are on, so engines without lanes keep vLLM's own
backend selection. Everything but the name (``CUSTOM``, which the attention
layer maps back to this class) and the impl is FlashAttention's: metadata
builder, KV cache shape and layouts, validation.
"""

from __future__ import annotations

import torch
from vllm.v1.attention.backends.flash_attn import FlashAttentionBackend, FlashAttentionImpl

from vllm_fafo.attention.lane_impl import LaneAttentionMixin
from vllm_fafo.attention.paged_kv import LogicalPagedKV


class FafoFlashAttentionImpl(LaneAttentionMixin, FlashAttentionImpl):
    def paged_kv(self, layer: torch.nn.Module, kv_cache: torch.Tensor, attn_metadata) -> LogicalPagedKV:
        return LogicalPagedKV(kv_cache, attn_metadata.block_table)


class FafoFlashAttentionBackend(FlashAttentionBackend):
    @staticmethod
    def get_name() -> str:
        return "CUSTOM"

    @staticmethod
    def get_impl_cls() -> type[FlashAttentionImpl]:
        return FafoFlashAttentionImpl
