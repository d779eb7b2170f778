"""Draft-tree branches through vLLM's own CPU attention kernel: equal to the dense
reference, the paged cache left exactly as vLLM wrote it, and (bf16, split over the
keys off) each branch row bit for bit what a verification of the same tokens as the
spine gives."""

from types import SimpleNamespace

import pytest
import torch
from vllm import _custom_ops as ops
from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

from tests.branch_steps import HK, HQ, REQUESTS, D, PagedStep
from vllm_fafo.attention.branch_attention import (
    kernel_rounds,
    run_branches_in_kernel,
)
from vllm_fafo.attention.cpu import CPUBranchKernel
from vllm_fafo.attention.paged_kv import VERIFIED_CPU_ISAS, CPUPagedKV

BLOCK_SIZE, NUM_BLOCKS = 128, 24
"""vLLM's CPU block size."""


class Batch(PagedStep):
    """vLLM's CPU attention cache and kernel."""

    block_size = BLOCK_SIZE

    def __init__(self, dtype: torch.dtype, seed: int = 0) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.dtype = dtype
        self.isa = _get_attn_isa(dtype, BLOCK_SIZE, D)
        if self.isa not in VERIFIED_CPU_ISAS:
            pytest.skip(f"CPU attention ISA {self.isa!r}: CPUPagedKV reads only {VERIFIED_CPU_ISAS}")
        self.kv_cache = torch.zeros(NUM_BLOCKS, HK, BLOCK_SIZE, 2 * D, dtype=dtype)
        halves = self.kv_cache.view(NUM_BLOCKS, HK, 2 * BLOCK_SIZE, D)
        self.key_cache, self.value_cache = halves.chunk(2, dim=2)
        self.fill(dtype, torch.device("cpu"), gen, NUM_BLOCKS, blocks_per_request=8)
        self.layer = SimpleNamespace(isa=self.isa, _k_scale_float=1.0, _v_scale_float=1.0)
        self.impl = SimpleNamespace(num_heads=HQ, num_kv_heads=HK, head_size=D, scale=D**-0.5, alibi_slopes=None,
                                    sliding_window=-1, logits_soft_cap=0, sinks=None, kv_cache_dtype="auto",
                                    attn_type="decoder")

    def write(self, row: int, positions: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> None:
        ops.cpu_attn_reshape_and_cache(key, value, self.key_cache, self.value_cache, self.slots(row, positions),
                                       self.isa, k_scale=1.0, v_scale=1.0, kv_cache_dtype="auto")

    def run_kernel_path(self) -> torch.Tensor:
        output = torch.zeros_like(self.query)
        kernel = CPUBranchKernel(self.impl, self.layer, self.kv_cache)
        rounds = kernel_rounds(self.plan, self.block_table, BLOCK_SIZE)
        reader = CPUPagedKV(self.kv_cache, self.block_table, self.isa)
        run_branches_in_kernel(self.plan, rounds, self.query, self.key, self.value, output, kernel, reader)
        return output

    def verify(self, row: int, node: int, branch_rows: slice) -> torch.Tensor:
        x_position, x_index = self.plan.requests[row].x_position, self.plan.requests[row].x_index
        n = branch_rows.stop - branch_rows.start
        positions = torch.arange(x_position + node + 1, x_position + node + 1 + n)
        saved = self.kv_cache.clone()
        self.write(row, positions, self.key[branch_rows], self.value[branch_rows])
        query = torch.cat([self.query[x_index : x_index + node + 1], self.query[branch_rows]])
        seq_lens = torch.tensor([x_position + node + 1 + n], dtype=torch.int32)
        query_start_loc = torch.tensor([0, len(query)], dtype=torch.int32)
        metadata = ops.cpu_attn_get_scheduler_metadata(
            num_reqs=1, num_heads=HQ, num_kv_heads=HK, head_dim=D, seq_lens=seq_lens, dtype=self.dtype,
            query_start_loc=query_start_loc, causal=True, sliding_window_size=-1, isa=self.isa,
            enable_kv_split=False, dynamic_causal=None, kv_cache_dtype="auto")
        output = torch.empty_like(query)
        ops.cpu_attention_with_kv_cache(
            query=query, key_cache=self.key_cache, value_cache=self.value_cache, output=output,
            query_start_loc=query_start_loc, seq_lens=seq_lens, scale=D**-0.5, causal=True, alibi_slopes=None,
            sliding_window=-1, block_table=self.block_table[row : row + 1], softcap=0.0,
            scheduler_metadata=metadata, s_aux=None, dynamic_causal=None, k_scale=1.0, v_scale=1.0,
            kv_cache_dtype="auto")
        self.kv_cache.copy_(saved)
        return output[node + 1 :]


def test_kernel_path_matches_the_dense_reference_and_leaves_the_cache_as_vllm_wrote_it():
    batch = Batch(torch.float32)
    before = batch.kv_cache.clone()
    got = batch.run_kernel_path()
    assert torch.equal(batch.kv_cache, before)
    batch.assert_matches_the_dense_reference(got, CPUPagedKV(batch.kv_cache, batch.block_table, batch.isa))
    assert len(batch.plan.kv_stash) == 1  # this layer's branch KV, for an accepted branch's write-back
    assert batch.plan.kv_stash[0][1].shape[0] == batch.plan.num_tokens


def test_kernel_rounds_hold_one_branch_per_request_each():
    batch = Batch(torch.float32)
    rounds = kernel_rounds(batch.plan, batch.block_table, BLOCK_SIZE)
    assert len(rounds) == max(len(branches) for *_, branches in REQUESTS)
    assert [len(r.seq_lens) for r in rounds] == [3, 2, 1]
    first = rounds[0]  # request 0's branch off node 0 (3 tokens): positions 301..303
    assert first.seq_lens.tolist() == [300 + 0 + 1 + 3, 129 + 1 + 1 + 1, 700 + 2 + 1 + 3]
    assert first.spine_rows[:3].tolist() == [1, 2, 3]
    assert torch.equal(first.slots[:3], batch.slots(0, torch.tensor([301, 302, 303])))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_each_branch_row_is_what_verifying_its_tokens_as_the_spine_gives(monkeypatch, dtype):
    monkeypatch.setenv("VLLM_CPU_ATTN_SPLIT_KV", "0")
    batch = Batch(dtype, seed=3)
    batch.assert_each_branch_row_is_its_verification_as_the_spine(batch.run_kernel_path())
