"""The draft judge against a dense reference: every draft's common prefix with its request's text."""

from __future__ import annotations

import numpy as np
import pytest

from vllm_fafo.control.draft_judge import DraftJudge

MAX_DRAFT = 6


def add(judge: DraftJudge, slots: list[int], starts: list[int], drafts: list[list[int]], key_lens: list[int]) -> None:
    """``judge.add`` with the drafts as lists (the proposer hands its found drafts' rows)."""
    tokens = np.zeros((len(drafts), max(map(len, drafts), default=0)), dtype=np.int32)
    for row, draft in enumerate(drafts):
        tokens[row, : len(draft)] = draft
    judge.add(np.array(slots, dtype=np.int64), np.array(starts), tokens, np.array(list(map(len, drafts))), np.array(key_lens))


def judge_batch(judge: DraftJudge, rows: dict[int, int], num_tokens: np.ndarray, token_ids: np.ndarray):
    """``judge.judge`` of the requests (slots) at their rows ``rows`` (``num_tokens`` by row)."""
    batch_rows = np.array(list(rows.values()), dtype=np.int64)
    return judge.judge(np.array(list(rows), dtype=np.int64), batch_rows, num_tokens[batch_rows], token_ids)


def common_prefix(draft: list[int], text: np.ndarray, start: int) -> int:
    matched = 0
    while matched < len(draft) and start + matched < len(text) and draft[matched] == text[start + matched]:
        matched += 1
    return matched


def test_each_draft_is_judged_once_as_soon_as_its_text_decides_it_with_its_common_prefix():
    """Three requests decode random steps of their texts (1-4 tokens, some steps not
    scheduled at all); each step every request finds a draft (half copied from its
    text's continuation, so long matches occur, half random; some empty). Every
    non-empty draft is judged exactly once, in the first step whose text covers it or
    differs from it, with its common prefix with the text and its key length."""
    rng = np.random.default_rng(0)
    texts = [rng.integers(0, 3, size=400) for _ in range(3)]  # 3 token values: partial matches are common
    done = [20, 35, 50]
    judge = DraftJudge(MAX_DRAFT)
    expected: dict[int, tuple[int, int, list[int], int]] = {}  # id -> (request, start, draft, key length)
    judged_ids: list[int] = []
    next_id = 0
    width = max(map(len, texts)) + 8
    for _ in range(60):
        scheduled = [i for i in range(3) if rng.random() < 0.8]
        for i in scheduled:
            done[i] += int(rng.integers(1, 5))
        order = rng.permutation(scheduled).tolist()  # batch rows change from step to step
        token_ids = np.full((len(order) + 1, width), -1, dtype=np.int32)
        num_tokens = np.zeros(len(order) + 1, dtype=np.int64)
        for row, i in enumerate(order):
            token_ids[row, : done[i]] = texts[i][: done[i]]
            token_ids[row, done[i] :] = rng.integers(0, 3, size=width - done[i])  # stale tokens past the text
            num_tokens[row] = done[i]
        lengths, matched, key_lens = judge_batch(judge, {i: row for row, i in enumerate(order)}, num_tokens,
                                                 token_ids)
        # the reference: drafts of scheduled requests whose text now covers or contradicts them
        due = [j for j, (req, start, draft, _) in expected.items() if j not in judged_ids and int(req) in scheduled
               and (done[int(req)] - start >= len(draft)
                    or common_prefix(draft, texts[int(req)][: done[int(req)]], start) < done[int(req)] - start)]
        assert sorted(zip(lengths.tolist(), matched.tolist(), key_lens.tolist())) == sorted(
            (len(expected[j][2]), common_prefix(expected[j][2], texts[int(expected[j][0])][: done[int(expected[j][0])]],
                                                 expected[j][1]), expected[j][3]) for j in due)
        judged_ids += due
        drafts, key_lens_found = [], []
        for i in order:
            length = int(rng.integers(0, MAX_DRAFT + 1))
            copied = texts[i][done[i] : done[i] + length].tolist()
            drafts.append(copied if rng.random() < 0.5 else rng.integers(0, 3, size=length).tolist())
            key_lens_found.append(int(rng.integers(1, 9)))
        add(judge, order, [done[i] for i in order], drafts, key_lens_found)
        for i, draft, key_len in zip(order, drafts, key_lens_found):
            if draft:
                expected[next_id] = (i, done[i], draft, key_len)
                next_id += 1
    assert len(judged_ids) > 100 and len(judge) == len(expected) - len(judged_ids)
    judged_whole = sum(common_prefix(expected[j][2], texts[int(expected[j][0])], expected[j][1]) == len(expected[j][2])
                       for j in judged_ids)
    assert judged_whole > 20  # long matches were judged, not only early mismatches


def test_finished_requests_drafts_are_forgotten_and_absent_requests_wait():
    judge = DraftJudge(MAX_DRAFT)
    add(judge, [0, 1, 2], [3, 3, 3], [[1, 2], [1, 2], []], [2, 3, 4])
    assert len(judge) == 2  # the empty draft teaches nothing
    judge.forget([0])
    token_ids = np.array([[0, 0, 0, 1, 2, 0]], dtype=np.int32)
    assert [x.tolist() for x in judge_batch(judge, {0: 0}, np.array([6]), token_ids)] == [[], [], []]
    assert len(judge) == 1  # slot 1 was not in the batch: it waits
    assert [x.tolist() for x in judge_batch(judge, {1: 0}, np.array([6]), token_ids)] == [[2], [2], [3]]
    assert len(judge) == 0


def test_a_draft_longer_than_the_judge_holds_is_refused():
    with pytest.raises(ValueError, match="at most 6"):
        add(DraftJudge(MAX_DRAFT), [0], [0], [[1] * 7], [1])
