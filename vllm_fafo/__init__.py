"""vllm-fafo: draftless, lossless FAFO speculative decoding as a vLLM plugin."""

__version__ = "0.1.0"
