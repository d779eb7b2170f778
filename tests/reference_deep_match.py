"""The tests' reference deep matches: plain Python and numpy, the semantics the native
ones (vllm_fafo.drafting.deep_match, numba kernels in vllm_fafo.drafting.text_kernels)
must keep; this was the plugin's until the native one replaced it (2026-12-02).
tests/test_native_pool.py drives both alike through a whole step.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from vllm_fafo.drafting.deep_match import MATCH_DEPTH, MAX_POSITIONS, PLACE_BYTES, TOKEN_BYTES


class TextIndex:
    """One text, and where each of its ``key_len``-token keys ended (the latest
    ``MAX_POSITIONS``), for the keys followed by at least one token."""

    def __init__(self, key_len: int, tokens: np.ndarray) -> None:
        self.key_len = key_len
        self._text = np.zeros(max(64, 2 * len(tokens)), dtype=np.int32)
        self._len = 0
        self._ends: dict[tuple[int, ...], tuple[int, ...]] | None = {}
        """Key -> the latest positions of its last token, oldest first (None: frozen).
        Tuples, not lists: a tuple of ints is untracked by the garbage collector after
        one collection, a list never is (:func:`vllm_fafo.drafting.pool._packed` says why it matters)."""
        self.extend(tokens)

    @property
    def text(self) -> np.ndarray:
        return self._text[: self._len]

    def __len__(self) -> int:
        return self._len

    def extend(self, tokens: np.ndarray) -> list[tuple[int, tuple[int, ...]]]:
        """Append ``tokens``; index the keys that now have a following token, and
        return them (position of the key's last token, key)."""
        if self._ends is None:
            raise RuntimeError("TextIndex.extend after freeze")
        start, self._len = self._len, self._len + len(tokens)
        if self._len > len(self._text):
            self._text = np.concatenate([self._text, np.zeros(self._len, dtype=np.int32)])
        self._text[start : self._len] = tokens
        first = max(0, start - self.key_len)  # keys ending at start - 1 got their following token now
        keys = keys_ending(self._text[first : self._len - 1], self.key_len, first)
        all_ends = self._ends
        for end, key in keys:
            all_ends[key] = (*all_ends.get(key, ())[1 - MAX_POSITIONS :], end)
        return keys

    def ends_of(self, key: tuple[int, ...]) -> tuple[int, ...]:
        return () if self._ends is None else self._ends.get(key, ())

    def freeze(self) -> None:
        """Keep the text, drop the key index (an answer is found through its cache's)."""
        self._ends = None
        self._text = self._text[: self._len].copy()


def keys_ending(tokens: np.ndarray, key_len: int, offset: int) -> list[tuple[int, tuple[int, ...]]]:
    """(position of its last token + ``offset``, key) for every ``key_len``-token window."""
    values = tokens.tolist()
    return [(offset + i + key_len - 1, tuple(values[i : i + key_len])) for i in range(len(values) - key_len + 1)]


def match_depths(texts: Sequence[np.ndarray], ends: Sequence[int], context_reversed: list[int]) -> list[int]:
    """For each (text, end): how many tokens back from ``end`` equal the context's
    end (``context_reversed[0]`` is its last token). One ``tolist`` per place and
    Python ints: for the ~10 places of a lookup this costs half what a numpy
    comparison matrix did (most matches end a few tokens past the key)."""
    depth = len(context_reversed)
    depths = []
    for text, end in zip(texts, ends):
        matched = 0
        for token, wanted in zip(text[max(0, end - depth + 1) : end + 1][::-1].tolist(), context_reversed):
            if token != wanted:
                break
            matched += 1
        depths.append(matched)
    return depths


class TextDraft(NamedTuple):
    """What :meth:`TextCache.speculate` found."""

    token_ids: list[int]
    match_len: int


class _Answer(NamedTuple):
    index: TextIndex
    start: int
    """Where the answer starts in the request's text (after its prompt)."""
    number: int
    """The answer's number in its cache (packed into its places)."""


class TextCache:
    """One tenant's texts: the running requests' own, and its answers (running and
    finished).

    ``key_len``: the shortest match drafted from (the goodput controller's pool
    drafts cover shorter ones); ``keep_answers`` false: every request drafts from
    its own text only; true: answers are shared and kept until
    :meth:`evict_cached_response`.

    The answers' places are kept compact, since a tenant keeps up to thousands of
    answers: a key is filed under its hash (a collision shows as a match less than
    ``key_len`` deep and is never drafted), a place is one int (the answer's number
    and the position, packed), and a key with one place holds that int, not a list.
    A key's places are its latest ``MAX_POSITIONS`` filed; a lookup takes those filed
    after the latest whose answer was forgotten."""

    def __init__(self, key_len: int, keep_answers: bool) -> None:
        self.key_len = key_len
        self.keep_answers = keep_answers
        self._running: dict[str, TextIndex] = {}
        self._answers: dict[str, _Answer] = {}
        self._numbered: dict[int, str] = {}
        self._next_number = 0
        self._answer_places: dict[int, int | tuple[int, ...]] = {}
        """Hash of a key -> the latest places (answer number << 32 | position of the
        key's last token) it ended at in the answers, oldest first (a tuple: untracked
        by the garbage collector, as :class:`TextIndex`'s)."""

    @property
    def cached_requests(self) -> dict[str, _Answer]:
        """The requests whose answers are kept (running ones included)."""
        return self._answers

    def start_request(self, req_id: str, prompt: np.ndarray) -> None:
        index = TextIndex(self.key_len, np.asarray(prompt))
        self._running[req_id] = index
        self._answers[req_id] = _Answer(index, len(index), self._next_number)
        self._numbered[self._next_number] = req_id
        self._next_number += 1

    def add_active_response(self, req_id: str, tokens: np.ndarray) -> None:
        index, _, number = self._answers[req_id]
        # the keys whose following token is new: in the answer, since the index holds the prompt already
        keys = index.extend(np.asarray(tokens))
        if not self.keep_answers:  # no sharing: not even between running requests
            return
        places = self._answer_places
        for end, key in keys:
            place, key_hash = number << 32 | end, hash(key)
            held = places.get(key_hash)
            if held is None:
                places[key_hash] = place
            elif isinstance(held, int):
                places[key_hash] = (held, place)
            else:
                places[key_hash] = (*held[1 - MAX_POSITIONS :], place)

    def stop_request(self, req_id: str) -> None:
        self._running.pop(req_id).freeze()
        if not self.keep_answers:
            self.evict_cached_response(req_id)

    def evict_cached_response(self, req_id: str) -> None:
        """Forget a request's answer: its places end the lookups that reach them."""
        _, _, number = self._answers.pop(req_id)
        del self._numbered[number]

    def speculate(self, req_id: str, context: np.ndarray, max_spec_tokens: int) -> TextDraft:
        """The continuation (up to ``max_spec_tokens``) of the deepest match of
        ``context``'s end, at least ``key_len`` deep, in the request's own text or the
        kept answers; empty if none. ``context``: the request's text's last tokens, as
        many as the deepest match looked for."""
        own = self._running[req_id]
        if max_spec_tokens <= 0 or len(context) < self.key_len:
            return TextDraft([], 0)
        key = tuple(context[-self.key_len :].tolist())
        held = self._answer_places.get(hash(key), ())
        own_number = self._answers[req_id].number
        live = []
        for place in reversed((held,) if isinstance(held, int) else held):
            if place >> 32 not in self._numbered:  # forgotten: the places before it are not looked at
                break
            live.append(place)
        places = [(self._answers[self._numbered[place >> 32]].index.text, place & 0xFFFFFFFF)
                  for place in reversed(live) if place >> 32 != own_number]
        places += [(own.text, end) for end in own.ends_of(key)]  # last: the own text wins ties
        if not places:
            return TextDraft([], 0)
        texts, ends = zip(*places)
        depths = match_depths(texts, ends, np.asarray(context)[::-1].tolist())
        best = len(depths) - 1 - depths[::-1].index(max(depths))  # the deepest, the latest on ties
        if depths[best] < self.key_len:  # an answer's key whose hash collided with this one
            return TextDraft([], 0)
        start = ends[best] + 1
        return TextDraft(texts[best][start : start + max_spec_tokens].tolist(), depths[best])


@dataclass
class _Running:
    tenant: str | None
    fed: int
    """Tokens of the request's text its cache holds."""
    prompt_len: int


class TenantTexts:
    """One :class:`TextCache` per tenant; requests start, grow, draft and stop here.

    The finished answers kept for later requests are bounded per tenant in bytes
    (``answer_bytes``; each charged ``TOKEN_BYTES`` per token of its text and ``PLACE_BYTES``
    per answer token; the earliest finished evicted first); at most ``max_tenants``
    tenants (the least recently used one without running requests is dropped).
    ``key_len``: the shortest match drafted."""

    def __init__(self, answer_bytes: int, max_tenants: int, key_len: int) -> None:
        self.key_len = key_len
        self.answer_bytes = answer_bytes
        self.max_tenants = max_tenants
        self._caches: OrderedDict[str | None, TextCache] = OrderedDict()
        self._running: dict[str, _Running] = {}
        self._finished: dict[str | None, OrderedDict[str, int]] = {}
        """Tenant -> its finished answers kept, the earliest finished first, with their charges."""

    def start(self, req_id: str, tenant: str | None, prompt: np.ndarray) -> None:
        """A new request: its prompt is the first text it matches in; its answer is
        kept for its tenant's other requests, running and later."""
        cache = self._caches.get(tenant)
        if cache is None:
            cache = self._caches[tenant] = TextCache(self.key_len, self.answer_bytes > 0)
            self._finished[tenant] = OrderedDict()
        self._caches.move_to_end(tenant)
        if req_id in cache.cached_requests:  # a request id used again: its old answer must not draft for it
            self._evict(tenant, req_id)
        cache.start_request(req_id, np.ascontiguousarray(prompt, dtype=np.int32))
        self._running[req_id] = _Running(tenant, len(prompt), len(prompt))
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
        context = np.ascontiguousarray(history[max(0, num_tokens - MATCH_DEPTH) : num_tokens], dtype=np.int32)
        found = cache.speculate(req_id, context, room)
        return found.token_ids, (found.match_len if found.token_ids else 0)

    def stop(self, req_id: str) -> None:
        """A request finished: its answer stays for later requests of its tenant while
        the tenant's finished answers fit in ``answer_bytes``."""
        running = self._running.pop(req_id, None)
        if running is None:
            return
        self._caches[running.tenant].stop_request(req_id)
        if self.answer_bytes:
            finished = self._finished[running.tenant]
            finished[req_id] = TOKEN_BYTES * running.fed + PLACE_BYTES * (running.fed - running.prompt_len)
            while sum(finished.values()) > self.answer_bytes:
                self._evict(running.tenant, next(iter(finished)))
        self._drop_idle_tenants()

    def clear(self) -> None:
        """Forget every finished answer (running requests keep their own text)."""
        for tenant, finished in self._finished.items():
            for req_id in list(finished):
                self._evict(tenant, req_id)

    @property
    def num_tenants(self) -> int:
        return len(self._caches)

    def num_kept_answers(self) -> int:
        """Answers kept, running requests' included."""
        return sum(len(cache.cached_requests) for cache in self._caches.values()) if self.answer_bytes else 0

    def charged_bytes(self, tenant: str | None) -> int:
        return sum(self._finished.get(tenant, {}).values())

    def _evict(self, tenant: str | None, req_id: str) -> None:
        self._caches[tenant].evict_cached_response(req_id)
        self._finished[tenant].pop(req_id, None)

    def _drop_idle_tenants(self) -> None:
        """Drop the least recently used tenants without running requests while there
        are more than ``max_tenants`` (tenants that all have running requests may
        exceed it: a running request's texts are never dropped)."""
        excess = len(self._caches) - self.max_tenants
        if excess <= 0:
            return
        busy = {running.tenant for running in self._running.values()}
        for tenant in list(self._caches):
            if excess <= 0:
                break
            if tenant not in busy:
                del self._caches[tenant]
                del self._finished[tenant]
                excess -= 1
