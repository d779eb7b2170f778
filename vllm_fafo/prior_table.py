"""The target's own guess of what follows each token, built once per model.

Where the text's last token has never been followed by anything (not in the
request's text, not in its tenant's earlier answers) the pools and the text
have no candidate: 629 of 2,406 steps of the MT-Bench replay (README "Prior
table"). The prior table answers there: for every token ``t`` of the
vocabulary, the target's greedy continuation of ``width`` tokens after a
short chat turn whose answer begins with ``t`` (:func:`answer_prefix`). Drafts from it are verified like any other, so a wrong
guess costs only its verification tokens.

Built by vLLM itself (one greedy ``generate`` over the vocabulary, so any model
vLLM serves), into the plugin's cache, where ``"prior_table": "auto"`` (the
default) finds it::

    vllm-fafo-prior-table --model MODEL [--width 4] [--out PATH] [vLLM engine flags as JSON]

A table is ``vocabulary x width`` int32 (-1 after a continuation that stopped
early): 786 KiB for a 49,152-token vocabulary at width 4.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import time
from pathlib import Path
from typing import Any

import numpy as np

from vllm_fafo.errors import FafoConfigError
from vllm_fafo.log import init_logger
from vllm_fafo.pool import Candidate, Match, Origin

logger = init_logger(__name__)

FORMAT = "vllm-fafo-prior-table/1"
AUTO = "auto"
OFF = "off"
DEFAULT_WIDTH = 4
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


class PriorTable:
    """Read-only: token -> the target's continuation after it (:mod:`vllm_fafo.prior_table`)."""

    def __init__(self, rows: np.ndarray) -> None:
        if rows.ndim != 2 or rows.dtype != np.int32:
            raise ValueError(f"a prior table is a 2-D int32 array, got {rows.dtype} {rows.shape}")
        self._rows = rows
        stopped = rows < 0
        self._lengths = np.where(stopped.any(axis=1), stopped.argmax(axis=1), rows.shape[1])

    @property
    def vocab_size(self) -> int:
        return len(self._rows)

    @property
    def width(self) -> int:
        return self._rows.shape[1]

    def continuation(self, token: int) -> Candidate:
        """The target's continuation after ``token`` (empty for a token outside the table)."""
        if not 0 <= token < len(self._rows):
            return ()
        return tuple(self._rows[token, : self._lengths[token]].tolist())

    def match(self, context: list[int]) -> Match | None:
        """:func:`vllm_fafo.pool.match_pools`'s answer for the text's last token: found
        under a key of 0 tokens of the text (the goodput controller's bucket for drafts
        not found in the text, as the runner-up tokens')."""
        candidate = self.continuation(context[-1]) if context else ()
        return Match(candidate, Origin.PRIOR, 0) if candidate else None


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


def default_path(model: str) -> Path:
    """Where ``auto`` looks for ``model``'s table: the plugin's cache, by the model's name
    as vLLM was given it (a local folder: by its absolute path)."""
    from vllm_fafo.assets import cache_dir

    local = Path(model).expanduser()
    model = str(local.resolve()) if local.is_dir() else model  # one table however a folder is spelled
    name = Path(model.rstrip("/")).name or "model"
    digest = hashlib.sha256(model.encode()).hexdigest()[:12]
    return cache_dir() / "prior_tables" / f"{name}-{digest}.npz"


def save_table(path: Path, rows: np.ndarray, model: str, prefix: list[int]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp.npz")
    np.savez(tmp, rows=rows, prefix=np.asarray(prefix, np.int32),
             meta=np.asarray(json.dumps({"format": FORMAT, "model": model})))
    tmp.replace(path)


def load_table(path: Path, vocab_size: int) -> PriorTable:
    """A built table; errors name the config key, the file and the fix."""
    fix = "build one with vllm-fafo-prior-table --model MODEL --out PATH"
    try:
        with np.load(path) as data:
            meta = json.loads(str(data["meta"]))
            rows = data["rows"]
    except (OSError, ValueError, KeyError) as error:
        raise FafoConfigError(f"speculative_config['prior_table']={str(path)!r} cannot be read as a prior "
                              f"table ({error}); {fix}") from None
    if meta.get("format") != FORMAT:
        raise FafoConfigError(f"speculative_config['prior_table']={str(path)!r} is not a {FORMAT} file; {fix}")
    if len(rows) != vocab_size:
        raise FafoConfigError(f"speculative_config['prior_table']={str(path)!r} covers {len(rows)} tokens, but "
                              f"this model's vocabulary has {vocab_size} (built for {meta.get('model')!r}); {fix}")
    return PriorTable(rows)


def check_setting(setting: Any) -> None:
    """``prior_table`` is ``auto``, ``off`` or the path of an existing file."""
    if not isinstance(setting, str) or not setting:
        raise FafoConfigError(f"speculative_config['prior_table']={setting!r} must be {AUTO!r}, {OFF!r} "
                              "or the path of a table built by vllm-fafo-prior-table")
    if setting not in (AUTO, OFF) and not Path(setting).is_file():
        raise FafoConfigError(f"speculative_config['prior_table']={setting!r}: no such file; allowed: {AUTO!r}, "
                              f"{OFF!r} or the path of a table built by vllm-fafo-prior-table")


def resolve(setting: str, model: str, vocab_size: int) -> PriorTable | None:
    """The table ``prior_table`` names for this engine: ``off`` none; ``auto`` the one
    built for ``model`` into the cache, if there is one (said in the log either way);
    else the file at that path."""
    if setting == OFF:
        return None
    if setting == AUTO:
        path = default_path(model)
        if not path.exists():
            logger.warning("vllm-fafo: no prior table for %s (looked for %s): where the text has no candidate "
                           "the draft stays empty; `vllm-fafo-prior-table --model %s` builds one", model, path, model)
            return None
        table = load_table(path, vocab_size)
        logger.info("vllm-fafo: prior table %s (%d tokens x %d)", path, table.vocab_size, table.width)
        return table
    return load_table(Path(setting), vocab_size)


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
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="the model as vLLM is given it (name or path)")
    parser.add_argument("--out", help="default: where \"prior_table\": \"auto\" looks for this model's table")
    parser.add_argument("--width", type=int, default=DEFAULT_WIDTH, help="tokens of continuation per token")
    parser.add_argument("--engine-args", default="{}",
                        help=f"vllm.LLM keyword arguments as JSON, over {json.dumps(BUILD_ENGINE_ARGS)}")
    args = parser.parse_args(argv)
    if not 1 <= args.width <= 64:
        parser.error(f"--width {args.width}: allowed 1..64")
    from vllm import LLM

    llm = LLM(model=args.model, **{**BUILD_ENGINE_ARGS, **json.loads(args.engine_args)})
    rows, prefix = build_rows(llm, args.width)
    out = Path(args.out) if args.out else default_path(args.model)
    save_table(out, rows, args.model, prefix)
    print(f"prior table of {len(rows)} tokens x {args.width} -> {out}")


if __name__ == "__main__":
    main()
