"""Turn ``{"method": "fafo" | "lookahead" | "cacheback", ...}`` into vLLM's
``custom_class`` proposer path.

Wraps ``vllm.engine.arg_utils.EngineArgs.create_engine_config``
(vLLM 0.32.0), before it builds any config: lanes must change the cache,
compilation and attention settings, which that function reads before the
speculative one. ``SpeculativeConfig.method`` is a closed Literal, so the user's
dict is validated by :class:`vllm_fafo.config.FafoConfig` here, in the front
process, before vLLM sees it; vLLM then gets ``method="custom_class"`` with
the proposer's import path, and the FAFO settings ride to every worker in
``additional_config["fafo"]``. Both ``vllm serve --speculative-config`` and
``LLM(speculative_config=...)`` pass through this function.
"""

from __future__ import annotations

import copy
import functools
import os
from typing import Any

import torch
from vllm import envs
from vllm.engine.arg_utils import EngineArgs
from vllm.platforms import current_platform
from vllm.v1.attention.backends.registry import AttentionBackendEnum

from vllm_fafo.config import (
    ADDITIONAL_CONFIG_KEY,
    METHOD,
    PROPOSER_CLASS_PATH,
    FafoConfig,
    FafoConfigError,
    fafo_settings,
    platform_defaults,
    platform_defaults_line,
    user_settings,
)
from vllm_fafo.lanes.compression import POLICIES
from vllm_fafo.log import init_logger
from vllm_fafo.modes import parse_speculative_config
from vllm_fafo.patches.guard import require_signature

logger = init_logger(__name__)


def translate_speculative_config(args: EngineArgs) -> None:
    """Rewrite ``args`` in place when its speculative config asks for FAFO."""
    config = parse_speculative_config(with_platform_defaults(args.speculative_config))
    if config is None:
        return
    if envs.VLLM_USE_V2_MODEL_RUNNER:
        raise FafoConfigError(
            f"speculative_config method {config.method!r} runs on vLLM's V1 model runner "
            "(vllm_fafo.patches wrap GPUModelRunner), but VLLM_USE_V2_MODEL_RUNNER=1 asks "
            "for V2; unset it (vLLM then picks V1 for custom proposers)"
        )
    args.speculative_config = {
        "method": "custom_class",
        "model": PROPOSER_CLASS_PATH,
        "num_speculative_tokens": config.num_speculative_tokens,
    }
    additional = dict(args.additional_config or {})
    additional[ADDITIONAL_CONFIG_KEY] = config.to_dict()
    args.additional_config = additional
    if config.num_lanes > 0:
        _make_room_for_lanes(args, config)
    elif config.num_candidates > 1:
        _make_room_for_tail(args, config, "draft-tree branches")
    if current_platform.is_cpu():
        bound_onednn_primitive_cache()


ONEDNN_CACHE_ENV = "ONEDNN_PRIMITIVE_CACHE_CAPACITY"
ONEDNN_CACHE_CAPACITY = 64
"""Compiled oneDNN primitives kept (oneDNN's default: 1,024). On CPU, oneDNN compiles a matrix
kernel per distinct step token count, and speculative steps vary that count: at 1,024 a server
under load keeps ~0.5 GiB of kernels; at 64 a fafo server grew less than plain vLLM's (which keeps
1,024), its rounds at batch 32 up to 3 % longer, at batch 1 the same (docs/results/serving.md,
"Memory under load with the plugin's defaults")."""


def bound_onednn_primitive_cache() -> None:
    """Set ``ONEDNN_PRIMITIVE_CACHE_CAPACITY`` where the user has not (their value stands), in this
    process before vLLM starts the engine's processes, which inherit it. oneDNN reads it at its
    first primitive: an engine built in a process that already ran oneDNN keeps that process's cache."""
    if ONEDNN_CACHE_ENV in os.environ:
        logger.info("vllm-fafo: %s=%s (set by the user)", ONEDNN_CACHE_ENV, os.environ[ONEDNN_CACHE_ENV])
        return
    os.environ[ONEDNN_CACHE_ENV] = str(ONEDNN_CACHE_CAPACITY)
    logger.info("vllm-fafo: %s=%d (oneDNN's default 1024 keeps a matrix kernel per step token count; "
                "set the variable to choose another bound)", ONEDNN_CACHE_ENV, ONEDNN_CACHE_CAPACITY)


def with_platform_defaults(raw: Any) -> Any:
    """``raw`` with the platform defaults of ``{"method": "fafo"}`` it does not set
    (:func:`vllm_fafo.config.platform_defaults`, which says why each), logged; added before
    validation, so that ``{"method": "fafo", "pad_drafts": true}`` is valid on CUDA as it is
    the default there. Other methods pass through."""
    if not isinstance(raw, dict) or raw.get("method") != METHOD:
        return raw
    on_cuda = current_platform.is_cuda()
    asked = user_settings(raw)
    applied = platform_defaults(asked, on_cuda)
    if not applied:
        return raw
    logger.info(platform_defaults_line(applied, {**asked, **applied}, on_cuda))
    return {**raw, **applied}


def _make_room_for_tail(args: EngineArgs, config: FafoConfig, what: str) -> None:
    """Tokens behind the real ones: the wrapping attention backend, eager mode."""
    _select_lane_backend(args, config)
    if not args.enforce_eager:
        logger.warning(
            "vllm-fafo: %s change the token count of every step, which CUDA graphs "
            "capture; running eager (enforce_eager=True)", what,
        )
        args.enforce_eager = True


def _make_room_for_lanes(args: EngineArgs, config: FafoConfig) -> None:
    """Pick the lane attention backend; turn off what conflicts, saying why. Prefix
    caching stays: a request's region reads a prefix-cache hit back from the paged cache."""
    _make_room_for_tail(args, config, "fumble lanes")
    if POLICIES[config.compression].reads_paged_kv and args.kv_cache_dtype != "auto":
        raise FafoConfigError(
            f"speculative_config compression {config.compression!r} reads vLLM's paged KV "
            f"cache back into the lanes' region and needs kv_cache_dtype 'auto', got "
            f"{args.kv_cache_dtype!r}; use kv_cache_dtype 'auto' or compression 'streaming'"
        )


# Attention backends lanes wrap on CUDA: vLLM's choice (None), FlashAttention, or ours.
LANE_BASE_BACKENDS = (None, "FLASH_ATTN", "CUSTOM")


def _select_lane_backend(args: EngineArgs, config: FafoConfig) -> None:
    """CPU: the CPU_ATTN wrapper is always in place. CUDA: select CUSTOM (FlashAttention + lanes)."""
    if current_platform.is_cpu():
        return
    if not current_platform.is_cuda():
        if config.num_lanes == 0:
            raise FafoConfigError(
                f"speculative_config['num_candidates']={config.num_candidates}: draft-tree branches "
                "run on vLLM's CPU attention and on CUDA FlashAttention only in this release; on "
                f"{current_platform.device_name} set num_candidates to 1"
            )
        fix = (
            "set num_lanes to 0 (pool only)" if config.method == "fafo"
            else "use method 'fafo' with num_lanes 0, or 'cacheback'"
        )
        raise FafoConfigError(
            f"speculative_config method {config.method!r} runs {config.num_lanes} lanes per "
            "request: lanes run on vLLM's CPU attention and on CUDA FlashAttention only in "
            f"this release; on {current_platform.device_name} {fix}"
        )
    chosen = _backend_name(args.attention_backend) or _backend_name(args.attention_config.backend)
    if chosen not in LANE_BASE_BACKENDS:
        raise FafoConfigError(
            f"attention_backend {chosen!r}: vllm-fafo lanes on CUDA wrap FLASH_ATTN (as "
            f"the CUSTOM backend); leave attention_backend unset or choose one of "
            f"{', '.join(name for name in LANE_BASE_BACKENDS if name)}, or set num_lanes to 0 "
            "and num_candidates to 1"
        )
    if chosen != "CUSTOM":
        logger.info("vllm-fafo: lanes on; attention backend CUSTOM (FlashAttention + lanes)")
    args.attention_config = copy.deepcopy(args.attention_config)
    args.attention_config.backend = None
    args.attention_backend = AttentionBackendEnum.CUSTOM


def refuse_inexact_branches(vllm_config) -> None:
    """On CPU, draft-tree branches need float32: only there are their logits plain vLLM's.

    A branch token's attention runs through the base backend's own kernel
    (:mod:`vllm_fafo.attention.branch_attention`), in another arrangement than a
    verification of the same tokens as the spine. vLLM's CPU kernel, with its
    default split over the keys, changes a row's rounding with the arrangement
    (docs/results/draft-trees.md, "bfloat16 on CPU"), so in bfloat16 a branch could accept a token plain
    vLLM would not pick. FlashAttention on CUDA computes a row independently of the
    rows beside it at a given split count (the spine's; 1 under
    ``VLLM_BATCH_INVARIANT=1``), so there trees run in the model's dtype.
    Checked on the resolved config, where ``dtype="auto"`` is known.
    """
    settings = fafo_settings(vllm_config)
    if settings is None or settings["num_candidates"] == 1 or not current_platform.is_cpu():
        return
    dtype = vllm_config.model_config.dtype
    if dtype != torch.float32:
        raise FafoConfigError(
            f"speculative_config num_candidates={settings['num_candidates']} verifies draft-tree "
            f"branches on CPU with attention that matches a verification of the same tokens only to "
            f"float32 rounding; the model runs in {dtype}, where a branch could accept a token plain "
            "vLLM would not pick. Set num_candidates to 1, or dtype to float32"
        )


def _backend_name(backend: AttentionBackendEnum | str | None) -> str | None:
    if isinstance(backend, AttentionBackendEnum):
        return backend.name
    if backend is None or str(backend).lower() == "auto":
        return None
    return str(backend).upper()


def apply() -> None:
    original = require_signature(
        EngineArgs, "create_engine_config", ["self", "usage_context", "headless"]
    )

    @functools.wraps(original)
    def create_engine_config(self, *args, **kwargs):
        translate_speculative_config(self)
        vllm_config = original(self, *args, **kwargs)
        refuse_inexact_branches(vllm_config)
        return vllm_config

    create_engine_config.vllm_fafo_patch = __name__
    EngineArgs.create_engine_config = create_engine_config
