"""StreamingLLM (Xiao et al., 2024): attention sinks plus a recent window.

The smallest policy: it selects nothing, so the region is the framework's
sink part (positions 0..sink-1, kept for good) and its ring, which position
p >= sink enters at slot ``sink + (p - sink) % window``, overwriting the
entry that expired. After positions 0..n-1 are written, the region holds
exactly the sinks and the latest ``window`` positions: StreamingLLM's view.
"""

from __future__ import annotations

from vllm_fafo.lanes.compression.base import CompressionPolicy


class StreamingPolicy(CompressionPolicy):
    name = "streaming"
