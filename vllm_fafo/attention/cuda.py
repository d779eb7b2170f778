"""FLASH_ATTN wrapper for CUDA: vLLM's FlashAttention for real tokens, lanes for the tail.

Registered as ``AttentionBackendEnum.CUSTOM`` by
``vllm_fafo.patches.attention_backend``; the engine-args patch selects
``CUSTOM`` when lanes or draft trees are on, so engines without them keep
vLLM's own backend selection. Everything but the name (``CUSTOM``, which the
attention layer maps back to this class) and the impl is FlashAttention's:
metadata builder, KV cache shape and layouts, validation. Draft-tree branches
run through FlashAttention's own kernel (:class:`FlashBranchKernel`).
"""

from __future__ import annotations

import torch
from vllm.utils.torch_utils import canonicalize_singleton_dim_strides, is_quantized_kv_cache
from vllm.v1.attention.backends import flash_attn
from vllm.v1.attention.backends.flash_attn import FlashAttentionBackend, FlashAttentionImpl

from vllm_fafo.attention.branch_attention import KernelRound
from vllm_fafo.attention.lane_impl import LaneAttentionMixin
from vllm_fafo.attention.paged_kv import LogicalPagedKV
from vllm_fafo.errors import FafoConfigError


class FlashBranchKernel:
    """vLLM 0.32.0's ``FlashAttentionImpl.do_kv_cache_update``, and the FlashAttention
    call ``FlashAttentionImpl.forward`` makes for a decoder layer, with the layer's own
    settings and the step's split count: a branch row is computed as a verification of
    the same tokens as the spine computes it (bit for bit under
    ``VLLM_BATCH_INVARIANT=1``, where the split count is 1). The forward's other
    paths (decode context parallel, FA4's head-size-256 kernel, quantized KV caches,
    multimodal prefixes, R-SWA, per-request causal) are refused, not mirrored."""

    def __init__(self, impl: FlashAttentionImpl, layer: torch.nn.Module, kv_cache: torch.Tensor,
                 attn_metadata) -> None:
        if not (attn_metadata.causal is True and attn_metadata.rswa_prefix_lens is None
                and attn_metadata.mm_prefix_query_range_tensor is None):
            raise RuntimeError(
                "vllm-fafo: draft-tree branches run FlashAttention as a causal decoder layer's "
                "forward does; this step's metadata asks for per-request causality, R-SWA or "
                "multimodal prefix ranges, which the branch kernel does not mirror"
            )
        self.impl, self.layer, self.kv_cache = impl, layer, kv_cache
        self.num_splits = attn_metadata.max_num_splits
        key_cache, value_cache = kv_cache.transpose(1, 2).split(impl.head_size, dim=-1)  # (B, N, Hk, D)
        self.key_cache = canonicalize_singleton_dim_strides(key_cache)
        self.value_cache = canonicalize_singleton_dim_strides(value_cache)
        self.block_size = key_cache.shape[1]
        window = flash_attn._maybe_symmetrize_window(impl.sliding_window, True)
        self.window_size = list(window) if window is not None else None

    def write(self, key: torch.Tensor, value: torch.Tensor, slots: torch.Tensor) -> None:
        FlashAttentionImpl.do_kv_cache_update(self.impl, self.layer, key, value, self.kv_cache, slots)

    def attend(self, query: torch.Tensor, kernel_round: KernelRound) -> torch.Tensor:
        impl, layer = self.impl, self.layer
        descale_shape = (len(kernel_round.seq_lens), impl.num_kv_heads)
        output = torch.empty_like(query)
        flash_attn._FA4_DENSE_ATTENTION_KERNEL(
            q=query, k=self.key_cache, v=self.value_cache, out=output,
            cu_seqlens_q=kernel_round.query_start_loc, max_seqlen_q=kernel_round.max_query_len,
            seqused_k=kernel_round.seq_lens, max_seqlen_k=kernel_round.max_seq_len,
            softmax_scale=impl.scale, causal=True, alibi_slopes=impl.alibi_slopes,
            window_size=self.window_size, block_table=kernel_round.block_table,
            softcap=impl.logits_soft_cap, scheduler_metadata=None, fa_version=impl.vllm_flash_attn_version,
            q_descale=layer._q_scale.expand(descale_shape) if impl.supports_quant_query_input else None,
            k_descale=layer._k_scale.expand(descale_shape), v_descale=layer._v_scale.expand(descale_shape),
            dynamic_causal=None, num_splits=self.num_splits, s_aux=impl.sinks, mask_mod=None, aux_tensors=None,
        )
        return output


class FafoFlashAttentionImpl(LaneAttentionMixin, FlashAttentionImpl):
    def paged_kv(self, layer: torch.nn.Module, kv_cache: torch.Tensor, attn_metadata) -> LogicalPagedKV:
        return LogicalPagedKV(kv_cache, attn_metadata.block_table)

    def branch_kernel(self, layer: torch.nn.Module, kv_cache: torch.Tensor, attn_metadata) -> FlashBranchKernel:
        return FlashBranchKernel(self, layer, kv_cache, attn_metadata)

    def refuse_branches_here(self) -> None:
        """What :class:`FlashBranchKernel` does not mirror, refused when the layer is built."""
        unsupported = {
            "decode context parallelism": self.dcp_world_size > 1,
            "FA4's head-size-256 kernel (page-aligned block tables)": self.fa4_hd256,
            f"kv_cache_dtype {self.kv_cache_dtype!r} (accepted branches write back unquantized)":
                is_quantized_kv_cache(self.kv_cache_dtype),
        }
        used = [name for name, present in unsupported.items() if present]
        if used:
            raise FafoConfigError(
                f"speculative_config num_candidates > 1: draft-tree branches on FlashAttention do not "
                f"support {', '.join(used)}; set num_candidates to 1"
            )


class FafoFlashAttentionBackend(FlashAttentionBackend):
    @staticmethod
    def get_name() -> str:
        return "CUSTOM"

    @staticmethod
    def get_impl_cls() -> type[FlashAttentionImpl]:
        return FafoFlashAttentionImpl
