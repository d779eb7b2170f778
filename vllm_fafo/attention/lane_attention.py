"""Lane attention, reference path: torch SDPA with an explicit boolean mask.

A lane token attends to the request's compressed region (which already
holds this step's input token x) and to the earlier tokens of its own lane,
never to drafts, other lanes or other requests.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from vllm_fafo.lanes import lane_mask


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


@functools.lru_cache(maxsize=64)
def _own_lane_mask(active_lanes: int, lane_len: int, device: torch.device) -> torch.Tensor:
    """The lane-to-lane mask, built once per layout instead of per layer and step."""
    return torch.from_numpy(lane_mask(active_lanes, lane_len)).to(device)
