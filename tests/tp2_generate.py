"""Runs one engine at ``tensor_parallel_size=2`` in its own process (tests/test_tp_engine.py).

Usage: ``python -m tests.tp2_generate SPEC_JSON_OR_none OUT_JSON``. Writes the greedy
tokens of MT-Bench prompts (concurrent, different lengths; then two at batch 1) and,
for FAFO, every rank's proposer snapshot.
"""

from __future__ import annotations

import json
import os
import sys

CONCURRENT_PROMPTS = 4
BATCH1_PROMPTS = 2


def threads_bind() -> str:
    """Half of this process's CPUs to each of the two workers, e.g. ``0|1`` (vLLM's
    CPU backend cannot bind two workers on one NUMA node by itself)."""
    cpus = sorted(os.sched_getaffinity(0))
    half = max(1, len(cpus) // 2)
    return "|".join(",".join(map(str, part)) for part in (cpus[:half], cpus[half:] or cpus[:half]))


def main() -> None:
    spec_arg, out_path = sys.argv[1:3]
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1"
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", threads_bind())
    os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"  # collective_rpc with a function
    from vllm_fafo.assets import load_prompts, smollm2_tp2_dir
    from vllm_fafo.metrics import worker_metrics

    from .engine_utils import chat_prompts, generate_one_by_one, greedy, make_llm, token_ids

    spec = None if spec_arg == "none" else json.loads(spec_arg)
    llm = make_llm(str(smollm2_tp2_dir()), spec, tensor_parallel_size=2, distributed_executor_backend="mp",
                   kv_cache_memory_bytes=256 * 1024 * 1024)
    prompts = chat_prompts(llm, load_prompts("mtbench", CONCURRENT_PROMPTS + BATCH1_PROMPTS))
    params = [greedy(48 + 16 * i) for i in range(CONCURRENT_PROMPTS)]
    tokens = token_ids(llm.generate(prompts[:CONCURRENT_PROMPTS], params, use_tqdm=False))
    tokens += token_ids(generate_one_by_one(llm, prompts[CONCURRENT_PROMPTS:], greedy(48)))
    snapshots = None if spec is None else llm.collective_rpc(worker_metrics)
    with open(out_path, "w") as out:
        json.dump({"tokens": tokens, "snapshots": snapshots}, out)


if __name__ == "__main__":
    main()
