"""vllm-fafo: draftless, lossless FAFO speculative decoding as a vLLM plugin."""

from vllm_fafo.kernel_cache import drop_stale_caches

__version__ = "0.1.0"

drop_stale_caches()  # before any kernel is loaded from numba's cache (vllm_fafo/kernel_cache.py)
