"""The /metrics route: worker snapshot -> file -> Prometheus collector (no engine)."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
from prometheus_client import CollectorRegistry, generate_latest

from vllm_fafo.drafting.pool import ORIGIN_CODE, Origin
from vllm_fafo.serving.metrics import FafoMetrics, count_drafts
from vllm_fafo.serving.metrics_export import (
    COUNTERS,
    GAUGES,
    SNAPSHOT_FILE,
    FafoStatLogger,
    SnapshotCollector,
    SnapshotPublisher,
    snapshot_dir,
)

from .test_proposer import make_proposer


def _snapshot(**counters) -> dict:
    metrics = FafoMetrics(**counters)
    origins = np.array([[ORIGIN_CODE[Origin.PROMPT], ORIGIN_CODE[Origin.LANE]]], dtype=np.int32)
    count_drafts(origins, np.array([2]), ORIGIN_CODE[Origin.PAD], metrics.proposed_counts, metrics.draft_counts)
    metrics.accepted_counts[ORIGIN_CODE[Origin.PROMPT]] += 1
    return {**metrics.as_dict(), "requests_tracked": 3, "requests_with_region": 2,
            "shared_pool_tenants": 1, "shared_pool_keys": 40, "kept_answers": 5, "index_bytes": 4096,
            "controller": {"controller": "fixed", "lanes": 16, "draft_len": 4}}


def test_every_counter_and_gauge_is_exported():
    """A counter added to FafoMetrics or the snapshot must get a metric (and a line in docs/configuration.md)."""
    snapshot_keys = set(_snapshot()) - {"controller"}
    assert set(COUNTERS) == set(FafoMetrics().as_dict())
    assert set(COUNTERS) | set(GAUGES) == snapshot_keys


def test_publisher_writes_only_into_a_directory_the_front_made(tmp_path):
    directory = tmp_path / "engine0"
    publisher = SnapshotPublisher(directory, interval_s=1.0)
    assert publisher.is_due(0.0)
    made = []
    publisher.publish(lambda: made.append(1) or _snapshot(), now=0.0)
    assert not directory.exists() and not made  # offline LLM: nobody reads, nothing made or written
    directory.mkdir()
    assert not publisher.is_due(0.5) and publisher.is_due(1.0)
    publisher.publish(lambda: _snapshot(propose_calls=7), now=1.0)
    assert [p.name for p in directory.iterdir()] == [SNAPSHOT_FILE]


def test_collector_exports_the_snapshot_with_vllm_labels(tmp_path):
    SnapshotPublisher(tmp_path).publish(lambda: _snapshot(propose_calls=7, tail_tokens=95))
    registry = CollectorRegistry()
    registry.register(SnapshotCollector(tmp_path / SNAPSHOT_FILE, "smollm2", 0))
    value = registry.get_sample_value
    labels = {"model_name": "smollm2", "engine": "0"}
    assert value("vllm:fafo_propose_calls_total", labels) == 7
    assert value("vllm:fafo_tail_tokens_total", labels) == 95
    assert value("vllm:fafo_pool_hits_total", labels) == 1
    assert value("vllm:fafo_proposed_tokens_total", {**labels, "origin": "lane"}) == 1
    assert value("vllm:fafo_accepted_tokens_total", {**labels, "origin": "prompt"}) == 1
    assert value("vllm:fafo_accepted_tokens_total", {**labels, "origin": "lane"}) == 0
    assert value("vllm:fafo_shared_pool_keys", labels) == 40
    assert value("vllm:fafo_kept_answers", labels) == 5
    assert value("vllm:fafo_controller_lanes", {**labels, "controller": "fixed"}) == 16
    assert 0 <= value("vllm:fafo_snapshot_age_seconds", labels) < 60
    assert b"# HELP vllm:fafo_tail_tokens_total Fumble-lane tokens" in generate_latest(registry)


def test_collector_is_empty_before_the_first_snapshot(tmp_path):
    registry = CollectorRegistry()
    registry.register(SnapshotCollector(tmp_path / SNAPSHOT_FILE, "m", 0))
    assert generate_latest(registry) == b""


def test_goodput_controller_curve_is_exported(tmp_path):
    proposer = make_proposer(controller="goodput")
    SnapshotPublisher(tmp_path).publish(proposer.metrics_snapshot)
    registry = CollectorRegistry()
    registry.register(SnapshotCollector(tmp_path / SNAPSHOT_FILE, "m", 1))
    labels = {"model_name": "m", "engine": "1", "controller": "goodput"}
    assert registry.get_sample_value("vllm:fafo_controller_draft_len", labels) == proposer.num_speculative_tokens
    text = generate_latest(registry).decode()
    assert 'vllm:fafo_draft_reach_probability{' in text and 'position="1"' in text
    assert set(proposer.metrics_snapshot()) - {"controller"} == set(COUNTERS) | set(GAUGES)
    index_bytes = registry.get_sample_value("vllm:fafo_index_bytes", {"model_name": "m", "engine": "1"})
    assert index_bytes == proposer.index.nbytes() > 0


def test_stat_logger_is_inert_without_fafo():
    config = SimpleNamespace(additional_config=None, instance_id="x")
    assert not FafoStatLogger(config, 0).exporting
    assert not snapshot_dir("x", 0).exists()
