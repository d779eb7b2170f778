"""Route attention through the FAFO lane wrappers.

- CPU: overrides ``AttentionBackendEnum.CPU_ATTN`` (vLLM 0.32.0's CPU
  platform only honours that backend) with
  ``vllm_fafo.attention.cpu.FafoCPUAttentionBackend``. The wrapper is the
  base backend until a step plan asks for lanes.
- CUDA: registers ``AttentionBackendEnum.CUSTOM`` as
  ``vllm_fafo.attention.cuda.FafoFlashAttentionBackend`` (FlashAttention plus
  lanes). Nothing selects it but ``vllm_fafo.patches.engine_args``, and only
  for configurations with lanes.

Both go through vLLM's own ``register_backend``.
"""

from __future__ import annotations

from vllm.platforms import current_platform
from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

from vllm_fafo.patches.guard import PatchTargetChanged

CPU_WRAPPER_PATH = "vllm_fafo.attention.cpu.FafoCPUAttentionBackend"
CPU_EXPECTED_BASE = "vllm.v1.attention.backends.cpu_attn.CPUAttentionBackend"
CUDA_WRAPPER_PATH = "vllm_fafo.attention.cuda.FafoFlashAttentionBackend"
CUDA_EXPECTED_BASE = "vllm.v1.attention.backends.flash_attn.FlashAttentionBackend"


def apply() -> None:
    if current_platform.is_cpu():
        _require_base(AttentionBackendEnum.CPU_ATTN, CPU_EXPECTED_BASE)
        register_backend(AttentionBackendEnum.CPU_ATTN, CPU_WRAPPER_PATH)
    elif current_platform.is_cuda():
        _require_base(AttentionBackendEnum.FLASH_ATTN, CUDA_EXPECTED_BASE)
        register_backend(AttentionBackendEnum.CUSTOM, CUDA_WRAPPER_PATH)


def _require_base(backend: AttentionBackendEnum, expected: str) -> None:
    if backend.value != expected:
        raise PatchTargetChanged(
            f"vllm-fafo wraps {expected} as {backend.name}, but vLLM now names {backend.value}"
        )
