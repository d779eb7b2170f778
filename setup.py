"""Package discovery for vllm-fafo (all other metadata is in pyproject.toml).

The runtime patches of vLLM live in the top-level ``patches/`` folder and are
installed as ``vllm_fafo.patches``; every package under both folders is found,
none is listed by hand, so a wheel carries exactly what an editable install
imports.
"""

from setuptools import find_packages, setup

PATCHES_DIR = "patches"

packages = find_packages(include=["vllm_fafo", "vllm_fafo.*"])
packages += ["vllm_fafo.patches"] + [f"vllm_fafo.patches.{name}" for name in find_packages(PATCHES_DIR)]

setup(
    packages=packages,
    package_dir={"vllm_fafo.patches": PATCHES_DIR},
)
