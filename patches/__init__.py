"""Runtime patches of vLLM internals, installed as ``vllm_fafo.patches``.

Each module wraps named vLLM functions of the version in
``vllm_fafo.plugin.SUPPORTED_VLLM_VERSION`` and checks, before wrapping, that
they still exist with the parameters it was written against
(:func:`vllm_fafo.patches.guard.require_signature`).
"""

from __future__ import annotations

_applied = False


def apply_all() -> None:
    """Apply every patch once per process."""
    global _applied
    if _applied:
        return
    from vllm_fafo.patches import (
        attention_backend, cpu_sampling, engine_args, model_runner, tail,
    )

    engine_args.apply()
    model_runner.apply()
    tail.apply()
    attention_backend.apply()
    cpu_sampling.apply()
    _applied = True
