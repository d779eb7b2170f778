"""Turn ``{"method": "fafo" | "lookahead" | "cacheback", ...}`` into vLLM's
``custom_class`` proposer path.

Wraps ``vllm.engine.arg_utils.EngineArgs.create_engine_config``
(vLLM 0.32.0), before it builds any config: lanes must change the cache and
compilation settings, which that function reads before the speculative one. ``SpeculativeConfig.method`` is a closed Literal, so the user's
dict is validated by :class:`vllm_fafo.config.FafoConfig` here, in the front
process, before vLLM sees it; vLLM then gets ``method="custom_class"`` with
the proposer's import path, and the FAFO settings ride to every worker in
``additional_config["fafo"]``. Both ``vllm serve --speculative-config`` and
``LLM(speculative_config=...)`` pass through this function.
"""

from __future__ import annotations

import functools

from vllm.engine.arg_utils import EngineArgs
from vllm.logger import init_logger
from vllm.platforms import current_platform

from vllm_fafo.config import (
    ADDITIONAL_CONFIG_KEY,
    PROPOSER_CLASS_PATH,
    FafoConfig,
    FafoConfigError,
)
from vllm_fafo.modes import parse_speculative_config
from vllm_fafo.patches.guard import require_signature

logger = init_logger(__name__)


def translate_speculative_config(args: EngineArgs) -> None:
    """Rewrite ``args`` in place when its speculative config asks for FAFO."""
    config = parse_speculative_config(args.speculative_config)
    if config is None:
        return
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


def _make_room_for_lanes(args: EngineArgs, config: FafoConfig) -> None:
    """Refuse platforms without lane attention; turn off what conflicts, saying why."""
    if not current_platform.is_cpu():
        fix = (
            "set num_lanes to 0 (pool only)" if config.method == "fafo"
            else "use method 'fafo' with num_lanes 0, or 'cacheback'"
        )
        raise FafoConfigError(
            f"speculative_config method {config.method!r} runs {config.num_lanes} lanes per "
            "request: lanes run on vLLM's CPU attention backend only in this release (no "
            f"CUDA lane attention yet); on {current_platform.device_name} {fix}"
        )
    if not args.enforce_eager:
        logger.warning(
            "vllm-fafo: fumble lanes change the token count of every step, which "
            "CUDA graphs capture; running eager (enforce_eager=True)"
        )
        args.enforce_eager = True
    if args.enable_prefix_caching is not False:
        logger.warning(
            "vllm-fafo: a prefix-cache hit skips the prompt tokens whose KV would fill "
            "the lanes' compressed region; prefix caching is off while lanes are on"
        )
        args.enable_prefix_caching = False


def apply() -> None:
    original = require_signature(
        EngineArgs, "create_engine_config", ["self", "usage_context", "headless"]
    )

    @functools.wraps(original)
    def create_engine_config(self, *args, **kwargs):
        translate_speculative_config(self)
        return original(self, *args, **kwargs)

    create_engine_config.vllm_fafo_patch = __name__
    EngineArgs.create_engine_config = create_engine_config
