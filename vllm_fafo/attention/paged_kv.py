"""Reading vLLM's CPU paged KV cache back, for policies that select from it.

vLLM 0.32.0's CPU_ATTN cache is ``[num_blocks, Hk, block_size, 2 * D]``,
viewed as a key half and a value half of ``[num_blocks, Hk, block_size, D]``
each. ``cpu_attn_reshape_and_cache`` stores values row-major but keys
transposed inside each (block, head) tile, ``[D, block_size]``, for the
``vec``/``vec16`` kernels (checked on this release, not documented by vLLM).
Other ISAs (AMX packs bf16 keys) are refused, and the first read of every
layer is checked against keys the layer just wrote, so a layout change
fails loudly instead of feeding lanes garbage.
"""

from __future__ import annotations

import torch

VERIFIED_ISAS = ("vec", "vec16")


class PagedKVLayoutError(RuntimeError):
    """The paged KV cache is not laid out as this reader assumes."""


class CPUPagedKV:
    """:class:`vllm_fafo.compression.base.PagedKV` over one layer's CPU cache."""

    def __init__(self, kv_cache: torch.Tensor, block_table: torch.Tensor, isa: str) -> None:
        num_blocks, num_kv_heads, block_size, twice_dim = kv_cache.shape
        dim = twice_dim // 2
        if not kv_cache.is_contiguous():
            raise PagedKVLayoutError("vllm-fafo expects a contiguous CPU paged KV cache")
        tile = block_size * dim
        block_stride, head_stride = num_kv_heads * 2 * tile, 2 * tile
        # Views, never copies: key tiles are D x block_size, value tiles follow them.
        self._keys = kv_cache.as_strided(
            (num_blocks, num_kv_heads, dim, block_size), (block_stride, head_stride, block_size, 1)
        )
        self._values = kv_cache.as_strided(
            (num_blocks, num_kv_heads, block_size, dim), (block_stride, head_stride, dim, 1),
            kv_cache.storage_offset() + tile,
        )
        self._block_table = block_table
        self._block_size = block_size
        self._isa = isa

    def read(self, batch_row: int, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self._isa not in VERIFIED_ISAS:
            raise PagedKVLayoutError(
                f"vllm-fafo reads the paged KV cache for this compression policy, but "
                f"the CPU attention ISA {self._isa!r} packs keys in a layout it has not "
                f"been checked against (checked: {', '.join(VERIFIED_ISAS)}); use "
                "compression 'streaming', which never reads it"
            )
        num_kv_heads = self._values.shape[1]
        per_head = positions if positions.dim() == 2 else positions[None].expand(num_kv_heads, -1)
        blocks = self._block_table[batch_row, per_head // self._block_size].long()  # (Hk, n)
        offsets = per_head % self._block_size
        heads = torch.arange(num_kv_heads, device=positions.device)[:, None].expand_as(blocks)
        keys = self._keys[blocks, heads, :, offsets]  # (Hk, n, D)
        values = self._values[blocks, heads, offsets]  # (Hk, n, D)
        return keys.transpose(0, 1), values.transpose(0, 1)

    def check(self, batch_row: int, positions: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> None:
        """Raise unless the cache returns ``key``/``value`` (n, Hk, D) at ``positions``."""
        got_key, got_value = self.read(batch_row, positions)
        if not (torch.equal(got_key, key) and torch.equal(got_value, value)):
            raise PagedKVLayoutError(
                "vllm-fafo read back different keys/values from vLLM's CPU paged KV "
                "cache than the layer wrote: the cache layout changed under this "
                "release of vllm-fafo (written against vLLM 0.32.0)"
            )
