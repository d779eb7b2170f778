"""Attention of draft-tree branches: exact, over the request's paged KV and the branch.

A branch token at spine node ``j`` sees paged positions ``0..x+j`` (vLLM wrote
this step's spine tokens before the layer's attention ran) and the earlier
tokens of its own branch, nothing else: softmax over exactly those keys, with
the bias built once per step (:func:`vllm_fafo.tree.layout_request`), one
call per request and layer, over the request's pages copied block by block. The layer's branch keys and values are kept
on the plan, so an accepted branch's KV can be copied into the paged cache
once sampling is done (:mod:`vllm_fafo.tree`).
"""

from __future__ import annotations

import torch

from vllm_fafo.attention.paged_kv import PagedKVReader
from vllm_fafo.tree import BranchPlan, RequestBranches


def request_branch_attention(
    query: torch.Tensor,  # (T, Hq, D) the request's branch queries
    key: torch.Tensor,  # (T, Hk, D)
    value: torch.Tensor,
    paged_key: torch.Tensor,  # (Hk, V, D) paged positions 0..V-1, V >= request.num_paged
    paged_value: torch.Tensor,
    request: RequestBranches,
    scale: float,
) -> torch.Tensor:
    """Attention output (T, Hq, D, float32) of one request's branch tokens.

    Written out (batched matmuls per KV head, its query heads stacked) rather
    than through torch SDPA, which on CPU at these sizes (a few queries, a few
    hundred keys, GQA, a mask) took about three times as long. Scores and
    softmax in float32."""
    tokens, query_heads, dim = query.shape
    kv_heads = key.shape[1]
    group = query_heads // kv_heads
    paged = slice(0, request.num_paged)
    # query head h attends with KV head h // group
    q = query.float().reshape(tokens, kv_heads, group, dim).permute(1, 2, 0, 3).reshape(kv_heads, group * tokens, dim)
    own_key, own_value = key.float().transpose(0, 1), value.float().transpose(0, 1)  # (Hk, T, D)
    paged_k, paged_v = paged_key[:, paged].float(), paged_value[:, paged].float()
    scores = torch.cat([torch.bmm(q, paged_k.transpose(1, 2)), torch.bmm(q, own_key.transpose(1, 2))], dim=2)
    scores = scores.view(kv_heads, group, tokens, -1) * scale + request.bias
    probs = torch.softmax(scores, dim=-1).view(kv_heads, group * tokens, -1)
    out = torch.bmm(probs[..., : request.num_paged], paged_v) + torch.bmm(probs[..., request.num_paged :], own_value)
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
        paged_key, paged_value = reader.read_prefix(request.batch_row, request.num_paged)
        output[rows] = request_branch_attention(
            query[rows], key[rows], value[rows], paged_key.to(key.dtype), paged_value.to(value.dtype),
            request, scale,
        ).to(output.dtype)
    span = slice(plan.first_token, plan.first_token + plan.num_tokens)
    plan.kv_stash.append((reader, key[span].clone(), value[span].clone()))
