"""numba kernels of the deep matches (:mod:`vllm_fafo.drafting.deep_match`).

Texts (a request's prompt and output so far; kept on as its tenant's answer
once it finishes) live in one int32 store, each a segment (``start``,
``length``, ``capacity``) that the Python side moves when it outgrows its
room. Where each ``key_len``-token key of a text ended is filed in a
:class:`~vllm_fafo.drafting.pool.PoolArena` of fixed-length keys (the pool
kernels): under the request's own owner the positions in its own text
(candidates of one token), under its tenant's answers owner the places
(text id, position) in every answer kept; each key keeps the latest
``MAX_POSITIONS``, the oldest evicted first (recency is filing order).
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
    remove_entry,
)


@njit(cache=True, inline="always")
def feed_text(pos, store, start, old_len, new_len, key_len, own, answers, text_id, place):
    """File the keys of ``store[start:start+new_len]`` that got their following token
    when the text grew from ``old_len`` to ``new_len`` tokens: each key's end under ``own``
    and, where ``answers`` >= 0, (``text_id``, end) under ``answers``."""
    first = max(0, old_len - key_len)
    for end in range(first + key_len - 1, new_len - 1):
        k0 = start + end - key_len + 1
        place[0] = end
        file_candidate(pos, own, 0, store, k0, k0 + key_len, place, 0, 1, 0)
        if answers >= 0:
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
def _deepest_place(pos, s, store, t_start, context, n_ctx, own_text, answers_key, best):
    """``best`` (text, end, depth, stamp, the own text's) after the places under slot ``s``
    (-1: none): answers' (text id, end) where ``answers_key``, other texts than
    ``own_text``; else the own text's ends. A place beats the best so far where deeper,
    or as deep and the own text's where the best is not, or as deep, of the same kind and
    later (stamps are unique: one pass, no sorting)."""
    e = -1 if s < 0 else pos[ST_SLOTS][s, S_HEAD]
    while e >= 0:
        text = pos[ST_ENTRIES][e, E_TOK + 0] if answers_key else own_text
        end = pos[ST_ENTRIES][e, E_TOK + 1] if answers_key else pos[ST_ENTRIES][e, E_TOK + 0]
        if not (answers_key and text == own_text):
            mine, stamp = not answers_key, pos[ST_STAMPS][e]
            depth = _depth(store, t_start[text], end, context, n_ctx)
            if depth > best[2] or (depth == best[2] and before_on_tie(mine, stamp, best[4], best[3])):
                best = (text, end, depth, stamp, mine)
        e = pos[ST_ENTRIES][e, E_NEXT]
    return best


@njit(cache=True, inline="always")
def deep_match(pos, store, t_start, t_len, context, n_ctx, key_len, own, answers, own_text):
    """The deepest match of ``context[:n_ctx]``'s end at least ``key_len`` deep: in the
    kept answers (places under ``answers``, other texts than ``own_text``) and in the
    own text (positions under ``own``), the own text on ties, then the latest place
    (:func:`_deepest_place`). Returns (text id, end position, depth), depth 0 where none."""
    if n_ctx < key_len:
        return -1, -1, 0
    k0 = n_ctx - key_len
    best = (-1, -1, 0, np.int64(0), False)
    if answers >= 0:
        best = _deepest_place(pos, find_slot(pos, answers, context, k0, key_len), store, t_start, context, n_ctx,
                              own_text, True, best)
    best = _deepest_place(pos, find_slot(pos, own, context, k0, key_len), store, t_start, context, n_ctx, own_text,
                          False, best)
    if best[2] < key_len:
        return -1, -1, 0
    return best[0], best[1], best[2]
