"""Fail loudly when a patched vLLM function is not the one a patch expects."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from types import ModuleType


class PatchTargetChanged(RuntimeError):
    """The vLLM function a patch wraps moved or changed its parameters."""


def require_signature(owner: type | ModuleType, name: str, params: Sequence[str]) -> Callable:
    """Return ``owner.name`` (a class's method or a module's function) after
    checking its leading parameter names."""
    target = getattr(owner, name, None)
    if isinstance(owner, ModuleType):
        where = f"{owner.__name__}.{name}"
    else:
        where = f"{owner.__module__}.{owner.__qualname__}.{name}"
    if target is None:
        raise PatchTargetChanged(f"vllm-fafo patches {where}, which no longer exists")
    found = list(inspect.signature(target).parameters)[: len(params)]
    if found != list(params):
        raise PatchTargetChanged(
            f"vllm-fafo patches {where} expecting parameters {list(params)}, "
            f"found {found}: vLLM changed under the plugin"
        )
    return target
