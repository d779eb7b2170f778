"""FafoProposer driven directly, the way vLLM's runner calls it."""

from types import SimpleNamespace

import numpy as np
import pytest

from vllm_fafo.config import FafoConfig
from vllm_fafo.proposer import FafoProposer

from .test_pool import _reference_lookup


def make_proposer(max_model_len=4096, **settings) -> FafoProposer:
    """A pool-only proposer (lanes need a runner; see test_region.py)."""
    config = FafoConfig(**{"num_lanes": 0, "controller": "fixed", "deep_match": False, "prior_table": "off",
                           **settings})
    vllm_config = SimpleNamespace(
        speculative_config=SimpleNamespace(
            num_speculative_tokens=config.num_speculative_tokens
        ),
        additional_config={"fafo": config.to_dict()},
        instance_id="", parallel_config=SimpleNamespace(data_parallel_rank=0),
        model_config=SimpleNamespace(max_model_len=max_model_len),
    )
    return FafoProposer(vllm_config)


class FakeBatch:
    """The runner's persistent batch: one history row per request."""

    def __init__(self, max_model_len=4096):
        self.req_ids: list[str] = []
        self.token_ids = np.zeros((8, max_model_len), dtype=np.int32)
        self.num_tokens = np.zeros(8, dtype=np.int32)
        self.scheduled_drafts: dict[str, list[int]] = {}  # what vLLM verifies in the next step
        self.new_requests: dict[str, str | None] = {}  # announced at the next step, with their salt

    def add(self, req_id, prompt, cache_salt=None):
        row = len(self.req_ids)
        self.req_ids.append(req_id)
        self.new_requests[req_id] = cache_salt
        self.token_ids[row, : len(prompt)] = prompt
        self.num_tokens[row] = len(prompt)

    def step(self, proposer, sampled_per_row, before_sampling=None, num_scheduled_tokens=0):
        """One step; ``before_sampling(proposer)`` runs where vLLM's runner samples."""
        for row, sampled in enumerate(sampled_per_row):
            n = self.num_tokens[row]
            self.token_ids[row, n : n + len(sampled)] = sampled
            self.num_tokens[row] += len(sampled)
        proposer.begin_step((), num_scheduled_tokens, self.scheduled_drafts, self.new_requests)
        self.new_requests = {}
        if before_sampling is not None:
            before_sampling(proposer)
        proposer.finish_forward(self.req_ids, None)
        drafts = proposer.propose(sampled_per_row, self.num_tokens, self.token_ids)
        self.scheduled_drafts = {req_id: draft for req_id, draft in zip(self.req_ids, drafts) if draft}
        return drafts


def test_first_draft_matches_reference_and_rows_keep_their_own_pools():
    # candidates as long as a draft (text_ngram_len 0), as the reference files them
    proposer = make_proposer(num_speculative_tokens=3, max_key_len=3, text_ngram_len=0)
    batch = FakeBatch()
    prompt_a = [1, 2, 3, 4, 5, 6, 1, 2, 3, 7, 8, 9, 1]
    prompt_b = [5, 5, 6, 5, 5, 7, 5]
    batch.add("a", prompt_a)
    batch.add("b", prompt_b)
    drafts = batch.step(proposer, [[2], [5]])
    assert tuple(drafts[0]) == _reference_lookup(prompt_a + [2], 3, 3) == (3, 7, 8)
    assert tuple(drafts[1]) == _reference_lookup(prompt_b + [5], 3, 3) == (7, 5, 5)


def test_prefill_chunk_rows_get_no_draft():
    proposer = make_proposer(num_speculative_tokens=4)
    batch = FakeBatch()
    batch.add("a", [1, 2, 1, 2, 1])
    batch.add("b", [3] * 8)
    drafts = batch.step(proposer, [[], [3]])
    assert drafts == [[], [3, 3, 3, 3]]
    assert proposer.num_tracked_requests == 1


def test_draft_respects_max_model_len_and_num_speculative_tokens():
    proposer = make_proposer(max_model_len=12, num_speculative_tokens=4)
    batch = FakeBatch(max_model_len=12)
    batch.add("a", [1, 2, 3, 4, 5, 6, 1, 2, 3])
    assert batch.step(proposer, [[4]]) == [[5, 6]]  # 10 tokens, room for 2
    proposer2 = make_proposer(num_speculative_tokens=2)
    batch2 = FakeBatch()
    batch2.add("a", [1, 2, 3, 4, 5, 6, 1, 2, 3])
    assert batch2.step(proposer2, [[4]]) == [[5, 6]]


def test_short_text_ngrams_chain_along_the_newest_places():
    """``text_ngram_len`` 2: the draft is chained from 2-token pieces, each found under
    the draft's own last tokens (the newest place of "3 4" is followed by "8 8"); whole
    6-token n-grams follow the one place of "1 2"."""
    prompt = [1, 2, 3, 4, 5, 6, 7, 9, 3, 4, 8, 8, 1]
    drafts = {}
    for ngram_len in (0, 2):
        proposer = make_proposer(num_speculative_tokens=6, max_key_len=2, text_ngram_len=ngram_len)
        batch = FakeBatch()
        batch.add("a", prompt)
        drafts[ngram_len] = batch.step(proposer, [[2]])[0]
    assert drafts == {0: [3, 4, 5, 6, 7, 9], 2: [3, 4, 8, 8, 1, 2]}


def test_padded_drafts_are_num_speculative_tokens_long_found_tokens_first():
    """``pad_drafts``: the found draft ("2 3": nothing is filed under "2 3" or "3" yet),
    then its last token repeated; a request without a draft repeats its text's last
    token; never past ``max_model_len``. Filler is counted as origin ``pad``, and a
    draft of filler only as a miss."""
    proposer = make_proposer(max_model_len=14, num_speculative_tokens=4, max_key_len=2, text_ngram_len=2,
                             pad_drafts=True)
    batch = FakeBatch(max_model_len=14)
    batch.add("a", [1, 2, 3])
    batch.add("b", [5, 6, 7, 8])
    batch.add("c", [4] * 11)
    assert batch.step(proposer, [[1], [9], [10]]) == [[2, 3, 3, 3], [9, 9, 9, 9], [10, 10]]
    metrics = proposer.metrics
    assert (metrics.lookups, metrics.pool_hits) == (3, 1)
    assert metrics.proposed_tokens["pad"] == 2 + 4 + 2
    assert metrics.proposed_tokens["prompt"] == 2


def test_padded_drafts_under_the_goodput_controller_take_its_one_tier_for_the_batch():
    """``pad_drafts`` with the goodput controller: every request drafts the tier the
    controller chose (found tokens cut to it, the rest filler), and a uniform step of
    that tier teaches the controller that tier's cost. Tier 4's steps are priced cheap,
    0's and 8's dear, so the step's kernel chooses 4."""
    proposer = make_proposer(num_speculative_tokens=8, max_key_len=2, text_ngram_len=2, pad_drafts=True,
                             controller="goodput")
    controller = proposer.controller
    assert controller.tiers.tolist() == [0, 4, 8]
    controller.cost.observe(10, 1.0)
    for tier, seconds in ((0, 1.0), (4, 0.01), (8, 100.0)):
        controller.tier_cost[tier].observe(2, seconds)
    batch = FakeBatch()
    batch.add("a", [1, 2, 3, 4, 5, 6, 7, 8, 1, 2])
    batch.add("b", [5, 6, 7, 8])
    assert batch.step(proposer, [[3], [9]]) == [[4, 5, 6, 7], [9, 9, 9, 9]]  # a's 8 found cut to 4, b's filler
    assert controller.last.draft_len == 4 and proposer.metrics.padded_request_steps == {"4": 2}
    priced = {tier: costs.curve()[1].tolist() for tier, costs in controller.tier_cost.items()}
    assert priced == {0: [1.0], 4: [0.01], 8: [100.0]}  # the first step was no uniform decode batch
    batch.step(proposer, [[4, 5], [9]], num_scheduled_tokens=2 * (1 + 4))
    assert controller.tier_cost[4].curve()[1].tolist() != [0.01]  # the uniform step's seconds, at its 2 requests
    assert {tier: controller.tier_cost[tier].curve()[1].tolist() for tier in (0, 8)} == {0: [1.0], 8: [100.0]}


@pytest.mark.parametrize("num_scheduled_tokens, drafts, tail, expected", [
    (2 * 5, {"a": [1] * 4, "b": [2] * 4}, 0, 4),
    (2, {}, 0, 0),  # tier 0: plain vLLM's decode step
    (2, {"a": [], "b": []}, 0, 0),
    (9, {"a": [1] * 4, "b": [2] * 3}, 0, -1),  # a draft cut by vLLM's token budget
    (6, {"a": [1] * 4}, 0, -1),  # a request without drafts
    (2 * 5 + 7, {"a": [1] * 4, "b": [2] * 4}, 0, -1),  # a prefill chunk in the step
    (2 * 5, {"a": [1] * 4, "b": [2] * 4}, 12, -1),  # lanes or branches behind the tokens
])
def test_uniform_draft_len_only_for_a_uniform_decode_batch_and_nothing_else(num_scheduled_tokens, drafts, tail,
                                                                           expected, monkeypatch):
    from vllm_fafo.proposer import FafoStep, _uniform_draft_len

    step = FafoStep(num_scheduled_tokens, drafts, 0.0)
    monkeypatch.setattr(FafoStep, "tail_tokens", tail)
    assert _uniform_draft_len(step, decoding_requests=2) == expected


def test_seed_from_prompt_false_ignores_prompt_ngrams():
    proposer = make_proposer(seed_from_prompt=False)
    batch = FakeBatch()
    batch.add("a", [1, 2, 3, 4, 5, 6, 7, 1, 2, 3])
    assert batch.step(proposer, [[4]]) == [[]]


def test_acceptance_is_attributed_to_the_candidate_origin():
    proposer = make_proposer(num_speculative_tokens=2, max_key_len=2)
    batch = FakeBatch()
    batch.add("a", [1, 2, 3, 4, 9, 1])
    assert batch.step(proposer, [[2]]) == [[3, 4]]  # from the prompt
    batch.step(proposer, [[3, 4, 9]])  # both drafted tokens accepted, plus bonus
    assert proposer.metrics.accepted_tokens["prompt"] == 2
    assert proposer.metrics.proposed_tokens["prompt"] >= 2


def test_only_drafts_vllm_scheduled_count_as_verified():
    """A preempted request's last draft is never verified (vLLM drops it and
    recomputes the request): its resumption must not count it as rejected."""
    proposer = make_proposer(num_speculative_tokens=2, max_key_len=2, controller="goodput")
    batch = FakeBatch()
    batch.add("a", [1, 2, 3, 4, 9, 1])
    assert batch.step(proposer, [[2]]) == [[3, 4]]
    trials = proposer.controller.yields.position_trials.sum()
    batch.scheduled_drafts = {}  # preempted: the draft was dropped
    batch.step(proposer, [[3]])
    assert proposer.controller.yields.position_trials.sum() <= trials  # decayed, nothing added
    assert proposer.metrics.accepted_tokens["prompt"] == 0
    batch.step(proposer, [batch.scheduled_drafts["a"][:1] + [7]])  # scheduled again: one accepted
    assert proposer.controller.yields.position_trials.sum() > trials
    assert proposer.metrics.accepted_tokens["prompt"] + proposer.metrics.accepted_tokens["output"] == 1


def test_state_is_freed_and_nothing_leaks_over_many_requests():
    proposer = make_proposer()
    for i in range(500):
        batch = FakeBatch(max_model_len=64)
        batch.add(f"r{i}", [i % 7, 1, 2, i % 7, 1])
        batch.step(proposer, [[2]])
        batch.step(proposer, [[i % 7]])
        proposer.remove_requests([f"r{i}"])
    assert proposer.num_tracked_requests == 0
    assert proposer.metrics.requests_started == proposer.metrics.requests_freed == 500


def test_a_pool_only_proposer_plans_no_forward():
    """Without lanes or a draft tree the runner patch builds no batch view for ``plan_forward``."""
    proposer = make_proposer()
    assert proposer.lanes is None and not proposer.tree_enabled
    assert not proposer.plans_forward


def test_propose_without_batch_order_fails_loudly():
    proposer = make_proposer()
    with pytest.raises(RuntimeError, match="runner patches are not applied"):
        proposer.propose([[1]], np.array([3]), np.zeros((1, 8), dtype=np.int32))


def test_step_cost_does_not_grow_with_history():
    """A step files only the n-grams its accepted tokens completed, at 100 or 3000 tokens
    of history: two per step (the kernel files from the request's next anchor on)."""
    per_step = {}
    for length in (100, 3000):
        proposer = make_proposer(max_model_len=4096)
        batch = FakeBatch()
        rng = np.random.default_rng(length)
        batch.add("a", rng.integers(0, 50, size=length).tolist())
        batch.step(proposer, [[1]])  # prefill seeding: proportional to the prompt, once
        first = int(proposer._table.next_anchor[proposer._table.slot_of["a"]])
        for _ in range(20):
            batch.step(proposer, [[2, 3]])
        per_step[length] = (int(proposer._table.next_anchor[proposer._table.slot_of["a"]]) - first) / 20
    assert per_step[100] == per_step[3000] == 2


def test_a_step_lives_from_begin_step_to_propose():
    proposer = make_proposer()
    batch = FakeBatch()
    batch.add("a", [1, 2, 1, 2, 1])
    proposer.begin_step((), 1, {}, {"a": None})
    assert proposer.step is not None and proposer.attention_plan() is None  # pool only: no plan
    proposer.finish_forward(batch.req_ids, None)
    proposer.propose([[2]], np.array([6]), batch.token_ids)
    assert proposer.step is None  # nothing of the step outlives it
    with pytest.raises(RuntimeError, match="runner patches are not applied"):
        proposer.propose([[1]], np.array([7]), batch.token_ids)


def test_the_controller_learns_each_step_from_begin_step_to_propose_on_the_proposers_clock():
    proposer = make_proposer(controller="goodput")
    now = [100.0]
    proposer.clock = lambda: now[0]
    batch = FakeBatch()
    batch.add("a", [1, 2, 1, 2, 1])
    proposer.begin_step((), 5, {}, {"a": None})
    now[0] += 0.25  # the forward and sampling
    proposer.finish_forward(batch.req_ids, None)
    proposer.propose([[2]], np.array([6]), batch.token_ids)
    tokens, seconds = proposer.controller.cost.curve()
    assert tokens.tolist() == [5] and seconds.tolist() == [0.25]


def test_branch_hidden_states_come_from_the_planned_forward_only():
    """The runner hands every forward's hidden states over (dummy runs too): only the
    forward of the planned size gives the branch rows, once."""
    import torch

    from vllm_fafo.proposer import FafoStep
    from vllm_fafo.verification.draft_tree import Branch, BranchPlan, layout_request

    proposer = make_proposer()
    request = layout_request("a", 0, 0, 4, 3, [Branch(0, (7, 8))])
    proposer.step = FafoStep(num_scheduled_tokens=3, scheduled_spec_tokens={"a": [5, 6]}, started=0.0,
                             branches=BranchPlan(np.array([7, 8]), np.array([5, 6]), (request,)), tree_tokens=2)
    hidden = torch.arange(5.0)[:, None].expand(5, 4)
    assert proposer.branch_hidden_states(torch.zeros(16, 4)) is None  # a dummy forward's
    assert proposer.branch_hidden_states(hidden)[:, 0].tolist() == [3.0, 4.0]
    logits = torch.zeros(2, 10)
    logits[0, 8], logits[1, 2] = 1.0, 1.0
    proposer.take_branch_logits(logits, lambda req_id: SimpleNamespace(sampling_type=0))
    assert proposer.step.branch_argmax.tolist() == [8, 2]
    assert proposer.branch_hidden_states(hidden) is None  # taken


def test_the_batch_numbers_kept_from_the_last_step_are_the_ones_looked_up():
    """Requests joining, swapping rows, leaving and coming back under the same id, prefilling
    (sampling nothing): every step the kernel is handed the request table's slots of the
    batch's decoding requests and their rows, and it was handed last step's numbers, not
    looked up, exactly in the steps where the same requests decoded in the same order."""
    proposer = make_proposer(max_model_len=256)
    history = np.random.default_rng(2).integers(0, 20, size=(4, 256)).astype(np.int32)
    row_of, length = {"a": 0, "b": 1, "c": 2}, {}
    steps = [["a", "b"], ["a", "b"], ["a", "b"], ["b", "a"], ["b", "a"], ["b", "a"], ["b", "a"],
             ["b", "a", "c"], ["b", "a", "c"], ["b", "a", "c"]]
    kept, held = [], None
    for step, req_ids in enumerate(steps):
        finished = ["a"] if step == 5 else []
        if finished:
            row_of["a"], length["a"] = 3, 0  # a new request under a used id
        new = {req_id: None for req_id in req_ids if req_id not in length or not length[req_id]}
        sampled = []
        for req_id in req_ids:
            prefill = req_id == "c" and step == 7
            length[req_id] = length.get(req_id) or 30
            sampled.append([] if prefill else [int(history[row_of[req_id], length[req_id]])])
            length[req_id] += len(sampled[-1])
        proposer.begin_step(finished, len(req_ids), {}, new)
        proposer.finish_forward(req_ids, None)
        rows = [row_of[req_id] for req_id in req_ids]
        proposer.propose(sampled, np.array([length[r] for r in req_ids], dtype=np.int32), history[rows])
        decoding = [i for i, tokens in enumerate(sampled) if tokens]
        numbers = proposer._batch
        assert numbers[0].tolist() == [proposer._table.slot_of[req_ids[i]] for i in decoding], f"step {step}"
        assert numbers[1].tolist() == decoding, f"step {step}"
        kept.append(numbers is held)
        held = numbers
    assert kept == [False, True, True, False, True, False, True, False, False, True]
