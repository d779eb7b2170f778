"""Counters of what the FAFO proposer did, readable from any vLLM process.

vLLM already counts drafted and accepted tokens (``vllm:spec_decode_*``);
these add what only the proposer knows: pool hits and where each proposed
or accepted token's candidate came from (:class:`vllm_fafo.drafting.pool.Origin`:
the prompt, the output, a lane, Cacheback's frozen table, another request via the
shared pool, a deep match, the prior table, or filler).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
from numba import njit

from vllm_fafo.drafting.pool import ORIGINS

LOOKUPS, POOL_HITS = 0, 1
"""Rows of :attr:`FafoMetrics.draft_counts`."""


@njit(cache=True)
def count_drafts(origins: np.ndarray, lengths: np.ndarray, pad: int, proposed: np.ndarray,
                 totals: np.ndarray) -> None:
    """Add one step's drafts (row i: its first ``lengths[i]`` tokens' origin codes) to
    ``proposed`` (by origin) and ``totals`` (lookups, hits: drafts not empty nor filler only)."""
    for i in range(len(lengths)):
        totals[LOOKUPS] += 1
        if lengths[i] > 0 and origins[i, 0] != pad:
            totals[POOL_HITS] += 1
        for k in range(lengths[i]):
            proposed[origins[i, k]] += 1


def _per_origin(counts: np.ndarray) -> dict[str, int]:
    return {origin.value: n for origin, n in zip(ORIGINS, counts.tolist())}


@dataclass
class FafoMetrics:
    """Running totals of one proposer (one worker). The per-step counts are arrays the
    step's kernels add to (:mod:`vllm_fafo.request_table`'s, with :func:`count_drafts`)."""

    propose_calls: int = 0
    tail_tokens: int = 0
    """Fumble-lane tokens run behind the real tokens, summed over steps."""
    caught_up_positions: int = 0
    """Region positions read back from the paged cache because the request's
    lanes were off when they were decoded (goodput controller)."""
    tree_tokens: int = 0
    """Draft-tree branch tokens verified next to the spines, summed over steps."""
    branch_wins: int = 0
    """Request-steps where a branch got further than the spine."""
    branch_accepted_tokens: int = 0
    """Tokens accepted from branches off the spine (beyond the spine's accepted prefix)."""
    requests_started: int = 0
    requests_freed: int = 0
    padded_request_steps: dict[str, int] = field(default_factory=dict)
    """``pad_drafts``: decoding request-steps by the draft length their step was padded to."""
    draft_counts: np.ndarray = field(default_factory=lambda: np.zeros(2, dtype=np.int64), repr=False)
    """Pool lookups (one per decoding request per step) and hits (:data:`LOOKUPS`, :data:`POOL_HITS`)."""
    proposed_counts: np.ndarray = field(default_factory=lambda: np.zeros(len(ORIGINS), dtype=np.int64), repr=False)
    """Draft tokens proposed, by :class:`Origin` code."""
    accepted_counts: np.ndarray = field(default_factory=lambda: np.zeros(len(ORIGINS), dtype=np.int64), repr=False)
    """Draft tokens accepted, by :class:`Origin` code."""

    @property
    def lookups(self) -> int:
        return int(self.draft_counts[LOOKUPS])

    @property
    def pool_hits(self) -> int:
        return int(self.draft_counts[POOL_HITS])

    @property
    def proposed_tokens(self) -> dict[str, int]:
        return _per_origin(self.proposed_counts)

    @property
    def accepted_tokens(self) -> dict[str, int]:
        return _per_origin(self.accepted_counts)

    def record_padded_step(self, draft_len: int, requests: int) -> None:
        key = str(draft_len)
        self.padded_request_steps[key] = self.padded_request_steps.get(key, 0) + requests

    def as_dict(self) -> dict[str, Any]:
        counts = asdict(self)
        del counts["draft_counts"], counts["proposed_counts"], counts["accepted_counts"]
        return {**counts, "lookups": self.lookups, "pool_hits": self.pool_hits,
                "proposed_tokens": self.proposed_tokens, "accepted_tokens": self.accepted_tokens}


def load_kernels() -> None:
    """Run the counting kernels once on the step's types, so that numba loads them
    (on a new machine: compiles them) while the engine starts."""
    origins, lengths = np.zeros((1, 1), dtype=np.int32), np.ones(1, dtype=np.int64)
    count_drafts(origins, lengths, 0, np.zeros(1, dtype=np.int64), np.zeros(2, dtype=np.int64))


def worker_metrics(worker: Any) -> dict[str, Any] | None:
    drafter = getattr(worker.model_runner, "drafter", None)
    if not isinstance(getattr(drafter, "metrics", None), FafoMetrics):
        return None
    return drafter.metrics_snapshot()


def collect_metrics(llm: Any) -> dict[str, Any]:
    """FAFO counters of an ``LLM`` engine (worker 0), via ``collective_rpc``, with
    gauges (``requests_tracked``: requests the proposer holds state for;
    ``requests_with_region``: those holding a compressed-region row;
    ``shared_pool_tenants`` and ``shared_pool_keys``: what the tenants' pools hold;
    ``kept_answers``: the answers deep matches are drafted from; ``index_bytes``:
    the bytes the draft index's arrays take, allocated) and the goodput
    controller's latest choices and cost curve under ``"controller"``."""
    results = llm.collective_rpc(worker_metrics)
    if not results or results[0] is None:
        raise RuntimeError("this engine does not run the FAFO proposer")
    return results[0]


def vllm_spec_counters(llm: Any) -> dict[str, float]:
    """vLLM's own speculative-decoding counters of an ``LLM`` (needs stats on)."""
    wanted = {
        "vllm:spec_decode_num_drafts": "num_drafts",
        "vllm:spec_decode_num_draft_tokens": "num_draft_tokens",
        "vllm:spec_decode_num_accepted_tokens": "num_accepted_tokens",
    }
    counters = {name: 0.0 for name in wanted.values()}
    for metric in llm.get_metrics():
        if metric.name in wanted:
            counters[wanted[metric.name]] += metric.value
    return counters
