"""numba kernels of the deep matches (:mod:`vllm_fafo.drafting.deep_match`).

Texts (a request's prompt and output so far; kept on as its tenant's answer
once it finishes) live in one int32 store, each a segment (``start``,
``length``, ``capacity``) that the Python side moves when it outgrows its
room. Where each ``key_len``-token key of a text ended is filed twice:

- in the request's own text, as a hash chain: a table of heads (``heads``,
  open addressing with linear probing on the text id and the key; a cell holds
  the text id and the key's latest end) and, beside each token of the store, the
  end before it of the same key (``prev``, -1: none). A running text's positions
  are never removed, so the chain's first ``MAX_POSITIONS`` are the latest ones;
  its cells are deleted when its request stops (:func:`forget_own`, shifting the
  cells after each back: no tombstones, no rebuild), and the table grows to at
  least four times its cells where it would be more than half full (:func:`rehash_own`). A position costs a cell
  and an int32 where a key filed in an arena cost a key row, a candidate row and
  their lists: filing the own positions there was half of the feeding's time
  (docs/results/host-time.md);
- under its tenant's answers owner, the places (text id, position) in every
  answer kept, in a :class:`~vllm_fafo.drafting.pool.PoolArena` of fixed-length
  keys (the pool kernels), each key the latest ``MAX_POSITIONS``, the oldest
  evicted first (recency is filing order).

The feeding and the match are inlined into the step's kernel, as the pool's
per-key kernels are (:mod:`vllm_fafo.drafting.pool_kernels`).
"""

from __future__ import annotations

import numpy as np
from numba import njit

from vllm_fafo.drafting.pool_kernels import (
    E_NEXT,
    E_TOK,
    S_HEAD,
    ST_ENTRIES,
    ST_SLOTS,
    ST_STAMPS,
    before_on_tie,
    file_candidate,
    find_slot,
    hash_key,
    remove_entry,
)

MAX_POSITIONS = 4
"""Latest places per key compared (:data:`vllm_fafo.drafting.deep_match.MAX_POSITIONS`, checked there)."""
_END_BITS = np.int64(32)
_END_MASK = np.int64((1 << 32) - 1)


@njit(cache=True, inline="always")
def _own_cell(heads, text, tokens, k0, key_len, store, start):
    """The cell of text ``text``'s key ``tokens[k0:k0+key_len]`` in ``heads`` (the text at
    ``store[start:]``), and whether it holds the key (else it is the empty cell to fill)."""
    mask = len(heads) - 1
    i = hash_key(text, tokens, k0, key_len) & mask
    while True:
        cell = heads[i]
        if cell == 0:
            return i, False
        if cell >> _END_BITS == text:
            end = (cell & _END_MASK) - 1
            same = True
            for j in range(key_len):
                if store[start + end - key_len + 1 + j] != tokens[k0 + j]:
                    same = False
                    break
            if same:
                return i, True
        i = (i + 1) & mask


@njit(cache=True, inline="always")
def _home(heads, cell, store, t_start, key_len):
    """Where a cell's key hashes to (its text's tokens read from the store)."""
    text, end = cell >> _END_BITS, (cell & _END_MASK) - 1
    return hash_key(text, store, t_start[text] + end - key_len + 1, key_len) & (len(heads) - 1)


@njit(cache=True, inline="always")
def file_own(heads, used, prev, store, start, end, key_len, text):
    """Chain the key ending at ``end`` of text ``text`` (at ``store[start:]``): its cell
    takes ``end``, ``prev`` beside it the key's end before (-1: none)."""
    i, held = _own_cell(heads, text, store, start + end - key_len + 1, key_len, store, start)
    if held:
        prev[start + end] = (heads[i] & _END_MASK) - 1
    else:
        prev[start + end] = -1
        used[0] += 1
    heads[i] = (np.int64(text) << _END_BITS) | np.int64(end + 1)


@njit(cache=True)
def index_own(heads, used, prev, store, start, old_len, new_len, key_len, text):
    """Chain the keys of text ``text`` (at ``store[start:]``) that got their following
    token when it grew from ``old_len`` to ``new_len`` tokens (a prompt: from 0)."""
    first = max(0, old_len - key_len)
    for end in range(first + key_len - 1, new_len - 1):
        file_own(heads, used, prev, store, start, end, key_len, text)


@njit(cache=True)
def forget_own(heads, used, store, t_start, length, key_len, text):
    """Delete the cells of text ``text``'s chains (its first ``length`` tokens fed), each
    gap closed by moving the cells after it back where their key allows (linear
    probing's deletion: the table stays as if they had never been filed)."""
    mask = len(heads) - 1
    start = t_start[text]
    for end in range(key_len - 1, length - 1):
        i, held = _own_cell(heads, text, store, start + end - key_len + 1, key_len, store, start)
        if not held:
            continue  # a later end of the same key's, deleted already
        used[0] -= 1
        j = i
        while True:
            j = (j + 1) & mask
            cell = heads[j]
            if cell == 0:
                break
            home = _home(heads, cell, store, t_start, key_len)
            if (j - home) & mask >= (j - i) & mask:  # its home is at or before the gap: it may fill it
                heads[i] = cell
                i = j
        heads[i] = 0


@njit(cache=True)
def rehash_own(old, heads, store, t_start, key_len):
    """Move the cells of ``old`` into the empty, larger table ``heads``."""
    mask = len(heads) - 1
    for cell in old:
        if cell != 0:
            i = _home(heads, cell, store, t_start, key_len)
            while heads[i] != 0:
                i = (i + 1) & mask
            heads[i] = cell


@njit(cache=True, inline="always")
def feed_text(pos, heads, used, prev, store, start, old_len, new_len, key_len, answers, text_id, place):
    """File the keys of ``store[start:start+new_len]`` (text ``text_id``) that got their
    following token when the text grew from ``old_len`` to ``new_len`` tokens: each key's
    end in the text's chain (:func:`file_own`) and, where ``answers`` >= 0, (``text_id``,
    end) under ``answers``."""
    first = max(0, old_len - key_len)
    for end in range(first + key_len - 1, new_len - 1):
        file_own(heads, used, prev, store, start, end, key_len, text_id)
        if answers >= 0:
            k0 = start + end - key_len + 1
            place[0], place[1] = text_id, end
            file_candidate(pos, answers, 0, store, k0, k0 + key_len, place, 0, 2, 0)


@njit(cache=True)
def forget_answer(pos, store, start, answer_start, length, key_len, answers, text_id):
    """Drop every place of text ``text_id`` (its keys ending from ``answer_start`` - 1 on)
    from the tenant's ``answers``."""
    first = max(0, answer_start - key_len)
    for end in range(first + key_len - 1, length - 1):
        k0 = start + end - key_len + 1
        s = find_slot(pos, answers, store, k0, key_len)
        if s < 0:
            continue
        e = pos[ST_SLOTS][s, S_HEAD]
        while e >= 0:
            nxt = pos[ST_ENTRIES][e, E_NEXT]
            if pos[ST_ENTRIES][e, E_TOK + 0] == text_id:
                remove_entry(pos, s, e)
            e = nxt


@njit(cache=True, inline="always")
def _depth(store, start, end, context, n_ctx):
    """Tokens back from ``store[start + end]`` equal to the context's end, at most ``n_ctx``."""
    depth = 0
    while depth < n_ctx and end - depth >= 0 and store[start + end - depth] == context[n_ctx - 1 - depth]:
        depth += 1
    return depth


@njit(cache=True, inline="always")
def _beats(depth, mine, stamp, best):
    """Whether a place beats ``best`` (text, end, depth, stamp, the own text's): deeper,
    or as deep and the own text's where the best is not, or as deep, of the same kind
    and later (stamps are unique, the own text's are its positions: one pass, no sorting)."""
    return depth > best[2] or (depth == best[2] and before_on_tie(mine, stamp, best[4], best[3]))


@njit(cache=True, inline="always")
def _deepest_answer(pos, s, store, t_start, context, n_ctx, own_text, best):
    """``best`` after the answers' places (text id, end) under slot ``s`` (-1: none), other
    texts than ``own_text``."""
    e = -1 if s < 0 else pos[ST_SLOTS][s, S_HEAD]
    while e >= 0:
        text, end = pos[ST_ENTRIES][e, E_TOK + 0], pos[ST_ENTRIES][e, E_TOK + 1]
        if text != own_text:
            stamp = pos[ST_STAMPS][e]
            depth = _depth(store, t_start[text], end, context, n_ctx)
            if _beats(depth, False, stamp, best):
                best = (text, end, depth, stamp, False)
        e = pos[ST_ENTRIES][e, E_NEXT]
    return best


@njit(cache=True, inline="always")
def _deepest_own(heads, prev, store, start, context, k0, key_len, n_ctx, own_text, best):
    """``best`` after the latest ``MAX_POSITIONS`` ends of the context's key in the own
    text ``own_text`` (at ``store[start:]``), along its chain."""
    i, held = _own_cell(heads, own_text, context, k0, key_len, store, start)
    end = (heads[i] & _END_MASK) - 1 if held else -1
    for _ in range(MAX_POSITIONS):
        if end < 0:
            break
        depth = _depth(store, start, end, context, n_ctx)
        if _beats(depth, True, np.int64(end), best):
            best = (own_text, end, depth, np.int64(end), True)
        end = prev[start + end]
    return best


@njit(cache=True, inline="always")
def deep_match(pos, heads, prev, store, t_start, t_len, context, n_ctx, key_len, answers, own_text):
    """The deepest match of ``context[:n_ctx]``'s end at least ``key_len`` deep: in the
    kept answers (places under ``answers``, other texts than ``own_text``) and in the
    own text (its chain), the own text on ties, then the latest place
    (:func:`_beats`). Returns (text id, end position, depth), depth 0 where none."""
    if n_ctx < key_len:
        return -1, -1, 0
    k0 = n_ctx - key_len
    best = (-1, -1, 0, np.int64(0), False)
    if answers >= 0:
        best = _deepest_answer(pos, find_slot(pos, answers, context, k0, key_len), store, t_start, context, n_ctx,
                               own_text, best)
    best = _deepest_own(heads, prev, store, t_start[own_text], context, k0, key_len, n_ctx, own_text, best)
    if best[2] < key_len:
        return -1, -1, 0
    return best[0], best[1], best[2]
