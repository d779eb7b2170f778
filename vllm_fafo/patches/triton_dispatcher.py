"""Patch of ``vllm.triton_utils.dispatcher._rebind_kernels`` (vLLM 0.32.0).

When a platform replaces Triton kernels (the CPU platform does, at every
worker's start), vLLM walks every attribute of every imported module and reads
``vars(value).get("kernel")`` of each one that has a ``__dict__``. llvmlite's
``llvmlite.binding.ffi.lib`` (imported with numba, which the draft index's
kernels and vLLM's own ``ngram`` proposer use) answers any attribute, ``__dict__``
included, with a C function wrapper that has no ``get``: the walk raises and
the engine does not start. The wrap hides such values (whose ``__dict__`` is not
a mapping) from the walk while it runs and puts them back after; they cannot
hold a Triton kernel.
"""

from __future__ import annotations

import functools
import sys
from typing import Any

from vllm.triton_utils import dispatcher

from vllm_fafo.patches.guard import require_signature


def _unwalkable() -> list[tuple[dict[str, Any], str, Any]]:
    """(module namespace, attribute, value) of every module attribute whose ``vars()``
    is not a mapping."""
    found = []
    for module in list(sys.modules.values()):
        namespace = getattr(module, "__dict__", None)
        if not namespace:
            continue
        for attr, value in list(namespace.items()):
            if hasattr(value, "__dict__") and not hasattr(vars(value), "get"):
                found.append((namespace, attr, value))
    return found


def apply() -> None:
    original = require_signature(dispatcher, "_rebind_kernels", ["overrides"])

    @functools.wraps(original)
    def _rebind_kernels(overrides, *args, **kwargs):
        hidden = _unwalkable()
        for namespace, attr, _ in hidden:
            del namespace[attr]
        try:
            return original(overrides, *args, **kwargs)
        finally:
            for namespace, attr, value in hidden:
                namespace[attr] = value

    _rebind_kernels.vllm_fafo_patch = True
    dispatcher._rebind_kernels = _rebind_kernels
