"""Build a model's prior table (:mod:`vllm_fafo.drafting.prior_table`) with vLLM itself::

    vllm-fafo-prior-table --model MODEL [--width 2] [--out PATH] [--engine-args JSON]
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from typing import Any

import numpy as np

from vllm_fafo.drafting.prior_table import DEFAULT_WIDTH, default_path, save_table

PRIMER_MESSAGE = "Hi! Can you help me with something?"
"""The user message before each token of the build: the answer then begins with that token."""

BUILD_ENGINE_ARGS: dict[str, Any] = {
    "block_size": 32, "enable_prefix_caching": True, "max_model_len": 256, "max_num_seqs": 1024,
    "max_num_batched_tokens": 8192, "kv_cache_memory_bytes": 2 << 30,
}
"""The build's engine: blocks small enough (vLLM's CPU attention allows multiples of 32)
that :func:`answer_prefix` fills whole ones and the prefix cache computes it once (on a
2-core CPU 7x faster than SmolLM2's default 128-token blocks), many prompts at a time,
a KV cache of 2 GiB (the prompts are short)."""


def answer_prefix(tokenizer: Any, block_size: int = 1) -> list[int]:
    """What each prompt of the build starts with: the model's chat template rendered for
    one short user message up to where the answer begins (SmolLM2: ``...<|im_start|>user
    \nHi<|im_end|>\n<|im_start|>assistant\n``), cut from the front to a whole number of
    ``block_size``-token blocks where it is that long, so that vLLM's prefix cache holds
    all of it and each prompt computes its last token only. Without a chat template: the
    beginning-of-sequence token if the model has one."""
    if not getattr(tokenizer, "chat_template", None):
        bos = getattr(tokenizer, "bos_token_id", None)
        return [] if bos is None else [bos]
    text = tokenizer.apply_chat_template([{"role": "user", "content": PRIMER_MESSAGE}],
                                         add_generation_prompt=True, tokenize=False)
    tokens = tokenizer(text, add_special_tokens=False)["input_ids"]
    whole_blocks = len(tokens) // block_size * block_size
    return tokens[len(tokens) - whole_blocks :] if whole_blocks else tokens


def build_rows(llm: Any, width: int, batch: int = 8192, progress: bool = True,
               tokens: range | None = None) -> tuple[np.ndarray, list[int]]:
    """Every token's (or only ``tokens``') greedy continuation of ``width`` tokens after
    :func:`answer_prefix`, by ``llm`` (a ``vllm.LLM``), and that prefix."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    prefix = answer_prefix(llm.get_tokenizer(), llm.llm_engine.vllm_config.cache_config.block_size)
    vocab_size = llm.llm_engine.model_config.get_vocab_size()
    params = SamplingParams(temperature=0.0, max_tokens=width, detokenize=False)
    rows = np.full((vocab_size, width), -1, np.int32)
    tokens = range(vocab_size) if tokens is None else tokens
    started = time.monotonic()
    for first in range(0, len(tokens), batch):
        chunk = tokens[first : first + batch]
        outputs = llm.generate([TokensPrompt(prompt_token_ids=[*prefix, t]) for t in chunk], params, use_tqdm=False)
        for token, output in zip(chunk, outputs):
            continuation = list(output.outputs[0].token_ids)[:width]
            rows[token, : len(continuation)] = continuation
        if progress:
            print(f"prior table: {first + len(chunk)} of {len(tokens)} tokens, {time.monotonic() - started:.0f} s",
                  flush=True)
    return rows, prefix


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Build a model's prior table with vLLM")
    parser.add_argument("--model", required=True, help="the model as vLLM is given it (name or path)")
    parser.add_argument("--out", help="default: where \"prior_table\": \"auto\" looks for this model's table")
    parser.add_argument("--width", type=int, default=DEFAULT_WIDTH, help="tokens of continuation per token")
    parser.add_argument("--engine-args", default="{}",
                        help=f"vllm.LLM keyword arguments as JSON, over {json.dumps(BUILD_ENGINE_ARGS)}")
    args = parser.parse_args(argv)
    if not 1 <= args.width <= 64:
        parser.error(f"--width {args.width}: allowed 1..64")
    # The engine in this process, as the tests and benchmarks run it: with its core in a
    # process of its own, one build (2-core CPU) wrote its table and then never exited.
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from vllm import LLM

    llm = LLM(model=args.model, **{**BUILD_ENGINE_ARGS, **json.loads(args.engine_args)})
    rows, prefix = build_rows(llm, args.width)
    out = Path(args.out) if args.out else default_path(args.model)
    save_table(out, rows, args.model, prefix)
    print(f"prior table of {len(rows)} tokens x {args.width} -> {out}")


if __name__ == "__main__":
    main()
