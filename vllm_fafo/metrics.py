"""Counters of what the FAFO proposer did, readable from any vLLM process.

vLLM already counts drafted and accepted tokens (``vllm:spec_decode_*``);
these add what only the proposer knows: pool hits and where each proposed
or accepted token's candidate came from (prompt, output, or a lane).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from vllm_fafo.pool import Origin


def _per_origin() -> dict[str, int]:
    return {origin.value: 0 for origin in Origin}


@dataclass
class FafoMetrics:
    """Running totals of one proposer (one worker)."""

    propose_calls: int = 0
    tail_tokens: int = 0
    """Fumble-lane tokens run behind the real tokens, summed over steps."""
    lookups: int = 0
    pool_hits: int = 0
    requests_started: int = 0
    requests_freed: int = 0
    proposed_tokens: dict[str, int] = field(default_factory=_per_origin)
    accepted_tokens: dict[str, int] = field(default_factory=_per_origin)

    def record_draft(self, origin: Origin | None, num_tokens: int) -> None:
        self.lookups += 1
        if origin is not None:
            self.pool_hits += 1
            self.proposed_tokens[origin.value] += num_tokens

    def record_acceptance(self, origin: Origin, num_accepted: int) -> None:
        self.accepted_tokens[origin.value] += num_accepted

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _worker_metrics(worker: Any) -> dict[str, Any] | None:
    drafter = getattr(worker.model_runner, "drafter", None)
    metrics = getattr(drafter, "metrics", None)
    return metrics.as_dict() if isinstance(metrics, FafoMetrics) else None


def collect_metrics(llm: Any) -> dict[str, Any]:
    """FAFO counters of an ``LLM`` engine (worker 0), via ``collective_rpc``."""
    results = llm.collective_rpc(_worker_metrics)
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
