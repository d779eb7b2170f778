"""Lookahead and Cacheback modes on the real engine: plain vLLM's tokens."""

from __future__ import annotations

import pytest

from vllm_fafo.metrics import collect_metrics

from .conftest import BATCH1_PROMPTS
from .engine_utils import (
    assert_concurrent_identical,
    assert_same_tokens,
    generate_one_by_one,
    greedy,
    token_ids,
)

pytestmark = pytest.mark.engine


def test_batch1_identical_to_plain(mode_llm, plain_batch1_tokens, mtbench):
    name, llm = mode_llm
    got = token_ids(generate_one_by_one(llm, mtbench[:BATCH1_PROMPTS], greedy(128)))
    assert_same_tokens(plain_batch1_tokens, got)
    metrics = collect_metrics(llm)
    if name == "lookahead":  # its pool holds lane n-grams only
        assert metrics["accepted_tokens"]["lane"] > 0
        assert metrics["proposed_tokens"]["prompt"] == metrics["proposed_tokens"]["output"] == 0
    else:
        assert metrics["tail_tokens"] == 0
        assert metrics["proposed_tokens"]["frozen"] > 0
        assert sum(metrics["accepted_tokens"].values()) > 0


def test_concurrent_requests_identical_to_plain(mode_llm, plain_llm, mtbench):
    _, llm = mode_llm
    assert_concurrent_identical(plain_llm, llm, mtbench[8:14])
