"""KV compression policies: which past tokens form a request's compressed view.

A policy maps absolute token positions to slots of the request's fixed
compressed region (FAFO Sec. 4.4, ``B_fixed``), so the region keeps one shape
for the request's whole life and is updated in place.
"""

from vllm_fafo.compression.streaming import StreamingPolicy

__all__ = ["StreamingPolicy"]
