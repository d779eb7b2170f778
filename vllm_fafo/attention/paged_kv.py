"""Reading vLLM's paged KV cache back, for policies that select from it.

vLLM 0.32.0 hands every attention layer a ``[num_blocks, Hk, block_size,
2 * D]`` cache, key in the first half of the last axis and value in the
second. Two readers:

- :class:`LogicalPagedKV` (FLASH_ATTN on CUDA): the tensor is a view whose
  strides follow the resolved KV cache layout (``KVCacheLayout``), so
  indexing it logically is right for every layout (FlashAttention itself
  reads it as ``kv_cache.transpose(1, 2).split(D, -1)``).
- :class:`CPUPagedKV` (CPU_ATTN): ``cpu_attn_reshape_and_cache`` stores
  values row-major but keys transposed inside each (block, head) tile,
  ``[D, block_size]``, for the ``vec``/``vec16`` kernels (checked on this
  release, not documented by vLLM). Other ISAs (AMX packs bf16 keys) are
  refused.

The first read of every layer is checked against keys the layer just wrote,
so a layout change fails loudly instead of feeding lanes garbage.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

import torch

VERIFIED_CPU_ISAS = ("vec", "vec16")


def paged_kv_readable(vllm_config: Any) -> bool:
    """Whether this engine's paged cache can be read back: unquantised, and on CPU
    an attention ISA whose layout :class:`CPUPagedKV` knows (vLLM 0.32.0's choice,
    ``cpu_attn._get_attn_isa``, asked with the engine's own settings)."""
    from vllm.platforms import current_platform

    if vllm_config.cache_config.cache_dtype != "auto":
        return False
    if not current_platform.is_cpu():
        return True  # FLASH_ATTN: the logical view is the content (LogicalPagedKV)
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    model = vllm_config.model_config
    isa = _get_attn_isa(model.dtype, vllm_config.cache_config.block_size, model.get_head_size(), "auto")
    return isa in VERIFIED_CPU_ISAS


class PagedKVLayoutError(RuntimeError):
    """The paged KV cache is not laid out as this reader assumes."""


class PagedKVReader(ABC):
    """:class:`vllm_fafo.lanes.compression.base.PagedKV` over one layer's cache.

    Subclasses say how to gather from their backend's layout.
    """

    def __init__(self, block_table: torch.Tensor, block_size: int, num_kv_heads: int) -> None:
        self._block_table = block_table
        self._block_size = block_size
        self._num_kv_heads = num_kv_heads

    def read(self, batch_row: int, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        per_head = positions if positions.dim() == 2 else positions[None].expand(self._num_kv_heads, -1)
        blocks = self._block_table[batch_row, per_head // self._block_size].long()  # (Hk, n)
        offsets = per_head % self._block_size
        heads = torch.arange(self._num_kv_heads, device=positions.device)[:, None].expand_as(blocks)
        keys, values = self._gather(blocks, heads, offsets)  # (Hk, n, D) each
        return keys.transpose(0, 1), values.transpose(0, 1)

    def read_tiles(self, batch_row: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The blocks holding positions ``0..length-1``, whole: keys as (blocks, Hk, D,
        block_size) and values as (blocks, Hk, block_size, D), block i holding positions
        ``i * block_size ..``. One gather of whole blocks, no per-position index and
        no transposing copy (keys come as the matmul's right-hand side, q @ k^T): a
        draft-tree branch's context (the caller masks positions past ``length``)."""
        num_blocks = -(-length // self._block_size)
        return self._blocks(self._block_table[batch_row, :num_blocks].long())

    def write(self, batch_row: int, positions: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> None:
        """Store ``key``/``value`` (n, Hk, D) at ``positions`` of the request's pages
        (a draft tree's accepted branch replacing rejected spine tokens)."""
        blocks = self._block_table[batch_row, positions // self._block_size].long()
        offsets = positions % self._block_size
        blocks, offsets = blocks[None].expand(self._num_kv_heads, -1), offsets[None].expand(self._num_kv_heads, -1)
        heads = torch.arange(self._num_kv_heads, device=positions.device)[:, None].expand_as(blocks)
        self._scatter(blocks, heads, offsets, key.transpose(0, 1), value.transpose(0, 1))

    @abstractmethod
    def _gather(self, blocks, heads, offsets) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values (Hk, n, D) at (block, head, offset) triples, (Hk, n) each."""

    @abstractmethod
    def _blocks(self, blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys (len(blocks), Hk, D, block_size) and values (len(blocks), Hk, block_size,
        D) of whole blocks, in order."""

    @abstractmethod
    def _scatter(self, blocks, heads, offsets, keys, values) -> None:
        """Store keys and values (Hk, n, D) at (block, head, offset) triples."""

    def check(self, batch_row: int, positions: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> None:
        """Raise unless the cache returns ``key``/``value`` (n, Hk, D) at ``positions``."""
        got_key, got_value = self.read(batch_row, positions)
        if not (torch.equal(got_key, key) and torch.equal(got_value, value)):
            raise PagedKVLayoutError(
                f"vllm-fafo read back different keys/values from vLLM's paged KV cache "
                f"({type(self).__name__}) than the layer wrote: the cache layout changed "
                "under this release of vllm-fafo (written against vLLM 0.32.0)"
            )


class LogicalPagedKV(PagedKVReader):
    """A cache whose logical ``[num_blocks, Hk, block_size, 2 * D]`` view is its content."""

    def __init__(self, kv_cache: torch.Tensor, block_table: torch.Tensor) -> None:
        _, num_kv_heads, block_size, twice_dim = kv_cache.shape
        super().__init__(block_table, block_size, num_kv_heads)
        dim = twice_dim // 2
        self._keys, self._values = kv_cache[..., :dim], kv_cache[..., dim:]

    def _gather(self, blocks, heads, offsets):
        return self._keys[blocks, heads, offsets], self._values[blocks, heads, offsets]

    def _blocks(self, blocks):
        return self._keys[blocks].transpose(2, 3), self._values[blocks]

    def _scatter(self, blocks, heads, offsets, keys, values):
        self._keys[blocks, heads, offsets] = keys.to(self._keys.dtype)
        self._values[blocks, heads, offsets] = values.to(self._values.dtype)


class CPUPagedKV(PagedKVReader):
    """vLLM's CPU_ATTN cache: key tiles ``[D, block_size]``, value tiles row-major."""

    def __init__(self, kv_cache: torch.Tensor, block_table: torch.Tensor, isa: str) -> None:
        num_blocks, num_kv_heads, block_size, twice_dim = kv_cache.shape
        super().__init__(block_table, block_size, num_kv_heads)
        if isa not in VERIFIED_CPU_ISAS:
            raise PagedKVLayoutError(
                f"vllm-fafo reads the paged KV cache for this compression policy, but "
                f"the CPU attention ISA {isa!r} packs keys in a layout it has not "
                f"been checked against (checked: {', '.join(VERIFIED_CPU_ISAS)}); use "
                "compression 'streaming', which never reads it"
            )
        if not kv_cache.is_contiguous():
            raise PagedKVLayoutError("vllm-fafo expects a contiguous CPU paged KV cache")
        dim = twice_dim // 2
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

    def _gather(self, blocks, heads, offsets):
        return self._keys[blocks, heads, :, offsets], self._values[blocks, heads, offsets]

    def _blocks(self, blocks):
        # key tiles are already D x block_size
        return self._keys.index_select(0, blocks), self._values.index_select(0, blocks)

    def _scatter(self, blocks, heads, offsets, keys, values):
        self._keys[blocks, heads, :, offsets] = keys.to(self._keys.dtype)
        self._values[blocks, heads, offsets] = values.to(self._values.dtype)
