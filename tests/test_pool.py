"""NgramPool against hand-worked cases and a brute-force reference."""

import random

import numpy as np

from vllm_fafo.drafting.pool import NgramPool, Origin

from .test_native_pool import file_and_draft_one, index_for


def test_add_files_candidate_under_every_suffix_up_to_k():
    pool = NgramPool(max_key_len=3, capacity=4)
    pool.add([9, 1, 2, 3], (4, 5), Origin.PROMPT)
    assert pool.candidates([3]) == [(4, 5)]
    assert pool.candidates([2, 3]) == [(4, 5)]
    assert pool.candidates([1, 2, 3]) == [(4, 5)]
    assert pool.candidates([9, 1, 2, 3]) == []  # longer than K
    assert len(pool) == 3


def test_lookup_prefers_the_longest_matching_suffix():
    pool = NgramPool(max_key_len=3, capacity=4)
    pool.add([1, 2, 3], (10,), Origin.PROMPT)
    pool.add([7, 3], (20,), Origin.OUTPUT)  # newer, but only matches [3]
    assert pool.lookup([5, 4, 3]) == ((20,), Origin.OUTPUT)  # only [3] matches
    assert pool.lookup([5, 2, 3]) == ((10,), Origin.PROMPT)  # [2, 3] matches
    assert pool.lookup([1, 2, 3]) == ((10,), Origin.PROMPT)  # [1, 2, 3] matches
    assert pool.lookup([4, 4, 4]) is None


def test_per_key_lru_cap_evicts_least_recently_used():
    pool = NgramPool(max_key_len=1, capacity=2)
    pool.add([1], (10,), Origin.PROMPT)
    pool.add([1], (11,), Origin.PROMPT)
    assert pool.lookup([1]) == ((11,), Origin.PROMPT)
    pool.add([1], (10,), Origin.OUTPUT)  # re-adding refreshes recency and origin
    assert pool.candidates([1]) == [(11,), (10,)]
    pool.add([1], (12,), Origin.OUTPUT)  # evicts (11,), the least recently used
    assert pool.candidates([1]) == [(10,), (12,)]


def test_lookup_counts_as_use():
    pool = NgramPool(max_key_len=1, capacity=2)
    pool.add([1], (10,), Origin.PROMPT)
    pool.add([1], (11,), Origin.PROMPT)
    pool.candidates([1])
    # touch (11,) via lookup; (10,) stays least recent and is the one evicted
    assert pool.lookup([1])[0] == (11,)
    pool.add([1], (12,), Origin.PROMPT)
    assert pool.candidates([1]) == [(11,), (12,)]


def _reference_lookup(history, max_key_len, ngram_len):
    """Continuation of the latest complete occurrence of the longest suffix."""
    n = len(history)
    for key_len in range(min(max_key_len, n), 0, -1):
        key = history[n - key_len :]
        for anchor in range(n - ngram_len - 1, key_len - 2, -1):
            if history[anchor - key_len + 1 : anchor + 1] == key:
                return tuple(history[anchor + 1 : anchor + 1 + ngram_len])
    return None


def test_text_seeded_pool_matches_brute_force_reference():
    rng = random.Random(0)
    for trial in range(200):
        vocab = rng.randint(2, 6)
        history = [rng.randrange(vocab) for _ in range(rng.randint(1, 60))]
        max_key_len, ngram_len = rng.randint(1, 5), rng.randint(1, 4)
        index = index_for(max_key_len=max_key_len, pool_capacity=4096, text_ngram_len=ngram_len,
                          rank_candidates="recency")
        target = index.start("r", None, np.array(history))
        pool = target.pool
        file_and_draft_one(index, target, history, prompt_len=len(history))
        found = pool.lookup(history)
        expected = _reference_lookup(history, max_key_len, ngram_len)
        assert (found[0] if found else None) == expected, (trial, history)


def test_filing_marks_origin_by_where_the_candidate_lies():
    index = index_for(max_key_len=1, pool_capacity=8, text_ngram_len=2, rank_candidates="recency")
    history = [1, 2, 3, 4, 5]
    target = index.start("r", None, np.array(history[:4]))
    pool = target.pool
    file_and_draft_one(index, target, history, prompt_len=4)
    assert pool.lookup([1]) == ((2, 3), Origin.PROMPT)
    assert pool.lookup([2]) == ((3, 4), Origin.PROMPT)
    assert pool.lookup([3]) == ((4, 5), Origin.OUTPUT)  # 5 was generated
