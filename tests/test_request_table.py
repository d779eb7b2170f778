"""The request table's settling of last drafts against the rule written out per request."""

from __future__ import annotations

import numpy as np

from vllm_fafo.request_table import RequestTable


def settle_reference(draft_len: int, origins: list[int], taken: int, verified: int) -> tuple[int, list[int]]:
    """(accepted, the accepted tokens' origins) of one request: vLLM's accepted drafts
    (taken - 1), at most those it verified, or the tokens a won branch gave (taken 0);
    at most the draft's length."""
    accepted = min(verified if taken == 0 else min(taken - 1, verified), draft_len)
    return accepted, origins[:accepted]


def test_settle_counts_what_vllm_accepted_of_each_last_draft_by_origin():
    rng = np.random.default_rng(3)
    table = RequestTable(max_draft=6, capacity=2)  # grows as requests come
    slots = [table.add(f"r{i}", np.full(4, -1), 10, 0) for i in range(9)]
    for _ in range(200):
        for slot in slots:
            table.draft_len[slot] = rng.integers(0, 7)
            table.draft_origins[slot] = rng.integers(0, 5, size=6)
        batch = rng.permutation(slots)[: rng.integers(1, len(slots) + 1)]
        taken = rng.integers(0, 9, size=len(batch))  # 0: a branch won
        verified = rng.integers(0, 8, size=len(batch))
        counts, accepted = np.zeros(5, dtype=np.int64), np.full(len(batch), -1, dtype=np.int64)
        table.settle(batch.astype(np.int64), taken, verified, counts, accepted)
        want_counts = np.zeros(5, dtype=np.int64)
        for i, slot in enumerate(batch.tolist()):
            want, origins = settle_reference(int(table.draft_len[slot]), table.draft_origins[slot].tolist(),
                                             int(taken[i]), int(verified[i]))
            assert accepted[i] == want
            np.add.at(want_counts, origins, 1)
        np.testing.assert_array_equal(counts, want_counts)
