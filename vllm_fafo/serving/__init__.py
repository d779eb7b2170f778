"""Metrics, their export to vllm serve's /metrics, tensor parallelism."""
