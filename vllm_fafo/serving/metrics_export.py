"""FAFO's counters on ``vllm serve``'s ``/metrics``, next to vLLM's ``vllm:spec_decode_*``.

The counters live in the worker that runs the proposer (inside the engine-core
process, or TP rank 0 of its workers); ``/metrics`` is served by the front
process. The route between them costs no step: about once a second, and at
once when the engine goes idle, the worker replaces a small JSON snapshot in
a directory that the front process made for that engine; the front's
collector reads the snapshot when ``/metrics`` is scraped. The directory is
named after vLLM's ``instance_id`` (the same in every process of one engine)
and the engine index. Without a front process (offline ``LLM``) there is no
directory and the worker writes nothing: read those counters with
``vllm_fafo.serving.metrics.collect_metrics`` instead.

:class:`FafoStatLogger` is the front half, found by vLLM through the entry-point
group ``vllm.stat_logger_plugins``; every metric it exports is listed in
:data:`COUNTERS` and :data:`GAUGES` and in docs/configuration.md "Metrics".
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
import weakref
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from prometheus_client import REGISTRY, CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from vllm.config import VllmConfig
from vllm.v1.metrics.loggers import StatLoggerBase
from vllm.v1.metrics.stats import IterationStats, MultiModalCacheStats, SchedulerStats

from vllm_fafo.config import fafo_settings
from vllm_fafo.log import init_logger

logger = init_logger(__name__)

PUBLISH_INTERVAL_S = 1.0
SNAPSHOT_FILE = "snapshot.json"
PREFIX = "vllm:fafo_"

COUNTERS: dict[str, str] = {
    "propose_calls": "Decoding steps the FAFO proposer ran.",
    "lookups": "Pool lookups (one per decoding request per step).",
    "pool_hits": "Pool lookups that found a draft.",
    "proposed_tokens": "Draft tokens proposed, by the origin of their candidate.",
    "accepted_tokens": "Draft tokens accepted, by the origin of their candidate.",
    "tail_tokens": "Fumble-lane tokens run behind the real tokens.",
    "caught_up_positions": "Compressed-region positions read back from the paged KV cache "
                           "after a request's lanes were off.",
    "tree_tokens": "Draft-tree branch tokens verified next to the spines.",
    "branch_wins": "Request-steps where a draft-tree branch got further than the spine.",
    "branch_accepted_tokens": "Tokens accepted from draft-tree branches beyond the spine's accepted prefix.",
    "requests_started": "Requests the proposer started tracking.",
    "requests_freed": "Requests the proposer freed (finished, aborted or preempted and dropped).",
    "padded_request_steps": "Decoding request-steps by the draft length their step was padded to (pad_drafts).",
}
"""Snapshot key -> help text of each counter (exported as ``vllm:fafo_<key>_total``;
the dicts carry the label :data:`COUNTER_LABELS` names)."""

COUNTER_LABELS = {"proposed_tokens": "origin", "accepted_tokens": "origin", "padded_request_steps": "draft_len"}
"""The label of each counter kept by a key (the snapshot's dicts)."""

GAUGES: dict[str, str] = {
    "requests_tracked": "Requests the proposer holds state for.",
    "requests_with_region": "Requests holding a compressed-region row (fumble lanes).",
    "shared_pool_tenants": "Tenants (cache_salt values) with a pool.",
    "shared_pool_keys": "Keys held by the tenants' pools (their running requests' included).",
    "kept_answers": "Answers (finished and running) of all tenants that deep matches are drafted from.",
    "index_bytes": "Bytes of the draft index's arrays (the pools, the deep matches' texts and places), "
                   "allocated.",
}
"""Snapshot key -> help text of each gauge (exported as ``vllm:fafo_<key>``)."""

CONTROLLER_GAUGES: dict[str, str] = {
    "lanes": "Fumble lanes per request the controller chose last.",
    "draft_len": "Longest draft the controller allows now.",
    "mean_draft_len": "Mean draft length the controller chose last step (goodput controller).",
    "sampled_draft_steps": "Steps whose drafts were found for a sample of the batch, the controller having "
                           "cut drafts found the step before (goodput controller; a count since the engine "
                           "started).",
    "lane_yield": "Accepted tokens per lane token, decayed average (goodput controller).",
    "tokens_per_request": "Tokens per request-step without lanes, decayed average (goodput controller).",
    "tree_tokens": "Draft-tree branch tokens the controller kept for the next step, all requests (goodput controller).",
}
"""Controller summary key -> help text (exported as ``vllm:fafo_controller_<key>``, with a
``controller`` label naming the controller); the goodput controller also exports
``vllm:fafo_draft_reach_probability{position}`` and ``vllm:fafo_step_cost_seconds{tokens}``."""


def snapshot_dir(instance_id: str, engine_index: int) -> Path:
    """Where the snapshot of one engine is exchanged (made and removed by the front process)."""
    return Path(tempfile.gettempdir()) / f"vllm-fafo-metrics-{instance_id}-engine{engine_index}"


class SnapshotPublisher:
    """Worker half: writes the proposer's snapshot where the front process reads it."""

    def __init__(self, directory: Path, interval_s: float = PUBLISH_INTERVAL_S) -> None:
        self.directory = directory
        self.interval_s = interval_s
        self._last = float("-inf")

    @classmethod
    def for_worker(cls, vllm_config: VllmConfig) -> SnapshotPublisher | None:
        """The publisher of this worker; None on TP ranks other than 0 (every rank
        holds the same counters; one snapshot per engine). Outside an engine (no
        parallel groups) the process is rank 0."""
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank, model_parallel_is_initialized

        if model_parallel_is_initialized() and get_tensor_model_parallel_rank() != 0:
            return None
        engine_index = vllm_config.parallel_config.data_parallel_rank
        return cls(snapshot_dir(vllm_config.instance_id, engine_index))

    def next_due(self) -> float:
        """When the next snapshot is due (monotonic seconds)."""
        return self._last + self.interval_s

    def is_due(self, now: float) -> bool:
        return now >= self.next_due()

    def publish(self, make_snapshot: Callable[[], dict[str, Any]], now: float | None = None) -> None:
        """Replace the snapshot atomically; nothing, not even the snapshot made, when no
        front process made the directory (offline ``LLM``: the proposer's snapshot took
        about 0.3 ms on the 2-core CPU) or it was removed (the server is shutting down)."""
        self._last = time.monotonic() if now is None else now
        if not self.directory.is_dir():
            return
        staging = self.directory / f"{SNAPSHOT_FILE}.{os.getpid()}"
        try:
            staging.write_text(json.dumps({**make_snapshot(), "time": time.time()}))
            os.replace(staging, self.directory / SNAPSHOT_FILE)
        except FileNotFoundError:  # the directory went away between the check and the write
            return


class SnapshotCollector:
    """Front half: a Prometheus collector that turns the latest snapshot into metrics."""

    def __init__(self, path: Path, model_name: str, engine_index: int) -> None:
        self.path = path
        self.labels = {"model_name": model_name, "engine": str(engine_index)}

    def describe(self) -> list[Metric]:
        """Nothing: the metrics appear with the first snapshot (and registering does
        not read the snapshot)."""
        return []

    def collect(self) -> Iterator[Metric]:
        try:
            snapshot = json.loads(self.path.read_text())
        except FileNotFoundError:  # the engine has not finished a step yet
            return
        names, values = list(self.labels), list(self.labels.values())
        for key, text in COUNTERS.items():
            value = snapshot[key]
            if isinstance(value, dict):
                family = CounterMetricFamily(PREFIX + key, text, labels=names + [COUNTER_LABELS[key]])
                for label, count in value.items():
                    family.add_metric(values + [label], count)
            else:
                family = CounterMetricFamily(PREFIX + key, text, labels=names)
                family.add_metric(values, value)
            yield family
        for key, text in GAUGES.items():
            yield _gauge(PREFIX + key, text, names, values, snapshot[key])
        controller = snapshot["controller"]
        names, values = names + ["controller"], values + [controller["controller"]]
        for key, text in CONTROLLER_GAUGES.items():
            if key in controller:
                yield _gauge(f"{PREFIX}controller_{key}", text, names, values, controller[key])
        if "reach_probability" in controller:
            family = GaugeMetricFamily(
                PREFIX + "draft_reach_probability",
                "Estimated probability that a draft's token at this position is accepted "
                "(goodput controller).", labels=names + ["position"])
            for position, probability in enumerate(controller["reach_probability"], start=1):
                family.add_metric(values + [str(position)], probability)
            yield family
        if "cost_curve_tokens" in controller:
            family = GaugeMetricFamily(
                PREFIX + "step_cost_seconds",
                "Learned forward time by tokens in the forward (goodput controller's cost curve).",
                labels=names + ["tokens"])
            for tokens, ms in zip(controller["cost_curve_tokens"], controller["cost_curve_ms"]):
                family.add_metric(values + [f"{tokens:g}"], ms / 1000)
            yield family
        yield _gauge(PREFIX + "snapshot_age_seconds",
                     "Seconds since the worker wrote the snapshot these metrics come from.",
                     names[:2], values[:2], max(0.0, time.time() - snapshot["time"]))


def _gauge(name: str, text: str, names: list[str], values: list[str], value: float) -> GaugeMetricFamily:
    family = GaugeMetricFamily(name, text, labels=names)
    family.add_metric(values, value)
    return family


def _close(registry: CollectorRegistry, collector: SnapshotCollector, directory: Path) -> None:
    registry.unregister(collector)
    shutil.rmtree(directory, ignore_errors=True)


class FafoStatLogger(StatLoggerBase):
    """vLLM stat-logger plugin: exports one engine's FAFO snapshot on ``/metrics``.

    Inert for engines without FAFO."""

    def __init__(self, vllm_config: VllmConfig, engine_index: int = 0) -> None:
        self.exporting = False
        if fafo_settings(vllm_config) is None:
            return
        if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
            logger.warning(
                "vllm-fafo metrics are not exported on /metrics with several API servers "
                "(PROMETHEUS_MULTIPROC_DIR is set); run with api_server_count 1 to scrape them")
            return
        directory = snapshot_dir(vllm_config.instance_id, engine_index)
        directory.mkdir(exist_ok=True)
        collector = SnapshotCollector(directory / SNAPSHOT_FILE,
                                      vllm_config.model_config.served_model_name, engine_index)
        REGISTRY.register(collector)
        weakref.finalize(self, _close, REGISTRY, collector, directory)
        self.exporting = True

    def record(
        self,
        scheduler_stats: SchedulerStats | None,
        iteration_stats: IterationStats | None,
        mm_cache_stats: MultiModalCacheStats | None = None,
        engine_idx: int = 0,
    ) -> None:
        """Nothing per output: the collector reads the worker's snapshot at scrape time."""

    def log_engine_initialized(self) -> None:
        if self.exporting:
            logger.info("vllm-fafo metrics exported on /metrics as %s*", PREFIX)
