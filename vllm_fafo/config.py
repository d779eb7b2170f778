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

# Keys that belong to fumble lanes (a later release). ``num_lanes: 0`` means
# "pool only" and is accepted; any other value is refused rather than ignored.
RESERVED_LANE_KEYS = ("num_lanes", "lane_len", "compression", "kv_budget")


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
    num_lanes: int = 0
    """Fumble lanes per request. Only 0 (pool only) in this release."""

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
            if key in RESERVED_LANE_KEYS and key != "num_lanes":
                raise FafoConfigError(
                    f"speculative_config[{key!r}]={settings[key]!r}: this key is "
                    "reserved for fumble lanes, which this release does not run yet"
                )
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
        _check_int("num_lanes", self.num_lanes, 0, 0)

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
