"""Attention of draft-tree branches: exact, over the request's paged KV and the branch.

A branch token at spine node ``j`` sees paged positions ``0..x+j`` (vLLM wrote
this step's spine tokens before the layer's attention ran) and the earlier
tokens of its own branch, nothing else: softmax over exactly those keys, with
the bias built once per step (:func:`vllm_fafo.tree.layout_request`), one
call per request and layer, over the request's pages gathered whole. The layer's branch keys and values are kept
on the plan, so an accepted branch's KV can be copied into the paged cache
once sampling is done (:mod:`vllm_fafo.tree`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from vllm_fafo.attention.paged_kv import PagedKVReader
from vllm_fafo.tree import BranchPlan, RequestBranches


def request_branch_attention(
    query: torch.Tensor,  # (T, Hq, D) the request's branch queries
    key: torch.Tensor,  # (T, Hk, D)
    value: torch.Tensor,
    key_tiles: torch.Tensor,  # (blocks, Hk, D, block_size) pages holding positions 0..num_paged-1 and on
    value_tiles: torch.Tensor,  # (blocks, Hk, block_size, D)
    request: RequestBranches,
    scale: float,
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
    scores = torch.cat([paged_scores, own_scores], dim=2).view(kv_heads, group, tokens, -1) * scale + request.bias
    probs = torch.softmax(scores, dim=-1).view(kv_heads, group * tokens, -1)
    paged_probs = F.pad(probs[..., :paged], (0, padded - paged)).view(kv_heads, group * tokens, num_blocks, block_size)
    out = (torch.matmul(paged_probs.permute(2, 0, 1, 3), value_tiles.float()).sum(dim=0)
           + torch.bmm(probs[..., paged:], value.float().transpose(0, 1)))
    return out.view(kv_heads, group, tokens, dim).permute(2, 0, 1, 3).reshape(tokens, query_heads, dim)


def run_branches(
    plan: BranchPlan,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    output: torch.Tensor,
    scale: float,
    reader: PagedKVReader,
) -> None:
    """Write every branch token's attention output; stash this layer's branch KV."""
    for request in plan.requests:
        rows = request.tokens
        key_tiles, value_tiles = reader.read_tiles(request.batch_row, request.num_paged)
        output[rows] = request_branch_attention(
            query[rows], key[rows], value[rows], key_tiles.to(key.dtype), value_tiles.to(value.dtype),
            request, scale,
        ).to(output.dtype)
    span = slice(plan.first_token, plan.first_token + plan.num_tokens)
    plan.kv_stash.append((reader, key[span].clone(), value[span].clone()))
