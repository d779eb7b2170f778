"""The request table's settling of last drafts against the rule written out per request."""

from __future__ import annotations

import numpy as np

from vllm_fafo.drafting.pool import ORIGIN_CODE, Origin
from vllm_fafo.request_table import RequestTable
from vllm_fafo.serving.metrics import FafoMetrics


def settle_reference(draft_len: int, origins: list[int], taken: int, won: int) -> tuple[int, list[int]]:
    """(accepted, the accepted tokens' origins) of one request: vLLM's accepted drafts
    (taken - 1), or the spine's tokens before a won branch (taken 0); at most the
    draft's length."""
    accepted = min(won if taken == 0 else taken - 1, draft_len)
    return accepted, origins[:accepted]


def test_settle_counts_what_vllm_accepted_of_each_last_draft_by_origin():
    rng = np.random.default_rng(3)
    table = RequestTable(max_draft=6, capacity=2)  # grows as requests come
    slots = [table.add(f"r{i}", np.full(3, -1), 10, 0) for i in range(9)]
    for _ in range(200):
        for slot in slots:
            table.draft_len[slot] = rng.integers(0, 7)
            table.draft_origins[slot] = rng.integers(0, 5, size=6)
        batch = rng.permutation(slots)[: rng.integers(1, len(slots) + 1)]
        taken = rng.integers(0, 9, size=len(batch))  # 0: a branch won
        won = rng.integers(0, 8, size=len(batch))  # read where taken is 0 only
        metrics, accepted = FafoMetrics(), np.full(len(batch), -1, dtype=np.int64)
        table.settle(batch.astype(np.int64), taken, won, metrics, accepted)
        want_counts = np.zeros(len(metrics.accepted_counts), dtype=np.int64)
        for i, slot in enumerate(batch.tolist()):
            want, origins = settle_reference(int(table.draft_len[slot]), table.draft_origins[slot].tolist(),
                                             int(taken[i]), int(won[i]))
            assert accepted[i] == want
            np.add.at(want_counts, origins, 1)
        np.testing.assert_array_equal(metrics.accepted_counts, want_counts)


def test_kept_drafts_are_what_the_next_settle_counts_and_the_metrics_count_them_as_proposed():
    table, metrics = RequestTable(max_draft=4, capacity=1), FafoMetrics()
    slots = np.array([table.add(req_id, np.full(3, -1), 5, 0) for req_id in "abc"], dtype=np.int64)
    prompt, lane, pad = (ORIGIN_CODE[o] for o in (Origin.PROMPT, Origin.LANE, Origin.PAD))
    origins = np.array([[prompt, lane, prompt, 0], [pad, pad, 0, 0], [lane, 0, 0, 0]], dtype=np.int32)
    table.keep(slots[[2, 0, 1]], origins, np.array([3, 2, 0]), metrics)
    assert table.draft_len[slots].tolist() == [2, 0, 3]
    assert table.draft_origins[slots[2], :3].tolist() == [prompt, lane, prompt]
    assert (metrics.lookups, metrics.pool_hits) == (3, 1)  # filler only and empty are misses
    assert metrics.proposed_counts[[prompt, lane, pad]].tolist() == [2, 1, 2]
    accepted = np.zeros(3, dtype=np.int64)
    table.settle(slots, np.array([3, 1, 9]), np.array([0, 0, 0]), metrics, accepted)
    assert accepted.tolist() == [2, 0, 3]  # at most each kept draft's length
    assert metrics.accepted_counts[[prompt, lane, pad]].tolist() == [2, 1, 2]
