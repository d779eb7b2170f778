"""FafoConfig: every user-facing knob of ``{"method": "fafo", ...}``.

vLLM's ``SpeculativeConfig`` only knows its own methods, so the plugin reads
the user's dict first (in the front process, see
``vllm_fafo.patches.engine_args``), validates it here with messages that name
the key, the value and what is allowed, and hands vLLM a ``custom_class``
config pointing at :class:`vllm_fafo.proposer.FafoProposer`. The validated
settings travel to the workers inside ``VllmConfig.additional_config``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

METHOD = "fafo"
ADDITIONAL_CONFIG_KEY = "fafo"
PROPOSER_CLASS_PATH = "vllm_fafo.proposer.FafoProposer"

COMPRESSION_POLICIES = ("streaming",)


class FafoConfigError(ValueError):
    """A bad ``speculative_config`` for method ``fafo``."""


@dataclass(frozen=True)
class FafoConfig:
    """Validated FAFO settings (FAFO Sec. 4.2-4.3, App. F)."""

    num_speculative_tokens: int = 4
    """Longest draft proposed per step (the candidate n-gram length k)."""
    max_key_len: int = 4
    """K: the longest suffix of the decoded text used as a pool key."""
    pool_capacity: int = 8
    """Candidates kept per key; the least recently used one is evicted."""
    seed_from_prompt: bool = True
    """Seed the pool with the prompt's n-grams at prefill."""
    num_lanes: int = 16
    """Fumble lanes per request (0: pool only). Lanes guess future n-grams
    on the compressed KV in the verification forward pass (FAFO Sec. 4.2)."""
    lane_len: int = 6
    """Tokens per lane; the n-grams lanes file have this length."""
    compression: str = "streaming"
    """Which KV entries lanes see: ``streaming`` (sink + recent window)."""
    sink_tokens: int = 4
    """StreamingLLM attention sinks kept in the compressed region."""
    kv_budget: int = 256
    """Tokens in each request's compressed region (sinks + recent window)."""
    max_lane_requests: int = 8
    """Requests that get a compressed region (and so lanes) at once; later
    ones run pool-only until a region frees up at their next prefill."""

    @classmethod
    def from_user_dict(cls, raw: dict[str, Any]) -> FafoConfig:
        """Validate a user's ``speculative_config`` dict (``method`` included)."""
        if not isinstance(raw, dict):
            raise FafoConfigError(
                f"speculative_config must be a dict, got {type(raw).__name__}"
            )
        settings = {k.replace("-", "_"): v for k, v in raw.items()}
        method = settings.pop("method", None)
        if method != METHOD:
            raise FafoConfigError(
                f"speculative_config['method'] must be {METHOD!r}, got {method!r}"
            )
        allowed = [f.name for f in dataclasses.fields(cls)]
        for key in settings:
            if key not in allowed:
                raise FafoConfigError(
                    f"speculative_config has unknown key {key!r} for method "
                    f"{METHOD!r}; allowed keys: {', '.join(sorted(allowed + ['method']))}"
                )
        config = cls(**settings)
        config.validate()
        return config

    def validate(self) -> None:
        _check_int("num_speculative_tokens", self.num_speculative_tokens, 1, 64)
        _check_int("max_key_len", self.max_key_len, 1, 32)
        _check_int("pool_capacity", self.pool_capacity, 1, 4096)
        _check_bool("seed_from_prompt", self.seed_from_prompt)
        _check_int("num_lanes", self.num_lanes, 0, 256)
        _check_int("lane_len", self.lane_len, 2, 32)
        if self.compression not in COMPRESSION_POLICIES:
            raise FafoConfigError(
                f"speculative_config['compression']={self.compression!r} is not a known "
                f"policy; allowed: {', '.join(repr(p) for p in COMPRESSION_POLICIES)}"
            )
        _check_int("kv_budget", self.kv_budget, 8, 1 << 16)
        _check_int("sink_tokens", self.sink_tokens, 0, self.kv_budget - 1)
        _check_int("max_lane_requests", self.max_lane_requests, 1, 1024)
        window = self.kv_budget - self.sink_tokens
        if window <= self.num_speculative_tokens + 1:
            raise FafoConfigError(
                f"speculative_config['kv_budget']={self.kv_budget} leaves a recent window of "
                f"{window} tokens after {self.sink_tokens} sink tokens; it must exceed "
                f"num_speculative_tokens + 1 = {self.num_speculative_tokens + 1}"
            )

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> FafoConfig:
        """Rebuild from :meth:`to_dict` output (worker side)."""
        config = cls(**data)
        config.validate()
        return config


def _check_int(key: str, value: Any, low: int, high: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise FafoConfigError(
            f"speculative_config[{key!r}]={value!r} must be an integer "
            f"in [{low}, {high}], got {type(value).__name__}"
        )
    if not low <= value <= high:
        raise FafoConfigError(
            f"speculative_config[{key!r}]={value!r} is out of range; "
            f"allowed: integers in [{low}, {high}]"
        )


def _check_bool(key: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise FafoConfigError(
            f"speculative_config[{key!r}]={value!r} must be true or false, "
            f"got {type(value).__name__}"
        )
