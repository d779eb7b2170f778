"""FafoConfigError and the checks that word every config error the same way."""

from __future__ import annotations

from typing import Any


class FafoConfigError(ValueError):
    """A bad ``speculative_config`` for a vllm-fafo method."""


def unknown_key(key: str, method: str, allowed) -> FafoConfigError:
    """The error for a key that ``method`` does not know, listing the ones it does."""
    return FafoConfigError(
        f"speculative_config has unknown key {key!r} for method {method!r}; "
        f"allowed keys: {', '.join(sorted([*allowed, 'method']))}"
    )


def check_int(key: str, value: Any, low: int, high: int) -> None:
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


def check_bool(key: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise FafoConfigError(
            f"speculative_config[{key!r}]={value!r} must be true or false, "
            f"got {type(value).__name__}"
        )
