"""A built wheel carries every module an editable install imports."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _source_modules() -> set[str]:
    modules = {f"vllm_fafo/{p.relative_to(ROOT / 'vllm_fafo')}" for p in (ROOT / "vllm_fafo").rglob("*.py")}
    modules |= {f"vllm_fafo/patches/{p.relative_to(ROOT / 'patches')}" for p in (ROOT / "patches").rglob("*.py")}
    return {m for m in modules if "__pycache__" not in m}


def test_wheel_holds_every_module_and_the_plugin_entry_point(tmp_path):
    # Build from a copy: setuptools' build/ folder would otherwise carry stale modules between builds.
    source = tmp_path / "src"
    for name in ("vllm_fafo", "patches"):
        shutil.copytree(ROOT / name, source / name, ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "setup.py", "README.md"):
        shutil.copy(ROOT / name, source / name)
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(tmp_path), str(source)],
        check=True, capture_output=True, text=True, timeout=300,
    )
    (wheel,) = tmp_path.glob("vllm_fafo-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
        entry_points = next(archive.read(n).decode() for n in names if n.endswith("entry_points.txt"))
        metadata = next(archive.read(n).decode() for n in names if n.endswith("METADATA"))
    missing = _source_modules() - names
    assert not missing, f"wheel lacks {sorted(missing)}"
    assert "vllm_fafo/attention/lane_impl.py" in names and "vllm_fafo/compression/quest.py" in names
    assert "[vllm.general_plugins]\nfafo = vllm_fafo.plugin:register" in entry_points
    # The model-building tools are an extra, not a runtime requirement.
    runtime = [line for line in metadata.splitlines() if line.startswith("Requires-Dist:") and "extra ==" not in line]
    assert not any(name in line for line in runtime for name in ("gguf", "accelerate", "matplotlib"))
