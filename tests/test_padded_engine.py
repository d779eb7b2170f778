"""Padded drafts (``pad_drafts``) on the real engine: every decoding request is given
exactly ``num_speculative_tokens`` draft tokens (the found draft, then filler), and
the mixed call's greedy tokens and sampled distribution stay plain vLLM's. The engine runs
in its own process (tests/engine_process.py): the test process, holding the session's
engines, has no memory to spare for one more."""

from __future__ import annotations

import pytest

from .engine_process import run_case
from .mixed_workload import SAMPLED_POSITIONS
from .sampling_stats import assert_same_distribution

pytestmark = pytest.mark.engine

PADDED_SPEC = {"method": "fafo", "num_lanes": 0, "controller": "goodput", "num_speculative_tokens": 8,
               "pad_drafts": True, "prior_table": "off"}
"""The CUDA kind of draft (pool only, padded), with the goodput controller choosing one
draft length per step for the whole batch (0, 4 or 8: the tiers up to 8; the default's
16 would cost this CPU run more tokens per request-step), without the prior table: the
table continues every draft to its full length (0 filler tokens in a batch-1 run with it,
every output identical to plain vLLM's), so with it the filler would go untested. The
fixed controller's padding (always ``num_speculative_tokens``) is the same code with the
longest tier every step (tests/test_proposer.py)."""


@pytest.fixture(scope="module")
def padded_run(tmp_path_factory) -> dict:
    return run_case("padded", PADDED_SPEC, tmp_path_factory.mktemp("padded"))


def _grew(run: dict, *keys: str) -> int:
    before, after = run["metrics_before"], run["metrics_after"]
    for key in keys:
        before, after = before[key], after[key]
    return after - before


def test_mixed_call_identical_to_plain_with_every_draft_padded(padded_run, plain_run):
    tokens = padded_run["tokens"]
    for label in plain_run.greedy_labels:
        assert tokens[label] == plain_run.tokens(label), f"{label} diverges from plain vLLM"
    lookups = _grew(padded_run, "lookups")
    proposed = sum(_grew(padded_run, "proposed_tokens", origin) for origin in padded_run["metrics_after"]["proposed_tokens"])
    found = sum(_grew(padded_run, "accepted_tokens", origin)
                for origin in padded_run["metrics_after"]["accepted_tokens"] if origin != "pad")
    before = padded_run["metrics_before"]["padded_request_steps"]
    tiers = {int(tier): steps - before.get(tier, 0)
             for tier, steps in padded_run["metrics_after"]["padded_request_steps"].items()}
    print("request-steps by padded draft length:", tiers)
    # every decoding request of a step drafted exactly the step's tier
    assert lookups > 0 and sum(tiers.values()) == lookups
    assert proposed == sum(tier * request_steps for tier, request_steps in tiers.items())
    assert found > 0 and _grew(padded_run, "proposed_tokens", "pad") > 0


def test_samples_from_plain_vllms_distribution(padded_run, plain_run):
    samples = [tokens for label, tokens in padded_run["tokens"].items() if label.startswith("sample-")]
    assert_same_distribution(plain_run.samples, samples, SAMPLED_POSITIONS)
