"""vLLM general plugin entry point (group ``vllm.general_plugins``, name ``fafo``).

vLLM calls :func:`register` in every process it starts (front end, engine
core, workers) and honours ``VLLM_PLUGINS``. ``VLLM_FAFO_DISABLE=1`` turns the
plugin off as well (vLLM is then left untouched, and ``{"method": "fafo"}`` is
refused by vLLM itself). Registration checks the vLLM version first: the
patches read vLLM internals of exactly one release.
"""

from __future__ import annotations

import os

import vllm

from vllm_fafo.log import init_logger
from vllm_fafo.version import check_vllm_version

DISABLE_ENV = "VLLM_FAFO_DISABLE"

logger = init_logger(__name__)


def is_disabled() -> bool:
    value = os.environ.get(DISABLE_ENV, "").strip().lower()
    if value in ("", "0", "false", "no"):
        return False
    if value in ("1", "true", "yes"):
        return True
    raise ValueError(f"{DISABLE_ENV}={value!r}: use 1/true/yes to disable vllm-fafo, 0/false/no or unset to enable it")


def register() -> None:
    """Entry point: check the version, then apply the patches once."""
    if is_disabled():
        logger.info("vllm-fafo is disabled (%s); vLLM runs unpatched", DISABLE_ENV)
        return
    check_vllm_version(vllm.__version__)
    from vllm_fafo.patches import apply_all

    apply_all()
    logger.debug("vllm-fafo plugin registered")
