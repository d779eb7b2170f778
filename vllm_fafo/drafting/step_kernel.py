"""The step's one kernel call: every decoding request's filing and draft.

:func:`file_and_draft` runs, for each request in row order (the order vLLM's
batch has), what the Python proposer ran per request: file the n-grams its
text completed into its pool (its tenant's where pools are shared, tagged as
its own; :mod:`vllm_fafo.drafting.pool_kernels`), feed its text to the deep matches
and match its end there (:mod:`vllm_fafo.drafting.text_kernels`), then chain
pool candidates after the deep match (or from scratch), where the pools miss
Cacheback's frozen table, then the prior table, into preallocated outputs.
:class:`vllm_fafo.drafting.index.DraftIndex` prepares its arguments.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from vllm_fafo.drafting.pool_kernels import (
    CFG_MAX_KEY,
    CFG_MIN_KEY,
    CFG_VOTES,
    E_LEN,
    E_NEXT,
    E_ORIGIN,
    E_TOK,
    O_RUNNING_KEYS,
    S_HEAD,
    ST_CFG,
    ST_ENTRIES,
    ST_OWNERS,
    ST_SLOTS,
    ST_STAMPS,
    ST_TABLE,
    file_candidate,
    has_room,
    hash_key,
    match_pool,
)
from vllm_fafo.drafting.text_kernels import deep_match, feed_text

ORIGIN_PROMPT, ORIGIN_OUTPUT, ORIGIN_SHARED, ORIGIN_DEEP_MATCH, ORIGIN_PRIOR = 0, 1, 4, 5, 7
""":class:`~vllm_fafo.drafting.pool.Origin` codes (checked there)."""
MATCH_DEPTH = 24
"""The deep matches' depth (:data:`vllm_fafo.drafting.deep_match.MATCH_DEPTH`, checked there)."""


@njit(cache=True)
def _prior_piece(prior, prior_lens, token):
    if token < 0 or token >= len(prior_lens):
        return 0
    return prior_lens[token]


@njit(cache=True, inline="always")
def _filing_stop(num_tokens, prompt_len, ngram_len, seed_from_output):
    """The first anchor a text of ``num_tokens`` tokens cannot file yet: its n-gram is
    not whole (nor, where output is not seeded, inside the prompt)."""
    stop = num_tokens - ngram_len
    if not seed_from_output:
        stop = min(stop, prompt_len - ngram_len)
    return stop


@njit(cache=True, inline="always")
def anchor_keys(st, anchors):
    """The keys ``anchors`` filed anchors count for (every key length each: at most what
    they file): what a request's filing adds to its tenant's pool's ``O_RUNNING_KEYS``
    while it runs (taken off when it stops: :meth:`~vllm_fafo.drafting.index.DraftIndex.stop`)."""
    return anchors * (st[ST_CFG][CFG_MAX_KEY] - st[ST_CFG][CFG_MIN_KEY] + 1)


ROOM_OK, ROOM_POOLS, ROOM_TEXTS, ROOM_OUTPUTS = range(4)
""":func:`file_and_draft`'s answers: done, or nothing done because the pools' arena, the
texts or the outputs lack room (the caller grows them and calls again)."""


@njit(cache=True)
def _room(st, heads_room, t_cap, t_len, deep_on, slots, owners, num_tokens, prompt_lens, next_anchors,
          max_draft, max_len, ngram_len, seed_from_output, drafts, context, max_key):
    """Whether the step fits what is allocated (:data:`ROOM_OK`), else what lacks room:
    the keys it files (each anchor's keys), the texts' growth and their chains' cells
    (``heads_room``: cells free to fill; two per place), the outputs' rows and width; and
    the keys it files (0 where it stopped before counting them all; :data:`ROOM_OK`'s and
    :data:`ROOM_POOLS`' are whole)."""
    count = len(num_tokens)
    if count > drafts.shape[0]:
        return ROOM_OUTPUTS, 0
    keys, places = 0, 0
    for i in range(count):
        s = slots[i]
        if min(max_draft, max_len - num_tokens[i]) > drafts.shape[1]:
            return ROOM_OUTPUTS, 0
        stop = _filing_stop(num_tokens[i], prompt_lens[s], ngram_len, seed_from_output)
        if stop > next_anchors[s]:
            keys += stop - next_anchors[s]
        if deep_on:
            text = owners[s, 2]
            if num_tokens[i] > t_cap[text]:
                return ROOM_TEXTS, 0
            places += max(num_tokens[i] - t_len[text], 0)
    keys *= max_key - st[ST_CFG][CFG_MIN_KEY] + 1
    if 2 * max_key + 2 * drafts.shape[1] + MATCH_DEPTH > len(context):
        return ROOM_OUTPUTS, keys
    if not has_room(st, keys, ngram_len):
        return ROOM_POOLS, keys
    if deep_on and 2 * places > heads_room:
        return ROOM_TEXTS, keys
    return ROOM_OK, keys


@njit(cache=True)
def _touch_filing(st, history, rows, num_tokens, slots, prompt_lens, next_anchors, owners, ngram_len,
                  seed_from_output, max_key, num_keys):
    """Read, changing nothing, what the step's filing will probe (each key's table cell,
    its key row, its candidates' rows, each read at its stamp and its link), in passes
    over its keys (at most ``num_keys``, as :func:`_room` counted them): the cells, the
    rows, then the candidate lists a candidate at a time, every key's in each pass;
    returns a checksum. Each pass's reads are independent of each other, so the processor
    overlaps their cache misses; the filing's own probes wait each for the one before (the
    caches are cold after a forward: docs/results/host-time.md)."""
    table, keys, entries, stamps = st[ST_TABLE], st[ST_SLOTS], st[ST_ENTRIES], st[ST_STAMPS]
    mask = len(table) - 1
    min_key = st[ST_CFG][CFG_MIN_KEY]
    cells = np.empty(num_keys, dtype=np.int64)
    n = 0
    for i in range(len(rows)):
        s = slots[i]
        hist = history[rows[i]]
        stop = _filing_stop(num_tokens[i], prompt_lens[s], ngram_len, seed_from_output)
        for anchor in range(next_anchors[s], stop):
            end = anchor + 1
            for key_len in range(min_key, min(max_key, end) + 1):
                cells[n] = table[hash_key(owners[s, 0], hist, end - key_len, key_len) & mask]
                n += 1
    for j in range(n):
        slot = cells[j] - 1
        cells[j] = keys[slot, S_HEAD] if slot >= 0 else -1
    # walk every key's candidates a step at a time, all keys in each round
    checksum = 0
    live = n
    while live > 0:
        live = 0
        for j in range(n):
            e = cells[j]
            if e >= 0:
                checksum += stamps[e]  # the row's first bytes (its stamp; E_NEXT below)
                cells[j] = entries[e, E_NEXT]
                live += 1
    return checksum


@njit(cache=True)
def file_and_draft(st, frozen, frozen_owner, prior, prior_lens, texts, history, rows, num_tokens, slots, prompt_lens,
                   next_anchors, owners, max_draft, max_len, ngram_len, seed_from_output, drafts, origins,
                   draft_lens, key_lens, scratch, context, kept_lens, draft_stride, draft_phase):
    """One step's filing and drafting for every decoding request, in row order (the
    Python proposer's loop). Request i's numbers are entry ``s = slots[i]`` of
    ``owners``, ``prompt_lens`` and ``next_anchors`` (tables by slot), its text the first
    ``num_tokens[i]`` tokens of ``history[rows[i]]``: file the n-grams it completed since
    ``next_anchors[s]`` into its pool ``owners[s, 0]`` tagged ``owners[s, 1]`` (its
    tenant's pool, which holds the keys filed so on top of its bound,
    :func:`anchor_keys`; -1: the pool is its own), then draft up to ``min(max_draft, max_len -
    num_tokens[i])`` tokens: a deep match
    first, then chained candidates of the pools, where they miss Cacheback's frozen table
    (``frozen``, its owner ``frozen_owner``; None: none), then the prior table (``prior_lens`` non-empty), whose next
    token votes where the pools rank by votes. ``texts``: the deep matches' (the chains'
    heads, cells used, ``prev``, ``links`` and text generations, store, text starts, lengths,
    capacities, answers owner by text, key length, on); request i's text is
    ``owners[s, 2]``, fed up to ``num_tokens``.
    Writes rows ``:len(rows)`` of ``drafts``, ``origins``, ``draft_lens``, ``key_lens`` (the
    deep match's depth, else the first piece's key, 0
    for the prior table's) and advances ``next_anchors``. ``context``: int32 room for
    ``MATCH_DEPTH`` + twice the keys and the outputs' width. Every request files; it drafts
    where its entry of ``kept_lens`` (by slot: its draft kept last step) is not 0, or it is
    every ``draft_stride``-th from request ``draft_phase`` (below the stride) on, else its
    draft is empty (:data:`~vllm_fafo.propose_kernel.SAMPLED_DRAFTS`; stride 1: every
    request drafts). Returns :data:`ROOM_OK`,
    or, having changed nothing, what lacks room (:func:`_room`), with the keys the step
    files (the arena's room to make for :data:`ROOM_POOLS`)."""
    max_key = st[ST_CFG][CFG_MAX_KEY]
    votes = st[ST_CFG][CFG_VOTES] != 0
    heads, heads_used, prev, links, gens, store, t_start, t_len, t_cap, t_answers, deep_key, deep_on = texts
    heads_room = len(heads) // 2 - heads_used[0]  # the chains' table kept at most half full
    room_status, num_keys = _room(st, heads_room, t_cap, t_len, deep_on, slots, owners, num_tokens, prompt_lens,
                                  next_anchors, max_draft, max_len, ngram_len, seed_from_output, drafts, context,
                                  max_key)
    if room_status != ROOM_OK:
        return room_status, num_keys
    # the touch pass's checksum stored, so that its reads stay (match_pool overwrites the scratch)
    scratch[0] = _touch_filing(st, history, rows, num_tokens, slots, prompt_lens, next_anchors, owners, ngram_len,
                               seed_from_output, max_key, num_keys)
    for i in range(len(rows)):
        s = slots[i]
        pool, tag = owners[s, 0], owners[s, 1]
        drafts[i, :] = 0
        origins[i, :] = 0
        hist = history[rows[i]]
        n_tok = num_tokens[i]
        # file the completed n-grams (anchors whose n-gram is whole)
        stop, start = _filing_stop(n_tok, prompt_lens[s], ngram_len, seed_from_output), next_anchors[s]
        if stop > start:
            next_anchors[s] = stop
            if tag >= 0:  # held on top of the tenant's bound from the first
                st[ST_OWNERS][pool, O_RUNNING_KEYS] += anchor_keys(st, stop - start)
        for anchor in range(start, stop):
            end = anchor + 1
            origin = ORIGIN_PROMPT if anchor + ngram_len < prompt_lens[s] else ORIGIN_OUTPUT
            k0 = max(0, end - max_key)
            file_candidate(st, pool, tag, hist, k0, end, hist, end, end + ngram_len, origin)
        drafts_now = i % draft_stride == draft_phase or kept_lens[s] > 0
        room = min(max_draft, max_len - n_tok) if drafts_now else 0
        length = 0
        first_key = 0
        first = True
        # the deep match: feed the text, match its end
        if deep_on:
            text = owners[s, 2]
            fed = t_len[text]
            for j in range(fed, n_tok):
                store[t_start[text] + j] = hist[j]
            if n_tok > fed:
                feed_text(heads, heads_used, prev, links, gens, store, t_start, t_answers, fed, n_tok, deep_key, text)
                t_len[text] = n_tok
            if room > 0:
                k0 = max(0, n_tok - MATCH_DEPTH)
                for j in range(n_tok - k0):
                    context[j] = hist[k0 + j]
                found, end, depth = deep_match(heads, prev, links, gens, store, t_start, t_answers, context,
                                               n_tok - k0, deep_key, text)
                if depth > 0:
                    first_key, first = depth, False
                    src = t_start[found] + end + 1
                    length = min(room, t_len[found] - end - 1)
                    for j in range(length):
                        drafts[i, j] = store[src + j]
                        origins[i, j] = ORIGIN_DEEP_MATCH
        # the pools' chain, after the deep match's draft
        k0 = max(0, n_tok - max_key)
        n_ctx = n_tok - k0
        for j in range(n_ctx):
            context[j] = hist[k0 + j]
        for j in range(length):
            context[n_ctx] = drafts[i, j]
            n_ctx += 1
        while length < room:
            c0 = max(0, n_ctx - max_key)
            guess_len = 0
            guess_entry = -1
            frozen_key = 0
            guess = -1
            if frozen is not None:  # compiled out without a frozen table (numba prunes it)
                entry, frozen_key, _ = match_pool(frozen, frozen_owner, -1, context, c0, n_ctx, -1, scratch)
                if entry >= 0:
                    guess_entry = entry
                    guess = frozen[ST_ENTRIES][guess_entry, E_TOK + 0]
            if guess_entry < 0:
                guess_len = _prior_piece(prior, prior_lens, context[n_ctx - 1])
                if guess_len > 0:
                    guess = prior[context[n_ctx - 1], 0]
            entry, key_len, own = match_pool(st, pool, tag, context, c0, n_ctx, guess if votes else -1, scratch)
            piece, piece_len, origin = st[ST_ENTRIES][0, E_TOK:], 0, 0
            if entry >= 0:
                piece, piece_len = st[ST_ENTRIES][entry, E_TOK:], st[ST_ENTRIES][entry, E_LEN]
                origin = st[ST_ENTRIES][entry, E_ORIGIN] if own else ORIGIN_SHARED
            elif guess_entry >= 0:
                if frozen is not None:
                    piece, piece_len = frozen[ST_ENTRIES][guess_entry, E_TOK:], frozen[ST_ENTRIES][guess_entry, E_LEN]
                    origin, key_len = frozen[ST_ENTRIES][guess_entry, E_ORIGIN], frozen_key
            elif guess_len > 0:
                piece, piece_len = prior[context[n_ctx - 1]], guess_len
                origin, key_len = ORIGIN_PRIOR, 0
            else:
                break
            if first:
                first_key, first = key_len, False
            for j in range(min(piece_len, room - length)):
                drafts[i, length] = piece[j]
                origins[i, length] = origin
                context[n_ctx] = piece[j]
                n_ctx += 1
                length += 1
            # keep the context short: only its last max_key tokens are ever read
            if n_ctx > max_key:
                shift = n_ctx - max_key
                for j in range(max_key):
                    context[j] = context[shift + j]
                n_ctx = max_key
        draft_lens[i] = length
        key_lens[i] = first_key
    return ROOM_OK, num_keys
