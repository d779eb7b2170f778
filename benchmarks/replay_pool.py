"""Offline tau of pool settings: plain vLLM's greedy outputs replayed through FAFO's pool.

A matrix run keeps every cell's tokens; its ``none`` cell is what plain vLLM
decoded. Under greedy decoding a draft is accepted up to its first token that
differs from that text, so replaying the text through the proposer's own
pool code (``file_new_ngrams``, ``chain_draft``, the shared pool, and with
``"text_source": "suffix_tree"`` the suffix trees first) gives the tau
of any pool setting in seconds, without an engine: how long drafts could be,
which key length, how many candidates per key, sharing on or off. Drafts are
not cut: this is the tau the goodput controller starts from (it cuts drafts
whose tokens do not pay on the machine), and the draft tokens per step say
what the verification would cost.

    python benchmarks/replay_pool.py --cells benchmarks/results/cpu_shared_mtbench \\
        --dataset mtbench --setting 'k4={"num_speculative_tokens":4}' \\
        --setting 'k16={"num_speculative_tokens":16}'

``--cost-ms 46,12,2.5`` also runs the goodput controller as at batch 1 on a
machine whose forward costs 46 ms, 12 ms more with a draft, 2.5 ms per further
draft token (what it learned on a 2-core CPU with SmolLM2, README "Draft
length"): its cuts, the tau they leave and the simulated tokens per second.

``--vllm-suffix`` adds vLLM's own ``suffix`` method replayed the same way (its
tau equals the engine's): the reference a setting has to beat, at the same
draft tokens per forward.

Requests are replayed one after another, as the matrix's batch-1 cells send
them (the shared pool learns from the earlier ones). Lanes and the frozen
table are not replayed.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

from vllm_fafo.config import FafoConfig
from vllm_fafo.goodput import GoodputController, StepOutcome
from vllm_fafo.proposer import (
    chain_draft,
    file_new_ngrams,
    first_anchor,
    longest_match,
    request_pool,
    shared_pools,
    suffix_trees,
    tree_draft,
)
from vllm_fafo.suffix_tree import MAX_SPEC_FACTOR, MIN_TOKEN_PROB, TREE_DEPTH, require_suffix_trees


def replay(config: FafoConfig, requests: list[tuple[list[int], list[int]]],
           cost_ms: tuple[float, float, float] | None = None) -> dict[str, float]:
    """tau (tokens per forward) and draft tokens per forward of ``config``'s pool over
    (prompt ids, plain vLLM's output ids) pairs.

    With ``cost_ms`` = (step, first draft token, each further draft token) the
    goodput controller cuts the drafts as in the engine at batch 1, learning from
    a forward that costs that much, and the simulated tokens per second are
    reported too; without it drafts are kept whole."""
    shared = shared_pools(config)
    k, max_key_len = config.num_speculative_tokens, config.max_key_len
    trees = suffix_trees(config)
    controller = None if cost_ms is None else GoodputController(config.lane_len, k, longest_match(config))
    forwards = tokens = drafted = 0
    seconds = 0.0
    for index, (prompt, output) in enumerate(requests):
        pools = (request_pool(config),) if shared is None else (request_pool(config), shared.pool_for(None))
        history = np.array([*prompt, *output])  # read only up to the tokens decoded so far
        next_anchor = first_anchor(config, len(prompt))
        if trees is not None:
            trees.start(str(index), None, history[: len(prompt)])
        done, forwards = 1, forwards + 1  # the prefill's forward gives the first token
        while done < len(output):
            num_tokens = len(prompt) + done
            next_anchor = file_new_ngrams(config, pools, history, next_anchor, num_tokens, len(prompt))
            draft, key_len = [], 0
            if trees is not None:
                draft, _, key_len = tree_draft(trees, pools, None, str(index), history, num_tokens, k) or ([], [], 0)
            if not draft:
                draft, _, key_len = chain_draft(pools, None, history[num_tokens - max_key_len : num_tokens].tolist(), k)
            if controller is not None:
                draft = draft[: int(controller.choose_draft_lens(1, np.array([key_len]), np.array([len(draft)]))[0])]
            accepted = accepted_prefix(draft, output, done)
            done += min(accepted + 1, len(output) - done)
            forwards += 1
            drafted += len(draft)
            if cost_ms is not None:
                step_s = step_seconds(cost_ms, len(draft))
                seconds += step_s
                controller.observe(StepOutcome(
                    tokens=1 + len(draft), seconds=step_s, lane_tokens=0, lane_accepted=0, text_accepted=accepted,
                    draft_lengths=np.array([len(draft)]), accepted_lengths=np.array([accepted]),
                    key_lens=np.array([key_len if draft else 0]),
                ))
        if trees is not None:
            trees.stop(str(index))
        tokens += len(output)
    result = {"tau": tokens / forwards, "draft_tokens_per_forward": drafted / forwards}
    if cost_ms is not None:
        result["tokens_per_s"] = tokens / seconds  # the prefills' forwards are not priced
    return result


def accepted_prefix(draft: list[int], output: list[int], done: int) -> int:
    """Draft tokens greedy verification accepts after ``output[:done]``."""
    accepted = 0
    while accepted < len(draft) and done + accepted < len(output) and draft[accepted] == output[done + accepted]:
        accepted += 1
    return accepted


def step_seconds(cost_ms: tuple[float, float, float], draft_len: int) -> float:
    """A forward's synthetic cost with ``draft_len`` draft tokens."""
    return (cost_ms[0] + (cost_ms[1] + cost_ms[2] * (draft_len - 1) if draft_len else 0.0)) / 1000


def replay_vllm_suffix(requests: list[tuple[list[int], list[int]]],
                       cost_ms: tuple[float, float, float] | None = None) -> dict[str, float]:
    """The same figures for vLLM's own ``suffix`` method, the reference to beat: Arctic
    Inference's cache with vLLM 0.32.0's defaults (trees 24 deep, 10,000 answers kept,
    up to 24 draft tokens, at most one per matched token, cut below an estimated 0.1),
    fed and asked as vLLM's ``SuffixDecodingProposer`` does; its drafts are never cut
    by a controller. (On a matrix run's batch-1 cells its tau equals the engine's.)"""
    cache = require_suffix_trees()(max_tree_depth=TREE_DEPTH, max_cached_requests=10000)
    forwards = tokens = drafted = 0
    seconds = 0.0
    for index, (prompt, output) in enumerate(requests):
        req_id, history = str(index), np.array([*prompt, *output], dtype=np.int32)
        cache.start_request(req_id, history[: len(prompt)])
        cache.add_active_response(req_id, history[len(prompt) : len(prompt) + 1])  # the prefill's token
        done, forwards = 1, forwards + 1
        while done < len(output):
            num_tokens = len(prompt) + done
            draft = cache.speculate(req_id, history[max(0, num_tokens - TREE_DEPTH) : num_tokens],
                                    max_spec_tokens=TREE_DEPTH, max_spec_factor=MAX_SPEC_FACTOR,
                                    min_token_prob=MIN_TOKEN_PROB).token_ids
            accepted = min(accepted_prefix(draft, output, done) + 1, len(output) - done)
            cache.add_active_response(req_id, history[num_tokens : num_tokens + accepted])
            done, forwards, drafted = done + accepted, forwards + 1, drafted + len(draft)
            seconds += 0.0 if cost_ms is None else step_seconds(cost_ms, len(draft))
        cache.stop_request(req_id)
        tokens += len(output)
    result = {"tau": tokens / forwards, "draft_tokens_per_forward": drafted / forwards}
    if cost_ms is not None:
        result["tokens_per_s"] = tokens / seconds
    return result


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
    parser.add_argument("--setting", action="append", default=[],
                        help='LABEL=JSON of fafo keys, e.g. k16={"num_speculative_tokens":16} (repeatable)')
    parser.add_argument("--vllm-suffix", action="store_true",
                        help="also replay vLLM's own suffix method (needs arctic-inference), the reference")
    parser.add_argument("--cost-ms", default=None,
                        help="STEP,FIRST,PER: cut drafts with the goodput controller on this synthetic step cost")
    args = parser.parse_args()
    cost_ms = None if args.cost_ms is None else tuple(float(v) for v in args.cost_ms.split(","))
    if cost_ms is not None and len(cost_ms) != 3:
        parser.error(f"--cost-ms {args.cost_ms!r}: need three numbers, STEP,FIRST,PER (milliseconds)")
    requests = load_requests(Path(args.cells), args.dataset)
    print(f"{args.dataset}: {len(requests)} requests, {sum(len(o) for _, o in requests)} tokens of plain vLLM's output")
    cut = "uncut" if cost_ms is None else f"cut by the controller at {args.cost_ms} ms"
    print(f"| setting | tau (drafts {cut}) | draft tokens per forward |" + (" simulated tokens/s |" if cost_ms else ""))
    print("|---|---|---|" + ("---|" if cost_ms else ""))
    def row(label: str, result: dict[str, float]) -> None:
        print(f"| {label} | {result['tau']:.3f} | {result['draft_tokens_per_forward']:.2f} |"
              + (f" {result['tokens_per_s']:.1f} |" if cost_ms else ""))

    if args.vllm_suffix:
        row("vLLM suffix (its own cuts)", replay_vllm_suffix(requests, cost_ms))
    for entry in args.setting:
        label, _, raw = entry.partition("=")
        config = FafoConfig.from_user_dict({"method": "fafo", **json.loads(raw or "{}")})
        row(label, replay(config, requests, cost_ms))


if __name__ == "__main__":
    main()
