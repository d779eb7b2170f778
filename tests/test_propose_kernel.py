"""The step's one kernel call (vllm_fafo.propose_kernel) against the kernels it runs, called one by one."""

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from vllm_fafo.control import kernels
from vllm_fafo.control.goodput import GoodputController, StepCostModel
from vllm_fafo.control.kernels import C_ASK_MAX_LANES, C_ASK_REQUESTS, C_DRAFTS_CUT, C_SAMPLED_STEPS
from vllm_fafo.drafting import index as index_module
from vllm_fafo.drafting.index import BatchDrafts
from vllm_fafo.drafting.pool import ORIGIN_CODE, Origin
from vllm_fafo.propose_kernel import LENGTHS_FOUND, LENGTHS_PADDED, LENGTHS_TIER, SAMPLED_DRAFTS
from vllm_fafo.proposer import FafoProposer
from vllm_fafo.step_arrays import same_or_new

from .test_proposer import make_proposer

LANE_CODE = ORIGIN_CODE[Origin.LANE]


def pad_drafts(drafts: BatchDrafts, rooms: np.ndarray, last_tokens: np.ndarray) -> None:
    """The padding as numpy did it before the step's kernel (the reference): fill each draft
    up to its room by repeating its last token (the text's, where it is empty), the filler
    of origin ``pad``, in place."""
    tokens, lengths = drafts.tokens, drafts.lengths
    rows = np.arange(len(lengths))
    last = np.where(lengths > 0, tokens[rows, np.maximum(lengths - 1, 0)], last_tokens)
    filler = (np.arange(tokens.shape[1]) >= lengths[:, None]) & (np.arange(tokens.shape[1]) < rooms[:, None])
    tokens[filler] = np.broadcast_to(last[:, None], tokens.shape)[filler]
    drafts.origins[filler] = ORIGIN_CODE[Origin.PAD]
    np.maximum(lengths, rooms, out=lengths)


def _longest_and_shortest(lengths: np.ndarray) -> tuple[int, int]:
    return (int(lengths.max()), int(lengths.min())) if len(lengths) else (0, 0)


class SeparateKernels(FafoProposer):
    """The step as the proposer ran it before :func:`propose_step`: each owner's public
    call in turn (the request table's settle and keep, the index's draft_batch, the
    judge's judge and add, the controller's observe, observe_tiers and choose_draft_lens or
    choose_tier, the padding in numpy)."""

    def _run_step_kernel(self, numbers, num_tokens_no_spec, token_ids, branch_trials, tokens, seconds, lane_tokens,
                         tree_tokens, step_tokens, uniform_draft_len=-1):
        slots, rows, taken, won = numbers[:4]
        numbers[4] = num_tokens_no_spec[rows]
        num_tokens, accepted = numbers[4], numbers[5]
        controller = self.controller
        learns = isinstance(controller, GoodputController)
        if learns:
            controller._curve_of(lane_tokens, tree_tokens).observe(tokens, seconds)
            controller.observe_tiers(uniform_draft_len, len(slots), seconds)
        lane_before = int(self.metrics.accepted_counts[LANE_CODE])
        self._table.settle(slots, taken, won, self.metrics, accepted)
        lane_accepted = int(self.metrics.accepted_counts[LANE_CODE]) - lane_before
        if learns:
            controller.yields.observe_counts(lane_tokens, lane_accepted, int(accepted.sum()) - lane_accepted,
                                             len(slots))
        stride, phase = 1, 0  # the requests that draft (SAMPLED_DRAFTS)
        if len(slots) > SAMPLED_DRAFTS and controller.control[C_DRAFTS_CUT]:
            stride = -(-len(slots) // SAMPLED_DRAFTS)
            phase = int(controller.control[C_SAMPLED_STEPS]) % stride
            controller.control[C_SAMPLED_STEPS] += 1
        found = self.index.draft_batch(slots, self._table.owners, self._table.prompt_len, self._table.next_anchor,
                                       token_ids, rows, num_tokens, self.controller.draft_room(), self.max_model_len,
                                       self._table.draft_len, stride, phase)
        lengths, matched, key_lens = self.judge.judge(slots, rows, num_tokens, token_ids)
        if learns:
            yields, none = controller.yields, np.zeros(0, dtype=np.int64)
            kernels.observe_chains(yields.position_trials, yields.position_hits, yields.draft_decay ** len(lengths),
                                   yields.row_of_key_len, key_lens, lengths, matched)
            kernels.observe_chains(yields.branch_trials, yields.branch_hits, yields.decay, yields._branch_rows, none,
                                   none, none)
        self.judge.add(slots, num_tokens, found.tokens, found.lengths, found.key_lens)
        if self.config.pad_drafts and learns:  # the goodput controller's tier for the batch: cut and padded to it
            tier = controller.choose_tier(step_tokens, found.key_lens, found.lengths)
            rooms = np.minimum(tier, self.max_model_len - num_tokens)
            np.minimum(found.lengths, rooms, out=found.lengths)
            pad_drafts(found, rooms, token_ids[rows, num_tokens - 1])
            self._table.keep(slots, found.origins, found.lengths, self.metrics)
            return LENGTHS_TIER, *_longest_and_shortest(found.lengths)
        if self.config.pad_drafts:  # the fixed controller's: padded whole
            pad_drafts(found, np.minimum(controller.draft_room(), self.max_model_len - num_tokens),
                       token_ids[rows, num_tokens - 1])
            self._table.keep(slots, found.origins, found.lengths, self.metrics)
            return LENGTHS_PADDED, *_longest_and_shortest(found.lengths)
        chosen = controller.choose_draft_lens(step_tokens, found.key_lens, found.lengths)
        np.minimum(found.lengths, chosen, out=found.lengths)
        self._table.keep(slots, found.origins, found.lengths, self.metrics)
        # choose_draft_lens noted its choice
        return LENGTHS_FOUND, *_longest_and_shortest(found.lengths)


def repetitive_text(length: int, rng: np.random.Generator) -> np.ndarray:
    """Random tokens with spans copied from earlier in the text, so that drafts are found
    and some of them accepted."""
    text = list(rng.integers(0, 50, size=8))
    while len(text) < length:
        if rng.random() < 0.6:
            start = int(rng.integers(0, len(text) - 4))
            text += text[start : start + int(rng.integers(3, 12))]
        else:
            text += rng.integers(0, 50, size=3).tolist()
    return np.array(text[:length], dtype=np.int32)


def sampled_tokens(history: np.ndarray, num_tokens: np.ndarray, rows: list[int], drafts: list[list[int]]) -> list[list[int]]:
    """Each request's sampled tokens, its text's (``history[rows[i]]``) next ones: its
    draft's matching prefix plus one (greedy verification); advances ``num_tokens`` by them."""
    sampled = []
    for row, draft in zip(rows, drafts):
        truth = history[row, num_tokens[row] : num_tokens[row] + len(draft) + 1].tolist()
        accepted = 0
        while accepted < len(draft) and draft[accepted] == truth[accepted]:
            accepted += 1
        sampled.append(truth[: accepted + 1])
        num_tokens[row] += accepted + 1
    return sampled


@pytest.mark.parametrize("settings", [{}, {"deep_match": True, "share_pool": True}, {"controller": "fixed"},
                                      {"controller": "fixed", "pad_drafts": True}, {"pad_drafts": True}],
                         ids=["goodput", "deep-match-shared", "fixed", "fixed-padded", "goodput-tiers"])
def test_the_step_kernel_does_what_the_separate_kernels_did(settings, monkeypatch):
    """Three requests (one joining late, one leaving early) over 40 steps of texts that
    repeat themselves, each step's sampled tokens the text's next ones (the draft's
    matching prefix and one more): the proposer with the one kernel call and one making
    the separate calls give the same drafts every step, and end with the same request
    table, judge queue, metrics, draft yields and cost curve; the arrays the kernel is
    handed without gathering them each step are, every step, the ones its owners hold.
    The fused proposer reads the texts from the same two arrays every step, as vLLM's input
    batch hands them (rows rewritten in place), so its kernel is called past numba's
    dispatcher (vllm_fafo.direct_call) in the steps where nothing it holds grew."""
    settings = {"controller": "goodput", "num_speculative_tokens": 6, **settings}
    monkeypatch.setattr(index_module, "INITIAL_KEYS", 256)  # a small arena: it grows during the run
    fused = make_proposer(max_model_len=512, **settings)
    separate = make_proposer(max_model_len=512, **settings)
    separate.__class__ = SeparateKernels
    rng = np.random.default_rng(3)
    history = np.stack([repetitive_text(512, rng) for _ in range(3)])
    num_tokens = np.array([20, 30, 25], dtype=np.int32)
    now = [0.0]  # a modelled clock: each step's forward takes what its tokens cost
    for proposer in (fused, separate):
        proposer.clock = lambda: now[0]
    req_ids, drafts, scheduled = ["a", "b"], [[], []], {}
    states, drafted, step_arrays = {}, 0, []
    batch_tokens, batch_history = np.zeros(3, dtype=np.int32), np.zeros_like(history)  # vLLM's input batch
    for step in range(40):
        if step == 5:
            req_ids, drafts = [*req_ids, "c"], [*drafts, []]
        finished = ["a"] if step == 30 else []
        if finished:
            keep = [i for i, req_id in enumerate(req_ids) if req_id not in finished]
            req_ids, drafts = [req_ids[i] for i in keep], [drafts[i] for i in keep]
        rows = [ord(req_id) - ord("a") for req_id in req_ids]
        sampled = sampled_tokens(history, num_tokens, rows, drafts)
        seconds = 0.05 + 0.002 * sum(map(len, drafts))
        new = {req_id: None for req_id in req_ids if req_id not in states}
        states.update(new)
        results = []
        batch_tokens[: len(rows)], batch_history[: len(rows)] = num_tokens[rows], history[rows]
        for proposer, texts in ((fused, (batch_tokens, batch_history)), (separate, (num_tokens[rows], history[rows]))):
            proposer.begin_step(finished, len(req_ids) + sum(map(len, drafts)), scheduled, new)
            now[0] += seconds
            proposer.finish_forward(req_ids, None)
            results.append(proposer.propose(sampled, *texts))
        assert results[0] == results[1], f"step {step}"
        step_arrays.append(fused._held)
        # the arrays the kernel is handed without gathering them are the owners' own
        owners_now = fused.step_parts()
        assert all(held is now for held, now in zip(fused._held_parts, owners_now)), f"step {step}"
        drafts = results[0]
        drafted += sum(map(len, drafts))
        scheduled = {req_id: draft for req_id, draft in zip(req_ids, drafts) if draft}
    print(drafted, fused.metrics.accepted_tokens, fused.controller.summary())
    assert drafted > 40 and sum(fused.metrics.accepted_tokens.values()) > 20  # drafts found and accepted
    # the owners grew during the run and the kernel followed them (StepArrays made anew), not every step
    assert 1 < len({id(held) for held in step_arrays}) < len(step_arrays) / 2
    # called through the dispatcher where they grew (and the first step), past it otherwise
    assert 1 < fused._step_call.resolutions < len(step_arrays) / 2
    for name in ("draft_len", "draft_origins", "next_anchor", "owners"):
        np.testing.assert_array_equal(getattr(fused._table, name), getattr(separate._table, name), err_msg=name)
    assert len(fused.judge) == len(separate.judge)
    np.testing.assert_array_equal(fused.judge._table[: len(fused.judge)], separate.judge._table[: len(fused.judge)])
    assert fused.metrics.as_dict() == separate.metrics.as_dict()
    if settings["controller"] == "goodput":  # the same arithmetic; compiled into one kernel, in the last bits
        ours, theirs, same = fused.controller, separate.controller, {"rtol": 1e-12, "atol": 0}
        np.testing.assert_allclose(ours.yields.position_trials, theirs.yields.position_trials, **same)
        np.testing.assert_allclose(ours.yields.position_hits, theirs.yields.position_hits, **same)
        assert ours.cost.num_points == theirs.cost.num_points > 0
        np.testing.assert_allclose(ours.cost.fitted[:2, : ours.cost.num_points],
                                   theirs.cost.fitted[:2, : theirs.cost.num_points], **same)
        np.testing.assert_allclose(ours.yields.reach_table(), theirs.yields.reach_table(), **same)
        np.testing.assert_allclose(ours.yields.totals, theirs.yields.totals, **same)
        assert ours.yields.totals[2] > 0
        assert (ours.last.draft_len, ours.last.mean_draft_len) == (theirs.last.draft_len, theirs.last.mean_draft_len)
        if settings.get("pad_drafts"):  # each tier's cost, learned from its own uniform steps
            priced = [tier for tier, costs in ours.tier_cost.items() if costs.has_data]
            assert priced == [tier for tier, costs in theirs.tier_cost.items() if costs.has_data] and priced
            for tier in priced:
                np.testing.assert_allclose(ours.tier_cost[tier].curve(), theirs.tier_cost[tier].curve(), **same)
            assert len(fused.metrics.padded_request_steps) > 1  # more than one tier chosen


def test_where_the_controller_cuts_drafts_only_a_sample_of_the_batch_finds_them(monkeypatch):
    """20 requests, first on a machine where a step's seconds grow faster than its tokens
    (the controller cuts every draft found), then where every step costs the same (it keeps
    drafts again once the dear steps' prices are forgotten: after 24 steps here): the fused
    kernel and the separate calls give the same drafts, judge queue and draft yields every
    step. While the controller cuts, a step finds drafts only for the requests whose draft
    it kept last step and every third request (SAMPLED_DRAFTS of 20: a stride of 3), a
    different third each step, and the yields go on learning from them; once steps cost the
    same, most requests' drafts are kept again."""
    monkeypatch.setattr(StepCostModel, "forget_after", 24)
    requests = 20
    fused = make_proposer(max_model_len=512, controller="goodput", num_speculative_tokens=6)
    separate = make_proposer(max_model_len=512, controller="goodput", num_speculative_tokens=6)
    separate.__class__ = SeparateKernels
    rng = np.random.default_rng(9)
    history = np.stack([repetitive_text(512, rng) for _ in range(requests)])
    num_tokens = rng.integers(40, 80, size=requests).astype(np.int32)
    now = [0.0]
    for proposer in (fused, separate):
        proposer.clock = lambda: now[0]
    req_ids, rows = [f"r{row}" for row in range(requests)], list(range(requests))
    drafts, scheduled = [[] for _ in rows], {}
    stride = -(-requests // SAMPLED_DRAFTS)
    trials_at, phases, sampled_at, slot_rows = {}, set(), {}, {}
    for step in range(40):
        dear = step < 20
        sampled = sampled_tokens(history, num_tokens, rows, drafts)
        tokens = requests + sum(map(len, drafts))
        new = dict.fromkeys(req_ids) if step == 0 else {}
        kept_before = {row for row, draft in enumerate(drafts) if draft}
        sampled_before = fused.controller.last.sampled_steps
        results = []
        for proposer in (fused, separate):
            proposer.begin_step([], tokens, scheduled, new)
            now[0] += 1e-4 * tokens ** 1.5 if dear else 0.01
            proposer.finish_forward(req_ids, None)
            results.append(proposer.propose(sampled, num_tokens[rows], history[rows]))
        assert results[0] == results[1], f"step {step}"
        np.testing.assert_array_equal(fused.judge._table[: len(fused.judge)],
                                      separate.judge._table[: len(separate.judge)], err_msg=f"step {step}")
        assert fused.controller.last.sampled_steps == separate.controller.last.sampled_steps, f"step {step}"
        sampled_at[step] = fused.controller.last.sampled_steps > sampled_before
        if step == 0:
            slot_rows = {fused._table.slot_of[req_id]: row for row, req_id in enumerate(req_ids)}
        # the drafts this step found, queued whole for the judge (from the text's end)
        found_rows = {slot_rows[slot] for slot, start in fused.judge._table[: len(fused.judge), :2].tolist()
                      if start == num_tokens[slot_rows[slot]]}
        if sampled_at[step]:
            phase = (fused.controller.last.sampled_steps - 1) % stride
            assert found_rows <= kept_before | {row for row in rows if row % stride == phase}, f"step {step}"
            assert found_rows - kept_before or not dear, f"step {step}"  # the sample found drafts
            phases.add(phase)
        trials_at[step] = fused.controller.yields.position_trials.sum()
        drafts = results[0]
        scheduled = {req_id: draft for req_id, draft in zip(req_ids, drafts) if draft}
    assert sum(sampled_at[step] for step in range(2, 20)) >= 16 and phases == set(range(stride))
    assert trials_at[19] > trials_at[5]  # the yields still learn from the sample
    assert sum(map(bool, drafts)) > requests / 2  # steps cost the same: most requests' drafts kept again
    np.testing.assert_allclose(fused.controller.yields.position_trials, separate.controller.yields.position_trials,
                               rtol=1e-12, atol=0)


def test_same_or_new_keeps_the_held_tuple_only_while_it_holds_the_same_objects():
    """The step's arrays are made anew where an owner's array is another object (it grew)
    or a setting differs; an equal copy of an array is another place in memory."""
    array = np.zeros(3)
    held = (array, 5, True)
    assert same_or_new(held, (array, 5, True)) is held
    assert same_or_new(held, (array.copy(), 5, True)) is not held
    assert same_or_new(held, (array, 6, True)) is not held
    assert same_or_new(None, held) is held


@pytest.mark.parametrize("settings", [{"deep_match": True, "share_pool": True}, {"share_pool": False}],
                         ids=["deep-match-shared", "own-pools"])
@pytest.mark.parametrize("arrivals", [{0: range(70)}, {0: range(20), 3: range(20, 30)}],
                         ids=["past-the-table", "into-the-room-left"])
def test_the_held_step_arrays_follow_requests_that_grow_the_owners(settings, arrivals):
    """The proposer hands the step's kernel the arrays it held last step unless an owner may
    have grown. Requests join with long prompts (70 at once: past the request table's 64
    slots; or 20, then 10 more after the first 10 left: the batch fits the outputs, the
    prompts fill the texts' store and places) into pools with room to spare (no step's
    kernel finds them short and runs again), then decode on: every step the arrays held are
    the ones the owners hold."""
    proposer = make_proposer(max_model_len=1024, controller="goodput", num_speculative_tokens=4, **settings)
    proposer.index.arena.reserve(1 << 17, 8)  # the pools never lack room: no step's kernel runs twice for it
    rng = np.random.default_rng(5)
    history = np.stack([repetitive_text(1024, rng) for _ in range(70)])
    num_tokens = np.full(70, 600, dtype=np.int32)
    running: list[int] = []
    drafts: dict[int, list[int]] = {}
    for step in range(6):
        joining = list(arrivals.get(step, ()))
        leaving = list(range(10)) if step == 2 else []
        running = [row for row in running if row not in leaving] + joining
        sampled = sampled_tokens(history, num_tokens, running, [drafts.get(row, []) for row in running])
        req_ids = [f"r{row}" for row in running]
        scheduled = {f"r{row}": drafts[row] for row in running if drafts.get(row)}
        proposer.begin_step([f"r{row}" for row in leaving], len(running) + sum(map(len, scheduled.values())),
                            scheduled, {f"r{row}": None for row in joining})
        proposer.finish_forward(req_ids, None)
        found = proposer.propose(sampled, num_tokens[running], history[running])
        drafts = dict(zip(running, found))
        owners_now = proposer.step_parts()
        assert all(held is now for held, now in zip(proposer._held_parts, owners_now)), f"step {step}"
    assert sum(map(len, drafts.values())) > 0


class _LanesFilingNgrams:
    """Stands in for the fumble lanes at the end of a forward: each request's lanes found
    ``per_request`` random n-grams (what :meth:`FafoProposer.finish_forward` files)."""

    def __init__(self, rng: np.random.Generator, per_request: int) -> None:
        self.rng, self.per_request = rng, per_request

    def start_lanes(self, req_id, prompt) -> None:
        """No lane state to start: only the filing is stood in for."""

    def remove_requests(self, req_ids) -> None:
        """No lane state to free."""

    def consume_tail(self, plan, hidden_states, compute_logits):
        for req_id in plan.tails:
            tokens = self.rng.integers(0, 5000, size=(self.per_request, 7)).tolist()
            yield req_id, [(row[:3], tuple(row[3:])) for row in tokens]


def test_the_held_step_arrays_follow_the_lanes_filing_into_the_pools():
    """Lanes file their n-grams before the step's kernel runs; where that grows the pools'
    arena, the arrays held for the kernel are made anew (every step they are the ones the
    owners hold), and only then."""
    proposer = make_proposer(max_model_len=512, controller="goodput", num_speculative_tokens=4)
    rng = np.random.default_rng(7)
    proposer.lanes = _LanesFilingNgrams(rng, per_request=400)
    proposer._model = SimpleNamespace(compute_logits=None)
    history = np.stack([repetitive_text(512, rng) for _ in range(2)])
    num_tokens = np.array([100, 120], dtype=np.int32)
    req_ids, made = ["a", "b"], set()
    for step in range(8):
        proposer.begin_step([], 2, {}, {req_id: None for req_id in req_ids} if step == 0 else {})
        if step:
            proposer.step.plan = SimpleNamespace(tails=req_ids, num_tail_tokens=0)
        proposer.finish_forward(req_ids, torch.zeros(1))
        sampled = [[int(history[row, num_tokens[row]])] for row in range(2)]
        num_tokens += 1
        proposer.propose(sampled, num_tokens, history)
        owners_now = proposer.step_parts()
        assert all(held is now for held, now in zip(proposer._held_parts, owners_now)), f"step {step}"
        made.add(id(proposer._held))
    assert 1 < len(made) < 8  # the arena grew under the lanes' filing in some steps, not in every one


def test_the_lane_question_the_step_kernel_asks_is_the_one_the_lanes_would_ask():
    """The lanes ask the controller how many lanes to run right after the step's kernel
    ran; the kernel asks it first, for the batch the last question had and the drafts it
    kept. Over 80 steps of three requests (one leaving), yields, lane step costs and
    probes changing, and now and then a question the kernel did not foresee: every answer
    is the one the rule in numpy gives on the controller's state (test_goodput's
    reference), and most were the kernel's."""
    from .test_goodput import LANE_LEN, lane_choice_reference

    proposer = make_proposer(max_model_len=1024, controller="goodput", num_speculative_tokens=6, lane_len=LANE_LEN)
    controller = proposer.controller
    rng = np.random.default_rng(5)
    history = np.stack([repetitive_text(1024, rng) for _ in range(3)])
    num_tokens = np.array([20, 30, 25], dtype=np.int32)
    now = [0.0]
    proposer.clock = lambda: now[0]
    req_ids, drafts, scheduled = ["a", "b", "c"], [[], [], []], {}
    answers, foreseen = set(), 0
    for step in range(80):
        finished = ["b"] if step == 50 else []
        if finished:
            req_ids, drafts = ["a", "c"], [drafts[0], drafts[2]]
        if step % 7 == 3:  # lanes that paid, that paid in a short probe, that did not; lane steps' costs
            lane_tokens, share = [(400.0, 0.5), (5.0, 0.4), (400.0, 0.0)][int(rng.integers(0, 3))]
            controller.yields.lane_tokens, controller.yields.lane_accepted = lane_tokens, share * lane_tokens
            controller.lane_cost.observe(int(rng.integers(10, 300)), float(rng.choice([0.03, 0.5])))
        rows = [ord(req_id) - ord("a") for req_id in req_ids]
        sampled = sampled_tokens(history, num_tokens, rows, drafts)
        proposer.begin_step(finished, len(req_ids) + sum(map(len, drafts)), scheduled,
                            dict.fromkeys(req_ids) if step == 0 else {})
        now[0] += 0.04 + 0.003 * sum(map(len, drafts))
        proposer.finish_forward(req_ids, None)
        drafts = proposer.propose(sampled, num_tokens[rows], history[rows])
        scheduled = {req_id: draft for req_id, draft in zip(req_ids, drafts) if draft}
        question = (len(req_ids) + sum(map(len, drafts)) + (step % 11 == 5), len(req_ids), len(req_ids), 8)
        answer, control = controller.kernel_answer, controller.control
        foreseen += (answer[0], *control[C_ASK_REQUESTS:C_ASK_MAX_LANES + 1]) == question
        want = lane_choice_reference(controller, *question)
        assert controller.choose_lanes(*question) == want[0], f"step {step}"
        assert controller.last.probe == want[1], f"step {step}"
        answers.add((want[0] > 0, want[1]))
    assert foreseen > 60, foreseen
    assert answers == {(False, False), (True, False), (True, True)}, answers  # off, chosen, probed
