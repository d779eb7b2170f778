"""Draft-tree branches through FlashAttention (:class:`FlashBranchKernel`).

On the CPU, FlashAttention's two kernels are replaced by dense stand-ins with
their documented semantics (``reshape_and_cache_flash`` stores at slots;
``flash_attn_varlen_func`` attends each sequence's queries causally, aligned to
the end of its ``seqused_k`` keys, over pages named by the block table): the
branch rows must equal the dense reference, the cache must be left as vLLM
wrote it, and the kernel must be called with the layer's own settings. On a
GPU (skipped elsewhere) the real kernels run in bfloat16 with one split, and
each branch row must be bit for bit what a verification of the same tokens as
the spine gives.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from vllm.v1.attention.backends import flash_attn

from tests.branch_steps import HK, HQ, REQUESTS, D, PagedStep
from vllm_fafo.attention.branch_attention import kernel_rounds, run_branches_in_kernel
from vllm_fafo.attention.cuda import FafoFlashAttentionImpl, FlashBranchKernel
from vllm_fafo.attention.paged_kv import LogicalPagedKV

BLOCK_SIZE, NUM_BLOCKS = 16, 150
"""FlashAttention's default block size."""


def dense_reshape_and_cache_flash(key, value, key_cache, value_cache, slot_mapping, kv_cache_dtype, k_scale, v_scale):
    n = len(slot_mapping)
    blocks, offsets = slot_mapping // key_cache.shape[1], slot_mapping % key_cache.shape[1]
    key_cache[blocks, offsets] = key[:n].to(key_cache.dtype)
    value_cache[blocks, offsets] = value[:n].to(value_cache.dtype)


class DenseFlashVarlen:
    """``flash_attn_varlen_func`` over a paged cache, written out; records each call's settings."""

    def __init__(self) -> None:
        self.calls: list[dict] = []

    def __call__(self, *, q, k, v, out, cu_seqlens_q, max_seqlen_q, seqused_k, max_seqlen_k, softmax_scale,
                 causal, block_table, **settings):
        assert causal is True and max_seqlen_q == int((cu_seqlens_q[1:] - cu_seqlens_q[:-1]).max())
        assert max_seqlen_k == int(seqused_k.max())
        self.calls.append(settings)
        group = q.shape[1] // k.shape[2]
        for i in range(len(seqused_k)):
            start, end, length = int(cu_seqlens_q[i]), int(cu_seqlens_q[i + 1]), int(seqused_k[i])
            positions = torch.arange(length)
            blocks = block_table[i, positions // k.shape[1]].long()
            keys = k[blocks, positions % k.shape[1]].repeat_interleave(group, dim=1).float()  # (L, Hq, D)
            values = v[blocks, positions % k.shape[1]].repeat_interleave(group, dim=1).float()
            scores = torch.einsum("qhd,khd->hqk", q[start:end].float(), keys) * softmax_scale
            query_positions = torch.arange(length - (end - start), length)
            scores = scores.masked_fill(positions[None, :] > query_positions[:, None], float("-inf"))
            out[start:end] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), values).to(out.dtype)
        return out


class FlashBatch(PagedStep):
    """FlashAttention's cache (the logical [blocks, Hk, block_size, 2D] layout) and kernels."""

    block_size = BLOCK_SIZE

    def __init__(self, dtype: torch.dtype, device: str, seed: int = 0, **impl_settings) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.device = torch.device(device)
        # vLLM's FlashAttention layout (LBNHC): logical [blocks, Hk, block_size, 2D] over [blocks, block_size, Hk, 2D]
        self.kv_cache = torch.zeros(NUM_BLOCKS, BLOCK_SIZE, HK, 2 * D, dtype=dtype, device=device).transpose(1, 2)
        settings = {"alibi_slopes": None, "sliding_window": None, "kv_cache_dtype": "auto", **impl_settings}
        self.impl = FafoFlashAttentionImpl(HQ, D, D**-0.5, HK, **settings)
        one = torch.ones((), dtype=torch.float32, device=device)
        self.layer = SimpleNamespace(_q_scale=one, _k_scale=one, _v_scale=one)
        self.metadata = SimpleNamespace(causal=True, rswa_prefix_lens=None, mm_prefix_query_range_tensor=None,
                                        max_num_splits=1)
        self.fill(dtype, self.device, gen, NUM_BLOCKS, blocks_per_request=48)

    def write(self, row: int, positions: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> None:
        self.impl.do_kv_cache_update(self.layer, key, value, self.kv_cache, self.slots(row, positions))

    def run_kernel_path(self) -> torch.Tensor:
        output = torch.zeros_like(self.query)
        kernel = self.impl.branch_kernel(self.layer, self.kv_cache, self.metadata)
        rounds = kernel_rounds(self.plan, self.block_table, kernel.block_size)
        reader = LogicalPagedKV(self.kv_cache, self.block_table)
        run_branches_in_kernel(self.plan, rounds, self.query, self.key, self.value, output, kernel, reader)
        return output

    def verify(self, row: int, node: int, branch_rows: slice) -> torch.Tensor:
        request = self.plan.requests[row]
        n = branch_rows.stop - branch_rows.start
        positions = torch.arange(request.x_position + node + 1, request.x_position + node + 1 + n)
        saved = self.kv_cache.clone()
        self.write(row, positions, self.key[branch_rows], self.value[branch_rows])
        query = torch.cat([self.query[request.x_index : request.x_index + node + 1], self.query[branch_rows]])
        key_cache, value_cache = self.kv_cache.transpose(1, 2).split(D, dim=-1)
        output = torch.empty_like(query)
        flash_attn._FA4_DENSE_ATTENTION_KERNEL(
            q=query, k=key_cache, v=value_cache, out=output,
            cu_seqlens_q=torch.tensor([0, len(query)], dtype=torch.int32, device=self.device), max_seqlen_q=len(query),
            seqused_k=torch.tensor([positions[-1] + 1], dtype=torch.int32, device=self.device),
            max_seqlen_k=int(positions[-1]) + 1, softmax_scale=D**-0.5, causal=True, alibi_slopes=None,
            window_size=None, block_table=self.block_table[row : row + 1], softcap=0, scheduler_metadata=None,
            fa_version=self.impl.vllm_flash_attn_version, q_descale=None, k_descale=None, v_descale=None,
            dynamic_causal=None, num_splits=1, s_aux=None, mask_mod=None, aux_tensors=None,
        )
        self.kv_cache.copy_(saved)
        return output[node + 1 :]


@pytest.fixture
def dense_flash(monkeypatch) -> DenseFlashVarlen:
    varlen = DenseFlashVarlen()
    monkeypatch.setattr(flash_attn, "flash_attn_varlen_func", varlen, raising=False)
    monkeypatch.setattr(flash_attn, "reshape_and_cache_flash", dense_reshape_and_cache_flash, raising=False)
    return varlen


def test_flash_branch_kernel_matches_the_dense_reference_and_leaves_the_cache_as_vllm_wrote_it(dense_flash):
    batch = FlashBatch(torch.float32, "cpu", seed=4)
    before = batch.kv_cache.clone()
    got = batch.run_kernel_path()
    assert torch.equal(batch.kv_cache, before)
    assert len(dense_flash.calls) == max(len(branches) for *_, branches in REQUESTS)  # one call per round
    batch.assert_matches_the_dense_reference(got, LogicalPagedKV(batch.kv_cache, batch.block_table))


def test_flash_branch_kernel_calls_flash_attention_with_the_layer_s_settings(dense_flash):
    """Sliding windows, soft-capping and ALiBi are FlashAttention's to compute: passed on as the
    forward passes them, with the step's split count and no precomputed schedule."""
    slopes = [0.5] * HQ
    batch = FlashBatch(torch.float32, "cpu", sliding_window=128, logits_soft_cap=30.0, alibi_slopes=slopes)
    batch.metadata.max_num_splits = 3
    batch.run_kernel_path()
    settings = dense_flash.calls[0]
    assert settings["window_size"] == [127, 0] and settings["softcap"] == 30.0
    assert settings["alibi_slopes"].tolist() == slopes
    assert settings["num_splits"] == 3 and settings["scheduler_metadata"] is None
    assert settings["k_descale"].shape == (3, HK)  # (sequences of the round, KV heads), as the forward's


@pytest.mark.parametrize("field, value", [
    ("causal", torch.ones(3, dtype=torch.int32)),
    ("rswa_prefix_lens", torch.zeros(3)),
    ("mm_prefix_query_range_tensor", torch.zeros(3)),
])
def test_flash_branch_kernel_refuses_forward_paths_it_does_not_mirror(dense_flash, field, value):
    batch = FlashBatch(torch.float32, "cpu")
    setattr(batch.metadata, field, value)
    with pytest.raises(RuntimeError, match="does not mirror"):
        FlashBranchKernel(batch.impl, batch.layer, batch.kv_cache, batch.metadata)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(),
                    reason="needs a CUDA GPU: FlashAttention has no CPU kernel; CI (CPU) checks the same "
                           "kernel path against dense stand-ins in the tests above")
def test_each_flash_branch_row_is_what_verifying_its_tokens_as_the_spine_gives():
    batch = FlashBatch(torch.bfloat16, "cuda", seed=3)
    batch.assert_each_branch_row_is_its_verification_as_the_spine(batch.run_kernel_path())
