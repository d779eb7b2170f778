"""The proposer's per-token state leaves nothing on the garbage collector's lists.

A vLLM engine freezes its start-up heap, so a full collection walks only what
was made since, and the pools and text indexes are most of that: with one tracked
dict (or list) per key, full collections were triggered by them and paused
the step for up to 0.43 s at 32 requests x 1,024 tokens (docs/results/serving.md "Garbage collector
pauses"). These tests count what a collection leaves tracked after thousands of
n-grams; each fails on the per-key dicts of enum members and tuples, and lists,
that the pool and the text index held before."""

from __future__ import annotations

import gc
from collections.abc import Callable

import numpy as np

from vllm_fafo.drafting.deep_match import TenantTexts
from vllm_fafo.drafting.pool import Origin, file_in, match_in

from .test_native_pool import file_and_draft_one, index_for

TOKENS = 5000
MAX_NEW_TRACKED = 50
"""Objects a collection may leave tracked: the structures' own handful, not one per key."""


def tracked_after(build: Callable[[], object]) -> int:
    """Objects the collector tracks after ``build`` ran and two collections (the
    first untracks what it can), beyond those tracked before; ``build``'s result is
    kept alive while counting."""
    gc.collect()
    gc.freeze()
    try:
        kept = build()
        gc.collect()
        gc.collect()
        count = len(gc.get_objects())
        del kept
    finally:
        gc.unfreeze()
    return count


def text(seed: int = 0) -> list[int]:
    return np.random.default_rng(seed).integers(0, 3000, size=TOKENS).tolist()


def test_pools_keep_no_tracked_object_per_key():
    def build():
        index = index_for(share_pool=True, text_ngram_len=16)
        history = text()
        target = index.start("r", None, np.array(history[: TOKENS // 2]))
        file_and_draft_one(index, target, history, prompt_len=TOKENS // 2)
        file_in(target, history[-4:], (1, 2, 3), Origin.LANE)
        assert match_in(target, history[-4:])[:2] == ((1, 2, 3), Origin.LANE)
        return index, target, history

    build()  # numba loads the kernels on their first call (objects of its own, once per process)
    assert tracked_after(build) <= MAX_NEW_TRACKED


def test_text_cache_keeps_no_tracked_object_per_key():
    def build():
        texts = TenantTexts(answer_bytes=1 << 20, max_tenants=4, key_len=5)
        tokens = np.tile(np.asarray(text(1)[: TOKENS // 5], dtype=np.int32), 5)  # every key recurs
        texts.start("a", None, tokens[:100])
        for end in range(103, TOKENS, 3):  # "a" runs on: its own places and its answer's, every key
            texts.draft("a", tokens, end, room=0)
        texts.start("b", None, tokens[:200])
        assert texts.draft("b", tokens, 200, room=8)[0] == tokens[200:208].tolist()
        return texts, tokens

    build()  # the kernels' first call
    assert tracked_after(build) <= MAX_NEW_TRACKED
