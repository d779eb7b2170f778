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

from vllm_fafo.drafting.pool import ORIGIN_CODE, ORIGINS, Origin


def _per_origin() -> dict[str, int]:
    return {origin.value: 0 for origin in Origin}


@dataclass
class FafoMetrics:
    """Running totals of one proposer (one worker)."""

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
    lookups: int = 0
    pool_hits: int = 0
    requests_started: int = 0
    requests_freed: int = 0
    proposed_tokens: dict[str, int] = field(default_factory=_per_origin)
    accepted_tokens: dict[str, int] = field(default_factory=_per_origin)
    padded_request_steps: dict[str, int] = field(default_factory=dict)
    """``pad_drafts``: decoding request-steps by the draft length their step was padded to."""

    def record_padded_step(self, draft_len: int, requests: int) -> None:
        key = str(draft_len)
        self.padded_request_steps[key] = self.padded_request_steps.get(key, 0) + requests

    def record_drafts(self, origins: np.ndarray, lengths: np.ndarray) -> None:
        """One step's drafts, row ``i`` its first ``lengths[i]`` tokens' origins
        (:class:`Origin` codes); an empty draft, or filler only, is a miss."""
        self.lookups += len(lengths)
        if not len(lengths):
            return
        self.pool_hits += int(np.count_nonzero((lengths > 0) & (origins[:, 0] != ORIGIN_CODE[Origin.PAD])))
        _count(self.proposed_tokens, origins[np.arange(origins.shape[1]) < lengths[:, None]])

    def record_acceptance(self, origins: np.ndarray) -> None:
        """The accepted prefixes of the last drafts, by token origin (codes)."""
        _count(self.accepted_tokens, origins)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _count(counts: dict[str, int], codes: np.ndarray) -> None:
    for code, n in enumerate(np.bincount(codes.reshape(-1), minlength=len(ORIGINS)).tolist()):
        counts[ORIGINS[code].value] += n


def worker_metrics(worker: Any) -> dict[str, Any] | None:
    drafter = getattr(worker.model_runner, "drafter", None)
    if not isinstance(getattr(drafter, "metrics", None), FafoMetrics):
        return None
    return drafter.metrics_snapshot()


def collect_metrics(llm: Any) -> dict[str, Any]:
    """FAFO counters of an ``LLM`` engine (worker 0), via ``collective_rpc``, with
    gauges (``requests_tracked``: requests the proposer holds state for;
    ``requests_with_region``: those holding a compressed-region row;
    ``shared_pool_tenants`` and ``shared_pool_keys``: what the shared pool holds;
    ``cached_answers``: the answers deep matches are drafted from) and the goodput
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
