"""The plugin's loggers, inside vLLM's logger tree.

vLLM configures only the ``vllm`` logger (handler, format, ``VLLM_LOGGING_LEVEL``);
a logger named ``vllm_fafo...`` would fall through to Python's last-resort handler,
which drops INFO lines. The plugin's loggers are ``vllm.vllm_fafo...``."""

from __future__ import annotations

from vllm.logger import init_logger as vllm_init_logger


def init_logger(name: str):
    """A logger for the plugin module ``name`` that writes where vLLM's do."""
    return vllm_init_logger(f"vllm.{name}")
