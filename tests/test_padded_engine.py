"""Padded drafts (``pad_drafts``) on the real engine: every decoding request is given
exactly ``num_speculative_tokens`` draft tokens (the found draft, then filler), and
greedy tokens and the sampled distribution stay exactly plain vLLM's. The engine runs
in its own process (tests/engine_process.py): the test process, holding the session's
engines, has no memory to spare for one more."""

from __future__ import annotations

import pytest

from .engine_process import PADDED_CONCURRENT_PROMPTS, run_case
from .engine_utils import assert_same_tokens, concurrent_params, token_ids
from .test_sampling import assert_same_distribution

pytestmark = pytest.mark.engine

PADDED_SPEC = {"method": "fafo", "num_lanes": 0, "controller": "fixed", "num_speculative_tokens": 4,
               "pad_drafts": True, "prior_table": "off"}
"""The CUDA default's kind of draft (pool only, fixed controller, padded) at 4 tokens (the
default's 16 would cost this CPU run 12 more tokens per request-step), without the prior
table: the table continues every draft to its full length (0 filler tokens in this test's
batch-1 run with it, every output identical to plain vLLM's), so with it the filler would
go untested."""


@pytest.fixture(scope="module")
def padded_run(tmp_path_factory) -> dict:
    return run_case("padded", PADDED_SPEC, tmp_path_factory.mktemp("padded"))


def _draft_tokens(metrics: dict) -> tuple[int, int, int]:
    """(lookups, draft tokens proposed, draft tokens accepted from found drafts)."""
    found = sum(n for origin, n in metrics["accepted_tokens"].items() if origin != "pad")
    return metrics["lookups"], sum(metrics["proposed_tokens"].values()), found


def _grown(run: dict, before: str | None, after: str) -> tuple[int, int, int]:
    start = (0, 0, 0) if before is None else _draft_tokens(run[before])
    return tuple(a - b for a, b in zip(_draft_tokens(run[after]), start))


def test_batch1_identical_to_plain_with_every_draft_padded(padded_run, plain_batch1_tokens):
    assert_same_tokens(plain_batch1_tokens, padded_run["batch1"])
    lookups, proposed, found = _grown(padded_run, None, "batch1_metrics")
    assert lookups > 0 and proposed == PADDED_SPEC["num_speculative_tokens"] * lookups
    assert found > 0 and padded_run["batch1_metrics"]["proposed_tokens"]["pad"] > 0


def test_concurrent_requests_identical_to_plain(padded_run, plain_llm, mtbench):
    prompts = mtbench[:PADDED_CONCURRENT_PROMPTS]
    expected = token_ids(plain_llm.generate(prompts, concurrent_params(len(prompts)), use_tqdm=False))
    assert_same_tokens(expected, padded_run["concurrent"])
    lookups, proposed, _ = _grown(padded_run, "batch1_metrics", "concurrent_metrics")
    assert lookups > 0 and proposed == PADDED_SPEC["num_speculative_tokens"] * lookups


def test_samples_from_plain_vllms_distribution(padded_run, plain_samples):
    lookups, proposed, found = _grown(padded_run, "concurrent_metrics", "sample_metrics")
    assert proposed == PADDED_SPEC["num_speculative_tokens"] * lookups and found > 0
    assert_same_distribution(plain_samples, padded_run["samples"])
