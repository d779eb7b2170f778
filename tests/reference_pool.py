"""The tests' reference n-gram pool: plain Python dicts, the semantics the native pool
(vllm_fafo.drafting.pool, numba kernels in vllm_fafo.drafting.pool_kernels) must keep.

This was the plugin's pool until the native one replaced it (2026-12-02);
tests/test_native_pool.py drives both with the same random and real token streams
and asserts the same answers, evictions and isolation. Since 2026-12-04 a tenant's
requests share one pool, each candidate tagged with the request that last filed it
(``RequestPool``'s tag; -1: the pool is the asker's alone).
"""

from __future__ import annotations

import sys
from array import array
from collections import OrderedDict
from collections.abc import Iterator, Sequence

from vllm_fafo.drafting.pool import GUESS_VOTES, OWN_VOTES, RANKINGS, Candidate, Match, Origin, RequestPool

_ORIGINS = tuple(Origin)
_ORIGIN_CODE = {origin: code for code, origin in enumerate(_ORIGINS)}
_TOKEN_BYTES = array("i").itemsize


def _packed(tokens: Sequence[int]) -> bytes:
    """Tokens as the pool keeps them, keys and candidates alike: 32-bit ints in a
    bytes object (the last ``n`` tokens of a packed key are its last ``4 n`` bytes).

    Why not tuples: the pool holds one dict of candidates per key (a 1,024-token
    prompt files 4,096 keys), and CPython's garbage collector tracks a dict that
    holds a freshly made tuple (or an enum member) until a *full* collection
    untracks it, so those dicts piled up on the collector's lists and every full
    collection walked them all: pauses of up to 0.43 s at 32 requests x 1,024 tokens
    (docs/results/serving.md "Garbage collector pauses"). A dict of bytes and ints is
    never tracked. (Since tags, each candidate's origin and tag are a tuple: tracked,
    which a reference for the tests can afford.)"""
    return array("i", tokens).tobytes()


def _unpacked(packed: bytes) -> Candidate:
    return tuple(array("i", packed))


class NgramPool:
    """Suffix-keyed candidate table with per-key LRU caps and an optional cap on keys,
    evicting the least recently used key (``key_eviction`` ``"lru"``) or the first filed."""

    def __init__(
        self,
        max_key_len: int,
        capacity: int,
        *,
        min_key_len: int = 1,
        max_keys: int = 0,
        key_eviction: str = "lru",
        touch_on_lookup: bool = True,
        rank: str = "recency",
    ) -> None:
        if not 1 <= min_key_len <= max_key_len:
            raise ValueError(f"need 1 <= min_key_len={min_key_len} <= max_key_len={max_key_len}")
        if rank not in RANKINGS:
            raise ValueError(f"rank={rank!r}: one of {RANKINGS}")
        self.max_key_len = max_key_len
        self.min_key_len = min_key_len
        self.capacity = capacity
        self.max_keys = max_keys  # 0: unbounded
        self.refresh_keys = bool(max_keys) and key_eviction == "lru"
        self.touch_on_lookup = touch_on_lookup
        self.rank = rank
        self.running_keys = 0
        """Keys held on top of ``max_keys`` (its running requests', where it is a tenant's)."""
        self._table: dict[bytes, dict[bytes, tuple[int, int]]] = OrderedDict() if max_keys else {}
        """Key -> its candidates and their (origin code, tag) (:func:`_packed`), least
        recently used first (a dict keeps insertion order, and a new one costs less than
        an OrderedDict: the pool makes one per new key).
        Keys are kept in recency order (an OrderedDict) only where ``max_keys`` evicts by
        it; unbounded or evicting the first filed, in first-filed order, with no move per key
        filed or looked up (docs/results/lanes.md, "FAFO's lanes", the proposer's host time)."""

    def __len__(self) -> int:
        """Number of keys held."""
        return len(self._table)

    def add(self, context: Sequence[int], candidate: Candidate, origin: Origin) -> None:
        """File ``candidate`` under every suffix of ``context`` of length
        ``min_key_len``..``max_key_len``.

        ``context`` only needs its last K tokens; callers pass a short slice.
        Re-adding a known candidate refreshes its recency and origin.
        """
        file_in(RequestPool(self, -1), context, candidate, origin)

    def _file(self, suffix: bytes, longest: int, candidate: bytes, value: tuple[int, int]) -> None:
        """:meth:`add` of a packed candidate, its (origin code, tag), under the packed
        ``longest``-token suffix."""
        table, max_keys = self._table, self.max_keys
        for key_len in range(self.min_key_len, longest + 1):
            key = suffix[(longest - key_len) * _TOKEN_BYTES :]
            entries = table.get(key)
            if entries is None:
                table[key] = {candidate: value}
                while max_keys and len(table) > max_keys + self.running_keys:
                    table.popitem(last=False)
                continue
            if self.refresh_keys:
                table.move_to_end(key)
            if entries.pop(candidate, None) is None and len(entries) >= self.capacity:
                del entries[next(iter(entries))]  # the least recently used
            entries[candidate] = value  # (re)inserted last: the most recently used

    def lookup(self, context: Sequence[int]) -> tuple[Candidate, Origin] | None:
        """Most recently used candidate under the longest matching suffix, and its origin."""
        found = self.match(context)
        return None if found is None else (found.candidate, found.origin)

    def match(self, context: Sequence[int]) -> Match | None:
        """Most recently used candidate under the longest matching suffix.

        The key's recency is refreshed; the candidate's only with
        ``touch_on_lookup``.
        """
        return match_in(RequestPool(self, -1), context)

    def _take(self, key: bytes, entries: dict[bytes, tuple[int, int]], candidate: bytes) -> tuple[int, int]:
        """``candidate``'s (origin code, tag) (packed, under ``key``) as a lookup's answer,
        refreshed as :meth:`match` says."""
        if self.refresh_keys:
            self._table.move_to_end(key)
        value = entries[candidate]
        if self.touch_on_lookup:
            entries[candidate] = entries.pop(candidate)
        return value

    def alternatives(self, context: Sequence[int]) -> Iterator[Candidate]:
        """Every candidate under the suffixes of ``context``, longest key first,
        most recently used first under each key, each once; recency untouched
        (the draft tree's branches, :mod:`vllm_fafo.verification.draft_tree`)."""
        return alternatives_in(RequestPool(self, -1), context)

    def entries_under(self, key: Sequence[int]) -> Iterator[Candidate]:
        """Candidates under exactly ``key``, most recently used first; recency untouched."""
        return self._entries(_packed(key))

    def _entries(self, key: bytes) -> Iterator[Candidate]:
        return map(_unpacked, reversed(self._table.get(key) or ()))

    def num_entries(self) -> int:
        """Candidates held under all keys (a candidate under several keys counts
        once per key): with :meth:`__len__`, what the pool's memory grows with."""
        return sum(map(len, self._table.values()))

    def nbytes(self, counted: set[int] | None = None) -> int:
        """Bytes of the table, its keys and its candidates (``sys.getsizeof``; a
        candidate filed under several keys, ids in ``counted``, is counted once).
        Walks everything: for reports, not for the step."""
        counted = set() if counted is None else counted
        total = sys.getsizeof(self._table)
        for key, entries in self._table.items():
            total += sys.getsizeof(key) + sys.getsizeof(entries)
            for candidate in entries:
                if id(candidate) not in counted:
                    counted.add(id(candidate))
                    total += sys.getsizeof(candidate)
        return total

    def clear(self) -> None:
        self._table.clear()

    def candidates(self, key: Sequence[int]) -> list[Candidate]:
        """Candidates under exactly ``key``, least recently used first."""
        return list(map(_unpacked, self._table.get(_packed(key), ())))

    def keys(self) -> list[Candidate]:
        """Keys, least recently used first (first filed first where ``max_keys`` is 0)."""
        return list(map(_unpacked, self._table))


def _own(tag: int, me: int) -> bool:
    return me < 0 or tag == me


def file_in(target: RequestPool, context: Sequence[int], candidate: Candidate, origin: Origin) -> None:
    """:meth:`NgramPool.add` into ``target``'s pool, tagged as its."""
    if not candidate:
        return
    pool, tag = target
    longest = min(pool.max_key_len, len(context))
    pool._file(_packed(context[len(context) - longest :]), longest, _packed(candidate), (_ORIGIN_CODE[origin], tag))


def match_in(target: RequestPool, context: Sequence[int], guess: int | None = None) -> Match | None:
    """A candidate under the longest suffix of ``context`` the pool holds one under, for
    the request ``target`` tags (-1: every candidate is its own); one another request
    filed is reported as :attr:`Origin.SHARED`.

    Ranked by ``recency`` (the pool's ``rank``): the request's most recently used
    candidate, else the most recently used. By ``votes``: the candidate whose first
    token has the most votes, the request's own casting :data:`OWN_VOTES` (1 where the
    pool is its alone), others' 1, ``guess`` :data:`GUESS_VOTES`; ties go to the
    request's own, then to the most recently used."""
    pool, me = target
    longest = min(pool.max_key_len, len(context))
    suffix = _packed(context[len(context) - longest :])
    for key_len in range(longest, pool.min_key_len - 1, -1):
        key = suffix[(longest - key_len) * _TOKEN_BYTES :]
        entries = pool._table.get(key)
        if not entries:
            continue
        chosen = _voted(entries, me, guess) if pool.rank == "votes" else _newest_held(entries, me)
        code, tag = pool._take(key, entries, chosen)
        return Match(_unpacked(chosen), _ORIGINS[code] if _own(tag, me) else Origin.SHARED, key_len)
    return None


def _newest_held(entries: dict[bytes, tuple[int, int]], me: int) -> bytes:
    """:func:`match_in`'s ``recency`` pick among a key's entries."""
    newest_first = list(reversed(entries))
    return next((c for c in newest_first if _own(entries[c][1], me)), newest_first[0])


def _voted(entries: dict[bytes, tuple[int, int]], me: int, guess: int | None) -> bytes:
    """:func:`match_in`'s ``votes`` pick among a key's entries: compares packed first
    tokens (4 bytes), no unpacking."""
    weight = {True: OWN_VOTES if me >= 0 else 1, False: 1}
    votes: dict[bytes, int] = {} if guess is None else {_packed((guess,)): GUESS_VOTES}
    for candidate, (_, tag) in entries.items():
        votes[candidate[:_TOKEN_BYTES]] = votes.get(candidate[:_TOKEN_BYTES], 0) + weight[_own(tag, me)]
    best, best_rank = b"", (-1, False)
    for candidate in reversed(entries):  # newest first: a later one must rank higher
        rank = (votes[candidate[:_TOKEN_BYTES]], _own(entries[candidate][1], me))
        if rank > best_rank:
            best, best_rank = candidate, rank
    return best


def alternatives_in(target: RequestPool, context: Sequence[int]) -> Iterator[Candidate]:
    """Every candidate under the suffixes of ``context``, longest key first, then the
    request's own, then most recently used first; each once."""
    seen: set[Candidate] = set()
    pool, me = target
    longest = min(pool.max_key_len, len(context))
    suffix = _packed(context[len(context) - longest :])
    for key_len in range(longest, pool.min_key_len - 1, -1):
        entries = pool._table.get(suffix[(longest - key_len) * _TOKEN_BYTES :]) or {}
        newest_first = list(reversed(entries))
        for packed in sorted(newest_first, key=lambda c: not _own(entries[c][1], me)):
            candidate = _unpacked(packed)
            if candidate not in seen:
                seen.add(candidate)
                yield candidate
