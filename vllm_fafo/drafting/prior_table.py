"""The target's own guess of what follows each token, built once per model.

Where the text's last token has never been followed by anything (not in the
request's text, not in its tenant's earlier answers) the pools and the text
have no candidate: 629 of 2,406 steps of the MT-Bench replay (docs/results/draft-sources.md "The prior
table"). The prior table answers there: for every token ``t`` of the
vocabulary, the target's greedy continuation of ``width`` tokens after a
short chat turn whose answer begins with ``t``. Drafts from it are verified like any other, so a wrong
guess costs only its verification tokens.

Built by vLLM itself (one greedy ``generate`` over the vocabulary, so any model
vLLM serves; :mod:`vllm_fafo.tools.build_prior_table`), into the plugin's cache,
where ``"prior_table": "auto"`` (the default) finds it::

    vllm-fafo-prior-table --model MODEL [--width 2] [--out PATH] [--engine-args JSON]

A table is ``vocabulary x width`` int32 (-1 after a continuation that stopped
early): 384 KiB for a 49,152-token vocabulary at width 2.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import numpy as np

from vllm_fafo.cache import cache_dir
from vllm_fafo.drafting.pool import Candidate
from vllm_fafo.errors import FafoConfigError
from vllm_fafo.log import init_logger

logger = init_logger(__name__)

FORMAT = "vllm-fafo-prior-table/1"
AUTO = "auto"
OFF = "off"
DEFAULT_WIDTH = 2
"""Tokens of continuation per token. The pool chains on after the table's first
tokens: in replay widths 1-4 left tau within 0.4 % of each other on MT-Bench, HumanEval
and GSM8K, and width 2 within 0.15 % of 4; its build took 331 s on a 2-core CPU
(width 1: 241 s), where width 4's took about 7.5 minutes of a CI set-up
(docs/results/draft-sources.md "Prior table width")."""





class PriorTable:
    """Read-only: token -> the target's continuation after it (:mod:`vllm_fafo.drafting.prior_table`)."""

    def __init__(self, rows: np.ndarray) -> None:
        if rows.ndim != 2 or rows.dtype != np.int32:
            raise ValueError(f"a prior table is a 2-D int32 array, got {rows.dtype} {rows.shape}")
        self._rows = rows
        stopped = rows < 0
        self._lengths = np.where(stopped.any(axis=1), stopped.argmax(axis=1), rows.shape[1])

    @property
    def rows(self) -> np.ndarray:
        """``vocabulary x width`` int32, -1 after a continuation that stopped early."""
        return self._rows

    @property
    def lengths(self) -> np.ndarray:
        """Each token's continuation's length."""
        return self._lengths

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


def default_path(model: str) -> Path:
    """Where ``auto`` looks for ``model``'s table: the plugin's cache, by the model's name
    as vLLM was given it (a local folder: by its absolute path)."""
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
