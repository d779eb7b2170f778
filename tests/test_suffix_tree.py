"""The suffix-tree text source (vllm_fafo.suffix_tree) against Arctic Inference's
trees used directly: what it feeds them, which tenant's tree answers, what it forgets.
The tenant and bound tests run for both caches SuffixTrees can hold: Arctic's trees
(``text_source`` ``suffix_tree``) and the deep-match text caches (``deep_match``)."""

from __future__ import annotations

import sys

import numpy as np
import pytest

from vllm_fafo.config import FafoConfig
from vllm_fafo.errors import FafoConfigError
from vllm_fafo.suffix_tree import SuffixTrees

PROMPT = np.array([5, 6, 7, 8, 9, 10, 11, 12], dtype=np.int64)
ANSWER = [21, 22, 23, 24, 25, 26, 27, 28, 29, 30]


@pytest.fixture(params=["suffix_tree", "deep_match"])
def deep_match_key_len(request) -> int:
    """0: Arctic's trees; 5: deep-match text caches drafting matches 5 or more deep
    (as ``text_source`` ``deep_match`` with ``max_key_len`` 4)."""
    return 0 if request.param == "suffix_tree" else 5


def decode(trees: SuffixTrees, req_id: str, tenant: str | None, prompt: np.ndarray, answer: list[int]) -> None:
    """Start ``req_id`` and feed it ``answer`` one token per step, as the proposer does."""
    trees.start(req_id, tenant, prompt)
    history = np.concatenate([prompt, answer])
    for num_tokens in range(len(prompt) + 1, len(history) + 1):
        trees.draft(req_id, history, num_tokens, room=8)


def draft_after(trees: SuffixTrees, req_id: str, tenant: str | None, history: list[int]) -> tuple[list[int], int]:
    trees.start(req_id, tenant, np.array(history[:-1]))
    return trees.draft(req_id, np.array(history), len(history), room=8)


def test_drafts_the_prompts_continuation_no_longer_than_the_match():
    trees = SuffixTrees(cached_requests=0, max_tenants=4)
    history = np.array([1, 2, 3, 4, 9, 9, 1, 2, 3])  # the prompt, then "1 2 3" decoded again
    trees.start("r", None, history[:6])
    draft, match_len = trees.draft("r", history, len(history), room=8)
    assert match_len == 3
    assert draft == [4, 9, 9]  # at most one drafted token per matched one (max_spec_factor 1)
    assert trees.draft("r", history, len(history), room=0) == ([], 0)


def test_a_finished_answer_drafts_for_its_tenant_only(deep_match_key_len):
    trees = SuffixTrees(cached_requests=100, max_tenants=4, deep_match_key_len=deep_match_key_len)
    decode(trees, "first", "salt-a", PROMPT, ANSWER)
    trees.stop("first")
    question = [1, 2, *ANSWER[:6]]  # another prompt, then the first answer's opening
    same, _ = draft_after(trees, "same tenant", "salt-a", question)
    other, _ = draft_after(trees, "other tenant", "salt-b", question)
    unsalted, _ = draft_after(trees, "no salt", None, question)
    assert same == ANSWER[6:]
    assert other == [] and unsalted == []


def test_no_cached_requests_means_no_sharing(deep_match_key_len):
    trees = SuffixTrees(cached_requests=0, max_tenants=4, deep_match_key_len=deep_match_key_len)
    decode(trees, "first", None, PROMPT, ANSWER)
    trees.stop("first")
    assert draft_after(trees, "second", None, [1, 2, *ANSWER[:6]]) == ([], 0)


def test_answers_are_bounded_over_all_tenants_oldest_evicted_first(deep_match_key_len):
    trees = SuffixTrees(cached_requests=2, max_tenants=8, deep_match_key_len=deep_match_key_len)
    answers = {name: [base + i for i in range(10)] for name, base in (("a", 100), ("b", 200), ("c", 300))}
    for name, tenant in (("a", "x"), ("b", "y"), ("c", "x")):
        decode(trees, name, tenant, PROMPT, answers[name])
        trees.stop(name)
    assert trees.num_cached_requests() == 2  # b's and c's: a's, the oldest, went
    # A new request's own answer takes a place too: b's goes now, c's stays.
    assert draft_after(trees, "asks c", "x", [1, 2, *answers["c"][:6]])[0] == answers["c"][6:]
    assert draft_after(trees, "asks a", "x", [1, 2, *answers["a"][:6]])[0] == []
    assert draft_after(trees, "asks b", "y", [1, 2, *answers["b"][:6]])[0] == []
    assert trees.num_cached_requests() == 2


def test_clear_forgets_finished_answers_but_not_a_running_requests_text():
    trees = SuffixTrees(cached_requests=100, max_tenants=4)
    decode(trees, "done", None, PROMPT, ANSWER)
    trees.stop("done")
    decode(trees, "running", None, np.array([40, 41, 42, 43, 44, 40, 41]), [])
    trees.clear()
    assert trees.num_cached_requests() == 1  # the running request's own response slot
    history = np.array([40, 41, 42, 43, 44, 40, 41])
    assert trees.draft("running", history, len(history), room=8)[0] == [42, 43]
    assert draft_after(trees, "later", None, [1, 2, *ANSWER[:6]]) == ([], 0)


def test_a_request_id_used_again_does_not_draft_its_old_answer(deep_match_key_len):
    trees = SuffixTrees(cached_requests=100, max_tenants=4, deep_match_key_len=deep_match_key_len)
    decode(trees, "r", None, PROMPT, ANSWER)
    trees.stop("r")
    trees.start("r", None, np.array([1, 2]))
    assert trees.num_cached_requests() == 1  # the old answer's slot went with it


def test_idle_tenants_beyond_the_bound_are_dropped_running_ones_kept(deep_match_key_len):
    trees = SuffixTrees(cached_requests=100, max_tenants=2, deep_match_key_len=deep_match_key_len)
    trees.start("running", "a", PROMPT)
    for tenant in ("b", "c", "d"):
        decode(trees, f"done-{tenant}", tenant, PROMPT, ANSWER)
        trees.stop(f"done-{tenant}")
    assert trees.num_tenants == 2  # "a" (running) and "d" (the most recent)
    question = [1, 2, *ANSWER[:6]]
    assert draft_after(trees, "asks d", "d", question)[0] == ANSWER[6:]
    assert draft_after(trees, "asks b", "b", question)[0] == []  # b's tree was dropped
    assert trees.num_tenants == 3  # a, d and b all run a request now: none is dropped


def test_config_names_the_key_and_the_allowed_sources():
    with pytest.raises(FafoConfigError, match=r"text_source.*'trie'.*allowed: 'pool', 'deep_match', 'suffix_tree'"):
        FafoConfig.from_user_dict({"method": "fafo", "text_source": "trie"})
    with pytest.raises(FafoConfigError, match=r"suffix_tree_cached_requests"):
        FafoConfig.from_user_dict({"method": "fafo", "suffix_tree_cached_requests": -1})


def test_suffix_tree_without_arctic_inference_says_how_to_get_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "arctic_inference.suffix_decoding", None)  # import fails
    with pytest.raises(FafoConfigError, match=r"pip install arctic-inference==0\.3\.0"):
        FafoConfig.from_user_dict({"method": "fafo", "text_source": "suffix_tree"})
    assert FafoConfig.from_user_dict({"method": "fafo", "text_source": "pool"}).text_source == "pool"
    deep = FafoConfig.from_user_dict({"method": "fafo", "text_source": "deep_match"})  # needs no Arctic
    trees = SuffixTrees(cached_requests=10, max_tenants=2, deep_match_key_len=deep.max_key_len + 1)
    decode(trees, "r", None, PROMPT, ANSWER)
