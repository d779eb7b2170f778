"""Lane attention: torch SDPA with an explicit boolean mask.

A lane token attends to the request's compressed region (which already
holds this step's input token x) and to the earlier tokens of its own lane,
never to drafts, other lanes or other requests. :func:`lane_attention` does
one request over keys it is given (the ``none`` policy's whole context);
:func:`batched_lane_attention` does every request's region at once, and
:func:`masked_lane_attention` is the same given its lane mask (the lane step's form).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from vllm_fafo.lanes.state import lane_mask


def lane_attention(
    query: torch.Tensor,  # (T, Hq, D) tail queries of one request
    key: torch.Tensor,  # (T, Hk, D) tail keys
    value: torch.Tensor,  # (T, Hk, D)
    region_key: torch.Tensor,  # (V, Hk, D) the valid part of the region
    region_value: torch.Tensor,
    active_lanes: int,
    lane_len: int,
    scale: float,
) -> torch.Tensor:
    """Attention output (T, Hq, D) of one request's lane tokens."""
    num_valid = region_key.shape[0]
    own = _own_lane_mask(active_lanes, lane_len, query.device)
    mask = torch.cat(
        [torch.ones(own.shape[0], num_valid, dtype=torch.bool, device=query.device), own],
        dim=1,
    )
    keys = torch.cat([region_key, key], dim=0).transpose(0, 1)  # (Hk, N, D)
    values = torch.cat([region_value, value], dim=0).transpose(0, 1)
    out = F.scaled_dot_product_attention(
        query.transpose(0, 1), keys, values, attn_mask=mask, scale=scale, enable_gqa=True
    )
    return out.transpose(0, 1)


def batched_lane_attention(
    query: torch.Tensor,  # (R * n, Hq, D) the tails of R requests, n tokens each, back to back
    key: torch.Tensor,  # (R * n, Hk, D)
    value: torch.Tensor,
    region_key: torch.Tensor,  # (R, S, Hk, D) each request's region row
    region_value: torch.Tensor,
    region_valid: torch.Tensor,  # (R, S) bool: the filled slots of each row
    active_lanes: int,
    lane_len: int,
    scale: float,
) -> torch.Tensor:
    """Attention output (R * n, Hq, D) of all requests' lane tokens in one call.

    One SDPA call per layer whatever the batch, instead of one per request:
    on a GPU every call is several kernel launches. The region rows are fixed
    size, so the only padding is the row's unfilled slots, masked out.
    """
    own = _own_lane_mask(active_lanes, lane_len, query.device)
    return masked_lane_attention(query, key, value, region_key, region_value, region_valid, own, scale)


def masked_lane_attention(
    query: torch.Tensor,  # (R * n, Hq, D)
    key: torch.Tensor,  # (R * n, Hk, D)
    value: torch.Tensor,
    region_key: torch.Tensor,  # (R, S, Hk, D)
    region_value: torch.Tensor,
    region_valid: torch.Tensor,  # (R, S) bool
    own_lane: torch.Tensor,  # (n, n) bool: the lane-to-lane mask
    scale: float,
) -> torch.Tensor:
    """:func:`batched_lane_attention` given its lane-to-lane mask: shapes and tensors only,
    so it traces into a graph (the lane step keeps the mask in its persistent buffers)."""
    rows, slots = region_valid.shape
    n = own_lane.shape[0]
    q = query.view(rows, n, *query.shape[1:]).transpose(1, 2)  # (R, Hq, n, D)
    keys = torch.cat([region_key, key.view(rows, n, *key.shape[1:])], dim=1).transpose(1, 2)
    values = torch.cat([region_value, value.view(rows, n, *value.shape[1:])], dim=1).transpose(1, 2)
    mask = torch.cat(
        [region_valid[:, None, :].expand(rows, n, slots), own_lane.expand(rows, n, n)], dim=2
    )[:, None]  # (R, 1, n, S + n), the same for every head
    out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=scale, enable_gqa=True)
    return out.transpose(1, 2).reshape(rows * n, *query.shape[1:])


@functools.lru_cache(maxsize=64)
def _own_lane_mask(active_lanes: int, lane_len: int, device: torch.device) -> torch.Tensor:
    """The lane-to-lane mask, built once per layout instead of per layer and step."""
    return torch.from_numpy(lane_mask(active_lanes, lane_len)).to(device)
