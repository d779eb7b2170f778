"""The goodput controller's per-step arithmetic, as numba kernels.

The controller runs on every step, between two forwards, for the whole batch:
counting the judged drafts into the yield table, turning the table into reach
probabilities, and choosing the draft tokens that pay. In numpy each was a
dozen calls (about 80, 75 and 120 us per step at batch 1 in the 2-core CPU
engine, docs/results/host-time.md); here each is one call, with the same
arithmetic in the same order. :func:`load_kernels` runs them once while the
engine starts.
"""

from __future__ import annotations

import numpy as np
from numba import njit


def as_int64(values) -> np.ndarray:
    """``values`` as the contiguous int64 array the kernels take (no copy where it is one)."""
    return np.ascontiguousarray(values, dtype=np.int64)


@njit(cache=True)
def count_chains(trials: np.ndarray, hits: np.ndarray, rows: np.ndarray, lengths: np.ndarray,
                 accepted: np.ndarray) -> None:
    """Add chains (drafts or branches, one per entry of ``rows``) to their row's counts:
    a chain reached position k (1-based) if it was that long and its first k - 1 tokens
    were accepted; it hit k if its first k were."""
    for i in range(len(rows)):
        row, length, matched = rows[i], lengths[i], accepted[i]
        for k in range(trials.shape[1]):
            if length >= k + 1 and matched >= k:
                trials[row, k] += 1.0
            if matched >= k + 1:
                hits[row, k] += 1.0


@njit(cache=True)
def reach(trials: np.ndarray, hits: np.ndarray, first_prior: np.ndarray, weights: np.ndarray,
          out: np.ndarray) -> None:
    """Per row, P(positions 1..k all accepted) into ``out``: the running product of the
    continuation rates (hits + w x prior) / (trials + w), w the row's pseudo-trials
    (``weights``), the prior being the row's rate at the position before (``first_prior``
    at the first)."""
    for row in range(trials.shape[0]):
        weight, rate, product = weights[row], first_prior[row], 1.0
        for k in range(trials.shape[1]):
            rate = (hits[row, k] + weight * rate) / (trials[row, k] + weight)
            product *= rate
            out[row, k] = product


@njit(cache=True)
def draft_reach(trials: np.ndarray, hits: np.ndarray, overall: np.ndarray, by_row: np.ndarray) -> None:
    """The draft yields' reach probabilities: over all drafts (``overall``: a quarter of a
    pseudo-trial, prior 1) and per key length's row (``by_row``: one pseudo-trial, prior
    the rate over all drafts at the first position)."""
    total_trials = trials.sum(axis=0).reshape(1, -1)
    total_hits = hits.sum(axis=0).reshape(1, -1)
    reach(total_trials, total_hits, np.ones(1), np.full(1, 0.25), overall.reshape(1, -1))
    first = (total_hits[0, 0] + 0.25) / (total_trials[0, 0] + 0.25)
    reach(trials, hits, np.full(trials.shape[0], first), np.ones(trials.shape[0]), by_row)


@njit(cache=True, error_model="numpy")  # a step priced at 0 s: rates of inf, as numpy's division gives
def choose_lengths(reach_by_row: np.ndarray, rows: np.ndarray, worth_share: np.ndarray, matched: np.ndarray,
                   available: np.ndarray, base_gain: float, seconds: np.ndarray, lengths: np.ndarray) -> None:
    """Into ``lengths``, per request, how many of its draft's first tokens to keep: the
    batch's tokens in order of worth (request r's token k is worth
    ``reach_by_row[rows[r], k] * worth_share[matched[r], k]``, ties to the earlier
    token), as many as maximise (``base_gain`` + their worth) / ``seconds[n]`` for n
    tokens (the first maximum)."""
    count = 0
    for r in range(len(available)):
        count += available[r]
    worth = np.empty(count)
    owners = np.empty(count, dtype=np.int64)
    i = 0
    for r in range(len(available)):
        for k in range(available[r]):
            worth[i] = reach_by_row[rows[r], k] * worth_share[matched[r], k]
            owners[i] = r
            i += 1
    order = np.argsort(-worth, kind="mergesort")
    gain, best, best_rate = base_gain, 0, base_gain / seconds[0]
    for n in range(count):
        gain += worth[order[n]]
        rate = gain / seconds[n + 1]
        if rate > best_rate:
            best, best_rate = n + 1, rate
    lengths[:] = 0
    for n in range(best):
        lengths[owners[order[n]]] += 1


def load_kernels() -> None:
    """Run every kernel once on small arrays of the step's types, so that numba loads
    them (on a new machine: compiles them) while the engine starts."""
    table = np.zeros((2, 3))
    index = np.zeros(1, dtype=np.int64)
    count_chains(table, table.copy(), index, index, index)
    draft_reach(table, table.copy(), np.zeros(3), np.zeros((2, 3)))
    reach(table, table.copy(), np.ones(2), np.ones(2), np.zeros((2, 3)))
    reach_table = np.ones((2, 3))
    reach_table.flags.writeable = False  # the controller hands its reach table out read-only
    choose_lengths(reach_table, index, np.ones((2, 3)), index, np.ones(1, dtype=np.int64), 1.0, np.ones(2),
                   np.zeros(1, dtype=np.int64))
