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

Queuing and judging are numba kernels over one table (:func:`queue_drafts`,
:func:`judge_drafts`): they run in every step, where each numpy call costs a
cache-cold Python call (docs/results/host-time.md).
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
from numba import njit

from vllm_fafo.control.kernels import as_int64
from vllm_fafo.step_arrays import same_or_new

_OWNER, _START, _LENGTH, _KEY_LEN, _TOKENS = range(5)
"""Columns of the judge's table: the request's slot, the position of the text the
draft's first token predicts, its length, its key's length, then its tokens."""


class DraftJudge:
    """The drafts found but not judged yet, of all requests, as rows of one table. A
    request is known by its slot (the proposer's :class:`~vllm_fafo.request_table.RequestTable`),
    which :meth:`forget` must clear before the slot is given to another request."""

    def __init__(self, max_draft: int, capacity: int = 256) -> None:
        self.max_draft = max_draft
        self._table = np.zeros((capacity, _TOKENS + max_draft), dtype=np.int64)
        self._count = 0
        self._judged = np.zeros((3, capacity), dtype=np.int64)
        """:meth:`judge`'s answers (views of it are handed out, valid until the next call)."""
        self._index_of_slot = np.zeros(64, dtype=np.int64)
        """Scratch of :func:`judge_drafts`: each slot's place in the batch this step."""
        self._arguments: tuple | None = None

    def __len__(self) -> int:
        return self._count

    def add(self, slots: np.ndarray, starts: np.ndarray, tokens: np.ndarray, lengths: np.ndarray,
            key_lens: np.ndarray) -> None:
        """Queue the drafts found this step, whole (before any cut): request ``slots[i]``'s
        draft ``tokens[i, :lengths[i]]`` predicts its text from position ``starts[i]`` on and
        was found under a key of ``key_lens[i]`` tokens. Empty drafts teach nothing and are
        not queued."""
        lengths = as_int64(lengths)
        if tokens.shape[1] > self.max_draft and int(lengths.max(initial=0)) > self.max_draft:
            raise ValueError(f"a draft of {int(lengths.max())} tokens; the judge holds at most {self.max_draft}")
        self.make_room(len(lengths), -1)
        self._count = queue_drafts(self._table, self._count, as_int64(slots), as_int64(starts),
                                   np.ascontiguousarray(tokens), lengths, as_int64(key_lens))

    def judge(self, slots: np.ndarray, rows: np.ndarray, num_tokens: np.ndarray,
              token_ids: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Judge the queued drafts of the requests ``slots`` (each at batch row ``rows[i]``
        of ``token_ids``, whose first ``num_tokens[i]`` tokens are the request's text so
        far) that their text now decides: it covers the whole draft, or differs from it
        within what it covers. Returns those drafts' (lengths, tokens matched, key
        lengths), views valid until the next call, and drops them; the others wait for
        more text."""
        slots, rows, num_tokens = as_int64(slots), as_int64(rows), as_int64(num_tokens)
        judged = self._judged
        count = judge_drafts(self._table, self._count, slots, rows, self._index_of_slot, num_tokens, token_ids, judged)
        if count < 0:  # a slot past the scratch: grown once
            self.make_room(0, int(slots.max()))
            count = judge_drafts(self._table, self._count, slots, rows, self._index_of_slot, num_tokens, token_ids,
                                 judged)
        self._count -= count
        return judged[0, :count], judged[1, :count], judged[2, :count]

    def kernel_arguments(self) -> tuple:
        """The table as :func:`~vllm_fafo.propose_kernel.propose_step` takes it: it judges,
        then queues the step's drafts, as :meth:`judge` and :meth:`add` do (:meth:`make_room`
        first where it says so; :meth:`finish_step` after), the drafts queued apart
        (``len``); the same tuple while nothing grew."""
        self._arguments = same_or_new(self._arguments, (self._table, self._index_of_slot, self._judged))
        return self._arguments

    def make_room(self, drafts: int, max_slot: int) -> None:
        """Room to queue ``drafts`` more drafts, and a slot map reaching ``max_slot``."""
        if self._count + drafts > len(self._table):
            self._table = np.concatenate([self._table, np.zeros_like(self._table[: self._count + drafts])])
            self._judged = np.zeros((3, len(self._table)), dtype=np.int64)
        if max_slot >= len(self._index_of_slot):
            self._index_of_slot = np.zeros(2 * (max_slot + 1), dtype=np.int64)

    def finish_step(self, count: int) -> None:
        """:func:`~vllm_fafo.propose_kernel.propose_step` left ``count`` drafts queued."""
        self._count = count

    def forget(self, slots: Iterable[int]) -> None:
        """Drop the queued drafts of finished or aborted requests (their text will not go on)."""
        slots = list(slots)
        if slots and self._count:
            keep = ~np.isin(self._table[: self._count, _OWNER], slots)
            kept = self._table[: self._count][keep]
            self._table[: len(kept)] = kept
            self._count = len(kept)


@njit(cache=True)
def queue_drafts(table: np.ndarray, count: int, slots: np.ndarray, starts: np.ndarray, tokens: np.ndarray,
                 lengths: np.ndarray, key_lens: np.ndarray) -> int:
    """Append the non-empty drafts as rows of ``table`` after its first ``count``; returns
    the new count (the table has room)."""
    for i in range(len(slots)):
        length = lengths[i]
        if length == 0:
            continue
        table[count, _OWNER] = slots[i]
        table[count, _START] = starts[i]
        table[count, _LENGTH] = length
        table[count, _KEY_LEN] = key_lens[i]
        for k in range(length):
            table[count, _TOKENS + k] = tokens[i, k]
        count += 1
    return count


@njit(cache=True)
def judge_drafts(table: np.ndarray, count: int, slots: np.ndarray, rows: np.ndarray, index_of_slot: np.ndarray,
                 num_tokens: np.ndarray, token_ids: np.ndarray, judged: np.ndarray) -> int:
    """Judge the first ``count`` rows of ``table`` whose slot is among ``slots`` (batch
    rows ``rows``, texts ``num_tokens`` long): a draft is decided when the text covers it
    or differs from it within what it covers; its (length, tokens matched, key length)
    go to the next column of ``judged`` and its row is dropped, the others kept in order.
    Returns the drafts judged, or -1, having changed nothing, where a slot has no entry
    in ``index_of_slot`` (scratch)."""
    for i in range(len(slots)):
        if slots[i] >= len(index_of_slot):
            return -1
    index_of_slot[:] = -1
    for i in range(len(slots)):
        if slots[i] >= 0:
            index_of_slot[slots[i]] = i
    last = token_ids.shape[1] - 1
    kept = done = 0
    for i in range(count):
        owner = table[i, _OWNER]
        at = index_of_slot[owner] if owner < len(index_of_slot) else -1  # a slot beyond it is not in the batch
        decided = False
        if at >= 0:
            row = rows[at]
            start, length = table[i, _START], table[i, _LENGTH]
            covered = min(max(num_tokens[at] - start, 0), length)
            matched = 0
            while matched < covered and token_ids[row, min(start + matched, last)] == table[i, _TOKENS + matched]:
                matched += 1
            decided = matched < covered or covered == length
            if decided:
                judged[0, done], judged[1, done], judged[2, done] = length, matched, table[i, _KEY_LEN]
                done += 1
        if not decided:
            if kept != i:
                table[kept, :] = table[i, :]
            kept += 1
    return done

