"""CPU_ATTN wrapper: vLLM's CPU attention for real tokens, lanes for the tail.

Registered over ``AttentionBackendEnum.CPU_ATTN`` (the only path the CPU
platform honours) by ``vllm_fafo.patches.attention_backend``. Draft-tree
branches run through vLLM's own CPU attention kernel (:class:`CPUBranchKernel`).
"""

from __future__ import annotations

import torch
from vllm import _custom_ops as ops
from vllm import envs
from vllm.v1.attention.backends.cpu_attn import (
    CPUAttentionBackend,
    CPUAttentionBackendImpl,
)

from vllm_fafo.attention.branch_attention import KernelRound
from vllm_fafo.attention.lane_impl import LaneAttentionMixin
from vllm_fafo.attention.paged_kv import CPUPagedKV


class CPUBranchKernel:
    """vLLM 0.32.0's ``CPUAttentionBackendImpl.do_kv_cache_update``, and its
    ``cpu_attention_with_kv_cache`` called with the layer's own settings, as
    ``CPUAttentionBackendImpl.forward`` calls it."""

    def __init__(self, impl: CPUAttentionBackendImpl, layer: torch.nn.Module, kv_cache: torch.Tensor) -> None:
        self.impl, self.layer, self.kv_cache = impl, layer, kv_cache
        num_blocks, num_kv_heads, self.block_size, _ = kv_cache.shape
        halves = kv_cache.view(num_blocks, num_kv_heads, 2 * self.block_size, -1)
        self.key_cache, self.value_cache = halves.chunk(2, dim=2)

    def write(self, key: torch.Tensor, value: torch.Tensor, slots: torch.Tensor) -> None:
        CPUAttentionBackendImpl.do_kv_cache_update(self.impl, self.layer, key, value, self.kv_cache, slots)

    def attend(self, query: torch.Tensor, kernel_round: KernelRound) -> torch.Tensor:
        impl, layer = self.impl, self.layer
        shape = (impl.num_heads, impl.num_kv_heads, impl.head_size, query.dtype, impl.sliding_window, layer.isa)
        scheduler_metadata = kernel_round.backend_state.get(shape)
        if scheduler_metadata is None:  # the work split, as the metadata builder makes it for a step
            scheduler_metadata = kernel_round.backend_state[shape] = ops.cpu_attn_get_scheduler_metadata(
                num_reqs=len(kernel_round.seq_lens), num_heads=impl.num_heads, num_kv_heads=impl.num_kv_heads,
                head_dim=impl.head_size, seq_lens=kernel_round.seq_lens, dtype=query.dtype,
                query_start_loc=kernel_round.query_start_loc, causal=True, sliding_window_size=impl.sliding_window,
                isa=layer.isa, enable_kv_split=envs.VLLM_CPU_ATTN_SPLIT_KV, dynamic_causal=None,
                kv_cache_dtype=impl.kv_cache_dtype,
            )
        output = torch.empty_like(query)
        ops.cpu_attention_with_kv_cache(
            query=query, key_cache=self.key_cache, value_cache=self.value_cache, output=output,
            query_start_loc=kernel_round.query_start_loc, seq_lens=kernel_round.seq_lens, scale=impl.scale,
            causal=True, alibi_slopes=impl.alibi_slopes, sliding_window=impl.sliding_window,
            block_table=kernel_round.block_table, softcap=impl.logits_soft_cap,
            scheduler_metadata=scheduler_metadata, s_aux=impl.sinks, dynamic_causal=None,
            k_scale=layer._k_scale_float, v_scale=layer._v_scale_float, kv_cache_dtype=impl.kv_cache_dtype,
        )
        return output


class FafoCPUAttentionBackendImpl(LaneAttentionMixin, CPUAttentionBackendImpl):
    def paged_kv(self, layer: torch.nn.Module, kv_cache: torch.Tensor, attn_metadata) -> CPUPagedKV:
        return CPUPagedKV(kv_cache, attn_metadata.block_table, layer.isa)

    def branch_kernel(self, layer: torch.nn.Module, kv_cache: torch.Tensor, attn_metadata) -> CPUBranchKernel:
        return CPUBranchKernel(self, layer, kv_cache)

    def refuse_branches_here(self) -> None:
        """Nothing to refuse: the kernel is called with every setting the layer has."""


class FafoCPUAttentionBackend(CPUAttentionBackend):
    @staticmethod
    def get_impl_cls() -> type[CPUAttentionBackendImpl]:
        return FafoCPUAttentionBackendImpl
