"""Mean accepted tokens per step (tau) of plain vLLM, vLLM ngram and FAFO.

Batch 1, greedy, fp32 on the small real model; every method decodes the
same prompts in the same run, each with its engine built once. tau is
decoded tokens / target forward steps = tokens / (tokens - accepted drafts),
which does not depend on the hardware. Wall-clock figures from a CPU machine
are printed too but say little about GPU speed.

    python benchmarks/tau.py --num-prompts 20 --max-tokens 256
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import time
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

NGRAM_SPEC = {
    "method": "ngram",
    "num_speculative_tokens": 4,
    "prompt_lookup_min": 2,
    "prompt_lookup_max": 4,
}


def method_specs(fafo_json: str) -> dict[str, dict | None]:
    return {"none": None, "ngram": NGRAM_SPEC, "fafo": json.loads(fafo_json)}


def run_method(name: str, spec: dict | None, texts: list[str], args) -> dict:
    from tqdm import tqdm
    from vllm import LLM, SamplingParams

    from vllm_fafo.assets import chat_prompt, smollm2_dir
    from vllm_fafo.metrics import collect_metrics, vllm_spec_counters

    llm = LLM(
        model=str(smollm2_dir()),
        dtype="float32",
        enforce_eager=True,
        seed=0,
        max_model_len=args.max_model_len,
        disable_log_stats=False,
        kv_cache_memory_bytes=512 * 1024 * 1024,
        speculative_config=spec,
    )
    tokenizer = llm.get_tokenizer()
    prompts = [chat_prompt(tokenizer, t) for t in texts]
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    llm.generate(prompts[:1], SamplingParams(temperature=0.0, max_tokens=8), use_tqdm=False)
    before = vllm_spec_counters(llm)["num_accepted_tokens"] if spec else 0.0
    outputs, start = [], time.perf_counter()
    for prompt in tqdm(prompts, desc=name, unit="prompt"):
        outputs.append(llm.generate([prompt], params, use_tqdm=False)[0])
    elapsed = time.perf_counter() - start
    accepted = (vllm_spec_counters(llm)["num_accepted_tokens"] - before) if spec else 0.0
    tokens = [list(o.outputs[0].token_ids) for o in outputs]
    num_tokens = sum(map(len, tokens))
    result = {
        "method": name,
        "config": spec,
        "tokens": num_tokens,
        "accepted": int(accepted),
        "tau": num_tokens / (num_tokens - accepted),
        "seconds": elapsed,
        "tokens_per_s": num_tokens / elapsed,
        "token_ids": tokens,
    }
    if name == "fafo":
        result["fafo_metrics"] = collect_metrics(llm)
    del llm
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--methods", default="none,ngram,fafo")
    parser.add_argument("--dataset", default="mtbench")
    parser.add_argument("--num-prompts", type=int, default=20)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--fafo-config", default='{"method": "fafo"}')
    parser.add_argument("--out", default="benchmarks/results")
    args = parser.parse_args()

    import torch
    import vllm

    from vllm_fafo.assets import load_prompts

    texts = load_prompts(args.dataset, args.num_prompts)
    specs = method_specs(args.fafo_config)
    results = [run_method(m, specs[m], texts, args) for m in args.methods.split(",")]
    plain = next((r for r in results if r["method"] == "none"), None)
    print(f"\n{args.dataset}, {len(texts)} prompts x {args.max_tokens} tokens, batch 1, greedy, fp32")
    print("| method | tau | tokens/s (this machine) | identical to plain |")
    print("|---|---|---|---|")
    for r in results:
        same = "n/a" if plain is None else str(r["token_ids"] == plain["token_ids"])
        r["identical_to_plain"] = same
        print(f"| {r['method']} | {r['tau']:.3f} | {r['tokens_per_s']:.1f} | {same} |")
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip()
    record = {
        "args": vars(args), "machine": platform.machine(), "processor": platform.processor(),
        "commit": commit, "vllm": vllm.__version__, "torch": torch.__version__,
        "results": results,
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"tau_{args.dataset}_{int(time.time())}.json"
    path.write_text(json.dumps(record))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
