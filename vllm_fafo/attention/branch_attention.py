"""Attention of draft-tree branches: exact, over the request's paged KV and the branch.

A branch token at spine node ``j`` sees paged positions ``0..x+j`` (vLLM wrote
this step's spine tokens before the layer's attention ran) and the earlier
tokens of its own branch, nothing else. It runs through the base backend's
own kernel (:func:`run_branches_in_kernel`, with the wrapper's
:class:`BranchKernel`: vLLM's CPU attention, FlashAttention on CUDA), so a
branch row is computed as a verification of the same tokens as the spine
computes it. A branch off node ``j`` with ``n`` tokens occupies positions
``x+j+1 .. x+j+n``, which hold the spine's drafts (a branch is never deeper
than its spine): its keys and values are written over those slots, the kernel
attends its queries causally over the request's pages exactly as it attends a
spine verification of the same tokens, and the spine's keys and values, which
this step's ``key``/``value`` still hold, are written back. One kernel call
per layer for the k-th branch of every request (a request's branches overlap
each other's slots or context).

:func:`request_branch_attention` writes the same attention out (softmax over
exactly those keys, with the bias :func:`vllm_fafo.verification.draft_tree.attention_bias`
builds): the dense reference the kernel path is tested and timed against.

The layer's branch keys and values are kept on the plan, so an accepted
branch's KV can be copied into the paged cache once sampling is done
(:mod:`vllm_fafo.verification.draft_tree`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import torch
import torch.nn.functional as F

from vllm_fafo.attention.paged_kv import PagedKVReader
from vllm_fafo.verification.draft_tree import BranchPlan, RequestBranches

Rows = slice | torch.Tensor
"""Batch indices: a slice where they run consecutively (one request: indexing is a view)."""


def _rows(indices: np.ndarray, device: torch.device) -> Rows:
    if len(indices) and np.array_equal(indices, np.arange(indices[0], indices[0] + len(indices))):
        return slice(int(indices[0]), int(indices[0]) + len(indices))
    return torch.from_numpy(indices).to(device)


@dataclass
class KernelRound:
    """The k-th branch of every request that has one: one kernel call per layer.

    Built once per step (:func:`kernel_rounds`); every layer reads it."""

    query_rows: Rows  # batch indices of the branch tokens, request by request
    spine_rows: Rows  # batch indices of the spine tokens at the same positions
    slots: torch.Tensor  # (n,) int64: the paged-cache slots of those positions
    query_start_loc: torch.Tensor  # (requests + 1,) int32
    seq_lens: torch.Tensor  # (requests,) int32: positions each request's last branch token sees
    max_query_len: int  # the longest branch of the round
    max_seq_len: int  # the largest of seq_lens
    block_table: torch.Tensor  # (requests, blocks) int32: the requests' rows of vLLM's block table
    backend_state: dict[Any, Any] = field(default_factory=dict)
    """What the kernel derives once per step and layer shape (the CPU kernel's work split)."""


class BranchKernel(Protocol):
    """The base backend's own attention over its paged cache, for branch queries."""

    block_size: int

    def write(self, key: torch.Tensor, value: torch.Tensor, slots: torch.Tensor) -> None:
        """Store ``key``/``value`` (n, Hk, D) at ``slots``, as the backend stores this step's KV."""

    def attend(self, query: torch.Tensor, kernel_round: KernelRound) -> torch.Tensor:
        """Causal attention output (n, Hq, D) of ``query`` over the round's requests' pages."""


def kernel_rounds(plan: BranchPlan, block_table: torch.Tensor, block_size: int) -> list[KernelRound]:
    """The plan's branches as kernel calls: round k holds each request's k-th branch.
    Built by the first layer that asks, kept on the plan per block table."""
    rounds = plan.kernel_rounds.get(block_table.data_ptr())
    if rounds is not None:
        return rounds
    rounds = plan.kernel_rounds[block_table.data_ptr()] = []
    offsets = [request.offsets() for request in plan.requests]
    for k in range(max(len(request.branches) for request in plan.requests)):
        query_rows, spine_rows, positions, batch_rows, lengths, seq_lens = [], [], [], [], [], []
        for request, request_offsets in zip(plan.requests, offsets):
            if k >= len(request.branches):
                continue
            branch, offset = request.branches[k], request_offsets[k]
            n, after = len(branch.tokens), np.arange(len(branch.tokens))
            query_rows.append(request.start + offset + after)
            spine_rows.append(request.x_index + branch.node + 1 + after)
            positions.append(request.x_position + branch.node + 1 + after)
            batch_rows.append(np.full(n, request.batch_row))
            lengths.append(n)
            seq_lens.append(request.x_position + branch.node + 1 + n)
        device = block_table.device
        rows = torch.from_numpy(np.concatenate(batch_rows)).to(device)
        where = torch.from_numpy(np.concatenate(positions)).to(device)
        slots = block_table[rows, where // block_size].long() * block_size + where % block_size
        first_rows = torch.tensor([request.batch_row for request in plan.requests if k < len(request.branches)],
                                  device=device)
        rounds.append(KernelRound(
            query_rows=_rows(np.concatenate(query_rows), device),
            spine_rows=_rows(np.concatenate(spine_rows), device),
            slots=slots,
            query_start_loc=torch.tensor(np.cumsum([0, *lengths]), dtype=torch.int32, device=device),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
            max_query_len=int(max(lengths)),
            max_seq_len=int(max(seq_lens)),
            block_table=block_table.index_select(0, first_rows),
        ))
    return rounds


def run_branches_in_kernel(
    plan: BranchPlan,
    rounds: list[KernelRound],
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    output: torch.Tensor,
    kernel: BranchKernel,
    reader: PagedKVReader,
) -> None:
    """Write every branch token's attention output through the backend's kernel,
    leaving the paged cache as vLLM wrote it; stash this layer's branch KV."""
    for kernel_round in rounds:
        rows, spine = kernel_round.query_rows, kernel_round.spine_rows
        kernel.write(key[rows], value[rows], kernel_round.slots)
        output[rows] = kernel.attend(query[rows], kernel_round).to(output.dtype)
        kernel.write(key[spine], value[spine], kernel_round.slots)  # the spine's drafts, as vLLM wrote them
    _stash(plan, key, value, reader)


def request_branch_attention(
    query: torch.Tensor,  # (T, Hq, D) the request's branch queries
    key: torch.Tensor,  # (T, Hk, D)
    value: torch.Tensor,
    key_tiles: torch.Tensor,  # (blocks, Hk, D, block_size) pages holding positions 0..num_paged-1 and on
    value_tiles: torch.Tensor,  # (blocks, Hk, block_size, D)
    request: RequestBranches,
    scale: float,
    bias: torch.Tensor,  # (T, num_paged + T) float32: vllm_fafo.verification.draft_tree.attention_bias(request)
) -> torch.Tensor:
    """Attention output (T, Hq, D, float32) of one request's branch tokens.

    Written out (batched matmuls per KV head, its query heads stacked) rather
    than through torch SDPA, which on CPU at these sizes (a few queries, a few
    hundred keys, GQA, a mask) took about three times as long; and against the
    pages as they lie (one matmul per block, broadcast over the blocks), not a
    copy of the context laid end to end. Scores and softmax in float32."""
    tokens, query_heads, dim = query.shape
    num_blocks, kv_heads, _, block_size = key_tiles.shape
    group = query_heads // kv_heads
    paged, padded = request.num_paged, num_blocks * block_size
    # query head h attends with KV head h // group
    q = query.float().reshape(tokens, kv_heads, group, dim).permute(1, 2, 0, 3).reshape(kv_heads, group * tokens, dim)
    paged_scores = torch.matmul(q, key_tiles.float())  # (blocks, Hk, G*T, block_size)
    paged_scores = paged_scores.permute(1, 2, 0, 3).reshape(kv_heads, group * tokens, padded)[..., :paged]
    own_scores = torch.bmm(q, key.float().permute(1, 2, 0))  # (Hk, G*T, T)
    scores = torch.cat([paged_scores, own_scores], dim=2).view(kv_heads, group, tokens, -1) * scale + bias
    probs = torch.softmax(scores, dim=-1).view(kv_heads, group * tokens, -1)
    paged_probs = F.pad(probs[..., :paged], (0, padded - paged)).view(kv_heads, group * tokens, num_blocks, block_size)
    out = (torch.matmul(paged_probs.permute(2, 0, 1, 3), value_tiles.float()).sum(dim=0)
           + torch.bmm(probs[..., paged:], value.float().transpose(0, 1)))
    return out.view(kv_heads, group, tokens, dim).permute(2, 0, 1, 3).reshape(tokens, query_heads, dim)


def _stash(plan: BranchPlan, key: torch.Tensor, value: torch.Tensor, reader: PagedKVReader) -> None:
    span = slice(plan.first_token, plan.first_token + plan.num_tokens)
    plan.kv_stash.append((reader, key[span].clone(), value[span].clone()))
