"""Draft trees on the real engine, beyond the mixed call of tests/test_engine.py: a
sliding-window model, and requests whose logits a branch cannot keep exact."""

from __future__ import annotations

import pytest

from vllm_fafo.serving.metrics import collect_metrics

from .engine_configs import TREE_SPEC
from .engine_process import WINDOW, run_case
from .engine_utils import assert_same_tokens, greedy, token_ids

pytestmark = pytest.mark.engine


def _grew(llm, before: dict, key: str) -> int:
    return collect_metrics(llm)[key] - before[key]


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


def test_requests_a_branch_cannot_keep_exact_verify_the_spine_only(plain_llm, engine, mtbench):
    """Logprobs and penalties read or rewrite the logits a branch's argmax would skip."""
    tree_llm = engine("tree")
    params = [greedy(48, logprobs=2), greedy(48, repetition_penalty=1.2)]
    prompts = mtbench[:2]
    expected = plain_llm.generate(prompts, params, use_tqdm=False)
    before = collect_metrics(tree_llm)
    got = tree_llm.generate(prompts, params, use_tqdm=False)
    assert _grew(tree_llm, before, "tree_tokens") == 0
    assert_same_tokens(token_ids(expected), token_ids(got))
    for want, have in zip(expected[0].outputs[0].logprobs, got[0].outputs[0].logprobs):
        assert want.keys() == have.keys()
