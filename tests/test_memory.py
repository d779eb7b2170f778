"""Lane memory is allocated when vLLM builds the layers, so vLLM accounts for it.

docs/configuration.md's per-layer formula ("Memory") is checked against the bytes every layer of a
real engine actually holds, and every one of those bytes must exist when
vLLM sizes the KV cache (instead of landing on top of a KV cache sized as if
they did not exist).
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from dataclasses import fields, is_dataclass
from pathlib import Path

import pytest
import torch

from vllm_fafo.config import FafoConfig
from vllm_fafo.lanes.compression import QuestPolicy
from vllm_fafo.lanes.compression.base import LayerShape
from vllm_fafo.lanes.compression.quest import QuestSettings

from .engine_configs import CONFIGS, LANES_SPEC
from .engine_utils import ENGINE_MAX_MODEL_LEN


def tensor_bytes(obj) -> int:
    """Bytes of every tensor held by ``obj`` (a tensor, a dataclass of them, or neither)."""
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if is_dataclass(obj):
        return sum(tensor_bytes(getattr(obj, f.name)) for f in fields(obj))
    return 0


CONFIGURATION_DOC = Path(__file__).resolve().parents[1] / "docs" / "configuration.md"


def documented_formulas() -> dict[str, str]:
    """docs/configuration.md "Memory"'s table: policy -> its bytes per attention layer, as a
    Python expression."""
    section = CONFIGURATION_DOC.read_text().split("## Memory", 1)[1].split("\n#", 1)[0]
    formulas: dict[str, str] = {}
    base = ""
    for names, cell in re.findall(r"^\| ([^|]+) \| ([^|]+) \|$", section, re.M):
        code = re.search(r"`([^`]+)`", cell)
        if code is None:  # the header
            continue
        expression = f"{base} {code.group(1)}" if cell.startswith("the above") else code.group(1)
        base = expression if not cell.startswith("the above") else base
        for name in re.findall(r"`(\w+)`", names):
            formulas[name] = expression.replace(" x ", " * ")
    assert {"streaming", "none", "quest", "snapkv"} <= set(formulas), formulas
    return formulas


def documented_formula(spec: dict, rows: int, num_heads: int, num_kv_heads: int, head_size: int,
                   max_model_len: int, dtype_bytes: int) -> int:
    """Bytes of one attention layer's lane state, evaluated from docs/configuration.md's table."""
    defaults = FafoConfig()
    names = {
        "R": rows, "k": spec.get("num_speculative_tokens", defaults.num_speculative_tokens),
        "Hk": num_kv_heads, "Hq": num_heads, "D": head_size, "b": dtype_bytes, "L": max_model_len,
        "kv_budget": spec["kv_budget"], "quest_page_size": spec.get("quest_page_size", 16),
        "snapkv_window": spec.get("snapkv_window", 32), "ceil": math.ceil,
    }
    return eval(documented_formulas()[spec.get("compression", "streaming")], {"__builtins__": {}}, names)


def layer_lane_bytes(worker) -> list[tuple[int, int, int, int]]:
    """(lane bytes, Hq, Hk, D) of every attention layer of a worker's model."""
    context = worker.model_runner.vllm_config.compilation_config.static_forward_context
    out = []
    for layer in context.values():
        impl = getattr(layer, "impl", None)
        if impl is not None:
            out.append((tensor_bytes(impl.region), impl.num_heads, impl.num_kv_heads, impl.head_size))
    return out


def _check_formula(llm, spec: dict) -> None:
    (layers,) = llm.collective_rpc(layer_lane_bytes)
    rows = min(spec.get("max_lane_requests", 8), llm.llm_engine.vllm_config.scheduler_config.max_num_seqs)
    assert len(layers) == llm.llm_engine.vllm_config.model_config.hf_config.num_hidden_layers
    for held, num_heads, num_kv_heads, head_size in layers:
        assert held == documented_formula(spec, rows, num_heads, num_kv_heads, head_size, ENGINE_MAX_MODEL_LEN, 4)


@pytest.mark.engine
def test_streaming_lane_bytes_match_the_documented_formula(lanes_llm):
    _check_formula(lanes_llm, LANES_SPEC)


@pytest.mark.engine
@pytest.mark.parametrize("name", ["quest", "snapkv"])
def test_policy_lane_bytes_match_the_documented_formula(name, engine):
    _check_formula(engine(name), CONFIGS[name])


@pytest.mark.engine
def test_full_cache_lanes_hold_one_region_slot_per_row(engine):
    """Lookahead's lanes (compression ``none``) read the paged cache: the "none" row."""
    from vllm_fafo.modes import parse_speculative_config

    config = parse_speculative_config(CONFIGS["lookahead"]).to_dict()
    assert config["compression"] == "none"
    _check_formula(engine("lookahead"), config)


@pytest.mark.engine
def test_engines_without_lanes_hold_no_lane_memory(plain_llm, engine):
    for llm in (plain_llm, engine("pool-tree")):
        (layers,) = llm.collective_rpc(layer_lane_bytes)
        assert layers and all(held == 0 for held, *_ in layers)


def test_quest_metadata_at_32k_context_fits_the_formula():
    """Llama-3-8B's attention shape, bf16, 8 rows, 32k context: the page min/max in the keys' dtype."""
    settings = QuestSettings(page_size=16, recent_tokens=32)
    policy = QuestPolicy(4, 256, settings)
    shape = LayerShape(rows=8, num_heads=32, num_kv_heads=8, head_size=128, max_model_len=32768,
                       dtype=torch.bfloat16, device=torch.device("cpu"))
    state = policy.new_layer_state(shape)
    assert tensor_bytes(state) == 2 * 8 * (32768 // 16) * 8 * 128 * 2 == 64 * 2**20
    assert state.kmin.dtype == torch.bfloat16


_KV_PROBE = """
import json, sys
from vllm import LLM
from vllm.v1.worker.cpu_worker import CPUWorker
from tests.test_memory import layer_lane_bytes
seen = {}
size_kv_cache = CPUWorker.determine_available_memory
def recording(worker):
    seen["lane_bytes_when_sized"] = sum(b for b, *_ in layer_lane_bytes(worker))
    return size_kv_cache(worker)
CPUWorker.determine_available_memory = recording
from vllm.utils.cpu_resource_utils import get_allowed_cpu_list, get_memory_node_info
# vLLM's CPU worker refuses to start unless utilization x its node's memory is free;
# ask for at most 90 % of what is free, so the probe does not depend on what else runs.
node = get_memory_node_info(get_allowed_cpu_list()[0].numa_node)
utilization = min(0.3, 0.9 * node.available_memory / node.total_memory)
spec = json.loads(sys.argv[1])
llm = LLM(model=sys.argv[2], dtype="float32", enforce_eager=True, max_model_len=1024, max_num_seqs=4,
          gpu_memory_utilization=utilization, enable_prefix_caching=False, speculative_config=spec)
(layers,) = llm.collective_rpc(layer_lane_bytes)
(kv_config,) = llm.collective_rpc(lambda worker: worker.model_runner.kv_cache_config)
seen["kv_cache_bytes"] = sum(t.size for t in kv_config.kv_cache_tensors)
seen["lane_bytes"] = sum(b for b, *_ in layers)
print("PROBE", json.dumps(seen))
"""


def _probe_kv_cache(model_dir: str, spec: dict) -> dict:
    """vLLM's KV cache size, sized from the memory left (no explicit size), in a fresh process."""
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    result = subprocess.run(
        [sys.executable, "-c", _KV_PROBE, json.dumps(spec), model_dir], env=env, capture_output=True,
        text=True, timeout=600, cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
    )
    assert result.returncode == 0, result.stderr[-4000:]
    line = next(line for line in result.stdout.splitlines() if line.startswith("PROBE "))
    return json.loads(line[len("PROBE "):])


@pytest.mark.engine
def test_every_lane_byte_exists_when_vllm_sizes_the_kv_cache(model_dir):
    """vLLM sizes the KV cache from what the process holds once the model is loaded (CPU: its
    resident memory; CUDA: its profiling run): the regions must all be allocated by then.

    The size vLLM's CPU worker then picks is not compared here: resident memory moves by
    hundreds of MB between starts of the same engine (for a 756 MB region the KV cache shrank
    by 938 MB in one pair of fresh processes and grew by 289 MB in another, late in a test
    session), so that comparison cannot tell a bug from noise."""
    lanes_spec = {"method": "fafo", "num_lanes": 4, "lane_len": 4, "kv_budget": 4096, "max_lane_requests": 4}
    with_lanes = _probe_kv_cache(model_dir, lanes_spec)
    region = with_lanes["lane_bytes"]
    assert region > 700 * 2**20
    assert with_lanes["lane_bytes_when_sized"] == region
