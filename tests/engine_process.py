"""Runs one engine in its own process, for tests whose engines the test process
cannot host next to its own: tensor parallel (two worker processes), a 16k
context (a KV cache of its own size) and another model (a sliding-window
SmolLM2: an engine made and dropped in the test process takes vLLM's
process-wide parallel state with it, under the session's other engines), and one
more SmolLM2 engine whose memory the test process, holding the session's engines,
cannot spare (padded drafts).

Usage: ``python -m tests.engine_process CASE SPEC_JSON_OR_none OUT_JSON``, CASE one
of :data:`CASES`. Writes the greedy tokens and, for FAFO, what the case checks.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

TP2_CONCURRENT_PROMPTS = 3
TP2_BATCH1_PROMPTS = 1
LONG_MODEL_LEN = 16896
"""16k-token prompts plus what they generate."""
LONG_CONTEXT_OVERRIDES = {"max_position_embeddings": LONG_MODEL_LEN}
"""SmolLM2 was trained on 8,192 positions; past them its text degenerates (YaRN without
fine-tuning did worse), which is the same for plain vLLM and FAFO: identity and memory
are what this case checks, not answer quality."""
LONG_PROMPTS = 1
LONG_MAX_TOKENS = 96


def threads_bind() -> str:
    """Half of this process's CPUs to each of two workers, e.g. ``0|1`` (vLLM's CPU
    backend cannot bind two workers on one NUMA node by itself)."""
    cpus = sorted(os.sched_getaffinity(0))
    half = max(1, len(cpus) // 2)
    return "|".join(",".join(map(str, part)) for part in (cpus[:half], cpus[half:] or cpus[:half]))


def bind_threads_to_all_cpus() -> None:
    """One worker's OpenMP threads on every CPU of this process (unless set already)."""
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", ",".join(map(str, sorted(os.sched_getaffinity(0)))))


def tp2(spec: dict | None) -> dict[str, Any]:
    """MT-Bench prompts at ``tensor_parallel_size=2`` (concurrent, different lengths;
    then two at batch 1), and every rank's proposer snapshot."""
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", threads_bind())
    from vllm_fafo.serving.metrics import worker_metrics
    from vllm_fafo.tools.assets import load_prompts, smollm2_tp2_dir

    from .engine_utils import chat_prompts, generate_one_by_one, greedy, make_llm, token_ids

    llm = make_llm(str(smollm2_tp2_dir()), spec, tensor_parallel_size=2, distributed_executor_backend="mp",
                   kv_cache_memory_bytes=256 * 1024 * 1024)
    prompts = chat_prompts(llm, load_prompts("mtbench", TP2_CONCURRENT_PROMPTS + TP2_BATCH1_PROMPTS))
    params = [greedy(32 + 8 * i) for i in range(TP2_CONCURRENT_PROMPTS)]
    tokens = token_ids(llm.generate(prompts[:TP2_CONCURRENT_PROMPTS], params, use_tqdm=False))
    tokens += token_ids(generate_one_by_one(llm, prompts[TP2_CONCURRENT_PROMPTS:], greedy(32)))
    return {"tokens": tokens, "snapshots": None if spec is None else llm.collective_rpc(worker_metrics)}


def long16k(spec: dict | None) -> dict[str, Any]:
    """A 16k-token prompt (vllm_fafo.tools.assets ``long16k``); for FAFO also its counters,
    the lane state bytes of every attention layer and vLLM's accepted tokens."""
    # One worker: all of this process's CPUs (vLLM's default binding keeps one back).
    bind_threads_to_all_cpus()
    from vllm_fafo.serving.metrics import collect_metrics, vllm_spec_counters
    from vllm_fafo.tools.assets import load_prompts, smollm2_dir

    from .engine_utils import chat_prompts, generate_one_by_one, greedy, make_llm, token_ids
    from .test_memory import layer_lane_bytes

    llm = make_llm(str(smollm2_dir()), spec, max_model_len=LONG_MODEL_LEN,
                   hf_overrides=LONG_CONTEXT_OVERRIDES,
                   kv_cache_memory_bytes=1024 * 1024 * 1024)
    prompts = chat_prompts(llm, load_prompts("long16k", LONG_PROMPTS))
    tokens = token_ids(generate_one_by_one(llm, prompts, greedy(LONG_MAX_TOKENS)))
    if spec is None:
        return {"tokens": tokens}
    return {"tokens": tokens, "metrics": collect_metrics(llm), "layer_bytes": llm.collective_rpc(layer_lane_bytes)[0],
            "accepted": vllm_spec_counters(llm)["num_accepted_tokens"],
            "max_num_seqs": llm.llm_engine.vllm_config.scheduler_config.max_num_seqs}


WINDOW = 48
WINDOWED_PROMPTS = 2
WINDOWED_MAX_TOKENS = 80


def windowed(spec: dict | None) -> dict[str, Any]:
    """MT-Bench prompts in one batch on SmolLM2 with every layer a ``WINDOW``-token
    sliding window; for FAFO also its counters and the window vLLM ran."""
    bind_threads_to_all_cpus()
    from vllm_fafo.serving.metrics import collect_metrics
    from vllm_fafo.tools.assets import load_prompts, smollm2_windowed_dir

    from .engine_utils import chat_prompts, greedy, make_llm, token_ids

    llm = make_llm(str(smollm2_windowed_dir(WINDOW)), spec)
    prompts = chat_prompts(llm, load_prompts("mtbench", WINDOWED_PROMPTS))
    tokens = token_ids(llm.generate(prompts, greedy(WINDOWED_MAX_TOKENS), use_tqdm=False))
    if spec is None:
        return {"tokens": tokens}
    return {"tokens": tokens, "metrics": collect_metrics(llm),
            "sliding_window": llm.llm_engine.model_config.hf_config.sliding_window}


PADDED_SEED0 = 990_000
"""The padded engine's sampled requests' first seed (other than every in-process configuration's)."""


def padded(spec: dict | None) -> dict[str, Any]:
    """SmolLM2 with padded drafts (tests/test_padded_engine.py): the mixed call of
    tests/mixed_workload.py (tokens by label) and FAFO's counters around it."""
    from .mixed_workload import run_mixed

    llm, workload = _smollm2_and_workload(spec)
    run = run_mixed(llm, workload)
    return {"tokens": {label: run.tokens(label) for label in run.outputs},
            "metrics_before": run.metrics_before, "metrics_after": run.metrics_after}


def sampled(spec: dict | None) -> dict[str, Any]:
    """Only the mixed call's sampled requests, after their primer (tests/test_sampling_stats.py)."""
    from .mixed_workload import is_sample, run_mixed

    llm, workload = _smollm2_and_workload(spec)
    return {"samples": run_mixed(llm, workload.keep(lambda label: label == "primer" or is_sample(label)),
                                 fafo=False).samples}


def _smollm2_and_workload(spec: dict | None):
    bind_threads_to_all_cpus()
    from vllm_fafo.tools.assets import smollm2_dir

    from .conftest import ENGINE_SAMPLES
    from .engine_utils import make_llm
    from .mixed_workload import session_workload

    llm = make_llm(str(smollm2_dir()), spec)
    return llm, session_workload(llm.get_tokenizer(), PADDED_SEED0, ENGINE_SAMPLES)


CASES = {"tp2": tp2, "long16k": long16k, "windowed": windowed, "padded": padded, "sampled": sampled}
ROOT = Path(__file__).resolve().parents[1]


def run_case(case: str, spec: dict | None, tmp_path: Path, env: dict[str, str] | None = None) -> dict:
    """``case`` with ``spec`` (None: plain vLLM), in its own process (``env`` added to
    this one's): what the test calls."""
    out = tmp_path / "out.json"
    result = subprocess.run(
        [sys.executable, "-m", "tests.engine_process", case, "none" if spec is None else json.dumps(spec), str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=1800, env={**os.environ, **(env or {})},
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    return json.loads(out.read_text())


def main() -> None:
    case, spec_arg, out_path = sys.argv[1:4]
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1"
    os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"  # collective_rpc with a function
    result = CASES[case](None if spec_arg == "none" else json.loads(spec_arg))
    with open(out_path, "w") as out:
        json.dump(result, out)


if __name__ == "__main__":
    main()
