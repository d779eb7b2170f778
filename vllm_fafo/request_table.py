"""The proposer's per-request numbers, as arrays by slot.

A request gets a slot when it first decodes and frees it when it finishes;
the step reads and writes every decoding request's numbers at once, by its
slots (fancy indexing, the step's kernels), instead of one Python object per
request: the step's host time grows with the batch only in the loops vLLM's
proposer contract itself needs (its lists of sampled and drafted tokens).
"""

from __future__ import annotations

import numpy as np
from numba import njit

from vllm_fafo.drafting.pool import ORIGIN_CODE, Origin
from vllm_fafo.serving.metrics import FafoMetrics, count_drafts
from vllm_fafo.step_arrays import same_or_new

_PAD, _LANE = ORIGIN_CODE[Origin.PAD], ORIGIN_CODE[Origin.LANE]


class RequestTable:
    """Slots of running requests: where they file (``owners``), how far their text is
    filed (``next_anchor``), their prompt's length, and their last draft's origins
    (what the metrics count as accepted once vLLM verified it)."""

    def __init__(self, max_draft: int, capacity: int = 64) -> None:
        self.slot_of: dict[str, int] = {}
        self.max_draft = max(1, max_draft)
        self._free: list[int] = []
        self.owners = np.zeros((0, 3), dtype=np.int64)
        """The request's ids in the draft index (:meth:`~vllm_fafo.drafting.index.DraftIndex.owners`)."""
        self.prompt_len = np.zeros(0, dtype=np.int64)
        self.next_anchor = np.zeros(0, dtype=np.int64)
        """First history position whose following n-gram is not filed yet."""
        self.draft_len = np.zeros(0, dtype=np.int64)
        self.draft_origins = np.zeros((0, self.max_draft), dtype=np.int32)
        """The last draft's tokens' :class:`~vllm_fafo.drafting.pool.Origin` codes."""
        self._arguments: tuple | None = None
        self._counts: tuple | None = None
        """:meth:`kernel_arguments`' tuples, the same objects while the arrays are
        (:func:`~vllm_fafo.step_arrays.same_or_new`)."""
        self._grow(capacity)

    def __len__(self) -> int:
        return len(self.slot_of)

    def _grow(self, capacity: int) -> None:
        old = len(self.prompt_len)
        self.owners = np.concatenate([self.owners, np.full((capacity - old, 3), -1, dtype=np.int64)])
        for name in ("prompt_len", "next_anchor", "draft_len"):
            setattr(self, name, np.concatenate([getattr(self, name), np.zeros(capacity - old, dtype=np.int64)]))
        self.draft_origins = np.concatenate(
            [self.draft_origins, np.zeros((capacity - old, self.max_draft), dtype=np.int32)])
        self._free.extend(range(capacity - 1, old - 1, -1))  # lowest slot taken first

    def add(self, req_id: str, owners: np.ndarray, prompt_len: int, next_anchor: int) -> int:
        """A new request's slot, with its numbers set (no draft yet)."""
        if not self._free:
            self._grow(2 * len(self.prompt_len))
        slot = self._free.pop()
        self.slot_of[req_id] = slot
        self.owners[slot] = owners
        self.prompt_len[slot], self.next_anchor[slot], self.draft_len[slot] = prompt_len, next_anchor, 0
        return slot

    def remove(self, req_id: str) -> bool:
        """Free a finished request's slot; whether it had one."""
        slot = self.slot_of.pop(req_id, None)
        if slot is None:
            return False
        self.owners[slot] = -1
        self._free.append(slot)
        return True

    def settle(self, slots: np.ndarray, taken: np.ndarray, won: np.ndarray, metrics: FafoMetrics,
               accepted: np.ndarray) -> None:
        """What vLLM accepted of each decoding request's last draft, into ``accepted``:
        the tokens it took for request ``slots[i]`` (``taken[i]``) but its own one, at most
        the draft's length; where ``taken[i]`` is 0 (a draft tree's branch won), the spine's
        ``won[i]`` tokens before the branch (``won`` is read nowhere else). vLLM takes at most
        one token more than the drafts it verified (fewer than the draft where its token
        budget cut them, none after a preemption), so they bound nothing more. The metrics
        count the accepted tokens by origin."""
        settle_drafts(slots, taken, won, self.draft_len, self.draft_origins, metrics.accepted_counts, accepted)

    def kernel_arguments(self, metrics: FafoMetrics) -> tuple[tuple, tuple]:
        """The table and the metrics' counts (with the filler's and the lanes' origin codes)
        as :func:`~vllm_fafo.propose_kernel.propose_step` takes them (it settles and keeps in
        one call with the step's other work); the same tuples while nothing grew."""
        self._arguments = same_or_new(self._arguments, (self.draft_len, self.draft_origins, self.prompt_len,
                                                         self.next_anchor, self.owners))
        if self._counts is None or self._counts[0] is not metrics.accepted_counts:  # a metrics' arrays never grow
            self._counts = (metrics.accepted_counts, metrics.proposed_counts, metrics.draft_counts, _PAD, _LANE)
        return self._arguments, self._counts

    def keep(self, slots: np.ndarray, origins: np.ndarray, lengths: np.ndarray, metrics: FafoMetrics) -> None:
        """The drafts proposed this step (request ``slots[i]``'s first ``lengths[i]``
        tokens, of ``origins[i]``), kept until :meth:`settle` next step; the metrics
        count them (an empty draft, or filler only, is a miss)."""
        keep_drafts(slots, origins, lengths, self.draft_len, self.draft_origins, _PAD, metrics.proposed_counts,
                    metrics.draft_counts)


@njit(cache=True)
def settle_drafts(slots: np.ndarray, taken: np.ndarray, won: np.ndarray, draft_len: np.ndarray,
                  draft_origins: np.ndarray, counts: np.ndarray, accepted: np.ndarray) -> None:
    """:meth:`RequestTable.settle` in one call."""
    for i in range(len(slots)):
        slot = slots[i]
        count = min(won[i] if taken[i] == 0 else taken[i] - 1, draft_len[slot])
        accepted[i] = count
        for k in range(count):
            counts[draft_origins[slot, k]] += 1


@njit(cache=True)
def keep_drafts(slots: np.ndarray, origins: np.ndarray, lengths: np.ndarray, draft_len: np.ndarray,
                draft_origins: np.ndarray, pad: int, proposed: np.ndarray, totals: np.ndarray) -> None:
    """:meth:`RequestTable.keep` in one call."""
    count_drafts(origins, lengths, pad, proposed, totals)
    for i in range(len(slots)):
        slot, length = slots[i], lengths[i]
        draft_len[slot] = length
        draft_origins[slot, :length] = origins[i, :length]


def load_kernels() -> None:
    """Run the kernels once on the step's types, so that numba loads them (on a new
    machine: compiles them) while the engine starts."""
    table, metrics = RequestTable(1, capacity=1), FafoMetrics()
    one = np.zeros(1, dtype=np.int64)
    table.settle(one, one, one, metrics, one.copy())
    table.keep(one, np.zeros((1, 1), dtype=np.int32), one, metrics)
