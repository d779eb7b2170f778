"""numba kernels of the n-gram pools (:mod:`vllm_fafo.drafting.pool`).

Every pool of an engine lives in one arena of preallocated numpy arrays (a
:class:`~vllm_fafo.drafting.pool.PoolArena`), told apart by an owner id: a
tenant's pool (its requests' candidates tagged with the request that filed them),
or a request's own. A key is a slot found through an
open-addressing table hashed on (owner, key tokens); a slot's candidates are
entries on a singly linked list, ordered by recency stamps (one counter per
arena, raised on every use), and an owner's keys are on a doubly linked list
in the order an ``OrderedDict`` would keep them: by recency where the owner
evicts its least recently used key (Cacheback's leaders), else in filing order
(the tenants' pools evict the first filed). Kernels never allocate: the
arena reserves room before each call (:meth:`PoolArena.reserve`), as vLLM's
``ngram`` kernel writes into preallocated outputs.

The state a kernel takes is :attr:`PoolArena.state`, a tuple in the order of
the ``ST_*`` indices below: a few arrays with a row per key, candidate and pool
(fields as columns), so that a key's or a candidate's fields share a cache line
and a call unboxes seven arrays, not one per field (the step's kernels run
between two forwards, with cold caches: docs/results/host-time.md). The semantics are the Python pool's (tests hold
them against ``tests/reference_pool.py``).

The kernels a step calls per key or candidate (the filing, the lookup, their
helpers) are inlined into their callers (``inline="always"``): a call that passes
the arena's seven arrays cost as much as the work it did (re-filing a 3-token
anchor in a warm arena took 490 ns per anchor through calls, 240 inlined; the
step kernel about 20 % faster at batch 8 and 32, docs/results/host-time.md),
at the price of about 20 s more compiling on a machine's first engine start.
"""

from __future__ import annotations

import numpy as np
from numba import njit

# cfg: the arena's settings
CFG_MIN_KEY, CFG_MAX_KEY, CFG_CAPACITY, CFG_TOUCH, CFG_VOTES = range(5)
# counters
CNT_STAMP, CNT_SLOT_FREE, CNT_ENTRY_FREE, CNT_TABLE_USED, CNT_LIVE_SLOTS = range(5)
NUM_COUNTERS = 5
ST_CFG, ST_COUNTERS, ST_TABLE, ST_SLOTS, ST_ENTRIES, ST_STAMPS, ST_OWNERS = range(7)
# columns of the slots (int32; one row per key, and the free slots' stack)
S_OWNER, S_KLEN, S_HEAD, S_COUNT, S_PREV, S_NEXT, S_TPOS, S_FREE, S_KEY = range(9)
# columns of the entries (int32; one row per candidate, and the free entries' stack), an even number: first the
# candidate's recency stamp, an int64 in two columns (the kernels read the stamps as ST_STAMPS, a view of them: a
# walk that ranks candidates reads one row per candidate, not a row and a stamp elsewhere); E_TAG: the request that
# last filed the candidate (a tenant's pool; tags are never reused), 0 where untagged
E_STAMP, E_LEN, E_ORIGIN, E_TAG, E_NEXT, E_FREE, E_TOK = 0, 2, 3, 4, 5, 6, 7
# columns of the owners (int64; one row per pool); O_LRU: the owner bounds its keys and a key filed or chosen
# again moves to its most recently used end (the least recently used evicted first), else keys stay in filing order;
# O_RUNNING_KEYS: keys its running requests filed, held on top of O_MAX_KEYS (a tenant's pool)
O_HEAD, O_TAIL, O_KEYS, O_MAX_KEYS, O_LRU, O_RUNNING_KEYS = range(6)
NUM_OWNER_COLUMNS = 6

EMPTY = 0
TOMBSTONE = -1
GUESS_VOTES = 2
"""Votes the fallbacks' guess of the next token casts (see vllm_fafo.drafting.pool)."""
OWN_VOTES = 3
"""Votes a candidate the asking request filed casts in its tenant's pool (another request's: 1)."""


@njit(cache=True, inline="always")
def hash_key(owner, tokens, start, length):
    h = np.int64(owner) * np.int64(0x9E3779B1) + np.int64(length)
    for i in range(start, start + length):
        h = (h ^ np.int64(tokens[i])) * np.int64(0x100000001B3)
    return h ^ (h >> np.int64(31))


@njit(cache=True, inline="always")
def find_slot(st, owner, tokens, start, length):
    """The slot of ``owner``'s key ``tokens[start:start+length]``, -1 where it has none."""
    table = st[ST_TABLE]
    mask = len(table) - 1
    i = hash_key(owner, tokens, start, length) & mask
    while True:
        v = table[i]
        if v == EMPTY:
            return -1
        if v > 0:
            s = v - 1
            if st[ST_SLOTS][s, S_OWNER] == owner and st[ST_SLOTS][s, S_KLEN] == length:
                same = True
                for j in range(length):
                    if st[ST_SLOTS][s, S_KEY + j] != tokens[start + j]:
                        same = False
                        break
                if same:
                    return s
        i = (i + 1) & mask


@njit(cache=True, inline="always")
def _insert_table(st, s, owner, tokens, start, length):
    table = st[ST_TABLE]
    mask = len(table) - 1
    i = hash_key(owner, tokens, start, length) & mask
    while table[i] > 0:
        i = (i + 1) & mask
    if table[i] == EMPTY:
        st[ST_COUNTERS][CNT_TABLE_USED] += 1
    table[i] = s + 1
    st[ST_SLOTS][s, S_TPOS] = i


@njit(cache=True, inline="always")
def _unlink_key(st, s):
    owner = st[ST_SLOTS][s, S_OWNER]
    prev, nxt = st[ST_SLOTS][s, S_PREV], st[ST_SLOTS][s, S_NEXT]
    if prev >= 0:
        st[ST_SLOTS][prev, S_NEXT] = nxt
    else:
        st[ST_OWNERS][owner, O_HEAD] = nxt
    if nxt >= 0:
        st[ST_SLOTS][nxt, S_PREV] = prev
    else:
        st[ST_OWNERS][owner, O_TAIL] = prev


@njit(cache=True, inline="always")
def _append_key(st, s, owner):
    tail = st[ST_OWNERS][owner, O_TAIL]
    st[ST_SLOTS][s, S_PREV] = tail
    st[ST_SLOTS][s, S_NEXT] = -1
    if tail >= 0:
        st[ST_SLOTS][tail, S_NEXT] = s
    else:
        st[ST_OWNERS][owner, O_HEAD] = s
    st[ST_OWNERS][owner, O_TAIL] = s


@njit(cache=True)
def has_room(st, keys, candidate_len):
    """Whether the arena holds ``keys`` more keys and candidates of up to ``candidate_len``
    tokens without growing (:meth:`~vllm_fafo.drafting.pool.PoolArena.reserve`'s test)."""
    counters = st[ST_COUNTERS]
    return (counters[CNT_SLOT_FREE] >= keys and counters[CNT_ENTRY_FREE] >= keys
            and st[ST_ENTRIES].shape[1] - E_TOK >= candidate_len and 2 * (counters[CNT_TABLE_USED] + keys) <= len(st[ST_TABLE]))


@njit(cache=True)
def file_each(st, owners, tags, contexts, context_lens, candidates, candidate_lens, origin):
    """:func:`file_candidate` of ``candidates[i, :candidate_lens[i]]`` under the suffixes
    of ``contexts[i, :context_lens[i]]`` into ``owners[i]`` tagged ``tags[i]``, in row
    order: a step's lane n-grams in one call."""
    for i in range(len(context_lens)):
        file_candidate(st, owners[i], tags[i], contexts[i], 0, context_lens[i], candidates[i], 0, candidate_lens[i],
                       origin)


@njit(cache=True, inline="always")
def refresh_key(st, s):
    """Move a key to its owner's most recently used end, where the owner bounds its keys
    by recency (``O_LRU``)."""
    owner = st[ST_SLOTS][s, S_OWNER]
    if st[ST_OWNERS][owner, O_LRU] != 0 and st[ST_OWNERS][owner, O_TAIL] != s:
        _unlink_key(st, s)
        _append_key(st, s, owner)


@njit(cache=True)
def remove_slot(st, s):
    """Drop a key and its candidates."""
    counters = st[ST_COUNTERS]
    e = st[ST_SLOTS][s, S_HEAD]
    while e >= 0:
        nxt = st[ST_ENTRIES][e, E_NEXT]
        st[ST_ENTRIES][counters[CNT_ENTRY_FREE], E_FREE] = e
        counters[CNT_ENTRY_FREE] += 1
        e = nxt
    st[ST_TABLE][st[ST_SLOTS][s, S_TPOS]] = TOMBSTONE
    _unlink_key(st, s)
    st[ST_OWNERS][st[ST_SLOTS][s, S_OWNER], O_KEYS] -= 1
    st[ST_SLOTS][s, S_OWNER] = -1
    st[ST_SLOTS][s, S_HEAD] = -1
    st[ST_SLOTS][s, S_COUNT] = 0
    st[ST_SLOTS][counters[CNT_SLOT_FREE], S_FREE] = s
    counters[CNT_SLOT_FREE] += 1
    counters[CNT_LIVE_SLOTS] -= 1


@njit(cache=True)
def remove_entry(st, s, e):
    """Drop candidate ``e`` of slot ``s`` (and the key, where it was the last)."""
    counters = st[ST_COUNTERS]
    if st[ST_SLOTS][s, S_HEAD] == e:
        st[ST_SLOTS][s, S_HEAD] = st[ST_ENTRIES][e, E_NEXT]
    else:
        p = st[ST_SLOTS][s, S_HEAD]
        while st[ST_ENTRIES][p, E_NEXT] != e:
            p = st[ST_ENTRIES][p, E_NEXT]
        st[ST_ENTRIES][p, E_NEXT] = st[ST_ENTRIES][e, E_NEXT]
    st[ST_ENTRIES][counters[CNT_ENTRY_FREE], E_FREE] = e
    counters[CNT_ENTRY_FREE] += 1
    st[ST_SLOTS][s, S_COUNT] -= 1
    if st[ST_SLOTS][s, S_COUNT] == 0:
        remove_slot(st, s)


@njit(cache=True)
def clear_owner(st, owner):
    """Drop every key of ``owner``."""
    s = st[ST_OWNERS][owner, O_HEAD]
    while s >= 0:
        nxt = st[ST_SLOTS][s, S_NEXT]
        remove_slot(st, s)
        s = nxt


@njit(cache=True)
def rehash(st):
    """Rebuild the table from the live slots (drops tombstones; the table may be new)."""
    table = st[ST_TABLE]
    table[:] = EMPTY
    st[ST_COUNTERS][CNT_TABLE_USED] = 0
    for s in range(len(st[ST_SLOTS])):
        if st[ST_SLOTS][s, S_OWNER] >= 0:
            _insert_table(st, s, st[ST_SLOTS][s, S_OWNER], st[ST_SLOTS][s, S_KEY:], 0, st[ST_SLOTS][s, S_KLEN])


@njit(cache=True, inline="always")
def _same_entry(st, e, cand, c0, n):
    if st[ST_ENTRIES][e, E_LEN] != n:
        return False
    for j in range(n):
        if st[ST_ENTRIES][e, E_TOK + j] != cand[c0 + j]:
            return False
    return True


@njit(cache=True, inline="always")
def key_full(st, s):
    """Whether slot ``s``'s key holds the arena's capacity of candidates: filing a new one
    evicts the least recently used (whose stamps only then are read)."""
    return st[ST_SLOTS][s, S_COUNT] >= st[ST_CFG][CFG_CAPACITY]


@njit(cache=True, inline="always")
def _file_under(st, s, tag, cand, c0, n, origin):
    """File a candidate under slot ``s``, tagged ``tag``: refresh it if held (its origin
    and tag the new ones; moved to the list's front, where it is found first when filed
    again: the list's order is no ranking, stamps are), else add it (evicting the least
    recently used candidate where the key is full)."""
    counters = st[ST_COUNTERS]
    counters[CNT_STAMP] += 1
    full = key_full(st, s)  # the oldest is evicted: find it
    e = st[ST_SLOTS][s, S_HEAD]
    before = -1
    oldest, oldest_stamp = -1, np.int64(0)
    while e >= 0:
        if _same_entry(st, e, cand, c0, n):
            st[ST_STAMPS][e] = counters[CNT_STAMP]
            st[ST_ENTRIES][e, E_ORIGIN] = origin
            st[ST_ENTRIES][e, E_TAG] = tag
            if before >= 0:
                st[ST_ENTRIES][before, E_NEXT] = st[ST_ENTRIES][e, E_NEXT]
                st[ST_ENTRIES][e, E_NEXT] = st[ST_SLOTS][s, S_HEAD]
                st[ST_SLOTS][s, S_HEAD] = e
            return
        if full and (oldest < 0 or st[ST_STAMPS][e] < oldest_stamp):
            oldest, oldest_stamp = e, st[ST_STAMPS][e]
        before = e
        e = st[ST_ENTRIES][e, E_NEXT]
    if full:
        e = oldest
    else:
        counters[CNT_ENTRY_FREE] -= 1
        e = st[ST_ENTRIES][counters[CNT_ENTRY_FREE], E_FREE]
        st[ST_ENTRIES][e, E_NEXT] = st[ST_SLOTS][s, S_HEAD]
        st[ST_SLOTS][s, S_HEAD] = e
        st[ST_SLOTS][s, S_COUNT] += 1
    for j in range(n):
        st[ST_ENTRIES][e, E_TOK + j] = cand[c0 + j]
    st[ST_ENTRIES][e, E_LEN] = n
    st[ST_ENTRIES][e, E_ORIGIN] = origin
    st[ST_ENTRIES][e, E_TAG] = tag
    st[ST_STAMPS][e] = counters[CNT_STAMP]


@njit(cache=True, inline="always")
def file_candidate(st, owner, tag, ctx, k0, k1, cand, c0, c1, origin):
    """File ``cand[c0:c1]``, tagged ``tag``, under every suffix of ``ctx[k0:k1]`` of the
    arena's key lengths (the Python pool's ``add``). A bounded owner past its
    ``O_MAX_KEYS`` plus ``O_RUNNING_KEYS`` keys evicts down to them."""
    n = c1 - c0
    if n <= 0:
        return
    cfg, counters = st[ST_CFG], st[ST_COUNTERS]
    longest = min(cfg[CFG_MAX_KEY], k1 - k0)
    max_keys = st[ST_OWNERS][owner, O_MAX_KEYS]
    bound = max_keys + st[ST_OWNERS][owner, O_RUNNING_KEYS]
    for key_len in range(cfg[CFG_MIN_KEY], longest + 1):
        start = k1 - key_len
        s = find_slot(st, owner, ctx, start, key_len)
        if s < 0:
            counters[CNT_SLOT_FREE] -= 1
            s = st[ST_SLOTS][counters[CNT_SLOT_FREE], S_FREE]
            counters[CNT_LIVE_SLOTS] += 1
            st[ST_SLOTS][s, S_OWNER] = owner
            st[ST_SLOTS][s, S_KLEN] = key_len
            for j in range(key_len):
                st[ST_SLOTS][s, S_KEY + j] = ctx[start + j]
            st[ST_SLOTS][s, S_HEAD] = -1
            st[ST_SLOTS][s, S_COUNT] = 0
            _insert_table(st, s, owner, ctx, start, key_len)
            _append_key(st, s, owner)
            st[ST_OWNERS][owner, O_KEYS] += 1
            _file_under(st, s, tag, cand, c0, n, origin)
            while max_keys > 0 and st[ST_OWNERS][owner, O_KEYS] > bound:  # more than one where requests stopped
                remove_slot(st, st[ST_OWNERS][owner, O_HEAD])
            continue
        refresh_key(st, s)
        _file_under(st, s, tag, cand, c0, n, origin)


@njit(cache=True, inline="always")
def _is_own(st, e, me):
    """Whether candidate ``e`` is the request tagged ``me``'s (< 0: every candidate is its own)."""
    return me < 0 or st[ST_ENTRIES][e, E_TAG] == me


@njit(cache=True, inline="always")
def _weight(st, e, me):
    """Votes candidate ``e`` casts for the request tagged ``me``: its own ``OWN_VOTES`` in a
    tenant's pool, else 1."""
    return OWN_VOTES if me >= 0 and st[ST_ENTRIES][e, E_TAG] == me else 1


@njit(cache=True, inline="always")
def before_on_tie(own, stamp, best_own, best_stamp):
    """The one tie rule of every ranking (candidates, deep matches' places): the asker's
    own before others', then the later (stamps are unique)."""
    return (own and not best_own) or (own == best_own and stamp > best_stamp)


@njit(cache=True, inline="always")
def _newest(st, s, me):
    """The most recently used of slot ``s``'s candidates the request tagged ``me`` filed,
    else of all of them (``me`` < 0: all are its own)."""
    best, best_own, e = -1, False, st[ST_SLOTS][s, S_HEAD]
    while e >= 0:
        own = _is_own(st, e, me)
        if best < 0 or before_on_tie(own, st[ST_STAMPS][e], best_own, st[ST_STAMPS][best]):
            best, best_own = e, own
        e = st[ST_ENTRIES][e, E_NEXT]
    return best


@njit(cache=True)
def by_recency(st, s, out):
    """Slot ``s``'s entries into ``out``, most recently used first; returns how many."""
    n, e = 0, st[ST_SLOTS][s, S_HEAD]
    while e >= 0:
        i = n
        while i > 0 and st[ST_STAMPS][out[i - 1]] < st[ST_STAMPS][e]:
            out[i] = out[i - 1]
            i -= 1
        out[i] = e
        n += 1
        e = st[ST_ENTRIES][e, E_NEXT]
    return n


@njit(cache=True, inline="always")
def _votes(st, s, me, firsts, counts, num):
    """Count the first tokens of slot ``s``'s candidates, each its :func:`_weight`, into
    (firsts, counts)[:num]; returns the new ``num``."""
    e = st[ST_SLOTS][s, S_HEAD]
    while e >= 0:
        first = st[ST_ENTRIES][e, E_TOK + 0]
        k = 0
        while k < num and firsts[k] != first:
            k += 1
        if k == num:
            firsts[num] = first
            counts[num] = 0
            num += 1
        counts[k] += _weight(st, e, me)
        e = st[ST_ENTRIES][e, E_NEXT]
    return num


@njit(cache=True, inline="always")
def _count_of(firsts, counts, num, token):
    for k in range(num):
        if firsts[k] == token:
            return counts[k]
    return 0


@njit(cache=True, inline="always")
def _most_voted(st, s, me, firsts, counts, num):
    """Slot ``s``'s candidate whose first token has the most votes in (firsts, counts)[:num];
    among equals one the request tagged ``me`` filed, then the most recently used (stamps
    are unique): one pass."""
    best, best_votes, best_own, best_stamp = -1, -1, False, np.int64(0)
    e = st[ST_SLOTS][s, S_HEAD]
    while e >= 0:
        c = _count_of(firsts, counts, num, st[ST_ENTRIES][e, E_TOK + 0])
        own = _is_own(st, e, me)
        stamp = st[ST_STAMPS][e]
        if c > best_votes or (c == best_votes and before_on_tie(own, stamp, best_own, best_stamp)):
            best, best_votes, best_own, best_stamp = e, c, own, stamp
        e = st[ST_ENTRIES][e, E_NEXT]
    return best


@njit(cache=True, inline="always")
def match_pool(st, owner, me, ctx, k0, k1, guess, scratch):
    """The Python pool's ``match`` in ``owner`` for the request tagged ``me`` (< 0: the
    pool is the request's alone): returns (entry, key length, whether the request filed
    it), (-1, 0, False) where no suffix of ``ctx[k0:k1]`` holds a candidate. The chosen
    key and candidate are refreshed as the arena's settings say. ``guess`` < 0: none.
    ``scratch``: int64 room for 2 x (the capacity + 1)."""
    cfg = st[ST_CFG]
    longest = min(cfg[CFG_MAX_KEY], k1 - k0)
    votes = cfg[CFG_VOTES] != 0
    cap = len(scratch) // 2
    firsts, counts = scratch[:cap], scratch[cap : 2 * cap]
    for key_len in range(longest, cfg[CFG_MIN_KEY] - 1, -1):
        s = find_slot(st, owner, ctx, k1 - key_len, key_len)
        if s < 0 or st[ST_SLOTS][s, S_HEAD] < 0:
            continue
        if votes:
            num = 0
            if guess >= 0:
                firsts[0], counts[0], num = guess, GUESS_VOTES, 1
            num = _votes(st, s, me, firsts, counts, num)
            best = _most_voted(st, s, me, firsts, counts, num)
        else:
            best = _newest(st, s, me)
        refresh_key(st, s)
        if cfg[CFG_TOUCH] != 0:
            st[ST_COUNTERS][CNT_STAMP] += 1
            st[ST_STAMPS][best] = st[ST_COUNTERS][CNT_STAMP]
        return best, key_len, _is_own(st, best, me)
    return -1, 0, False


@njit(cache=True)
def slot_entries(st, owner, ctx, k0, k1, out):
    """The entries under exactly the key ``ctx[k0:k1]``, most recently used first, into
    ``out``; returns how many (0 where the key is not held)."""
    s = find_slot(st, owner, ctx, k0, k1 - k0)
    return 0 if s < 0 else by_recency(st, s, out)


@njit(cache=True)
def owner_slots(st, owner, out):
    """``owner``'s keys in their order (least recently used first) into ``out``; returns
    how many."""
    n, s = 0, st[ST_OWNERS][owner, O_HEAD]
    while s >= 0:
        out[n] = s
        n += 1
        s = st[ST_SLOTS][s, S_NEXT]
    return n


@njit(cache=True)
def owner_entries(st, owner):
    """Candidates held under all of ``owner``'s keys."""
    total, s = 0, st[ST_OWNERS][owner, O_HEAD]
    while s >= 0:
        total += st[ST_SLOTS][s, S_COUNT]
        s = st[ST_SLOTS][s, S_NEXT]
    return total
