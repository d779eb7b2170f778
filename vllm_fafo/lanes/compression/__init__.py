"""KV compression policies: which past tokens form a request's compressed view.

See :mod:`vllm_fafo.lanes.compression.base` for the interface and how to add one.
"""

from vllm_fafo.lanes.compression.base import CompressionPolicy, RegionLayout
from vllm_fafo.lanes.compression.full import FullCachePolicy
from vllm_fafo.lanes.compression.quest import QuestPolicy
from vllm_fafo.lanes.compression.snapkv import SnapKVPolicy
from vllm_fafo.lanes.compression.streaming import StreamingPolicy

POLICIES: dict[str, type[CompressionPolicy]] = {
    policy.name: policy for policy in (StreamingPolicy, QuestPolicy, SnapKVPolicy, FullCachePolicy)
}

__all__ = ["POLICIES", "CompressionPolicy", "FullCachePolicy", "QuestPolicy", "RegionLayout", "SnapKVPolicy", "StreamingPolicy"]
