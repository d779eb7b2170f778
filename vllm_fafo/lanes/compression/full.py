"""No compression: lanes attend to the request's whole KV cache.

Lookahead Decoding's lookahead branch sees the full context (Lookahead
Sec. 3.1); this policy gives FAFO's lanes the same view, so the ``lookahead``
mode (and a FAFO ablation) run on the shared lane machinery. Every layer
reads the request's final keys and values back from the paged cache each
step, so its cost grows with the context, unlike the fixed region.
"""

from __future__ import annotations

from vllm_fafo.lanes.compression.base import CompressionPolicy, RegionLayout


class FullCachePolicy(CompressionPolicy):
    name = "none"
    reads_paged_kv = True
    attends_full_cache = True

    def make_layout(self, sink_tokens: int, kv_budget: int, settings) -> RegionLayout:
        return RegionLayout(0, 0, 1)  # the region is unused: one slot per request
