"""Every draft a request found, judged whole against the text the request went on to produce.

The goodput controller learns per draft position and matched key length how
often a draft token is accepted. Learned from the verified drafts alone, a
draft it cut teaches nothing past the cut: after a stretch of early
rejections the rates fall, the controller cuts every draft to nothing, and
nothing drafted is nothing learned (docs/results/goodput-controller.md, "Why: the controller's draft
yields, replayed at batch 1 and 8"). Judged against the request's own text
instead, every found draft teaches every one of its positions, whatever the
controller kept of it.

The judgement is the verification's in expectation, greedy or sampled: greedy
verification accepts a draft token exactly when it is the token the target
produces there; under sampling a one-hot draft token is accepted with the
target's probability of it, which is the probability that the produced token
is that token (speculative decoding leaves the text distributed as the
target's own). A draft is judged once the text covers it or differs from it,
a few steps after it was found.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

import numpy as np

_OWNER, _START, _LENGTH, _KEY_LEN, _TOKENS = range(5)
"""Columns of the judge's table: the request's slot, the position of the text the
draft's first token predicts, its length, its key's length, then its tokens."""


class DraftJudge:
    """The drafts found but not judged yet, of all requests, as rows of one table
    (a few numpy calls per step for the whole batch: it runs in the step path)."""

    def __init__(self, max_draft: int, capacity: int = 256) -> None:
        self.max_draft = max_draft
        self._table = np.zeros((capacity, _TOKENS + max_draft), dtype=np.int64)
        self._count = 0
        self._slots: dict[str, int] = {}
        """Each request's number in the table's owner column, while it has drafts queued
        or decodes (freed by :meth:`forget`)."""
        self._free_slots: list[int] = []
        self._columns = np.arange(max_draft)

    def __len__(self) -> int:
        return self._count

    def add(self, req_ids: Sequence[str], starts: Sequence[int], drafts: Sequence[Sequence[int]],
            key_lens: Sequence[int]) -> None:
        """Queue the drafts found this step, whole (before any cut): ``drafts[i]`` predicts
        request ``req_ids[i]``'s text from position ``starts[i]`` on and was found under a
        key of ``key_lens[i]`` tokens. Empty drafts teach nothing and are not queued."""
        found = [i for i, draft in enumerate(drafts) if draft]
        if not found:
            return
        longest = max(len(drafts[i]) for i in found)
        if longest > self.max_draft:
            raise ValueError(f"a draft of {longest} tokens; the judge holds at most {self.max_draft}")
        if self._count + len(found) > len(self._table):
            self._table = np.concatenate([self._table, np.zeros_like(self._table[: self._count + len(found)])])
        block = self._table[self._count : self._count + len(found)]
        self._count += len(found)
        for row, i in zip(block, found):
            draft = drafts[i]
            row[_OWNER], row[_START], row[_LENGTH], row[_KEY_LEN] = self._slot(req_ids[i]), starts[i], len(draft), key_lens[i]
            row[_TOKENS : _TOKENS + len(draft)] = draft

    def judge(self, rows: Mapping[str, int], num_tokens: np.ndarray,
              token_ids: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Judge the queued drafts of the requests in ``rows`` (request id -> row of
        ``token_ids``, whose first ``num_tokens[row]`` tokens are the request's text so
        far) that their text now decides: it covers the whole draft, or differs from it
        within what it covers. Returns those drafts' (lengths, tokens matched, key
        lengths) and drops them; the others wait for more text."""
        table = self._table[: self._count]
        if not self._count:
            return table[:, _LENGTH], table[:, _LENGTH], table[:, _KEY_LEN]
        row_of_slot = np.full(len(self._slots) + len(self._free_slots), -1, dtype=np.int64)
        for req_id, row in rows.items():
            slot = self._slots.get(req_id)
            if slot is not None:
                row_of_slot[slot] = row
        draft_rows = row_of_slot[table[:, _OWNER]]  # -1: not decoding this step (read as the last row, unused)
        starts, lengths = table[:, _START], table[:, _LENGTH]
        covered = np.minimum(np.maximum(num_tokens[draft_rows] - starts, 0), lengths)
        positions = np.minimum(starts[:, None] + self._columns, token_ids.shape[1] - 1)
        same = (token_ids[draft_rows[:, None], positions] == table[:, _TOKENS:]) & (self._columns < covered[:, None])
        matched = same.cumprod(axis=1).sum(axis=1)
        decided = (draft_rows >= 0) & ((matched < covered) | (covered == lengths))
        judged = lengths[decided], matched[decided], table[decided, _KEY_LEN]
        self._keep(~decided)
        return judged

    def forget(self, req_ids: Iterable[str]) -> None:
        """Drop the queued drafts of finished or aborted requests (their text will not go on)."""
        slots = [self._slots.pop(req_id) for req_id in req_ids if req_id in self._slots]
        if slots:
            self._free_slots += slots
            self._keep(~np.isin(self._table[: self._count, _OWNER], slots))

    def _slot(self, req_id: str) -> int:
        slot = self._slots.get(req_id)
        if slot is None:
            slot = self._slots[req_id] = self._free_slots.pop() if self._free_slots else len(self._slots)
        return slot

    def _keep(self, keep: np.ndarray) -> None:
        kept = self._table[: self._count][keep]
        self._table[: len(kept)] = kept
        self._count = len(kept)
