"""The n-gram pool: candidates keyed by suffixes of the text (FAFO Alg. 2-3).

One pool per tenant where requests share (vllm_fafo.drafting.shared_pool), each
candidate tagged with the request that last filed it, else one per request.
A candidate is a tuple of tokens that followed a key somewhere (in the prompt,
in the output, or in a lane's guess). Each key keeps at most ``capacity``
candidates and evicts the least recently used one (FAFO App. F); a lookup
tries the longest suffix first because a longer shared context predicts the
continuation better (FAFO Prop. F.1).

The same class, configured, is the pool of every method the plugin runs:

- FAFO: keys of 1..K tokens, a lookup refreshes the candidate it returns.
- Lookahead (Sec. 3, Alg. 1): keys of exactly 1 token (the n-gram's first
  token), at most G candidates per key, lookups change nothing.
- Cacheback (Sec. 3.1): keys of exactly LL tokens (leaders) with an LRU cap
  of LC leaders, which both insertion and lookup refresh; at most FC
  followers per leader, refreshed on insertion only.

Pools are native: every pool of an engine is an owner in one
:class:`PoolArena` of numpy arrays worked by numba kernels
(:mod:`vllm_fafo.drafting.pool_kernels`), so that one call per step files and
drafts for the whole batch (:func:`vllm_fafo.drafting.step_kernel.file_and_draft`),
as vLLM's ``ngram`` proposer is one numba kernel. :class:`NgramPool` is a
request's handle on its owner, for everything outside the step's kernel
(lanes, the draft tree, the modes, tests). The plain Python pool these
kernels reproduce is kept as the tests' reference (``tests/reference_pool.py``).
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator, Sequence
from enum import Enum
from typing import NamedTuple

import numpy as np

from vllm_fafo.drafting import pool_kernels as kernels


class Origin(str, Enum):
    """Where a candidate came from; counted separately in the metrics."""

    PROMPT = "prompt"
    OUTPUT = "output"
    LANE = "lane"
    FROZEN = "frozen"  # Cacheback's offline table
    SHARED = "shared"  # another request's text or lanes, via the shared pool
    DEEP_MATCH = "deep_match"  # the own text or the tenant's answers, matched deep (vllm_fafo.drafting.deep_match)
    PAD = "pad"  # filler after the found draft (pad_drafts)
    PRIOR = "prior"  # the target's continuation of the text's last token (vllm_fafo.drafting.prior_table)


Candidate = tuple[int, ...]

ORIGINS = tuple(Origin)
"""Origins by their code (the kernels' int)."""
ORIGIN_CODE = {origin: code for code, origin in enumerate(ORIGINS)}
RANKINGS = ("votes", "recency")
"""How a lookup picks among a key's candidates (``rank_candidates``; :func:`match_in`)."""
KEY_EVICTIONS = ("lru", "fifo")
"""Which key a pool bounded in keys evicts: the least recently used (Cacheback's leaders), or the first
filed (the tenants' shared pools: no relinking per key filed or chosen, docs/results/host-time.md)."""
GUESS_VOTES = kernels.GUESS_VOTES
"""Votes the fallbacks' guess of the next token casts (:func:`match_in`): in a probe over the MT-Bench
replay 2 and 3 did best (tau 2.313-2.314; 1: 2.302, 5: 2.306)."""
OWN_VOTES = kernels.OWN_VOTES
"""Votes a candidate the asking request filed casts in its tenant's pool (:func:`match_in`; another
request's: 1): with 3 every replayed cell was within 1 % of the tau of a pool per request beside a
shared one; with 2 GSM8K at batch 8 lost 1.3 %, with no tags HumanEval at batch 8 3.3 %
(docs/results/host-time.md)."""


class Match(NamedTuple):
    """A lookup's answer: the candidate, where it came from, and the length of the
    key it was found under (the goodput controller's evidence for how far to draft)."""

    candidate: Candidate
    origin: Origin
    key_len: int


def _tokens(values: Sequence[int]) -> np.ndarray:
    return np.asarray(values, dtype=np.int32).reshape(-1)


def _table_cells(keys: int, at_least: int = 1) -> int:
    """The table's size for ``keys`` keys: ``at_least`` doubled until they fill a quarter of it
    at most (open addressing stays short; tombstones fill it up to half before a rehash)."""
    size = at_least
    while 4 * keys > size:
        size *= 2
    return size


def _entry_columns(candidate_len: int) -> int:
    """Columns of an entry row holding candidates of ``candidate_len`` tokens: even, so that
    each row's ``E_STAMP`` pair is an aligned int64 (:func:`_stamps_of`)."""
    columns = kernels.E_TOK + candidate_len
    return columns + columns % 2


def _stamps_of(entries: np.ndarray) -> np.ndarray:
    """The entries' stamps: a view of each row's two ``E_STAMP`` columns as one int64."""
    return entries.view(np.int64)[:, kernels.E_STAMP // 2]


class PoolArena:
    """The arrays every pool of one engine lives in (:mod:`vllm_fafo.drafting.pool_kernels`),
    with the settings all its pools share, from room for ``initial_keys`` keys. Grows
    geometrically, never inside a kernel: callers :meth:`reserve` room for what a call
    may add."""

    def __init__(self, max_key_len: int, capacity: int, *, min_key_len: int = 1, touch_on_lookup: bool = True,
                 rank: str = "recency", candidate_len: int = 8, initial_keys: int = 256) -> None:
        if not 1 <= min_key_len <= max_key_len:
            raise ValueError(f"need 1 <= min_key_len={min_key_len} <= max_key_len={max_key_len}")
        if rank not in RANKINGS:
            raise ValueError(f"rank={rank!r}: one of {RANKINGS}")
        if capacity < 1:
            raise ValueError(f"capacity={capacity}: at least 1")
        self.max_key_len = max_key_len
        self.min_key_len = min_key_len
        self.capacity = capacity
        self.touch_on_lookup = touch_on_lookup
        self.rank = rank
        self._cfg = np.array([min_key_len, max_key_len, capacity, touch_on_lookup, rank == "votes"], dtype=np.int64)
        self._counters = np.zeros(kernels.NUM_COUNTERS, dtype=np.int64)
        self._table = np.zeros(_table_cells(initial_keys), dtype=np.int32)
        self._slots = np.zeros((0, kernels.S_KEY + max_key_len), dtype=np.int32)
        """A row per key: its fields (``S_*`` columns), the free slots' stack in ``S_FREE``."""
        self._entries = np.zeros((0, _entry_columns(candidate_len)), dtype=np.int32)
        """A row per candidate: its stamp, fields and tokens (``E_*`` columns), the free entries' stack in ``E_FREE``."""
        self._owners = np.zeros((0, kernels.NUM_OWNER_COLUMNS), dtype=np.int64)
        """A row per pool (``O_*`` columns)."""
        self._grow_slots(initial_keys)
        self._grow_entries(initial_keys, candidate_len)
        self._grow_owners(8)
        self._free_owners: list[int] = list(range(7, -1, -1))
        self._tags = 0
        self.scratch = np.zeros(2 * (capacity + 1), dtype=np.int64)
        """Room for :func:`~vllm_fafo.drafting.pool_kernels.match_pool` (a key's votes)."""
        self._state: tuple | None = None

    # arrays ---------------------------------------------------------------------------
    @staticmethod
    def _grown(old: np.ndarray, rows: int, columns: int, fill: dict[int, int]) -> np.ndarray:
        """``old`` in a larger array of ``rows`` x ``columns``, the new rows' columns set as ``fill`` says (else 0)."""
        new = np.zeros((rows, columns), dtype=old.dtype)
        new[: len(old), : old.shape[1]] = old
        for column, value in fill.items():
            new[len(old) :, column] = value
        return new

    def _grow_slots(self, size: int) -> None:
        old = self._slots
        self._slots = self._grown(old, size, old.shape[1], {kernels.S_OWNER: -1, kernels.S_HEAD: -1,
                                                            kernels.S_PREV: -1, kernels.S_NEXT: -1})
        top = int(self._counters[kernels.CNT_SLOT_FREE])
        added = np.arange(size - 1, len(old) - 1, -1, dtype=np.int32)  # lowest index taken first
        self._slots[top : top + len(added), kernels.S_FREE] = added
        self._counters[kernels.CNT_SLOT_FREE] = top + len(added)
        self._state = None

    def _grow_entries(self, size: int, candidate_len: int) -> None:
        old = self._entries
        self._entries = self._grown(old, size, _entry_columns(candidate_len), {kernels.E_NEXT: -1})
        top = int(self._counters[kernels.CNT_ENTRY_FREE])
        added = np.arange(size - 1, len(old) - 1, -1, dtype=np.int32)
        self._entries[top : top + len(added), kernels.E_FREE] = added
        self._counters[kernels.CNT_ENTRY_FREE] = top + len(added)
        self._state = None

    def _grow_owners(self, size: int) -> None:
        self._owners = self._grown(self._owners, size, kernels.NUM_OWNER_COLUMNS, {kernels.O_HEAD: -1, kernels.O_TAIL: -1})
        self._state = None

    @property
    def candidate_len(self) -> int:
        """The longest candidate the arena holds without growing."""
        return self._entries.shape[1] - kernels.E_TOK

    @property
    def state(self) -> tuple:
        """The arrays, in the order the kernels read them (``ST_*``)."""
        if self._state is None:
            self._state = (self._cfg, self._counters, self._table, self._slots, self._entries,
                           _stamps_of(self._entries), self._owners)
        return self._state

    def reserve(self, keys: int, candidate_len: int = 0) -> None:
        """Room for ``keys`` more keys and candidates, candidates up to ``candidate_len`` long."""
        counters = self._counters
        if counters[kernels.CNT_SLOT_FREE] < keys:
            self._grow_slots(max(2 * len(self._slots), len(self._slots) + keys))
        short = counters[kernels.CNT_ENTRY_FREE] < keys
        if short or candidate_len > self.candidate_len:
            size = len(self._entries)
            self._grow_entries(max(2 * size, size + keys) if short else size, max(candidate_len, self.candidate_len))
        if 2 * (counters[kernels.CNT_TABLE_USED] + keys) > len(self._table):
            self._table = np.zeros(_table_cells(int(counters[kernels.CNT_LIVE_SLOTS]) + keys, len(self._table)),
                                   dtype=np.int32)
            self._state = None
            kernels.rehash(self.state)

    # owners ---------------------------------------------------------------------------
    def new_owner(self, max_keys: int = 0, key_eviction: str = "lru") -> int:
        """A new empty pool's id, holding at most ``max_keys`` keys (0: unbounded), past
        them evicting the least recently used key (``"lru"``) or the first filed (``"fifo"``)."""
        if key_eviction not in KEY_EVICTIONS:
            raise ValueError(f"key_eviction={key_eviction!r}: one of {KEY_EVICTIONS}")
        if not self._free_owners:
            size = len(self._owners)
            self._grow_owners(2 * size)
            self._free_owners = list(range(2 * size - 1, size - 1, -1))
        owner = self._free_owners.pop()
        self._owners[owner, kernels.O_MAX_KEYS] = max_keys
        self._owners[owner, kernels.O_LRU] = max_keys > 0 and key_eviction == "lru"
        return owner

    def release(self, owner: int) -> None:
        """Drop a pool's keys and free its id (its handle is gone)."""
        kernels.clear_owner(self.state, owner)
        self._owners[owner, kernels.O_MAX_KEYS] = self._owners[owner, kernels.O_LRU] = 0
        self._owners[owner, kernels.O_RUNNING_KEYS] = 0
        self._free_owners.append(owner)

    def new_tag(self) -> int:
        """A request's tag in a shared pool: never one handed out before, so a later
        request never takes an earlier one's candidates for its own."""
        self._tags += 1
        return self._tags

    def release_running(self, owner: int, keys: int) -> None:
        """A running request of pool ``owner`` stopped: the ``keys`` it filed no longer
        count on top of the pool's bound (:func:`~vllm_fafo.drafting.step_kernel.anchor_keys`)."""
        self._owners[owner, kernels.O_RUNNING_KEYS] -= keys
        if self._owners[owner, kernels.O_RUNNING_KEYS] < 0:
            raise RuntimeError(f"PoolArena.release_running: pool {owner} released more running keys than it held")

    def num_keys(self, owner: int) -> int:
        return int(self._owners[owner, kernels.O_KEYS])

    @property
    def num_live_keys(self) -> int:
        """Keys held by every pool of the arena."""
        return int(self._counters[kernels.CNT_LIVE_SLOTS])

    def nbytes(self) -> int:
        """Bytes of all the arena's arrays (allocated, used or not)."""
        own = (a for i, a in enumerate(self.state) if i != kernels.ST_STAMPS)  # a view of the entries
        return int(sum(a.nbytes for a in own) + self.scratch.nbytes)

    def bytes_per_key(self, candidates: int | None = None) -> int:
        """Bytes one key slot and its candidates take (default: at full capacity)."""
        slot = self._slots.itemsize * self._slots.shape[1] + 2 * self._table.itemsize
        entry = self._entries.itemsize * self._entries.shape[1]
        return int(slot + (self.capacity if candidates is None else candidates) * entry)

    def candidate(self, entry: int) -> Candidate:
        row = self._entries[entry]
        return tuple(row[kernels.E_TOK : kernels.E_TOK + row[kernels.E_LEN]].tolist())

    def origin(self, entry: int) -> Origin:
        return ORIGINS[int(self._entries[entry, kernels.E_ORIGIN])]

    def tag(self, entry: int) -> int:
        return int(self._entries[entry, kernels.E_TAG])


class NgramPool:
    """One pool (an owner of a :class:`PoolArena`): a suffix-keyed candidate table with
    per-key LRU caps and an optional cap on keys (``key_eviction``: which key it evicts).
    Without ``arena`` the pool gets an arena of its own with these settings; with one,
    the settings must be the arena's."""

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
        arena: PoolArena | None = None,
    ) -> None:
        if arena is None:
            arena = PoolArena(max_key_len, capacity, min_key_len=min_key_len, touch_on_lookup=touch_on_lookup,
                              rank=rank)
        settings = (max_key_len, capacity, min_key_len, touch_on_lookup, rank)
        if settings != (arena.max_key_len, arena.capacity, arena.min_key_len, arena.touch_on_lookup, arena.rank):
            raise ValueError(f"pool settings {settings} differ from its arena's")
        self.arena = arena
        self.max_key_len = max_key_len
        self.min_key_len = min_key_len
        self.capacity = capacity
        self.max_keys = max_keys  # 0: unbounded
        self.key_eviction = key_eviction
        self.touch_on_lookup = touch_on_lookup
        self.rank = rank
        self.owner = arena.new_owner(max_keys, key_eviction)
        weakref.finalize(self, arena.release, self.owner).atexit = False

    def __len__(self) -> int:
        """Number of keys held."""
        return self.arena.num_keys(self.owner)

    def add(self, context: Sequence[int], candidate: Candidate, origin: Origin) -> None:
        """File ``candidate`` under every suffix of ``context`` of length
        ``min_key_len``..``max_key_len``, untagged (:func:`file_in`).

        ``context`` only needs its last K tokens; callers pass a short slice.
        Re-adding a known candidate refreshes its recency and origin.
        """
        file_in(RequestPool(self, -1), context, candidate, origin)

    def lookup(self, context: Sequence[int]) -> tuple[Candidate, Origin] | None:
        """Most recently used candidate under the longest matching suffix, and its origin."""
        found = self.match(context)
        return None if found is None else (found.candidate, found.origin)

    def match(self, context: Sequence[int]) -> Match | None:
        """The candidate under the longest matching suffix, every candidate counted as
        the asker's own (:func:`match_in`).

        The key's recency is refreshed (``key_eviction`` ``"lru"``); the candidate's only
        with ``touch_on_lookup``.
        """
        return match_in(RequestPool(self, -1), context)

    def alternatives(self, context: Sequence[int]) -> Iterator[Candidate]:
        """Every candidate under the suffixes of ``context``, longest key first,
        most recently used first under each key, each once; recency untouched
        (the draft tree's branches, :mod:`vllm_fafo.verification.draft_tree`)."""
        return alternatives_in(RequestPool(self, -1), context)

    def entries_under(self, key: Sequence[int]) -> Iterator[Candidate]:
        """Candidates under exactly ``key``, most recently used first; recency untouched."""
        return iter(self._newest_first(_tokens(key)))

    def _newest_first(self, key: np.ndarray) -> list[Candidate]:
        return [self.arena.candidate(entry) for entry in self._newest_first_entries(key)]

    def _newest_first_entries(self, key: np.ndarray) -> list[int]:
        out = np.empty(self.capacity, dtype=np.int64)
        count = kernels.slot_entries(self.arena.state, self.owner, key, 0, len(key), out)
        return out[:count].tolist()

    def num_entries(self) -> int:
        """Candidates held under all keys (a candidate under several keys counts
        once per key): with :meth:`__len__`, what the pool's memory grows with."""
        return int(kernels.owner_entries(self.arena.state, self.owner))

    def nbytes(self) -> int:
        """Bytes the pool's keys and candidates take in its arena (slots at full capacity)."""
        return len(self) * self.arena.bytes_per_key()

    def clear(self) -> None:
        kernels.clear_owner(self.arena.state, self.owner)

    def candidates(self, key: Sequence[int]) -> list[Candidate]:
        """Candidates under exactly ``key``, least recently used first."""
        return self._newest_first(_tokens(key))[::-1]

    def keys(self) -> list[Candidate]:
        """Keys, least recently used first (first filed first where ``max_keys`` is 0 or
        ``key_eviction`` is ``"fifo"``)."""
        arena = self.arena
        out = np.empty(len(self), dtype=np.int64)
        count = kernels.owner_slots(arena.state, self.owner, out)
        slots = arena._slots
        return [tuple(slots[s, kernels.S_KEY : kernels.S_KEY + slots[s, kernels.S_KLEN]].tolist())
                for s in out[:count].tolist()]


class RequestPool(NamedTuple):
    """Where a request files and drafts: its pool (its tenant's where requests share
    one, vllm_fafo.drafting.shared_pool) and its tag there (-1: the pool is its own)."""

    pool: NgramPool
    tag: int


def file_in(target: RequestPool, context: Sequence[int], candidate: Candidate, origin: Origin) -> None:
    """File ``candidate`` under every suffix of ``context`` of the pool's key lengths,
    tagged as ``target``'s (re-filing a held candidate refreshes its recency, origin
    and tag)."""
    if not len(candidate):
        return
    context, candidate = _tokens(context), _tokens(candidate)
    pool = target.pool
    pool.arena.reserve(pool.max_key_len, len(candidate))
    kernels.file_candidate(pool.arena.state, pool.owner, target.tag, context, 0, len(context), candidate, 0,
                           len(candidate), ORIGIN_CODE[origin])


def file_each_in(targets: Sequence[RequestPool], ngrams: Sequence[tuple[Sequence[int], Candidate]],
                 origin: Origin) -> None:
    """:func:`file_in` of each (context, candidate) in ``ngrams`` into its target (pools
    of one arena), in order, in one kernel call."""
    if not ngrams:
        return
    arena = targets[0].pool.arena
    count = len(ngrams)
    context_len = max(len(context) for context, _ in ngrams) or 1
    candidate_len = max(len(candidate) for _, candidate in ngrams) or 1
    owners = np.zeros(count, dtype=np.int64)
    tags = np.zeros(count, dtype=np.int64)
    contexts = np.zeros((count, context_len), dtype=np.int32)
    candidates = np.zeros((count, candidate_len), dtype=np.int32)
    context_lens = np.zeros(count, dtype=np.int64)
    candidate_lens = np.zeros(count, dtype=np.int64)
    for i, (target, (context, candidate)) in enumerate(zip(targets, ngrams)):
        if target.pool.arena is not arena:
            raise ValueError("file_each_in: every pool must live in one arena")
        owners[i], tags[i] = target.pool.owner, target.tag
        contexts[i, : len(context)] = context
        candidates[i, : len(candidate)] = candidate
        context_lens[i], candidate_lens[i] = len(context), len(candidate)
    arena.reserve(count * arena.max_key_len, candidate_len)
    kernels.file_each(arena.state, owners, tags, contexts, context_lens, candidates, candidate_lens,
                      ORIGIN_CODE[origin])


def match_in(target: RequestPool, context: Sequence[int], guess: int | None = None) -> Match | None:
    """The candidate under the longest suffix of ``context`` the pool holds one under, for
    the request ``target`` tags. A candidate another request filed is reported as
    :attr:`Origin.SHARED`.

    Ranked by ``recency`` (the pool's ``rank``): the most recently used candidate the
    request filed, else the most recently used one. By ``votes``: the candidate whose
    first token the most candidates under the key begin with, each the request filed
    casting :data:`OWN_VOTES` and each other one 1 (where the request's own text and
    others' disagree, its own weighs more), ``guess`` (the next token the fallbacks would
    draft, the prior table's) casting :data:`GUESS_VOTES`; ties go to the request's own,
    then to the most recently used. Where a key's candidates disagree, the majority is
    right more often than the newest: tau 2.268 -> 2.316 on the MT-Bench replay
    (docs/results/draft-sources.md "Candidate ranking, replayed")."""
    pool = target.pool
    context = _tokens(context)
    entry, key_len, own = kernels.match_pool(pool.arena.state, pool.owner, target.tag, context, 0, len(context),
                                             -1 if guess is None else guess, pool.arena.scratch)
    if entry < 0:
        return None
    arena = pool.arena
    return Match(arena.candidate(entry), arena.origin(entry) if own else Origin.SHARED, key_len)


def alternatives_in(target: RequestPool, context: Sequence[int]) -> Iterator[Candidate]:
    """Every candidate under the suffixes of ``context``, longest key first, then those
    the request ``target`` tags filed, then most recently used first; each once; recency
    untouched (the draft tree's branches, :mod:`vllm_fafo.verification.draft_tree`)."""
    seen: set[Candidate] = set()
    pool, tag = target
    context = _tokens(context)
    longest = min(pool.max_key_len, len(context))
    for key_len in range(longest, pool.min_key_len - 1, -1):
        entries = pool._newest_first_entries(context[len(context) - key_len :])
        if tag >= 0:
            entries = sorted(entries, key=lambda entry: pool.arena.tag(entry) != tag)  # stable: recency kept
        for entry in entries:
            candidate = pool.arena.candidate(entry)
            if candidate not in seen:
                seen.add(candidate)
                yield candidate
