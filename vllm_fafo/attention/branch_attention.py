"""Attention of draft-tree branches: exact, over the request's paged KV and the branch.

A branch token at spine node ``j`` sees paged positions ``0..x+j`` (vLLM wrote
this step's spine tokens before the layer's attention ran) and the earlier
tokens of its own branch, nothing else; torch SDPA with the mask built once
per step (:func:`vllm_fafo.tree.layout_request`), one call per request and
layer, over the request's pages copied block by block. The layer's branch keys and values are kept
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
    paged_key: torch.Tensor,  # (Hk, V, D) paged positions 0..V-1, V >= request.num_paged
    paged_value: torch.Tensor,
    request: RequestBranches,
    scale: float,
) -> torch.Tensor:
    """Attention output (T, Hq, D) of one request's branch tokens."""
    paged = slice(0, request.num_paged)
    keys = torch.cat([paged_key[:, paged], key.transpose(0, 1)], dim=1)
    values = torch.cat([paged_value[:, paged], value.transpose(0, 1)], dim=1)
    out = F.scaled_dot_product_attention(
        query.transpose(0, 1), keys, values, attn_mask=request.mask, scale=scale, enable_gqa=True
    )
    return out.transpose(0, 1)


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
