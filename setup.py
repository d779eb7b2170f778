"""Package discovery for vllm-fafo (all other metadata is in pyproject.toml): every
package under ``vllm_fafo/`` is found, none is listed by hand, so a wheel carries
exactly what an editable install imports."""

from setuptools import find_packages, setup

setup(packages=find_packages(include=["vllm_fafo", "vllm_fafo.*"]))
