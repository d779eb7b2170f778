"""The texts deep matches draft from (vllm_fafo.drafting.deep_match.TenantTexts): which
tenant's answers answer, what is bounded and forgotten."""

from __future__ import annotations

import numpy as np

from vllm_fafo.drafting import text_kernels
from vllm_fafo.drafting.deep_match import TenantTexts

PROMPT = np.array([5, 6, 7, 8, 9, 10, 11, 12], dtype=np.int64)
ANSWER = [21, 22, 23, 24, 25, 26, 27, 28, 29, 30]


KEY_LEN = 5
"""Matches drafted from are 5 or more deep (``max_key_len`` 4, the default)."""


def decode(trees: TenantTexts, req_id: str, tenant: str | None, prompt: np.ndarray, answer: list[int]) -> None:
    """Start ``req_id`` and feed it ``answer`` one token per step, as the proposer does."""
    trees.start(req_id, tenant, prompt)
    history = np.concatenate([prompt, answer])
    for num_tokens in range(len(prompt) + 1, len(history) + 1):
        trees.draft(req_id, history, num_tokens, room=8)


def answer_cells(trees: TenantTexts) -> int:
    """Cells of the answers' chains in the chains' table."""
    return int(np.count_nonzero(trees.heads & text_kernels.ANSWER_CELL))


def assert_cells_live(trees: TenantTexts) -> None:
    """Every cell of the chains' table points into a live text (an answers' cell: a kept
    answer), and the count of cells used is the table's."""
    cells = trees.heads[trees.heads != 0]
    texts = (cells >> 32) & text_kernels._TEXT_MASK
    assert int(trees.heads_used[0]) == len(cells)
    assert (trees.capacities[texts] > 0).all()
    assert (trees.answers_of[texts[(cells & text_kernels.ANSWER_CELL) != 0]] >= 0).all()


def draft_after(trees: TenantTexts, req_id: str, tenant: str | None, history: list[int]) -> tuple[list[int], int]:
    trees.start(req_id, tenant, np.array(history[:-1]))
    return trees.draft(req_id, np.array(history), len(history), room=8)


def test_drafts_the_prompts_continuation_after_a_deep_enough_match():
    trees = TenantTexts(answer_bytes=0, max_tenants=4, key_len=KEY_LEN)
    history = np.array([1, 2, 3, 4, 5, 6, 7, 9, 9, 3, 4, 5, 6, 7])  # the prompt, then "3 4 5 6 7" decoded again
    trees.start("r", None, history[:9])
    draft, match_len = trees.draft("r", history, len(history), room=8)
    assert match_len == 5
    assert draft == [9, 9, 3, 4, 5, 6, 7]  # the text's continuation, up to where it ends
    assert trees.draft("r", history, len(history), room=0) == ([], 0)
    shallow = np.array([1, 2, 3, 4, 9, 2, 3, 4])  # "2 3 4" again: 3 deep, the pool's
    trees.start("s", None, shallow[:5])
    assert trees.draft("s", shallow, len(shallow), room=8) == ([], 0)


def test_a_finished_answer_drafts_for_its_tenant_only():
    trees = TenantTexts(answer_bytes=1 << 20, max_tenants=4, key_len=KEY_LEN)
    decode(trees, "first", "salt-a", PROMPT, ANSWER)
    trees.stop("first")
    question = [1, 2, *ANSWER[:6]]  # another prompt, then the first answer's opening
    same, _ = draft_after(trees, "same tenant", "salt-a", question)
    other, _ = draft_after(trees, "other tenant", "salt-b", question)
    unsalted, _ = draft_after(trees, "no salt", None, question)
    assert same == ANSWER[6:]
    assert other == [] and unsalted == []


def test_no_cached_requests_means_no_sharing():
    trees = TenantTexts(answer_bytes=0, max_tenants=4, key_len=KEY_LEN)
    decode(trees, "first", None, PROMPT, ANSWER)
    trees.stop("first")
    assert draft_after(trees, "second", None, [1, 2, *ANSWER[:6]]) == ([], 0)


def test_answers_are_bounded_per_tenant_in_bytes_earliest_finished_evicted_first():
    charge = TenantTexts.answer_charge(len(PROMPT) + 10, 10)
    trees = TenantTexts(answer_bytes=2 * charge, max_tenants=8, key_len=KEY_LEN)
    answers = {name: [base + i for i in range(10)] for name, base in (("a", 100), ("b", 200), ("c", 300), ("d", 400))}
    for name, tenant in (("a", "x"), ("b", "y"), ("c", "x"), ("d", "x")):
        decode(trees, name, tenant, PROMPT, answers[name])
        trees.stop(name)
    assert trees.num_kept_answers() == 3  # b's (tenant y's only), c's and d's: a's, x's earliest, went
    assert trees.charged_bytes("x") == 2 * charge and trees.charged_bytes("y") == charge
    assert draft_after(trees, "asks c", "x", [1, 2, *answers["c"][:6]])[0] == answers["c"][6:]
    assert draft_after(trees, "asks a", "x", [1, 2, *answers["a"][:6]])[0] == []
    assert draft_after(trees, "asks b", "y", [1, 2, *answers["b"][:6]])[0] == answers["b"][6:]


def test_clear_forgets_finished_answers_but_not_a_running_requests_text():
    trees = TenantTexts(answer_bytes=1 << 20, max_tenants=4, key_len=KEY_LEN)
    decode(trees, "done", None, PROMPT, ANSWER)
    trees.stop("done")
    history = np.array([40, 41, 42, 43, 44, 45, 46, 40, 41, 42, 43, 44])
    decode(trees, "running", None, history, [])
    trees.clear()
    assert trees.num_kept_answers() == 1  # the running request's own response slot
    assert trees.draft("running", history, len(history), room=8)[0] == [45, 46, 40, 41, 42, 43, 44]
    assert draft_after(trees, "later", None, [1, 2, *ANSWER[:6]]) == ([], 0)


def test_a_request_id_used_again_does_not_draft_its_old_answer():
    trees = TenantTexts(answer_bytes=1 << 20, max_tenants=4, key_len=KEY_LEN)
    decode(trees, "r", None, PROMPT, ANSWER)
    trees.stop("r")
    trees.start("r", None, np.array([1, 2]))
    assert trees.num_kept_answers() == 1  # the old answer's slot went with it


def test_idle_tenants_beyond_the_bound_are_dropped_running_ones_kept():
    trees = TenantTexts(answer_bytes=1 << 20, max_tenants=2, key_len=KEY_LEN)
    trees.start("running", "a", PROMPT)
    for tenant in ("b", "c", "d"):
        decode(trees, f"done-{tenant}", tenant, PROMPT, ANSWER)
        trees.stop(f"done-{tenant}")
    assert trees.num_tenants == 2  # "a" (running) and "d" (the most recent)
    assert_cells_live(trees)
    answer_keys = len(ANSWER)  # d's: a key before each answer token (b's and c's deleted)
    assert answer_cells(trees) == answer_keys
    question = [1, 2, *ANSWER[:6]]
    assert draft_after(trees, "asks d", "d", question)[0] == ANSWER[6:]
    assert draft_after(trees, "asks b", "b", question)[0] == []  # b's texts were dropped
    assert trees.num_tenants == 3  # a, d and b all run a request now: none is dropped
