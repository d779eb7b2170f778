"""Text candidates from suffix trees (Arctic Inference's ``SuffixDecodingCache``).

``"text_source": "suffix_tree"`` drafts the decoded text's continuations from
a suffix tree over the request's prompt and output and over the outputs of
earlier requests of the same tenant (SuffixDecoding, the data structure of
vLLM's ``suffix`` method), instead of from the n-gram pool. Why: at the same
tau a suffix tree drafts far fewer tokens. It matches the text's suffix up to
``TREE_DEPTH`` tokens deep (the pool's keys stop at ``max_key_len``), picks
the continuation seen most often under the deepest match, and drafts at most
as many tokens as it matched; on the prompts of ``benchmarks/replay_pool.py``
that is where the pool's drafts lose (README, "Text source").

The pool still holds lane n-grams, the text's n-grams for the draft tree's
branches and for steps where the tree has nothing (its draft is then the
pool's chain); the goodput controller cuts either draft by its matched
context length (the tree's match length, the pool's key length).

``"text_source": "deep_match"`` runs the same bookkeeping over numpy text
caches (vllm_fafo.text_match) instead of Arctic's trees.

Tenants (vLLM's ``cache_salt``) never share a tree: each has its own cache,
at most ``max_tenants`` of them (the least recently used one without running
requests is dropped); all together keep at most ``cached_requests`` answers
(0: each request drafts from its own text only).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import numpy as np

from vllm_fafo.errors import FafoConfigError
from vllm_fafo.text_match import MATCH_DEPTH, TextCache

TEXT_SOURCES = ("pool", "deep_match", "suffix_tree")

TREE_DEPTH = MATCH_DEPTH
"""Deepest suffix match, as vLLM's ``suffix_decoding_max_tree_depth`` default."""
MAX_SPEC_FACTOR = 1.0
"""Draft at most this many tokens per matched token (vLLM's default)."""
MIN_TOKEN_PROB = 0.1
"""Stop the draft where the tree's estimate of a token falls below this (vLLM's default)."""


def require_suffix_trees() -> Any:
    """Arctic Inference's ``SuffixDecodingCache`` class, or the error that says how to get it."""
    try:
        from arctic_inference.suffix_decoding import SuffixDecodingCache
    except ImportError as error:
        raise FafoConfigError(
            "speculative_config['text_source']='suffix_tree' needs Arctic Inference's suffix "
            "trees: pip install arctic-inference==0.3.0 (scripts/install_cpu.sh does), or set "
            "text_source to 'pool'"
        ) from error
    return SuffixDecodingCache


@dataclass
class _Running:
    tenant: str | None
    fed: int
    """Tokens of the request's text its tree holds."""


class SuffixTrees:
    """One ``SuffixDecodingCache`` per tenant; requests start, grow, draft and stop here.

    The answers the trees keep for later requests are bounded over all tenants
    together (``cached_requests``, the oldest answer evicted first), not per
    tenant: a tree holds about 65 KiB per 256-token answer of random tokens and
    7.5 KiB for repetitive text (README, "Text source")."""

    def __init__(self, cached_requests: int, max_tenants: int, deep_match_key_len: int = 0) -> None:
        """``deep_match_key_len`` > 0: each tenant's texts are a numpy
        :class:`~vllm_fafo.text_match.TextCache` drafting matches at least that deep
        (``text_source`` ``deep_match``), not Arctic's tree."""
        self.deep_match_key_len = deep_match_key_len
        if deep_match_key_len:
            self._new_cache = lambda keep: TextCache(deep_match_key_len, keep)
            self._speculate = lambda cache, req_id, context, room: cache.speculate(req_id, context, room)
        else:
            tree_class = require_suffix_trees()
            self._new_cache = lambda keep: tree_class(max_tree_depth=TREE_DEPTH, max_cached_requests=keep)
            self._speculate = lambda cache, req_id, context, room: cache.speculate(
                req_id, context, max_spec_tokens=room, max_spec_factor=MAX_SPEC_FACTOR, min_token_prob=MIN_TOKEN_PROB)
        self.cached_requests = cached_requests
        self.max_tenants = max_tenants
        self._caches: OrderedDict[str | None, Any] = OrderedDict()
        self._running: dict[str, _Running] = {}
        self._answers: OrderedDict[tuple[str | None, str], None] = OrderedDict()
        """(tenant, request) of every answer the trees keep, oldest first."""

    def start(self, req_id: str, tenant: str | None, prompt: np.ndarray) -> None:
        """A new request: its prompt is the first text its tree matches; its answer
        is kept for later requests of its tenant (the oldest answer kept goes)."""
        cache = self._caches.get(tenant)
        if cache is None:
            # Arctic's own bound is per cache: -1 (none) here, the bound over all tenants is kept below.
            cache = self._caches[tenant] = self._new_cache(-1 if self.cached_requests else 0)
        self._caches.move_to_end(tenant)
        if req_id in cache.cached_requests:  # a request id used again: its old answer must not draft for it
            self._evict(tenant, req_id)
        cache.start_request(req_id, np.ascontiguousarray(prompt, dtype=np.int32))
        self._running[req_id] = _Running(tenant, len(prompt))
        if self.cached_requests:
            self._answers[(tenant, req_id)] = None
            while len(self._answers) > self.cached_requests:
                self._evict(*next(iter(self._answers)))
        self._drop_idle_tenants()

    def draft(self, req_id: str, history: np.ndarray, num_tokens: int, room: int) -> tuple[list[int], int]:
        """Feed the tokens decoded since the last call, then draft up to ``room`` tokens
        after ``history[:num_tokens]``; returns the draft and its match length."""
        running = self._running[req_id]
        cache = self._caches[running.tenant]
        if num_tokens > running.fed:
            cache.add_active_response(req_id, np.ascontiguousarray(history[running.fed : num_tokens], dtype=np.int32))
            running.fed = num_tokens
        if room <= 0:
            return [], 0
        context = np.ascontiguousarray(history[max(0, num_tokens - TREE_DEPTH) : num_tokens], dtype=np.int32)
        found = self._speculate(cache, req_id, context, room)
        tokens = list(found.token_ids)
        return tokens, (found.match_len if tokens else 0)

    def stop(self, req_id: str) -> None:
        """A request finished: its output stays in its tenant's tree for later requests."""
        running = self._running.pop(req_id, None)
        if running is None:
            return
        self._caches[running.tenant].stop_request(req_id)
        self._drop_idle_tenants()

    def clear(self) -> None:
        """Forget every finished answer (running requests keep their own text)."""
        for tenant, req_id in list(self._answers):
            if req_id not in self._running:
                self._evict(tenant, req_id)

    @property
    def num_tenants(self) -> int:
        return len(self._caches)

    def num_cached_requests(self) -> int:
        """Answers the trees keep, running requests' included."""
        return len(self._answers)

    def _evict(self, tenant: str | None, req_id: str) -> None:
        self._caches[tenant].evict_cached_response(req_id)
        self._answers.pop((tenant, req_id), None)

    def _drop_idle_tenants(self) -> None:
        """Drop the least recently used tenants without running requests while there
        are more than ``max_tenants`` (tenants that all have running requests may
        exceed it: a running request's tree is never dropped)."""
        excess = len(self._caches) - self.max_tenants
        if excess <= 0:
            return
        busy = {running.tenant for running in self._running.values()}
        for tenant in list(self._caches):
            if excess <= 0:
                break
            if tenant not in busy:
                del self._caches[tenant]
                for answer in [a for a in self._answers if a[0] == tenant]:
                    del self._answers[answer]
                excess -= 1
