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
from typing import Any

import torch
from vllm import envs
from vllm.engine.arg_utils import EngineArgs
from vllm.platforms import current_platform
from vllm.v1.attention.backends.registry import AttentionBackendEnum

from vllm_fafo.compression import POLICIES
from vllm_fafo.config import (
    ADDITIONAL_CONFIG_KEY,
    METHOD,
    PROPOSER_CLASS_PATH,
    FafoConfig,
    FafoConfigError,
    fafo_settings,
    user_settings,
)
from vllm_fafo.log import init_logger
from vllm_fafo.modes import parse_speculative_config
from vllm_fafo.patches.guard import require_signature

logger = init_logger(__name__)


def translate_speculative_config(args: EngineArgs) -> None:
    """Rewrite ``args`` in place when its speculative config asks for FAFO."""
    config = parse_speculative_config(with_cuda_defaults(args.speculative_config))
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


CUDA_PADDED_DEFAULTS = {"controller": "fixed", "num_speculative_tokens": 16, "pad_drafts": True}
"""What ``{"method": "fafo"}`` runs on CUDA unless the user sets these keys (docs/results.md "GPU levers",
"Padded draft length")."""


MAX_GRAPH_TOKENS_HOPPER = 512
"""The largest decode step vLLM 0.32 captures as a CUDA graph by default before Blackwell
(``VllmConfig._set_cudagraph_sizes``; 1,024 on Blackwell): larger steps run without graphs."""


def with_cuda_defaults(raw: Any) -> Any:
    """On CUDA, ``{"method": "fafo"}`` runs pool-only with padded 16-token drafts:
    ``raw`` with the keys the user did not set added (before validation, so that
    ``{"method": "fafo", "pad_drafts": true}`` is valid there as it is the default).

    Lanes need eager mode, which costs more than lanes earned in every GPU
    measurement so far (H100, SmolLM2 bf16, batch 1, 2026-11-23: 15.9 ms per
    step with lanes against 4.6 ms pool-only; docs/results.md "GPU figures"). Drafts of
    varying length make steps that vLLM's V1 runner runs piecewise, padded ones
    the uniform batches it replays as whole CUDA graphs (H200, 2026-11-28: 4.1 ms
    per step against 10.8 under the goodput controller, tau 1.42 against 1.38). A
    padded step of 16 drafts costs about what one of 4 does at batch 1 (H200,
    2026-11-30: 3.3-3.7 ms against 3.3-3.5) and reaches 1.16x-1.22x vLLM
    ``suffix``'s tau against 0.90x-1.06x for 4 (docs/results.md "Padded draft length").
    Asking for lanes, a draft tree or the goodput controller keeps the CPU
    defaults of the other keys.
    """
    if not isinstance(raw, dict) or raw.get("method") != METHOD or not current_platform.is_cuda():
        return raw
    asked = user_settings(raw)
    defaults: dict[str, Any] = {"num_lanes": 0}
    if (asked.get("num_lanes", 0) == 0 and asked.get("num_candidates", 1) == 1
            and asked.get("controller", "fixed") == "fixed"):
        defaults |= CUDA_PADDED_DEFAULTS
    added = {key: value for key, value in defaults.items() if key not in asked}
    if not added:
        return raw
    settings = {**asked, **added}
    graphs = ""
    if settings.get("pad_drafts"):
        draft_len = settings.get("num_speculative_tokens", FafoConfig.num_speculative_tokens)
        graphs = (f"; vLLM captures decode steps of up to {MAX_GRAPH_TOKENS_HOPPER} tokens on Hopper: "
                  f"{MAX_GRAPH_TOKENS_HOPPER // (1 + draft_len)} requests with {draft_len}-token drafts, "
                  "more run without CUDA graphs, where fewer draft tokens cost less")
    logger.info(
        "vllm-fafo: CUDA defaults %s (lanes force eager mode; padded drafts keep decode steps "
        "whole CUDA graphs%s); set these keys to override",
        ", ".join(f"{key}={value!r}" for key, value in added.items()), graphs,
    )
    return {**raw, **added}


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
    (README, "bfloat16 on CPU"), so in bfloat16 a branch could accept a token plain
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
