"""Build a Cacheback frozen table (:mod:`vllm_fafo.drafting.frozen_table`) from a corpus::

    vllm-fafo-frozen-table --model MODEL_DIR --out table.json --dataset mtbench
    vllm-fafo-frozen-table --model MODEL_DIR --out table.json corpus/*.txt
"""

from __future__ import annotations

import argparse
import json
from collections import Counter, defaultdict
from collections.abc import Iterable, Sequence
from pathlib import Path

from vllm_fafo.drafting.frozen_table import FORMAT


def build_table(
    documents: Iterable[Sequence[int]],
    leader_len: int,
    follower_len: int,
    leader_capacity: int,
    follower_capacity: int,
) -> list[tuple[list[int], list[list[int]]]]:
    """(leader, followers least frequent first) for the most frequent leaders."""
    leaders: Counter = Counter()
    followers: defaultdict[tuple, Counter] = defaultdict(Counter)
    for tokens in documents:
        tokens = list(tokens)
        for start in range(len(tokens) - leader_len + 1):
            leader = tuple(tokens[start : start + leader_len])
            leaders[leader] += 1
            follower = tuple(tokens[start + leader_len : start + leader_len + follower_len])
            if len(follower) == follower_len:
                followers[leader][follower] += 1
    table = []
    for leader, _ in leaders.most_common(leader_capacity):
        top = followers[leader].most_common(follower_capacity)
        if top:
            table.append((list(leader), [list(f) for f, _ in reversed(top)]))
    return table


def save_table(path: Path, table, leader_len: int, follower_len: int, tokenizer: str) -> None:
    path.write_text(json.dumps({
        "format": FORMAT, "leader_len": leader_len, "follower_len": follower_len,
        "tokenizer": tokenizer, "entries": table,
    }))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Build a Cacheback frozen table from a corpus")
    parser.add_argument("files", nargs="*", help="UTF-8 text files, one document each")
    parser.add_argument("--dataset", help="a bundled prompt set as the corpus (mtbench, humaneval, gsm8k)")
    parser.add_argument("--model", help="tokenizer folder; default: the SmolLM2 built by vllm_fafo.tools.assets")
    parser.add_argument("--out", required=True)
    parser.add_argument("--leader-len", type=int, default=1)
    parser.add_argument("--follower-len", type=int, default=3)
    parser.add_argument("--leader-capacity", type=int, default=1 << 20)
    parser.add_argument("--follower-capacity", type=int, default=128)
    args = parser.parse_args(argv)
    if not args.files and not args.dataset:
        parser.error("give text files or --dataset")

    from transformers import AutoTokenizer

    from vllm_fafo.tools.assets import load_prompts, smollm2_dir

    model = args.model or str(smollm2_dir())
    tokenizer = AutoTokenizer.from_pretrained(model)
    texts = [Path(f).read_text(encoding="utf-8") for f in args.files]
    if args.dataset:
        texts += load_prompts(args.dataset)
    documents = [tokenizer(text, add_special_tokens=False)["input_ids"] for text in texts]
    table = build_table(documents, args.leader_len, args.follower_len,
                        args.leader_capacity, args.follower_capacity)
    save_table(Path(args.out), table, args.leader_len, args.follower_len, model)
    print(f"{len(table)} leaders from {len(documents)} documents -> {args.out}")


if __name__ == "__main__":
    main()
