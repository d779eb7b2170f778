"""Where an engine's memory grows under repeated batches: RSS after each round of requests,
before and after glibc's ``malloc_trim`` (what the allocator holds free is given back, so
what stays is live memory).

One in-process engine (no API server, no engine process), rounds of ``--batch`` MT-Bench
chat prompts, half greedy and half sampled, ``--max-tokens`` each. Growth after the trim
that plain vLLM does not show is what a speculative method keeps alive; set environment
variables around the command to test a cause (``ONEDNN_PRIMITIVE_CACHE_CAPACITY``,
``MALLOC_MMAP_THRESHOLD_``).

    python benchmarks/memory_probe.py --speculative-config none
    python benchmarks/memory_probe.py --speculative-config '{"method": "fafo"}'
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--speculative-config", default='{"method": "fafo"}',
                        help="JSON speculative config, or 'none' for plain vLLM")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--batch", type=int, default=48, help="requests per round")
    parser.add_argument("--max-num-seqs", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=128)
    args = parser.parse_args()
    for name in ("rounds", "batch", "max_num_seqs", "max_tokens"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    spec = None if args.speculative_config == "none" else json.loads(args.speculative_config)
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the whole engine in this process
    import psutil
    from vllm import LLM, SamplingParams

    from vllm_fafo.tools.assets import chat_prompt, load_prompts, smollm2_dir, smollm2_prior_table

    if spec and spec.get("method") == "fafo":
        smollm2_prior_table()
    llm = LLM(model=str(smollm2_dir()), dtype="float32", enforce_eager=True, seed=0, max_model_len=1024,
              kv_cache_memory_bytes=256 << 20, speculative_config=spec, max_num_seqs=args.max_num_seqs)
    prompts = [chat_prompt(llm.get_tokenizer(), text) for text in load_prompts("mtbench")]
    libc = ctypes.CDLL("libc.so.6")
    process = psutil.Process()
    llm.generate(prompts[:4], SamplingParams(temperature=0.0, max_tokens=8), use_tqdm=False)  # warm-up
    print(f"speculative config: {json.dumps(spec)}")
    print("| round | seconds | RSS MiB | after malloc_trim MiB |\n|---|---|---|---|")
    for round_index in range(args.rounds):
        batch = [prompts[(round_index * args.batch + i) % len(prompts)] for i in range(args.batch)]
        params = [SamplingParams(temperature=0.0 if i % 2 else 0.8, max_tokens=args.max_tokens)
                  for i in range(args.batch)]
        start = time.monotonic()
        llm.generate(batch, params, use_tqdm=False)
        seconds = time.monotonic() - start
        gc.collect()
        before = process.memory_info().rss / 2**20
        libc.malloc_trim(0)
        after = process.memory_info().rss / 2**20
        print(f"| {round_index} | {seconds:.0f} | {before:.1f} | {after:.1f} |", flush=True)


if __name__ == "__main__":
    main()
