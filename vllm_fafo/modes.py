"""The ancestors as modes: ``lookahead`` and ``cacheback`` on FAFO's parts.

Each mode is a small user-facing config that validates its own keys and
maps onto :class:`~vllm_fafo.config.FafoConfig`, so all three methods run the
same proposer, pool, lanes, metrics and runner patches:

- ``lookahead`` (Lookahead Decoding, Sec. 3, Alg. 1): W lanes of N-1 tokens
  staggered like the 2D window's diagonals, attending to the full KV cache
  (compression ``none``), n-grams filed from the lanes only, under the single
  token that precedes them, at most G per key.
- ``cacheback`` (Cacheback, Sec. 3): no lanes; leader/follower LRU tables
  seeded from the prompt and updated from accepted tokens with a sliding
  window, plus an optional frozen table built offline.

Where the papers verify several candidates (Lookahead's G guesses,
Cacheback's draft tree), the mode drafts a chain for vLLM's own verification
(the most recently inserted candidate under the key, extended by further
lookups while the chain has room) and, with ``num_candidates`` > 1, verifies
up to ``num_candidates - 1`` of the key's other candidates in the same
forward as branches of a draft tree (:mod:`vllm_fafo.verification.draft_tree`); with the
default 1, the chain alone.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from vllm_fafo.config import METHOD, FafoConfig, user_settings
from vllm_fafo.errors import FafoConfigError, check_bool, check_int, unknown_key


def _read_keys(cls, method: str, raw: dict[str, Any]):
    """``cls(**keys)`` after refusing unknown keys, naming the allowed ones."""
    settings = user_settings(raw)
    settings.pop("method", None)
    allowed = [f.name for f in dataclasses.fields(cls)]
    for key in settings:
        if key not in allowed:
            raise unknown_key(key, method, allowed)
    return cls(**settings)


@dataclass(frozen=True)
class LookaheadConfig:
    """Defaults: Lookahead's Table 1 setting for its smallest (7B) models,
    W=15, N=5, G=15; the paper shrinks W and G as models grow, and the
    models this plugin is tested on are smaller still."""

    window: int = 15
    """W: lanes (columns of the 2D window) per request."""
    ngram: int = 5
    """N: n-gram size; lanes hold N-1 tokens and drafts are N-1 tokens."""
    guesses: int = 15
    """G: candidates kept per key (the last token)."""
    max_lane_requests: int = 8
    """Requests that run lanes at once (see ``fafo``)."""
    num_candidates: int = 1
    """Guesses verified per step: the newest as the chain, up to ``num_candidates - 1``
    others as branches (vllm_fafo.verification.draft_tree); the paper verifies all G."""

    def validate(self) -> None:
        check_int("window", self.window, 1, 256)
        check_int("ngram", self.ngram, 3, 33)
        check_int("guesses", self.guesses, 1, 4096)
        check_int("max_lane_requests", self.max_lane_requests, 1, 1024)
        check_int("num_candidates", self.num_candidates, 1, 64)

    def to_fafo(self) -> FafoConfig:
        return FafoConfig(
            method="lookahead",
            num_speculative_tokens=self.ngram - 1,
            num_lanes=self.window,
            lane_len=self.ngram - 1,
            max_key_len=1,
            pool_capacity=self.guesses,
            compression="none",
            max_lane_requests=self.max_lane_requests,
            seed_from_prompt=False,
            seed_from_output=False,
            touch_on_lookup=False,
            stagger_lanes=True,
            num_candidates=self.num_candidates,
            controller="fixed",  # the paper's W, N, G every step
            share_pool=False,  # the paper's pool is per request
            deep_match=False,  # the paper's n-gram pool drafts the text
            prior_table="off",  # the paper drafts from its pool alone
            rank_candidates="recency",  # the paper's pool: its newest guess
        )


@dataclass(frozen=True)
class CacheBackConfig:
    """Defaults: Cacheback Sec. 4 (LL=1, FL=3, LC=2^20, FC=128). Its tree
    budget TDL=96 has no one-chain counterpart; the chain is two followers
    long (6 tokens)."""

    leader_len: int = 1
    """LL: tokens in a leader (the key)."""
    follower_len: int = 3
    """FL: tokens in a follower (a candidate)."""
    leader_capacity: int = 1 << 20
    """LC: leaders kept per request (LRU on insertion and lookup)."""
    follower_capacity: int = 128
    """FC: followers kept per leader (LRU on insertion only)."""
    num_speculative_tokens: int = 6
    """Longest draft chain: followers are chained while it has room."""
    seed_from_prompt: bool = True
    """Seed the table with a sliding window over the prompt (Sec. 3.3)."""
    frozen_table: str | None = None
    """Path of a table built by ``vllm-fafo-frozen-table``."""
    num_candidates: int = 1
    """Followers verified per step: the chain and ``num_candidates - 1`` other
    followers as branches of its draft tree (vllm_fafo.verification.draft_tree)."""
    max_tree_tokens: int = 0
    """Draft tokens per step, chain and branches (Cacheback's TDL); 0: auto."""

    def validate(self) -> None:
        check_int("leader_len", self.leader_len, 1, 32)
        check_int("follower_len", self.follower_len, 1, 64)
        check_int("leader_capacity", self.leader_capacity, 1, 1 << 30)
        check_int("follower_capacity", self.follower_capacity, 1, 4096)
        check_int("num_speculative_tokens", self.num_speculative_tokens, 1, 64)
        check_bool("seed_from_prompt", self.seed_from_prompt)
        check_int("num_candidates", self.num_candidates, 1, 64)
        if self.frozen_table is not None:
            if not isinstance(self.frozen_table, str):
                raise FafoConfigError(
                    f"speculative_config['frozen_table']={self.frozen_table!r} must be a path"
                )
            from vllm_fafo.drafting.frozen_table import load_table

            load_table(self.frozen_table, self.leader_len, self.follower_len)

    def to_fafo(self) -> FafoConfig:
        return FafoConfig(
            method="cacheback",
            num_speculative_tokens=self.num_speculative_tokens,
            num_lanes=0,
            max_key_len=self.leader_len,
            min_key_len=self.leader_len,
            pool_capacity=self.follower_capacity,
            max_keys=self.leader_capacity,
            touch_on_lookup=False,
            seed_from_prompt=self.seed_from_prompt,
            text_ngram_len=self.follower_len,
            frozen_table=self.frozen_table,
            num_candidates=self.num_candidates,
            max_tree_tokens=self.max_tree_tokens,
            controller="fixed",  # the paper's chain every step
            share_pool=False,  # the paper's pool is per request (its frozen table is shared)
            deep_match=False,  # the paper's leaders and followers draft the text
            prior_table="off",  # the paper drafts from its two tables alone
            rank_candidates="recency",  # the paper's tables: the newest follower
        )


MODES = {"lookahead": LookaheadConfig, "cacheback": CacheBackConfig}
METHODS = (METHOD, *MODES)


def parse_speculative_config(raw: Any) -> FafoConfig | None:
    """The validated config of a vllm-fafo method, or None for vLLM's own."""
    if not isinstance(raw, dict) or raw.get("method") not in METHODS:
        return None
    if raw["method"] == METHOD:
        return FafoConfig.from_user_dict(raw)
    mode = _read_keys(MODES[raw["method"]], raw["method"], raw)
    mode.validate()
    config = mode.to_fafo()
    config.validate()
    return config
