"""numba kernels of the deep matches (:mod:`vllm_fafo.drafting.deep_match`).

Texts (a request's prompt and output so far; kept on as its tenant's answer
once it finishes) live in one int32 store, each a segment (``start``,
``length``, ``capacity``) that the Python side moves when it outgrows its
room. Where each ``key_len``-token key of a text ended is chained twice, in
one table of heads (``heads``: open addressing with linear probing; a cell holds
a text id and the key's latest end in it, and whether it heads an answers' chain):

- in the request's own text, keyed by the text id and the key; beside each token
  of the store, the end before it of the same key (``prev``, -1: none). A
  running text's positions are never removed, so the chain's first
  ``MAX_POSITIONS`` are the latest ones; its cells are deleted when its request
  stops (:func:`forget_own`);
- in its tenant's answers (the answers kept, running requests' included), keyed by
  the tenant's answers owner and the key; beside each answer token, the place
  (text id, end) filed before it under the same key (``links``), with the text's
  generation (``gens``, counted up each time a text id is freed). A lookup walks
  the chain from its head, the latest place first, and stops at a place whose
  answer was forgotten (its text freed or its answer no longer kept): the places
  are the latest ``MAX_POSITIONS`` filed after the key's latest forgotten one. A
  forgotten answer's cells are deleted (:func:`forget_answer`): every cell points
  into a live text, whose tokens its key is compared with.

Deletion shifts the cells after a gap back where their key allows (linear
probing's deletion: no tombstones, no rebuild); the table grows to at least four
times its cells where it would be more than half full (:func:`rehash`). A place
costs a cell and a link where a key filed in a :class:`~vllm_fafo.drafting.pool.PoolArena`
cost a key row, a candidate row and their lists (docs/results/host-time.md).

The feeding and the match are inlined into the step's kernel, as the pool's
per-key kernels are (:mod:`vllm_fafo.drafting.pool_kernels`).
"""

from __future__ import annotations

import numpy as np
from numba import njit

from vllm_fafo.drafting.pool_kernels import before_on_tie, hash_key

MAX_POSITIONS = 4
"""Latest places per key compared (:data:`vllm_fafo.drafting.deep_match.MAX_POSITIONS`, checked there)."""
ANSWER_CELL = np.int64(1 << 62)
"""A cell's flag: it heads an answers' chain (else an own text's)."""
_END_BITS = np.int64(32)
_END_MASK = np.int64((1 << 32) - 1)
_TEXT_MASK = np.int64((1 << 30) - 1)
LINK_BITS = 24
"""Bits of a link's text id and of its end: texts of at most 2**24 tokens, 2**24 text ids."""
_LINK_MASK = np.int64((1 << LINK_BITS) - 1)
_GEN_MASK = np.int64((1 << 15) - 1)
"""A link holds its text's generation's low 15 bits (a link into a text id freed 32,768
times since is taken as live: its place is still compared token by token)."""


@njit(cache=True, inline="always")
def _text_of(cell):
    return (cell >> _END_BITS) & _TEXT_MASK


@njit(cache=True, inline="always")
def _end_of(cell):
    return (cell & _END_MASK) - 1


@njit(cache=True, inline="always")
def _hash_domain(domain, answer):
    """The hash's first word: the text id (own chains), or below 0 the answers owner."""
    return -1 - domain if answer else domain


@njit(cache=True, inline="always")
def _find_cell(heads, domain, answer, tokens, k0, key_len, store, t_start, t_answers):
    """The cell of the key ``tokens[k0:k0+key_len]`` in text ``domain``'s chains (``answer``
    false) or in answers owner ``domain``'s (true), and whether it holds the key (else it is
    the empty cell to fill)."""
    mask = len(heads) - 1
    i = hash_key(_hash_domain(domain, answer), tokens, k0, key_len) & mask
    while True:
        cell = heads[i]
        if cell == 0:
            return i, False
        text = _text_of(cell)
        if ((cell & ANSWER_CELL) != 0) == answer and (t_answers[text] == domain if answer else text == domain):
            k = t_start[text] + _end_of(cell) - key_len + 1
            same = True
            for j in range(key_len):
                if store[k + j] != tokens[k0 + j]:
                    same = False
                    break
            if same:
                return i, True
        i = (i + 1) & mask


@njit(cache=True, inline="always")
def _home(heads, cell, store, t_start, t_answers, key_len):
    """Where a cell's key hashes to (its text's tokens read from the store)."""
    text = _text_of(cell)
    answer = (cell & ANSWER_CELL) != 0
    domain = t_answers[text] if answer else text
    k = t_start[text] + _end_of(cell) - key_len + 1
    return hash_key(_hash_domain(domain, answer), store, k, key_len) & (len(heads) - 1)


@njit(cache=True, inline="always")
def _delete_cell(heads, used, i, store, t_start, t_answers, key_len):
    """Empty cell ``i``, the gap closed by moving the cells after it back where their key
    allows (the table stays as if the cell had never been filed)."""
    mask = len(heads) - 1
    used[0] -= 1
    j = i
    while True:
        j = (j + 1) & mask
        cell = heads[j]
        if cell == 0:
            break
        home = _home(heads, cell, store, t_start, t_answers, key_len)
        if (j - home) & mask >= (j - i) & mask:  # its home is at or before the gap: it may fill it
            heads[i] = cell
            i = j
    heads[i] = 0


@njit(cache=True, inline="always")
def file_own(heads, used, prev, store, t_start, t_answers, end, key_len, text):
    """Chain the key ending at ``end`` of text ``text``: its cell takes ``end``, ``prev``
    beside it the key's end before (-1: none)."""
    start = t_start[text]
    i, held = _find_cell(heads, text, False, store, start + end - key_len + 1, key_len, store, t_start, t_answers)
    if held:
        prev[start + end] = _end_of(heads[i])
    else:
        prev[start + end] = -1
        used[0] += 1
    heads[i] = (np.int64(text) << _END_BITS) | np.int64(end + 1)


@njit(cache=True, inline="always")
def file_answer(heads, used, links, gens, store, t_start, t_answers, end, key_len, text):
    """Chain the key ending at ``end`` of text ``text`` under its answers owner: its cell
    takes (``text``, ``end``), ``links`` beside it the place it held (-1: none)."""
    start = t_start[text]
    i, held = _find_cell(heads, t_answers[text], True, store, start + end - key_len + 1, key_len, store, t_start,
                         t_answers)
    if held:
        before = _text_of(heads[i])
        links[start + end] = ((gens[before] & _GEN_MASK) << (2 * LINK_BITS)) | (before << LINK_BITS) | _end_of(heads[i])
    else:
        links[start + end] = -1
        used[0] += 1
    heads[i] = ANSWER_CELL | (np.int64(text) << _END_BITS) | np.int64(end + 1)


@njit(cache=True)
def index_own(heads, used, prev, store, t_start, t_answers, old_len, new_len, key_len, text):
    """Chain the keys of text ``text`` that got their following token when it grew from
    ``old_len`` to ``new_len`` tokens (a prompt: from 0)."""
    first = max(0, old_len - key_len)
    for end in range(first + key_len - 1, new_len - 1):
        file_own(heads, used, prev, store, t_start, t_answers, end, key_len, text)


@njit(cache=True)
def forget_own(heads, used, store, t_start, t_answers, length, key_len, text):
    """Delete the cells of text ``text``'s own chains (its first ``length`` tokens fed)."""
    start = t_start[text]
    for end in range(key_len - 1, length - 1):
        i, held = _find_cell(heads, text, False, store, start + end - key_len + 1, key_len, store, t_start, t_answers)
        if held:  # else a later end of the same key's, deleted already
            _delete_cell(heads, used, i, store, t_start, t_answers, key_len)


@njit(cache=True)
def forget_answer(heads, used, store, t_start, t_answers, answer_start, length, key_len, text):
    """Delete the answers' cells that point into text ``text`` (its keys ending from
    ``answer_start`` - 1 on, filed under its answers owner): the chains through its places
    end there."""
    start = t_start[text]
    first = max(0, answer_start - key_len)
    for end in range(first + key_len - 1, length - 1):
        i, held = _find_cell(heads, t_answers[text], True, store, start + end - key_len + 1, key_len, store, t_start,
                             t_answers)
        if held and _text_of(heads[i]) == text:
            _delete_cell(heads, used, i, store, t_start, t_answers, key_len)


@njit(cache=True)
def rehash(old, heads, store, t_start, t_answers, key_len):
    """Move the cells of ``old`` into the empty, larger table ``heads``."""
    mask = len(heads) - 1
    for cell in old:
        if cell != 0:
            i = _home(heads, cell, store, t_start, t_answers, key_len)
            while heads[i] != 0:
                i = (i + 1) & mask
            heads[i] = cell


@njit(cache=True, inline="always")
def feed_text(heads, used, prev, links, gens, store, t_start, t_answers, old_len, new_len, key_len, text):
    """File the keys of text ``text`` that got their following token when it grew from
    ``old_len`` to ``new_len`` tokens: each key's end in the text's chain (:func:`file_own`)
    and, where its answer is kept, in its answers owner's (:func:`file_answer`)."""
    first = max(0, old_len - key_len)
    answer = t_answers[text] >= 0
    for end in range(first + key_len - 1, new_len - 1):
        file_own(heads, used, prev, store, t_start, t_answers, end, key_len, text)
        if answer:
            file_answer(heads, used, links, gens, store, t_start, t_answers, end, key_len, text)


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
    and later (stamps grow with filing: one pass, no sorting)."""
    return depth > best[2] or (depth == best[2] and before_on_tie(mine, stamp, best[4], best[3]))


@njit(cache=True, inline="always")
def _deepest_answer(heads, links, gens, store, t_start, t_answers, context, k0, key_len, n_ctx, answers, own_text,
                    best):
    """``best`` after the latest ``MAX_POSITIONS`` places of the context's key under
    ``answers`` (up to a forgotten one), other texts than ``own_text``."""
    i, held = _find_cell(heads, answers, True, context, k0, key_len, store, t_start, t_answers)
    if not held:
        return best
    text, end = _text_of(heads[i]), _end_of(heads[i])
    for k in range(MAX_POSITIONS):
        link = links[t_start[text] + end]  # read first: its cache miss overlaps the compare's
        if text != own_text:
            depth = _depth(store, t_start[text], end, context, n_ctx)
            stamp = np.int64(MAX_POSITIONS - k)  # the latest first
            if _beats(depth, False, stamp, best):
                best = (text, end, depth, stamp, False)
        if link < 0:
            break
        text, end = (link >> LINK_BITS) & _LINK_MASK, link & _LINK_MASK
        if (gens[text] & _GEN_MASK) != link >> (2 * LINK_BITS) or t_answers[text] != answers:
            break  # its answer was forgotten
    return best


@njit(cache=True, inline="always")
def _deepest_own(heads, prev, store, t_start, t_answers, context, k0, key_len, n_ctx, own_text, best):
    """``best`` after the latest ``MAX_POSITIONS`` ends of the context's key in the own
    text ``own_text``, along its chain."""
    i, held = _find_cell(heads, own_text, False, context, k0, key_len, store, t_start, t_answers)
    end = _end_of(heads[i]) if held else -1
    start = t_start[own_text]
    for _ in range(MAX_POSITIONS):
        if end < 0:
            break
        before = prev[start + end]  # read first, as the answers' walk does
        depth = _depth(store, start, end, context, n_ctx)
        if _beats(depth, True, np.int64(end), best):
            best = (own_text, end, depth, np.int64(end), True)
        end = before
    return best


@njit(cache=True, inline="always")
def deep_match(heads, prev, links, gens, store, t_start, t_answers, context, n_ctx, key_len, own_text):
    """The deepest match of ``context[:n_ctx]``'s end at least ``key_len`` deep: in the
    kept answers of ``own_text``'s tenant (other texts than ``own_text``) and in the own
    text (its chain), the own text on ties, then the latest place (:func:`_beats`).
    Returns (text id, end position, depth), depth 0 where none."""
    if n_ctx < key_len:
        return -1, -1, 0
    k0 = n_ctx - key_len
    best = (-1, -1, 0, np.int64(0), False)
    answers = t_answers[own_text]
    if answers >= 0:
        best = _deepest_answer(heads, links, gens, store, t_start, t_answers, context, k0, key_len, n_ctx, answers,
                               own_text, best)
    best = _deepest_own(heads, prev, store, t_start, t_answers, context, k0, key_len, n_ctx, own_text, best)
    if best[2] < key_len:
        return -1, -1, 0
    return best[0], best[1], best[2]
