"""Where the plugin keeps what it builds once per machine (models, prompts, prior tables)."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """Where built assets live: ``$VLLM_FAFO_CACHE`` or ``~/.cache/vllm_fafo``."""
    root = os.environ.get("VLLM_FAFO_CACHE") or Path.home() / ".cache" / "vllm_fafo"
    path = Path(root)
    path.mkdir(parents=True, exist_ok=True)
    return path
