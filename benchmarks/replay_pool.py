"""Offline tau of pool settings: plain vLLM's greedy outputs replayed through FAFO's pool.

A matrix run keeps every cell's tokens; its ``none`` cell is what plain vLLM
decoded. Under greedy decoding a draft is accepted up to its first token that
differs from that text, so replaying the text through the proposer's own
pool code (``file_ngrams``, ``chain_draft``, the shared pool) gives the tau of
any pool setting in seconds, without an engine: how long drafts could be,
which key length, how many candidates per key, sharing on or off. Drafts are
not cut: this is the tau the goodput controller starts from (it cuts drafts
whose tokens do not pay on the machine), and the draft tokens per step say
what the verification would cost.

    python benchmarks/replay_pool.py --cells benchmarks/results/cpu_shared_mtbench \\
        --dataset mtbench --setting 'k4={"num_speculative_tokens":4}' \\
        --setting 'k16={"num_speculative_tokens":16}'

Requests are replayed one after another, as the matrix's batch-1 cells send
them (the shared pool learns from the earlier ones).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from vllm_fafo.config import FafoConfig
from vllm_fafo.pool import NgramPool
from vllm_fafo.proposer import chain_draft, file_ngrams
from vllm_fafo.shared_pool import TenantPools


def replay(config: FafoConfig, requests: list[tuple[list[int], list[int]]]) -> dict[str, float]:
    """tau (tokens per forward) and draft tokens per forward of ``config``'s pool over
    (prompt ids, plain vLLM's output ids) pairs."""
    shared = TenantPools(config.max_key_len, config.pool_capacity, min_key_len=config.min_key_len,
                         max_keys=config.shared_pool_keys, max_tenants=config.shared_pool_tenants,
                         touch_on_lookup=config.touch_on_lookup) if config.share_pool else None
    k, max_key_len = config.num_speculative_tokens, config.max_key_len
    forwards = tokens = drafted = 0
    for prompt, output in requests:
        own = NgramPool(max_key_len, config.pool_capacity, min_key_len=config.min_key_len,
                        max_keys=config.max_keys, touch_on_lookup=config.touch_on_lookup)
        pools = (own,) if shared is None else (own, shared.pool_for(None))
        history, next_anchor = [*prompt, output[0]], 0
        done, forwards = 1, forwards + 1  # the prefill's forward gives the first token
        while done < len(output):
            stop_anchor = len(history) - config.ngram_len
            if stop_anchor > next_anchor:
                offset = max(0, next_anchor + 1 - max_key_len)
                file_ngrams(pools, history[offset:], offset, range(next_anchor, stop_anchor),
                            config.ngram_len, len(prompt))
                next_anchor = stop_anchor
            draft, _, _ = chain_draft(pools, None, history[-max_key_len:], k)
            accepted = 0
            while (accepted < len(draft) and done + accepted < len(output)
                   and draft[accepted] == output[done + accepted]):
                accepted += 1
            step = min(accepted + 1, len(output) - done)
            history += output[done : done + step]
            done += step
            forwards += 1
            drafted += len(draft)
        tokens += len(output)
    return {"tau": tokens / forwards, "draft_tokens_per_forward": drafted / forwards}


def load_requests(cells: Path, dataset: str) -> list[tuple[list[int], list[int]]]:
    """The prompts (token ids, as the engine saw them) and plain vLLM's outputs of a
    matrix run's batch-1 ``none`` cell."""
    from transformers import AutoTokenizer

    from vllm_fafo.assets import chat_prompt, load_prompts, smollm2_dir

    cell = json.loads((cells / "cells" / f"none__{dataset}__b1.json").read_text())
    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir())
    texts = load_prompts(dataset, cell["prompts"])
    prompts = [tokenizer(chat_prompt(tokenizer, text))["input_ids"] for text in texts]
    return list(zip(prompts, cell["token_ids"]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cells", required=True, help="a matrix.py --out folder with a batch-1 none cell")
    parser.add_argument("--dataset", required=True)
    parser.add_argument("--setting", action="append", required=True,
                        help='LABEL=JSON of fafo keys, e.g. k16={"num_speculative_tokens":16} (repeatable)')
    args = parser.parse_args()
    requests = load_requests(Path(args.cells), args.dataset)
    print(f"{args.dataset}: {len(requests)} requests, {sum(len(o) for _, o in requests)} tokens of plain vLLM's output")
    print("| setting | tau (drafts uncut) | draft tokens per forward |")
    print("|---|---|---|")
    for entry in args.setting:
        label, _, raw = entry.partition("=")
        config = FafoConfig.from_user_dict({"method": "fafo", **json.loads(raw or "{}")})
        result = replay(config, requests)
        print(f"| {label} | {result['tau']:.3f} | {result['draft_tokens_per_forward']:.2f} |")


if __name__ == "__main__":
    main()
