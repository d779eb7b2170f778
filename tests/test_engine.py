"""Every engine configuration (tests/engine_configs.py) against plain vLLM, one mixed
workload each (tests/mixed_workload.py): greedy tokens, texts and finish
reasons identical to plain vLLM's (batch > 1, then the longest request alone; EOS, a
stop string, a prompt that nearly fills ``max_model_len``), sampled tokens from plain
vLLM's distribution, and each configuration's own draft sources at work. Plain vLLM
is batch invariant under the suite's settings (the first test), so its reference
cannot move with the batch or the order the tests ran in."""

from __future__ import annotations

import pytest

from vllm_fafo.attention.cpu import FafoCPUAttentionBackendImpl
from vllm_fafo.serving.metrics import collect_metrics

from .engine_configs import CONFIGS, LANES_SPEC, SAMPLED
from .engine_utils import greedy
from .mixed_workload import GREEDY_LENGTHS, NEAR_MAX_MODEL_LEN_TOKENS, SAMPLED_POSITIONS
from .sampling_stats import assert_same_distribution

pytestmark = pytest.mark.engine


def test_plain_vllm_gives_a_request_the_same_logprobs_in_any_batch(plain_llm, mtbench):
    """The references are plain vLLM's greedy tokens: under the suite's settings each
    chosen token's logprob is the same bits alone, in a batch of four, beside four more
    requests and with the prompts in the prefix cache (vLLM's defaults move them by
    up to 3.5e-5 here: docs/results/identity-references.md)."""
    from vllm import SamplingParams

    prompts = mtbench[8:12]
    params = [SamplingParams(temperature=0.0, max_tokens=32 + 8 * i, logprobs=1) for i in range(len(prompts))]

    def chosen(outputs):
        return [[(t, d[t].logprob) for t, d in zip(o.outputs[0].token_ids, o.outputs[0].logprobs)] for o in outputs]

    assert plain_llm.reset_prefix_cache()
    together = chosen(plain_llm.generate(prompts, params, use_tqdm=False))
    assert chosen(plain_llm.generate(prompts, params, use_tqdm=False)) == together  # prefix-cache hits
    assert plain_llm.reset_prefix_cache()
    alone = chosen([plain_llm.generate([p], q, use_tqdm=False)[0] for p, q in zip(prompts, params)])
    assert alone == together
    beside = plain_llm.generate(mtbench[:4] + prompts, [greedy(48)] * 4 + params, use_tqdm=False)
    assert chosen(beside[4:]) == together


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_mixed_call_identical_to_plain(name, mixed_run, plain_run):
    run = mixed_run(name)
    assert run.greedy_labels == plain_run.greedy_labels
    for label in plain_run.greedy_labels:
        want, have = plain_run.outputs[label], run.outputs[label]
        assert list(have.token_ids) == list(want.token_ids), f"{label} diverges from plain vLLM"
        assert (have.text, have.finish_reason, have.stop_reason) == (want.text, want.finish_reason, want.stop_reason)
    assert [len(run.tokens(f"greedy-{i}")) for i in range(len(GREEDY_LENGTHS))] == list(GREEDY_LENGTHS)
    assert (run.outputs["eos"].finish_reason, run.outputs["eos"].stop_reason) == ("stop", None)
    assert (run.outputs["stop"].finish_reason, run.outputs["stop"].stop_reason) == ("stop", "\n\n")
    near_max = run.outputs["near-max-len"]
    assert (len(near_max.token_ids), near_max.finish_reason) == (NEAR_MAX_MODEL_LEN_TOKENS, "length")
    assert sum(_accepted(run, origin) for origin in run.metrics_after["accepted_tokens"]) > 0


@pytest.mark.parametrize("name", SAMPLED)
def test_sampled_tokens_follow_plain_vllms_distribution(name, mixed_run, plain_run):
    run = mixed_run(name)
    assert len(run.samples) > 0
    assert_same_distribution(plain_run.samples, run.samples, SAMPLED_POSITIONS)


def _accepted(run, origin: str) -> int:
    return run.metrics_after["accepted_tokens"][origin] - run.metrics_before["accepted_tokens"][origin]


def test_default_runs_the_goodput_controller_without_lanes_and_reports_what_it_learned(mixed_run):
    run = mixed_run("default")
    controller = run.metrics_after["controller"]
    assert controller["controller"] == "goodput"
    assert run.metrics_after["requests_with_region"] == 0 and run.grew("tail_tokens") == 0  # pool only
    assert len(controller["cost_curve_tokens"]) >= 2  # prefill and decode sizes at least
    assert all(ms > 0 for ms in controller["cost_curve_ms"])
    assert sum(_accepted(run, origin) for origin in run.metrics_after["accepted_tokens"]) > 0
    # more than 8 requests at once (the greedy call's 11, the sampled call's), drafts cut: some
    # steps looked for drafts in a sample of the batch (vllm_fafo.propose_kernel.SAMPLED_DRAFTS),
    # so the identity and sampled-distribution tests of this engine cover them
    assert controller["sampled_draft_steps"] > 0


def test_goodput_controller_runs_lanes_asked_for_when_it_probes_them(mixed_run):
    run = mixed_run("goodput-lanes")
    assert run.metrics_after["controller"]["controller"] == "goodput"
    assert run.grew("tail_tokens") > 0  # lanes ran when the controller probed them
    # Regions skip upkeep while lanes are off and are read back from the paged cache when
    # lanes run again: the engine's first lane probe (judged at a yield of 1.0, 16 decode
    # steps in, see conftest's ``engine``) did that.
    assert run.grew("caught_up_positions") > 0


def test_lanes_and_deep_matches_draft_and_are_accepted(mixed_run):
    run = mixed_run("lanes")
    assert _accepted(run, "lane") > 0 and run.grew("tail_tokens") > 0
    assert _accepted(run, "deep_match") > 0  # deep matches are always drafted first
    assert _accepted(run, "shared") > 0  # other requests' n-grams, the sampled ones' above all


def test_fixed_controller_runs_the_configured_lanes_every_decode_step(lanes_llm, mtbench):
    before = collect_metrics(lanes_llm)
    lanes_llm.generate(mtbench[:1], greedy(24), use_tqdm=False)
    after = collect_metrics(lanes_llm)
    assert after["controller"] == {"controller": "fixed", "lanes": LANES_SPEC["num_lanes"],
                                   "draft_len": LANES_SPEC["num_speculative_tokens"]}
    tail = after["tail_tokens"] - before["tail_tokens"]
    steps = after["propose_calls"] - before["propose_calls"]
    # One prefill step without a tail, then every lane's tokens on every decode step.
    assert tail == LANES_SPEC["num_lanes"] * LANES_SPEC["lane_len"] * (steps - 1)


def test_goodput_sized_trees_without_lanes_draft_and_price_branches(mixed_run):
    """The controller cuts the grown branches to those it expects to pay (before any ran
    it tries them: a first-token rate of 0.5), learns their yields and the cost of
    steps with branches, and reports both."""
    run = mixed_run("pool-tree")
    assert run.grew("pool_hits") > 0
    assert _accepted(run, "prior") > 0  # the prior table drafted where the text had nothing
    assert run.grew("tail_tokens") == 0  # no lanes
    assert run.grew("tree_tokens") > 0
    controller = run.metrics_after["controller"]
    assert controller["controller"] == "goodput"
    assert len(controller["tree_cost_curve_tokens"]) >= 1  # steps with branches were priced
    assert all(ms > 0 for ms in controller["tree_cost_curve_ms"])
    assert 0.0 <= min(controller["branch_first_token_rate"]) <= max(controller["branch_first_token_rate"]) <= 1.0


def test_tree_branches_are_verified_and_accepted(mixed_run):
    run = mixed_run("tree")
    assert run.grew("tree_tokens") > 0 and run.grew("branch_wins") > 0
    assert run.grew("branch_accepted_tokens") > 0 and _accepted(run, "lane") > 0


def _selected_tokens(worker) -> int:
    """Selected tokens held in all layers' regions (0: the policy chose nothing)."""
    total = 0
    for module in worker.model_runner.model.modules():
        impl = getattr(module, "impl", None)
        if isinstance(impl, FafoCPUAttentionBackendImpl) and impl.region is not None:
            total += sum(impl.region.selected_count)
    return total


@pytest.mark.parametrize("name", ["quest", "snapkv"])
def test_compression_policies_choose_what_the_lanes_see(name, mixed_run, engine):
    run = mixed_run(name)
    assert engine(name).collective_rpc(_selected_tokens)[0] > 0, f"{name} never selected"
    assert _accepted(run, "lane") > 0


def test_lookahead_drafts_lane_ngrams_only(mixed_run):
    run = mixed_run("lookahead")
    assert _accepted(run, "lane") > 0 and run.grew("branch_accepted_tokens") > 0
    assert run.grew("proposed_tokens", "prompt") == run.grew("proposed_tokens", "output") == 0


def test_cacheback_drafts_from_its_frozen_table_without_lanes(mixed_run):
    run = mixed_run("cacheback")
    assert run.grew("tail_tokens") == 0
    assert run.grew("proposed_tokens", "frozen") > 0 and run.grew("branch_accepted_tokens") > 0


def test_chunked_prefill_fills_the_region_chunk_by_chunk(mixed_run):
    """Prompts split into 32-token chunks, four requests at a time."""
    run = mixed_run("chunked-prefill")
    assert run.grew("tail_tokens") > 0  # lanes ran on the regions the chunks filled


def test_request_state_freed_after_requests_finish(engine, mtbench):
    """vLLM reports finished requests with the next step, so exactly the last
    finished request is still tracked after the engine goes idle."""
    llm = engine("pool-tree")
    for _ in range(3):
        llm.generate(mtbench[:6], greedy(8), use_tqdm=False)
    llm.generate(mtbench[:1], greedy(2), use_tqdm=False)
    assert llm.collective_rpc(_tracked_requests)[0] == 1
    metrics = collect_metrics(llm)
    assert metrics["requests_started"] - metrics["requests_freed"] == 1


def _tracked_requests(worker) -> int:
    return worker.model_runner.drafter.num_tracked_requests
