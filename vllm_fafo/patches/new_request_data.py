"""Patch of ``vllm.v1.core.sched.output.NewRequestData`` (vLLM 0.32.0).

The shared pool (:mod:`vllm_fafo.drafting.shared_pool`) isolates tenants by vLLM's
``cache_salt``, which vLLM keeps on the scheduler's ``Request`` but does not
hand the workers. ``NewRequestData.from_request`` (where the scheduler turns a
request into what the workers see on its first step) is wrapped to carry the
salt along as an attribute.
"""

from __future__ import annotations

import functools

from vllm.v1.core.sched.output import NewRequestData

from vllm_fafo.patches.guard import require_signature

CACHE_SALT_ATTRIBUTE = "vllm_fafo_cache_salt"


def cache_salt_of(new_request: NewRequestData) -> str | None:
    """The salt the scheduler's request carried (None: unsalted)."""
    try:
        return getattr(new_request, CACHE_SALT_ATTRIBUTE)
    except AttributeError:
        raise RuntimeError(
            "vllm-fafo: NewRequestData arrived without the request's cache_salt; the "
            "vllm_fafo patches are not applied in the scheduler's process, so the "
            "shared pool cannot keep tenants apart"
        ) from None


def apply() -> None:
    original = require_signature(NewRequestData, "from_request", ["request", "block_ids"])
    original_function = original.__func__

    @functools.wraps(original_function)
    def from_request(cls, request, *args, **kwargs):
        data = original_function(cls, request, *args, **kwargs)
        setattr(data, CACHE_SALT_ATTRIBUTE, request.cache_salt)
        return data

    NewRequestData.from_request = classmethod(from_request)
