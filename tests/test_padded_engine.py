"""Padded drafts (``pad_drafts``) on the real engine: every decoding request is given
exactly ``num_speculative_tokens`` draft tokens (the found draft, then filler), and
greedy tokens and the sampled distribution stay exactly plain vLLM's."""

from __future__ import annotations

import pytest

from vllm_fafo.metrics import collect_metrics

from .conftest import BATCH1_PROMPTS
from .engine_utils import (
    assert_concurrent_identical,
    assert_same_tokens,
    generate_one_by_one,
    greedy,
    make_llm,
    token_ids,
)
from .test_sampling import assert_same_distribution, sample

pytestmark = pytest.mark.engine

PADDED_SPEC = {"method": "fafo", "num_lanes": 0, "controller": "fixed", "num_speculative_tokens": 4,
               "pad_drafts": True}


@pytest.fixture(scope="session")
def padded_llm(model_dir):
    return make_llm(model_dir, PADDED_SPEC)


def _draft_tokens(metrics: dict) -> tuple[int, int, int]:
    """(lookups, draft tokens proposed, draft tokens accepted from found drafts)."""
    found = sum(n for origin, n in metrics["accepted_tokens"].items() if origin != "pad")
    return metrics["lookups"], sum(metrics["proposed_tokens"].values()), found


def test_batch1_identical_to_plain_with_every_draft_padded(padded_llm, plain_batch1_tokens, mtbench):
    before = _draft_tokens(collect_metrics(padded_llm))
    got = token_ids(generate_one_by_one(padded_llm, mtbench[:BATCH1_PROMPTS], greedy(128)))
    assert_same_tokens(plain_batch1_tokens, got)
    after = collect_metrics(padded_llm)
    lookups, proposed, found = (a - b for a, b in zip(_draft_tokens(after), before))
    assert lookups > 0 and proposed == PADDED_SPEC["num_speculative_tokens"] * lookups
    assert found > 0 and after["proposed_tokens"]["pad"] > 0


def test_concurrent_requests_identical_to_plain(plain_llm, padded_llm, mtbench):
    assert_concurrent_identical(plain_llm, padded_llm, mtbench[:8])


def test_samples_from_plain_vllms_distribution(plain_samples, padded_llm):
    before = _draft_tokens(collect_metrics(padded_llm))
    got = sample(padded_llm, seed0=10_000)
    lookups, proposed, found = (a - b for a, b in zip(_draft_tokens(collect_metrics(padded_llm)), before))
    assert proposed == PADDED_SPEC["num_speculative_tokens"] * lookups and found > 0
    assert_same_distribution(plain_samples, got)
