"""The short soak: a FAFO `vllm serve` under 16 streaming chat requests for 60 s, one in
five aborted mid-stream, keeps answering, gives the same greedy text after the load
and its memory growth stays under a bound (benchmarks/soak.py)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.engine

ROOT = Path(__file__).resolve().parent.parent
MAX_RSS_GROWTH_MIB = 256


def test_short_soak_with_aborts_holds(tmp_path, model_dir):
    out = tmp_path / "soak"
    command = [
        sys.executable, str(ROOT / "benchmarks" / "soak.py"), "--model", model_dir,
        "--concurrency", "16", "--seconds", "60", "--max-tokens", "128",
        "--max-rss-growth-mib", str(MAX_RSS_GROWTH_MIB), "--out", str(out),
    ]
    result = subprocess.run(command, capture_output=True, text=True, timeout=900, cwd=ROOT)
    report = json.loads((out / "soak.json").read_text())
    summary = {k: v for k, v in report.items() if k != "rss_over_time"}
    assert report["failed"] == 0, summary
    assert report["completed"] > 0 and report["aborted"] > 0, summary
    assert report["same_text_before_and_after"], summary
    assert report["rss_growth_mib"] <= MAX_RSS_GROWTH_MIB, summary
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
