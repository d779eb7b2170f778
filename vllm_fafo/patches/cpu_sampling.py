"""Keep speculative decoding under sampling lossless on CPU.

Replaces ``vllm.utils.cpu_triton_utils._expand_kernel_impl(output, input_val,
cu_num_tokens, replace_from, replace_to, MAX_NUM_TOKENS)`` of vLLM 0.32.0,
the CPU stand-in that ``CpuPlatform.register_triton_kernel_overrides``
installs for ``vllm.v1.sample.rejection_sampler.expand_kernel``.
``expand_batch_to_tokens`` uses it to spread each request's temperature,
top-k and top-p over its draft positions before the rejection sampler
scores the drafts. vLLM 0.32.0's version hands the C++ kernel int64 *copies*
of the float32 / int32 buffers and never writes the caller's buffer back, so
every non-greedy step with drafts divides the logits by uninitialised memory
and the sampled text no longer follows the model (vLLM issue #55005, fix
proposed in PR #55006; greedy decoding never calls it). The replacement
expands at the caller's dtype, with the Triton kernel's
``replace_from -> replace_to`` rule.

Applied on CPU only (CUDA runs the Triton kernel), before vLLM's workers
register their CPU kernels: ``vllm.plugins.load_general_plugins`` runs just
before ``register_triton_kernel_overrides`` in ``WorkerWrapperBase``.
"""

from __future__ import annotations

import torch
from vllm.platforms import current_platform

from vllm_fafo.patches.guard import PatchTargetChanged, require_signature

EXPAND_KERNEL = "vllm.v1.sample.rejection_sampler.expand_kernel"
EXPAND_PARAMS = ["output", "input_val", "cu_num_tokens", "replace_from", "replace_to"]


def expand_at_caller_dtype(
    output: torch.Tensor,
    input_val: torch.Tensor,
    cu_num_tokens: torch.Tensor,
    replace_from: int | float,
    replace_to: int | float,
    MAX_NUM_TOKENS: int | None = None,  # noqa: N803 (the Triton kernel's name)
) -> None:
    """``output[cu[i-1]:cu[i]] = input_val[i]`` (``replace_to`` where it equals
    ``replace_from``), written into ``output`` itself."""
    values = torch.where(input_val == replace_from,
                         torch.full_like(input_val, replace_to), input_val)
    counts = torch.diff(cu_num_tokens.to(torch.int64), prepend=cu_num_tokens.new_zeros(1))
    expanded = torch.repeat_interleave(values, counts)
    output[: expanded.numel()].copy_(expanded)


def apply() -> None:
    if not current_platform.is_cpu():
        return
    from vllm.triton_utils.dispatcher import _registry
    from vllm.utils import cpu_triton_utils

    require_signature(cpu_triton_utils, "_expand_kernel_impl", EXPAND_PARAMS)
    if EXPAND_KERNEL in _registry:
        raise PatchTargetChanged(
            f"vLLM registered its CPU {EXPAND_KERNEL} before the vllm-fafo plugin loaded; "
            "the plugin must load first (vLLM 0.32.0 loads general plugins before it "
            "registers CPU kernels)"
        )
    cpu_triton_utils._expand_kernel_impl = expand_at_caller_dtype
