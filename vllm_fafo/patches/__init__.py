"""Runtime patches of vLLM internals, installed as ``vllm_fafo.patches``.

Each module wraps named vLLM functions of the version in
:func:`vllm_fafo.version.supported_vllm_version` and checks, before wrapping, that
they still exist with the parameters it was written against
(:func:`vllm_fafo.patches.guard.require_signature`).
"""

from __future__ import annotations


def apply_all() -> None:
    """Apply every patch once per process (vLLM calls plugins more than once)."""
    from vllm.engine.arg_utils import EngineArgs

    if getattr(EngineArgs.create_engine_config, "vllm_fafo_patch", None):
        return
    from vllm_fafo.patches import (
        attention_backend,
        cpu_sampling,
        cudagraph_dispatcher,
        engine_args,
        gpu_model_runner,
        new_request_data,
        rejection_sampler,
        triton_dispatcher,
    )

    engine_args.apply()
    gpu_model_runner.apply()
    attention_backend.apply()
    cpu_sampling.apply()
    cudagraph_dispatcher.apply()
    new_request_data.apply()
    rejection_sampler.apply()
    triton_dispatcher.apply()
