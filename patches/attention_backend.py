"""Route CPU attention through the FAFO wrapper.

Overrides ``AttentionBackendEnum.CPU_ATTN`` (vLLM 0.32.0's CPU platform only
honours that backend) with ``vllm_fafo.attention.cpu.FafoCPUAttentionBackend``
through vLLM's own ``register_backend``. The wrapper is the base backend
until a step plan asks for lanes.
"""

from __future__ import annotations

from vllm.platforms import current_platform
from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

from vllm_fafo.patches.guard import PatchTargetChanged

WRAPPER_PATH = "vllm_fafo.attention.cpu.FafoCPUAttentionBackend"
EXPECTED_BASE = "vllm.v1.attention.backends.cpu_attn.CPUAttentionBackend"


def apply() -> None:
    if not current_platform.is_cpu():
        return
    if AttentionBackendEnum.CPU_ATTN.value != EXPECTED_BASE:
        raise PatchTargetChanged(
            f"vllm-fafo wraps {EXPECTED_BASE} as CPU_ATTN, but vLLM now names "
            f"{AttentionBackendEnum.CPU_ATTN.value}"
        )
    register_backend(AttentionBackendEnum.CPU_ATTN, WRAPPER_PATH)
