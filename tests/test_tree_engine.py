"""Draft trees on the real engine: identical tokens to plain vLLM, branches accepted,
sampled requests (with branches: multi-candidate rejection sampling) still drawn from
plain vLLM's distribution."""

from __future__ import annotations

import pytest

from vllm_fafo.metrics import collect_metrics

from .conftest import BATCH1_PROMPTS, TREE_SPEC
from .engine_process import WINDOW, run_case
from .engine_utils import assert_same_tokens, generate_one_by_one, greedy, make_llm, token_ids
from .test_sampling import MAX_TOKENS, NUM_SAMPLES, PROMPT, assert_same_distribution, sample

pytestmark = pytest.mark.engine


def _grew(llm, before: dict, key: str) -> int:
    return collect_metrics(llm)[key] - before[key]


def test_batch1_identical_to_plain_with_branches_accepted(plain_batch1_tokens, tree_llm, mtbench):
    before = collect_metrics(tree_llm)
    got = token_ids(generate_one_by_one(tree_llm, mtbench[:BATCH1_PROMPTS], greedy(128)))
    assert_same_tokens(plain_batch1_tokens, got)
    assert _grew(tree_llm, before, "tree_tokens") > 0
    assert _grew(tree_llm, before, "branch_wins") > 0
    assert _grew(tree_llm, before, "branch_accepted_tokens") > 0


def test_modes_and_lanes_with_trees_identical_to_plain_with_branches_accepted(
    plain_batch1_tokens, mode_tree_llm, mtbench
):
    """Cacheback's followers and Lookahead's guesses verified as draft trees, and trees
    next to lanes (their regions catch branch tokens up from the paged cache)."""
    before = collect_metrics(mode_tree_llm)
    got = token_ids(generate_one_by_one(mode_tree_llm, mtbench[:BATCH1_PROMPTS], greedy(128)))
    assert_same_tokens(plain_batch1_tokens, got)
    assert _grew(mode_tree_llm, before, "branch_accepted_tokens") > 0


def test_concurrent_requests_identical_to_plain_with_branches_accepted(plain_llm, tree_llm, mtbench):
    """Eight requests of different prompt and output lengths in one batch."""
    prompts = mtbench[:8]
    params = [greedy(64 + 16 * i) for i in range(len(prompts))]
    expected = token_ids(plain_llm.generate(prompts, params, use_tqdm=False))
    before = collect_metrics(tree_llm)
    got = token_ids(tree_llm.generate(prompts, params, use_tqdm=False))
    assert_same_tokens(expected, got)
    assert _grew(tree_llm, before, "branch_accepted_tokens") > 0


def test_sliding_window_model_identical_to_plain_with_branches_accepted(tmp_path):
    """Branches attend through vLLM's CPU kernel with the layer's own window. Written
    out as plain softmax over the whole context (the release before), 5 of the first 6
    such answers differed from plain vLLM's, from tokens 6-64 on. Each engine runs in its
    own process (tests/engine_process.py)."""
    expected = run_case("windowed", None, tmp_path)["tokens"]
    result = run_case("windowed", TREE_SPEC, tmp_path)
    assert result["sliding_window"] == WINDOW
    assert_same_tokens(expected, result["tokens"])
    assert result["metrics"]["branch_wins"] > 0


def test_requests_a_branch_cannot_keep_exact_verify_the_spine_only(plain_llm, tree_llm, mtbench):
    """Logprobs and penalties read or rewrite the logits a branch's argmax would skip."""
    params = [greedy(48, logprobs=2), greedy(48, repetition_penalty=1.2)]
    prompts = mtbench[:2]
    expected = plain_llm.generate(prompts, params, use_tqdm=False)
    before = collect_metrics(tree_llm)
    got = tree_llm.generate(prompts, params, use_tqdm=False)
    assert _grew(tree_llm, before, "tree_tokens") == 0
    assert_same_tokens(token_ids(expected), token_ids(got))
    for want, have in zip(expected[0].outputs[0].logprobs, got[0].outputs[0].logprobs):
        assert want.keys() == have.keys()


def test_sampled_requests_with_branches_keep_plain_distribution(plain_llm, plain_samples, tree_llm, mtbench):
    """Sampled requests verify their branches too (vllm_fafo.tree.accept_sampled): the
    tokens keep plain vLLM's distribution with branch tokens accepted (seeded requests:
    ``sample`` seeds each, so branches draw from the request's generator), and next to
    unseeded sampled ones a greedy request stays identical to plain vLLM's."""
    from vllm import SamplingParams

    before = collect_metrics(tree_llm)
    got = sample(tree_llm, seed0=10_000)
    assert _grew(tree_llm, before, "tree_tokens") > 0
    assert _grew(tree_llm, before, "branch_accepted_tokens") > 0  # only sampled requests ran
    assert_same_distribution(plain_samples, got)

    greedy_expected = token_ids(plain_llm.generate([mtbench[3]], greedy(96), use_tqdm=False))
    sampled = [SamplingParams(temperature=0.9, top_p=0.95, max_tokens=MAX_TOKENS) for _ in range(NUM_SAMPLES // 10)]
    outputs = tree_llm.generate([mtbench[3]] + [PROMPT] * len(sampled), [greedy(96)] + sampled, use_tqdm=False)
    assert token_ids(outputs[:1]) == greedy_expected



@pytest.fixture(scope="session")
def goodput_tree_llm(model_dir):
    # 4-token text n-grams: the tree README "Text n-gram length" measures for GPUs
    return make_llm(model_dir, {"method": "fafo", "num_lanes": 0, "num_candidates": 4, "text_ngram_len": 4})


def test_trees_sized_by_the_goodput_controller_identical_to_plain(plain_batch1_tokens, goodput_tree_llm, mtbench):
    """The controller cuts the grown branches to those it expects to pay (before any
    ran it tries them: a first-token rate of 0.5, priced like other tokens), learns
    their yields and the cost of steps with branches, and reports both."""
    got = token_ids(generate_one_by_one(goodput_tree_llm, mtbench[:4], greedy(128)))
    assert_same_tokens(plain_batch1_tokens[:4], got)
    metrics = collect_metrics(goodput_tree_llm)
    assert metrics["tree_tokens"] > 0
    controller = metrics["controller"]
    assert controller["controller"] == "goodput"
    assert len(controller["tree_cost_curve_tokens"]) >= 1  # steps with branches were priced
    assert all(ms > 0 for ms in controller["tree_cost_curve_ms"])
    assert 0.0 <= min(controller["branch_first_token_rate"]) <= max(controller["branch_first_token_rate"]) <= 1.0
