"""The goodput controller against synthetic machines, no engine.

A synthetic machine has a true step cost (seconds against tokens in the
forward), a true lane yield (accepted lane tokens per lane token run, credited
one step later) and a true per-position draft acceptance. The controller only
sees what the proposer would show it: each step's tokens and seconds and
what was accepted.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import pytest

from vllm_fafo.control import kernels
from vllm_fafo.control.goodput import (
    LANE_YIELD_UNSEEN,
    MIN_DRAFT_ROOM,
    FixedController,
    GoodputController,
    StepCostModel,
    StepOutcome,
    YieldEstimates,
    draft_tiers,
    evidence_rows,
    isotonic_fit,
    make_controller,
)

LANE_LEN = 4
MAX_LANES = 16
MAX_DRAFT = 4
MAX_KEY_LEN = 4


def linear(base_ms: float, per_token_ms: float) -> Callable[[np.ndarray], np.ndarray]:
    return lambda n: (base_ms + per_token_ms * np.asarray(n, dtype=float)) / 1000


def flat_then_rising(base_ms: float, knee: int, per_token_ms: float) -> Callable[[np.ndarray], np.ndarray]:
    return lambda n: (base_ms + per_token_ms * np.maximum(0, np.asarray(n, dtype=float) - knee)) / 1000


@dataclass
class Machine:
    cost: Callable[[np.ndarray], np.ndarray]
    lane_yield: float  # accepted lane tokens per lane token (paid one step later)
    accept: float  # P(draft position accepted | the ones before were)
    requests: int = 1  # decoding requests, all with lanes
    key_accept: dict[int, float] | None = None
    """Per matched key length, P(position accepted | the ones before were); request i's
    drafts are found under the i-th key length, cyclically (None: key length 1, ``accept``)."""

    def acceptance(self) -> tuple[np.ndarray, np.ndarray]:
        """Each request's key length and acceptance rate."""
        table = self.key_accept or {1: self.accept}
        key_lens = np.array([list(table)[i % len(table)] for i in range(self.requests)])
        return key_lens, np.array([table[k] for k in key_lens])


def simulate(machine: Machine, controller, steps: int, fixed_lanes: int | None = None, fixed_draft: int | None = None,
             rng_seed: int = 0, change: tuple[int, Machine] | None = None) -> tuple[float, list[int]]:
    """Tokens per second realised over ``steps`` steps, and the lanes chosen per step."""
    rng = np.random.default_rng(rng_seed)
    tokens_out, seconds_total, lanes_chosen = 0.0, 0.0, []
    draft_lens, owed_lane_tokens = np.full(machine.requests, MAX_DRAFT), 0.0
    for step in range(steps):
        if change is not None and step == change[0]:
            machine = change[1]
        r = machine.requests
        key_lens, accept = machine.acceptance()
        real = r + int(draft_lens.sum())
        lanes = controller.choose_lanes(real, r, r, MAX_LANES) if fixed_lanes is None else fixed_lanes
        lanes_chosen.append(lanes)
        lane_tokens = lanes * LANE_LEN * r
        n = real + lane_tokens
        seconds = float(machine.cost(n))
        # Acceptance: geometric per position; the judge sees whole drafts, vLLM the cut ones.
        matched = np.minimum(rng.geometric(1 - accept) - 1, MAX_DRAFT)
        accepted = np.minimum(matched, draft_lens)
        lane_accepted = int(owed_lane_tokens)  # whole tokens; the fraction is owed on
        owed_lane_tokens += lane_tokens * machine.lane_yield - lane_accepted
        produced = r + int(accepted.sum()) + lane_accepted
        tokens_out += produced
        seconds_total += seconds
        controller.observe(StepOutcome(
            tokens=n, seconds=seconds, lane_tokens=lane_tokens, lane_accepted=lane_accepted,
            text_accepted=int(accepted.sum()), decoding_requests=r, draft_lengths=np.full(r, MAX_DRAFT),
            accepted_lengths=matched, key_lens=key_lens,
        ))
        undrafted = r + lane_tokens
        available = np.full(r, MAX_DRAFT)
        draft_lens = (controller.choose_draft_lens(undrafted, key_lens, available) if fixed_draft is None
                      else np.full(r, fixed_draft))
    return tokens_out / seconds_total, lanes_chosen


def best_fixed(machine: Machine, steps: int) -> float:
    rates = [
        simulate(machine, FixedController(MAX_DRAFT), steps, fixed_lanes=lanes, fixed_draft=draft)[0]
        for lanes in (0, 1, 2, 4, 8, 16) for draft in range(MAX_DRAFT + 1)
    ]
    return max(rates)


def test_cost_model_interpolates_a_monotone_curve_and_is_flat_outside_what_it_saw():
    model = StepCostModel()
    for n, ms in [(1, 10.0), (8, 10.0), (64, 20.0), (512, 100.0)]:
        for _ in range(5):
            model.observe(n, ms / 1000)
    got = 1000 * model.predict(np.array([1, 4, 36, 288, 4096]))
    np.testing.assert_allclose(got, [10.0, 10.0, 15.0, 60.0, 100.0], rtol=1e-6)
    model.observe(200, 0.001)  # a noisy fast sample never makes more tokens cheaper than fewer
    assert np.all(np.diff(model.predict(np.arange(1, 600))) >= 0)


def interp_reference(model: StepCostModel, tokens: np.ndarray) -> np.ndarray:
    """A step's price as numpy says it: ``np.interp`` on the curve, flat above it,
    proportional below it, 1 without a curve."""
    known_tokens, known_seconds = model.curve()
    if not len(known_tokens):
        return np.ones(len(tokens))
    tokens = np.asarray(tokens, dtype=np.float64)
    inside = np.interp(tokens, known_tokens, known_seconds)
    return np.where(tokens < known_tokens[0], known_seconds[0] * tokens / known_tokens[0], inside)


def test_the_price_kernels_interpolate_as_numpy_to_the_last_bit():
    """``predict`` (any tokens, any order) and the choice's ``step_seconds`` (a run of
    token counts, the dearer of two curves where lanes ran) against ``np.interp``."""
    rng = np.random.default_rng(5)
    for _ in range(50):
        plain, lanes = StepCostModel(), StepCostModel()
        for model in (plain, lanes)[: rng.integers(0, 3)]:
            for tokens in rng.integers(1, 300, size=rng.integers(1, 12)):
                model.observe(int(tokens), float(rng.uniform(0.01, 0.1)))
        asked = rng.integers(1, 400, size=30)
        np.testing.assert_array_equal(plain.predict(asked), interp_reference(plain, asked))
        start, count = int(rng.integers(1, 50)), int(rng.integers(1, 400))
        tokens = start + np.arange(count)
        for lane_count in (0, lanes.num_points):
            got = np.zeros(count)
            kernels.step_seconds(plain.fitted, plain.num_points, lanes.fitted, lane_count, start, got)
            want = interp_reference(plain, tokens)
            if lane_count:
                want = np.maximum(want, interp_reference(lanes, tokens))
            np.testing.assert_array_equal(got, want)


def lane_choice_reference(controller: GoodputController, real_tokens: int, lane_requests: int,
                          decoding_requests: int, max_lanes: int) -> tuple[int, bool]:
    """``choose_lanes``'s rule in numpy on the controller's state (without its probe's
    bookkeeping): (lanes, probed)."""
    options = np.unique(np.concatenate([[0], 1 << np.arange(int(np.log2(max_lanes)) + 1), [max_lanes]]))
    options = options[options <= max_lanes]
    yields = controller.yields
    plain = controller.cost if controller.cost.has_data or not controller.lane_cost.has_data else controller.lane_cost

    def lane_step_seconds(tokens):
        seconds = interp_reference(plain, np.atleast_1d(tokens))
        if controller.lane_cost.has_data:
            seconds = np.maximum(seconds, interp_reference(controller.lane_cost, np.atleast_1d(tokens)))
        return seconds

    lane_tokens = options * LANE_LEN * lane_requests
    base = decoding_requests * yields.tokens_per_request()
    seconds = lane_step_seconds(real_tokens + lane_tokens)
    seconds[0] = interp_reference(plain, np.array([real_tokens]))[0]
    best = int(options[int(((base + lane_tokens * yields.lane_yield()) / seconds).argmax())])
    probe = controller._lane_probe
    if best or not probe.due():
        return best, False
    size = int(max(options[seconds <= 2 * seconds[0]].max(), 1))
    could_pay = any(
        (base + size * LANE_LEN * lane_requests * yields.lane_yield_seen())
        / lane_step_seconds(tokens + size * LANE_LEN * lane_requests)[0]
        >= base / interp_reference(plain, np.array([tokens]))[0]
        for tokens in (real_tokens, decoding_requests))
    probed = probe.in_burst() or probe.overdue() or could_pay
    return (size if probed else 0), probed


def test_the_lane_choice_kernel_makes_the_numpy_rules_choice():
    """Random cost curves (plain, lanes), yields and probe states: the kernel chooses the
    lanes and the probe that the rule written in numpy chooses."""
    rng = np.random.default_rng(11)
    seen = set()
    for _ in range(2000):
        controller = GoodputController(LANE_LEN, MAX_DRAFT, MAX_KEY_LEN)
        for model in (controller.cost, controller.lane_cost)[: rng.integers(0, 3)]:
            per_token, knee = rng.uniform(0.0, 2e-3), rng.integers(0, 100)
            for tokens in rng.integers(1, 300, size=rng.integers(1, 10)):
                model.observe(int(tokens), float(0.01 + per_token * max(tokens - knee, 0) * rng.uniform(0.8, 1.2)))
        yields = controller.yields
        yields.decode_rows, yields.text_accepted = float(rng.uniform(0, 20)), float(rng.uniform(0, 20))
        yields.lane_tokens = float(rng.choice([0.0, rng.uniform(1, 500)]))
        yields.lane_accepted = float(rng.uniform(0, 0.2) * yields.lane_tokens)
        probe = controller._lane_probe
        probe.steps_off, probe.burst_left = int(rng.integers(0, 1100)), int(rng.random() < 0.1)
        decoding = int(rng.integers(1, 9))
        real, lane_requests = int(rng.integers(decoding, 200)), int(rng.integers(1, decoding + 1))
        max_lanes = int(rng.integers(1, 20))
        want = lane_choice_reference(controller, real, lane_requests, decoding, max_lanes)
        assert controller.choose_lanes(real, lane_requests, decoding, max_lanes) == want[0]
        assert controller.last.probe == want[1]
        seen.add((want[0] > 0, want[1]))
    assert seen == {(False, False), (True, False), (True, True)}  # off, chosen, probed


def isotonic_reference(values: np.ndarray, weights: np.ndarray) -> list[float]:
    """The fit at i: the largest over runs starting at or before i of the smallest weighted
    mean of a run from there ending at or after i."""
    n = len(values)

    def mean(j: int, k: int) -> float:
        return float(np.average(values[j:k + 1], weights=weights[j:k + 1]))
    return [max(min(mean(j, k) for k in range(i, n)) for j in range(i + 1)) for i in range(n)]


def test_isotonic_fit_equals_the_max_min_formula_of_weighted_means():
    rng = np.random.default_rng(3)
    for n in (1, 2, 5, 12):
        for _ in range(50):
            values, weights = rng.normal(size=n), rng.integers(1, 6, size=n).astype(float)
            np.testing.assert_allclose(isotonic_fit(values, weights), isotonic_reference(values, weights), atol=1e-12)


def test_one_slow_step_at_a_size_seldom_run_does_not_price_the_sizes_above_it():
    # 2-core CPU, GSM8K with draft trees: one slow 2-token step (55.5 ms) had a running
    # maximum price every size up to 11 tokens at 55.5 ms; steps of 3-7 tokens took 38-42 ms
    # (medians of hundreds of steps, defaults).
    model = StepCostModel()
    model.observe(1, 0.042)
    model.observe(2, 0.055)
    for _ in range(20):
        for tokens, ms in ((3, 41.0), (6, 38.0), (7, 42.0), (11, 46.0), (17, 54.0)):
            model.observe(tokens, ms / 1000)
    got = 1000 * model.predict(np.array([2, 6, 7, 11, 17]))
    assert np.all(np.diff(got) >= 0)
    assert got[1] < 43.0 and got[2] == pytest.approx(42.0) and got[3] == pytest.approx(46.0)


def test_cost_model_follows_a_change_in_a_few_steps():
    model = StepCostModel()
    for _ in range(20):
        model.observe(16, 0.010)
    for _ in range(15):
        model.observe(16, 0.030)
    assert model.predict(16) == pytest.approx(0.030, rel=0.05)


def test_reach_probability_chains_continuation_rates_and_is_optimistic_where_untried():
    estimates = YieldEstimates(max_draft=4, max_key_len=4, decay=1.0, draft_decay=1.0)
    estimates.observe(StepOutcome(tokens=12, seconds=0.01, lane_tokens=0, lane_accepted=0, text_accepted=5, decoding_requests=4,
                                  draft_lengths=np.array([2, 2, 2, 2]), accepted_lengths=np.array([0, 1, 2, 2]),
                                  key_lens=np.array([1, 1, 3, 3])))
    # Position 1: 4 drafts reached it, 3 accepted; position 2: 3 reached it, 2 accepted; nothing further.
    first = (3 + 0.25) / (4 + 0.25)  # a quarter pseudo-trial at the rate before (1 for the first)
    second = (2 + 0.25 * first) / (3 + 0.25)
    np.testing.assert_allclose(estimates.reach_probability(), np.cumprod([first, second, second, second]))
    assert estimates.tokens_per_request() == pytest.approx(1 + 5 / 4)
    # By key length: one pseudo-trial at the key's rate before (the overall first rate at the first).
    short_1 = (1 + first) / (2 + 1)  # key 1: 2 reached position 1, 1 accepted; 1 reached position 2, none
    short_2 = (0 + short_1) / (1 + 1)
    long_1 = (2 + first) / (2 + 1)  # key 3: both accepted twice
    long_2 = (2 + long_1) / (2 + 1)
    np.testing.assert_allclose(estimates.reach_probability(np.array([1, 3, 2])), [
        np.cumprod([short_1, short_2, short_2, short_2]),
        np.cumprod([long_1, long_2, long_2, long_2]),
        np.cumprod([first] * 4),  # an unseen key length
    ])


def test_reach_kernel_equals_the_recurrence_written_out():
    """The reach kernel against the continuation-rate recurrence and its running product,
    position by position, on random decayed counts: one prior and weight per row."""
    from vllm_fafo.control.kernels import reach

    rng = np.random.default_rng(3)
    trials = rng.random((5, 64)) * rng.choice([0.0, 1.0, 1e4], size=(5, 64))
    hits = trials * rng.random((5, 64))
    for priors, weights in ((rng.random(5), np.ones(5)), (np.ones(5), np.full(5, 0.25))):
        expected = np.empty_like(trials)
        for row in range(5):
            prior, product = priors[row], 1.0
            for k in range(64):
                prior = (hits[row, k] + weights[row] * prior) / (trials[row, k] + weights[row])
                product = expected[row, k] = product * prior
        got = np.zeros_like(trials)
        reach(trials, hits, priors, weights, got)
        np.testing.assert_allclose(got, expected, rtol=1e-12)


def test_reach_tables_kept_for_the_step_follow_every_observe_and_are_read_only():
    """The reach tables are computed once per step: asked again after an observe they
    must be the new counts' (equal to a fresh estimate fed the same steps), never
    the last step's, and what is handed out cannot be written into."""
    outcome = dict(tokens=5, seconds=0.01, lane_tokens=0, lane_accepted=0, text_accepted=1, decoding_requests=2)
    steps = [StepOutcome(draft_lengths=np.array([4, 3]), accepted_lengths=np.array([a, 1]),
                         key_lens=np.array([1, 3]), branch_ranks=np.array([0]), branch_lengths=np.array([2]),
                         branch_matches=np.array([a % 2]), **outcome) for a in (0, 4, 2, 3)]
    kept = YieldEstimates(max_draft=4, max_key_len=3)
    for done, step in enumerate(steps, start=1):
        before = kept.reach_probability(np.array([1, 3])), kept.branch_reach_probability()
        kept.observe(step)
        fresh = YieldEstimates(max_draft=4, max_key_len=3)
        for earlier in steps[:done]:
            fresh.observe(earlier)
        np.testing.assert_array_equal(kept.reach_probability(np.array([1, 3])), fresh.reach_probability(np.array([1, 3])))
        np.testing.assert_array_equal(kept.reach_probability(), fresh.reach_probability())
        np.testing.assert_array_equal(kept.branch_reach_probability(), fresh.branch_reach_probability())
        assert not np.array_equal(before[0], kept.reach_probability(np.array([1, 3])))
    with pytest.raises(ValueError):
        kept.reach_probability()[0] = 1.0
    with pytest.raises(ValueError):
        kept.branch_reach_probability()[0, 0] = 1.0


def test_a_position_that_failed_once_is_judged_by_the_drafts_that_reach_it_later():
    """One draft broke at position 3; afterwards drafts of 2 are always accepted. The
    position's failure fades and it is judged like position 2 again (estimating
    P(reach 3 | drafted 3) directly would keep it at 0: its trials and hits decay alike)."""
    estimates = YieldEstimates(max_draft=4, max_key_len=1, draft_decay=0.95)
    outcome = dict(tokens=5, seconds=0.01, lane_tokens=0, lane_accepted=0, text_accepted=2, decoding_requests=1,
                   key_lens=np.array([1]))
    estimates.observe(StepOutcome(draft_lengths=np.array([4]), accepted_lengths=np.array([2]), **outcome))
    for _ in range(100):
        estimates.observe(StepOutcome(draft_lengths=np.array([2]), accepted_lengths=np.array([2]), **outcome))
    reach = estimates.reach_probability(np.array([1]))[0]
    assert reach[2] > 0.95 * reach[1] > 0.9


def test_linear_cost_turns_lanes_off():
    machine = Machine(linear(10.0, 2.0), lane_yield=0.02, accept=0.5)  # a lane token earns 0.02, costs 2 ms
    controller = GoodputController(LANE_LEN, MAX_DRAFT, MAX_KEY_LEN)
    _, lanes = simulate(machine, controller, 400)
    assert np.mean(np.array(lanes[100:]) > 0) < 0.05  # only the (backed-off) probes


def test_lane_probes_that_could_not_pay_wait_for_the_longest_interval():
    # Every lane token costs 2 ms of a ~20 ms step and earns nothing: after the first
    # probe (lanes not run yet: judged optimistically) the next waits until the cost
    # curve has forgotten the sizes the probe priced (it then reads them as cheap as
    # the largest size still seen), at most the longest interval: not every 16-512 steps.
    machine = Machine(linear(10.0, 2.0), lane_yield=0.0, accept=0.5)
    controller = GoodputController(LANE_LEN, MAX_DRAFT, MAX_KEY_LEN)
    burst, longest = controller._lane_probe.burst, controller._lane_probe.max_interval
    _, lanes = simulate(machine, controller, 1200)
    on = np.flatnonzero(np.array(lanes) > 0)
    gaps = np.diff(on)[np.diff(on) > 1]
    assert len(on) == burst * (len(gaps) + 1) and 1 <= len(gaps) <= 2
    assert np.all(gaps > controller.cost.forget_after) and np.all(gaps <= longest + burst)
    # Where lanes are nearly free (GPU-like), a probe that earned nothing is still repeated.
    gpu = GoodputController(LANE_LEN, MAX_DRAFT, MAX_KEY_LEN)
    _, lanes = simulate(Machine(flat_then_rising(10.0, 256, 0.5), lane_yield=0.0, accept=0.5), gpu, 600)
    assert np.count_nonzero(np.array(lanes) > 0) >= 4 * burst


def test_before_any_lane_ran_a_probe_runs_only_where_lanes_could_pay_at_the_unseen_yield():
    # The engine's first step is a prefill: the cost curve has priced a large forward
    # before the first probe is due. Where each lane token costs a real share of a step
    # (CPU-like), lanes could not pay even at LANE_YIELD_UNSEEN, and the first probe
    # waits until the curve has forgotten the sizes it priced (then reads them as cheap),
    # as later probes do; where they cost next to nothing (GPU-like), it runs when first due.
    def first_probe(cost: Callable[[np.ndarray], np.ndarray]) -> int:
        controller = GoodputController(LANE_LEN, MAX_DRAFT, MAX_KEY_LEN)
        controller.cost.observe(256, float(cost(256)))  # a 256-token prompt
        _, lanes = simulate(Machine(cost, lane_yield=0.0, accept=0.5), controller, 1200)
        return int(np.flatnonzero(np.array(lanes) > 0)[0])

    assert first_probe(linear(10.0, 2.0)) > StepCostModel().forget_after
    assert first_probe(flat_then_rising(10.0, 256, 0.5)) <= 16
    assert 0.0 < LANE_YIELD_UNSEEN < 1.0
    assert YieldEstimates(MAX_DRAFT, MAX_KEY_LEN).lane_yield_seen() == LANE_YIELD_UNSEEN


def test_flat_then_rising_keeps_lanes_up_to_the_knee_and_shrinks_them_as_the_batch_grows():
    # A GPU-like step: 10 ms up to 64 tokens, then 0.5 ms per token.
    cost = flat_then_rising(10.0, knee=64, per_token_ms=0.5)
    alone = Machine(cost, lane_yield=0.05, accept=0.5, requests=1)
    controller = GoodputController(LANE_LEN, MAX_DRAFT, MAX_KEY_LEN)
    _, lanes_alone = simulate(alone, controller, 300)
    busy = Machine(cost, lane_yield=0.05, accept=0.5, requests=8)
    controller_busy = GoodputController(LANE_LEN, MAX_DRAFT, MAX_KEY_LEN)
    _, lanes_busy = simulate(busy, controller_busy, 300)
    typical_alone = int(np.median(lanes_alone[100:]))
    typical_busy = int(np.median(lanes_busy[100:]))
    assert typical_alone >= 8  # 1 request: 5 real + 8 x 4 lane tokens stay under the knee
    assert 1 + MAX_DRAFT + typical_alone * LANE_LEN <= 64 + LANE_LEN * typical_alone // 2
    assert typical_busy < typical_alone  # 8 requests: the batch alone is near the knee


def test_lane_steps_teach_their_own_curve_and_lanes_are_priced_by_it():
    # Lane attention costs a step more than its tokens say (on the 2-core CPU a step with
    # a lane probe took 15-26 % more than a plain step of as many tokens). Steps with lanes
    # leave the plain curve, by which drafts are sized, as plain steps taught it; lanes
    # that would pay at the tokens' price but not at what steps with lanes cost stay off.
    def run(lane_overhead_ms: float) -> tuple[GoodputController, list[int]]:
        cost = flat_then_rising(10.0, 256, 0.5)  # tokens nearly free: lanes pay at their price
        controller = GoodputController(LANE_LEN, MAX_DRAFT, MAX_KEY_LEN)
        lanes_chosen, owed = [], 0.0
        none = np.zeros(1, dtype=np.int64)
        for step in range(400):
            real = 1 + step % (MAX_DRAFT + 1)  # drafts of 0..MAX_DRAFT tokens: sizes lane steps also have
            lanes = controller.choose_lanes(real, 1, 1, MAX_LANES)
            lanes_chosen.append(lanes)
            lane_tokens = lanes * LANE_LEN
            owed += 0.01 * lane_tokens  # a lane token earns 0.01
            seconds = float(cost(real + lane_tokens)) + (lane_overhead_ms / 1000 if lanes else 0.0)
            controller.observe(StepOutcome(tokens=real + lane_tokens, seconds=seconds, lane_tokens=lane_tokens,
                                           lane_accepted=int(owed), text_accepted=0, decoding_requests=1,
                                           draft_lengths=none, accepted_lengths=none, key_lens=none))
            owed -= int(owed)
        return controller, lanes_chosen

    _, lanes = run(lane_overhead_ms=0.0)
    assert np.median(lanes[100:]) > 0
    dear, lanes = run(lane_overhead_ms=20.0)  # 20 ms of lane attention on a 10-ms step
    assert np.mean(np.array(lanes[100:]) > 0) < 0.05  # the probes only
    plain_tokens, plain_seconds = dear.cost.curve()
    np.testing.assert_allclose(plain_seconds, flat_then_rising(10.0, 256, 0.5)(plain_tokens))
    lane_tokens, lane_seconds = dear.lane_cost.curve()
    assert len(lane_tokens) and np.all(lane_seconds > 0.029)
    assert set(dear.summary()["lane_cost_curve_tokens"]) == set(lane_tokens.round(1).tolist())


def lane_step(lane_tokens: int, lane_accepted: int) -> StepOutcome:
    """A step of one request that ran lanes and drafted nothing."""
    none = np.zeros(1, dtype=np.int64)
    return StepOutcome(tokens=1 + lane_tokens, seconds=0.02, lane_tokens=lane_tokens, lane_accepted=lane_accepted,
                       text_accepted=0, decoding_requests=1, draft_lengths=none, accepted_lengths=none, key_lens=none)


def test_one_lucky_probe_does_not_make_lanes_look_paying_but_steady_evidence_does():
    estimates = YieldEstimates(MAX_DRAFT, MAX_KEY_LEN)
    assert estimates.lane_yield() == 0.0
    estimates.observe(lane_step(12, 3))  # a probe whose lane n-gram was accepted: 0.25 per lane token
    assert estimates.lane_yield() < 0.03  # shrunk by lane_prior_tokens that earned nothing
    for _ in range(300):  # lanes that run and earn 0.05 per lane token
        estimates.observe(lane_step(96, 5) if _ % 2 else lane_step(96, 4))
    assert 0.045 < estimates.lane_yield() < 0.047  # 0.046 of a true 0.047: the prior weighs 2 % against ~50 steps of lanes


def test_lanes_go_off_within_bounded_steps_when_they_stop_paying_and_come_back():
    cost = flat_then_rising(10.0, knee=128, per_token_ms=0.5)
    paying = Machine(cost, lane_yield=0.05, accept=0.5)
    useless = Machine(linear(10.0, 2.0), lane_yield=0.0, accept=0.5)
    controller = GoodputController(LANE_LEN, MAX_DRAFT, MAX_KEY_LEN)
    _, lanes = simulate(paying, controller, 600, change=(200, useless))
    assert np.median(lanes[100:200]) > 0
    assert np.mean(np.array(lanes[260:]) > 0) < 0.05
    controller = GoodputController(LANE_LEN, MAX_DRAFT, MAX_KEY_LEN)
    _, lanes = simulate(useless, controller, 2000, change=(300, paying))
    assert np.median(lanes[200:300]) == 0
    # Back on within the longest probe interval (1024 steps) and one probe burst.
    back = 300 + controller._lane_probe.max_interval + controller._lane_probe.burst
    assert np.median(lanes[back:]) > 0


def test_draft_length_full_when_tokens_are_free_and_cut_when_they_cost_more_than_they_earn():
    free = GoodputController(LANE_LEN, MAX_DRAFT, MAX_KEY_LEN)
    simulate(Machine(flat_then_rising(10.0, 256, 0.5), lane_yield=0.0, accept=0.3), free, 200)
    assert free.last.draft_len == MAX_DRAFT
    costly = GoodputController(LANE_LEN, MAX_DRAFT, MAX_KEY_LEN)
    simulate(Machine(linear(1.0, 1.0), lane_yield=0.0, accept=0.3), costly, 200)
    # Each draft token costs as much as a plain step's whole token; position k pays
    # only while 0.3 ** k beats the goodput it dilutes: the first position at most.
    assert costly.last.draft_len <= 1


def test_drafts_found_under_longer_keys_run_longer_when_tokens_cost():
    # Two requests: one's drafts come from 1-token keys (accepted 20 %), the other's
    # from 4-token keys (accepted 90 %). Each draft token costs a tenth of a step.
    machine = Machine(linear(10.0, 1.0), lane_yield=0.0, accept=0.0, requests=2, key_accept={1: 0.2, 4: 0.9})
    controller = GoodputController(LANE_LEN, MAX_DRAFT, MAX_KEY_LEN)
    simulate(machine, controller, 400)
    lengths = controller.choose_draft_lens(2, np.array([1, 4]), np.full(2, MAX_DRAFT))
    assert lengths[0] == 0 and lengths[1] == MAX_DRAFT
    # Shorter drafts are kept as found: the controller never lengthens one.
    assert controller.choose_draft_lens(2, np.array([1, 4]), np.array([0, 2])).tolist() == [0, 2]
    # Per-request lengths beat the best single length shared by both requests.
    got, _ = simulate(machine, GoodputController(LANE_LEN, MAX_DRAFT, MAX_KEY_LEN), 3000)
    assert got > 1.02 * best_fixed(machine, 3000)


def test_tokens_past_twice_the_matched_context_run_only_where_they_cost_little():
    # Under 1-token and 2-token keys alike, 3 drafts in 5 are right to their end and the
    # rest wrong from their first token: every position's reach is 0.6. Positions 3-4
    # of a 1-token key's draft are worth a quarter of it (DRAFT_PER_MATCHED_TOKEN = 2),
    # those of a 2-token key's all of it.
    def trained(cost: Callable[[np.ndarray], np.ndarray]) -> GoodputController:
        controller = GoodputController(LANE_LEN, MAX_DRAFT, MAX_KEY_LEN)
        for step in range(200):
            tokens = 1 + step % 12  # the cost curve sees 1..12 tokens
            controller.observe(StepOutcome(
                tokens=tokens, seconds=float(cost(tokens)), lane_tokens=0, lane_accepted=0, text_accepted=0,
                decoding_requests=1, draft_lengths=np.full(10, MAX_DRAFT),
                accepted_lengths=np.where(np.arange(10) % 5 < 3, MAX_DRAFT, 0), key_lens=np.repeat([1, 2], 5)))
        return controller

    # A token costs a fifth of a step: a 1-token key's draft stops at 2 tokens, worth
    # 1 + 1.2 per 16 ms, where all 4 would yield 1 + 1.5 per 20 ms (without the
    # discount: 1 + 2.4 per 20 ms, and it would run to 4); a 2-token key's runs to 4.
    costly = trained(linear(10.0, 2.0))
    np.testing.assert_allclose(costly.yields.reach_probability(np.array([1, 2])), 0.6, atol=0.02)
    assert costly.choose_draft_lens(1, np.array([1]), np.array([MAX_DRAFT])).tolist() == [2]
    assert costly.choose_draft_lens(1, np.array([2]), np.array([MAX_DRAFT])).tolist() == [MAX_DRAFT]
    assert costly.choose_draft_lens(2, np.array([1, 2]), np.full(2, MAX_DRAFT)).tolist() == [2, MAX_DRAFT]
    # Tokens free up to a knee: a discounted token that costs nothing still pays.
    free = trained(flat_then_rising(10.0, 256, 0.5))
    assert free.choose_draft_lens(1, np.array([1]), np.array([MAX_DRAFT])).tolist() == [MAX_DRAFT]


@pytest.mark.parametrize(
    "machine, share",
    [
        (Machine(linear(10.0, 2.0), lane_yield=0.02, accept=0.5), 0.95),
        (Machine(linear(20.0, 0.05), lane_yield=0.02, accept=0.6), 0.95),
        # Best: 16 lanes with 2-token drafts, just past the knee. The controller runs
        # 4-token drafts (94.99 %): it never runs the sizes between 5 and 69 tokens, so
        # its curve cannot see that the last draft tokens cross the knee.
        (Machine(flat_then_rising(10.0, 64, 0.5), lane_yield=0.05, accept=0.5), 0.94),
        (Machine(flat_then_rising(10.0, 64, 0.5), lane_yield=0.05, accept=0.5, requests=8), 0.95),
        (Machine(linear(2.0, 0.5), lane_yield=0.0, accept=0.1), 0.95),
    ],
    ids=["cpu-like", "cheap-tokens", "gpu-like", "gpu-like-batch8", "nothing-pays"],
)
def test_realised_goodput_near_the_best_fixed_setting(machine, share):
    controller = GoodputController(LANE_LEN, MAX_DRAFT, MAX_KEY_LEN)
    got, _ = simulate(machine, controller, 3000)
    assert got >= share * best_fixed(machine, 3000)


def test_drafts_are_found_in_twice_the_longest_chosen_and_the_room_grows_back_when_tokens_get_cheap():
    """:meth:`GoodputController.draft_room`: drafts are found only as long as the controller
    may choose next (twice its longest, at least MIN_DRAFT_ROOM); the judge learns each
    position from the drafts that reached it, so a short room does not teach it that long
    drafts fail, and where tokens get cheap the room doubles a step back to the most."""
    longest = 16
    controller = GoodputController(LANE_LEN, longest, MAX_KEY_LEN)
    assert controller.draft_room() == longest  # nothing chosen yet: drafts found whole
    assert FixedController(longest).draft_room() == longest
    rng = np.random.default_rng(0)

    def run(machine: Machine, steps: int) -> list[int]:
        rooms, draft_lens = [], np.full(1, longest)
        for _ in range(steps):
            room = controller.draft_room()
            rooms.append(room)
            found = np.full(1, room)  # the index found a draft as long as the room
            matched = np.minimum(rng.geometric(1 - machine.accept, size=1) - 1, found)
            controller.observe(StepOutcome(
                tokens=1 + int(draft_lens.sum()), seconds=float(machine.cost(1 + int(draft_lens.sum()))),
                lane_tokens=0, lane_accepted=0, text_accepted=int(np.minimum(matched, draft_lens).sum()),
                decoding_requests=1, draft_lengths=found, accepted_lengths=matched, key_lens=np.ones(1, np.int64)))
            draft_lens = controller.choose_draft_lens(1, np.ones(1, np.int64), found)
            assert draft_lens.max() <= room
        return rooms

    rooms = run(Machine(linear(1.0, 1.0), lane_yield=0.0, accept=0.3), 300)
    assert controller.last.draft_len <= 1 and rooms[-1] == MIN_DRAFT_ROOM  # tokens cost: short room
    trials = controller.yields.position_trials.copy()
    rooms = run(Machine(flat_then_rising(10.0, 256, 0.5), lane_yield=0.0, accept=0.9), 300)
    assert rooms[-1] == longest and controller.last.draft_len == longest  # free tokens: the room came back
    assert rooms.index(longest) < 20
    # the short room's drafts taught nothing past it (the first step's whole draft, decayed, is all)
    assert trials[:, MIN_DRAFT_ROOM:].sum() < 1.0 < trials[:, :MIN_DRAFT_ROOM].sum()


def test_fixed_keeps_the_configured_sizes():
    fixed = make_controller("fixed", LANE_LEN, MAX_DRAFT, MAX_KEY_LEN)
    assert fixed.choose_lanes(5, 1, 1, 7) == 7
    assert fixed.choose_draft_lens(5, np.array([1, 2]), np.array([MAX_DRAFT, 2])).tolist() == [MAX_DRAFT, 2]
    with pytest.raises(ValueError, match="allowed: goodput, fixed"):
        make_controller("greedy", LANE_LEN, MAX_DRAFT, MAX_KEY_LEN)


@dataclass
class TreeMachine:
    """One request's spine accepted position by position with ``accept``; off the node
    where it stops, the branch of rank r continues with probability ``first[r]`` (the
    branches off a node start with distinct tokens: at most one does) and each further
    branch token is accepted with ``further``."""

    cost: Callable[[np.ndarray], np.ndarray]
    accept: float
    first: tuple[float, ...]
    further: float
    branch_len: int = 3
    tree_overhead_ms: float = 0.0
    """What a step with any branch costs on top of its tokens (the branches' own attention)."""


def simulate_tree(machine: TreeMachine, controller, steps: int, keep_branches: bool | None = None,
                  rng_seed: int = 0) -> tuple[float, list[int]]:
    """Tokens per second over ``steps`` steps of one request with full-length spines and
    every rank of branch off every spine node; ``keep_branches`` True / False pins all
    or none of them (None: the controller chooses). Also the branch tokens per step."""
    from vllm_fafo.control.goodput import BranchSet

    rng = np.random.default_rng(rng_seed)
    ranks = len(machine.first)
    nodes = np.repeat(np.arange(MAX_DRAFT), ranks)
    grown = BranchSet(owners=np.zeros(len(nodes), np.int64), nodes=nodes,
                      ranks=np.tile(np.arange(ranks), MAX_DRAFT),
                      lengths=np.minimum(MAX_DRAFT - nodes, machine.branch_len))
    key_lens, tokens_out, seconds_total, tree_tokens = np.ones(1, np.int64), 0.0, 0.0, []
    kept = grown.lengths
    for _ in range(steps):
        tree_tokens.append(int(kept.sum()))
        seconds = float(machine.cost(1 + MAX_DRAFT + kept.sum())) + (kept.sum() > 0) * machine.tree_overhead_ms / 1000
        accepted = min(rng.geometric(1 - machine.accept) - 1, MAX_DRAFT)
        trials = (grown.nodes == accepted) & (kept > 0)
        matches = np.zeros(len(kept), np.int64)
        hit = np.flatnonzero(trials & (np.cumsum(machine.first)[grown.ranks] - np.array(machine.first)[grown.ranks]
                                       <= (u := rng.random())) & (u < np.cumsum(machine.first)[grown.ranks]))
        for index in hit:
            matches[index] = min(rng.geometric(1 - machine.further), kept[index])
        tokens_out += 1 + accepted + (matches.max() if len(hit) else 0)
        seconds_total += seconds
        controller.observe(StepOutcome(
            tokens=1 + MAX_DRAFT + int(kept.sum()), seconds=seconds, lane_tokens=0, lane_accepted=0,
            text_accepted=accepted, decoding_requests=1, draft_lengths=np.array([MAX_DRAFT]),
            accepted_lengths=np.array([accepted]),
            key_lens=key_lens, tree_tokens=int(kept.sum()), branch_ranks=grown.ranks[trials], branch_lengths=kept[trials],
            branch_matches=matches[trials],
        ))
        if keep_branches is None:
            controller.choose_draft_lens(1, key_lens, np.array([MAX_DRAFT]))  # reach probabilities of the spines
            kept = controller.choose_branches(1 + MAX_DRAFT, np.array([MAX_DRAFT]), grown)
        else:
            kept = grown.lengths if keep_branches else np.zeros_like(grown.lengths)
    return tokens_out / seconds_total, tree_tokens


TREE_MACHINES = {
    # tokens free up to the knee: every branch token that can be accepted is worth running
    "gpu-like": TreeMachine(flat_then_rising(10.0, 256, 0.5), accept=0.5, first=(0.4, 0.2, 0.1), further=0.6),
    # each token costs a fifteenth of a step: only the likeliest branch token pays
    "cpu-like": TreeMachine(linear(10.0, 1.0), accept=0.5, first=(0.4, 0.2, 0.1), further=0.6),
    # tokens free, but a step with branches costs 1.5 ms more: the tree pays
    "gpu-like, tree overhead": TreeMachine(flat_then_rising(10.0, 256, 0.5), accept=0.5, first=(0.4, 0.2, 0.1),
                                           further=0.6, tree_overhead_ms=1.5),
    # ... but not where it is 80 % of a step
    "gpu-like, tree overhead too high": TreeMachine(flat_then_rising(10.0, 256, 0.5), accept=0.5,
                                                    first=(0.4, 0.2, 0.1), further=0.6, tree_overhead_ms=8.0),
    # branches that are never right, and every token past the spine costs
    "useless": TreeMachine(flat_then_rising(10.0, 1 + MAX_DRAFT, 0.5), accept=0.5, first=(0.0, 0.0, 0.0), further=0.0),
}


def test_branch_yields_are_learned_per_rank_off_the_node_where_the_spine_stopped():
    estimates = YieldEstimates(max_draft=4, max_key_len=1, decay=1.0)
    none = np.zeros(0, np.int64)
    estimates.observe(StepOutcome(tokens=9, seconds=0.01, lane_tokens=0, lane_accepted=0, text_accepted=0,
                                  decoding_requests=1, draft_lengths=none, accepted_lengths=none, key_lens=none,
                                  branch_ranks=np.array([0, 0, 1]), branch_lengths=np.array([3, 2, 2]),
                                  branch_matches=np.array([3, 1, 0])))
    prior = estimates.branch_prior
    rank0 = [(2 + prior) / 3]  # position 1: 2 trials, 2 hits; then 2 trials 1 hit; then 1 trial 1 hit
    rank0 += [(1 + rank0[0]) / 3]
    rank0 += [(1 + rank0[1]) / 2, rank0[1] / 2 + 0.0]
    rank0[3] = rank0[2]  # position 4: untried, judged like position 3
    rank1_first = (0 + prior) / 2
    got = estimates.branch_reach_probability()
    np.testing.assert_allclose(got[0], np.cumprod(rank0))
    np.testing.assert_allclose(got[1, 0], rank1_first)
    np.testing.assert_allclose(got[2], np.full(4, prior) ** np.arange(1, 5))  # a rank never tried


@pytest.mark.parametrize("name", list(TREE_MACHINES))
def test_branch_tokens_follow_what_they_earn_against_what_they_cost(name):
    machine = TREE_MACHINES[name]
    controller = GoodputController(LANE_LEN, MAX_DRAFT, MAX_KEY_LEN)
    got, tree_tokens = simulate_tree(machine, controller, 2000)
    grown = simulate_tree(machine, GoodputController(LANE_LEN, MAX_DRAFT, MAX_KEY_LEN), 1, keep_branches=True)[1][0]
    typical = np.median(tree_tokens[500:])
    if name in ("gpu-like", "gpu-like, tree overhead"):
        assert typical == grown  # under the knee every branch runs
    elif name == "cpu-like":
        assert 0 < typical < grown / 2  # the likeliest few
    else:  # only the prior's occasional retries
        assert np.mean(np.array(tree_tokens[500:]) > 0) < 0.1
    best = max(simulate_tree(machine, FixedController(MAX_DRAFT), 2000, keep_branches=keep)[0] for keep in (False, True))
    assert got >= 0.95 * best


def test_a_step_with_branches_is_priced_at_least_what_tree_steps_cost_over_plain_ones():
    """Branch attention costs a step an amount per layer, not per token (2-core CPU, SmolLM2,
    MT-Bench: 56.3 ms per step with 1 branch token against 46.2 ms without). Tree steps
    seen only behind long spines must not price a branch behind a short spine as their
    curve scaled down by tokens would: cheaper than the plain step without it."""
    from vllm_fafo.control.goodput import BranchSet

    plain, overhead_s, max_draft = linear(40.0, 1.0), 0.010, 16
    controller = GoodputController(LANE_LEN, max_draft, MAX_KEY_LEN)
    one = np.ones(1, np.int64)
    for round_ in range(5):
        for tokens in range(1, 2 + max_draft):  # plain steps: the token and 0..16 drafts
            controller.observe(StepOutcome(tokens=tokens, seconds=float(plain(tokens)), lane_tokens=0, lane_accepted=0,
                                           text_accepted=0, decoding_requests=1, draft_lengths=one,
                                           accepted_lengths=0 * one, key_lens=one))
        for tokens in range(12, 2 + max_draft):  # one branch token behind long spines; one in five accepted
            controller.observe(StepOutcome(tokens=tokens, seconds=float(plain(tokens)) + overhead_s, lane_tokens=0,
                                           lane_accepted=0, text_accepted=0, decoding_requests=1, draft_lengths=one,
                                           accepted_lengths=0 * one, key_lens=one, tree_tokens=1,
                                           branch_ranks=np.zeros(1, np.int64), branch_lengths=one,
                                           branch_matches=np.array([int((tokens + round_) % 5 == 0)])))
    assert controller.yields.branch_reach_probability()[0, 0] < 0.3
    spine = controller.choose_draft_lens(2, one, np.array([1]))
    branch = BranchSet(owners=np.zeros(1, np.int64), nodes=np.zeros(1, np.int64), ranks=np.zeros(1, np.int64),
                       lengths=one)
    assert controller.choose_branches(2 + int(spine[0]), spine, branch).sum() == 0  # 10 ms for < 0.3 tokens
    controller.tree_cost = type(controller.tree_cost)()
    for tokens in range(12, 2 + max_draft):  # where branches cost only their tokens, the same branch pays
        controller.observe(StepOutcome(tokens=tokens, seconds=float(plain(tokens)), lane_tokens=0, lane_accepted=0,
                                       text_accepted=0, decoding_requests=1, draft_lengths=one,
                                       accepted_lengths=0 * one, key_lens=one, tree_tokens=1))
    assert controller.choose_branches(2 + int(spine[0]), spine, branch).sum() == 1


def test_reach_probability_of_a_batch_is_each_requests_own_row_repeats_and_order_kept():
    """Rows are computed once per distinct key length; every request still gets the row
    of its own key length (repeated, unsorted, and past ``max_key_len`` clipped to it)."""
    estimates = YieldEstimates(max_draft=4, max_key_len=4, draft_decay=0.9)
    rng = np.random.default_rng(7)
    for _ in range(30):
        drafted = rng.integers(0, 5, size=6)
        estimates.observe(StepOutcome(tokens=12, seconds=0.01, lane_tokens=0, lane_accepted=0, text_accepted=0,
                                      decoding_requests=6, draft_lengths=drafted, accepted_lengths=rng.integers(0, drafted + 1),
                                      key_lens=rng.integers(0, 5, size=6)))
    key_lens = np.array([3, 1, 3, 0, 9, 4, 1])
    alone = np.stack([estimates.reach_probability(np.array([k]))[0] for k in np.minimum(key_lens, 4)])
    np.testing.assert_array_equal(estimates.reach_probability(key_lens), alone)
    assert len({row.tobytes() for row in alone}) == 4  # the rows differ: a wrong mapping would show


def test_evidence_rows_one_per_short_match_and_growing_spans_beyond():
    rows = evidence_rows(24)
    np.testing.assert_array_equal(rows[:6], np.arange(6))  # the pool's keys and the shortest deep match
    spans = [np.flatnonzero(rows == row).tolist() for row in range(6, rows[-1] + 1)]
    assert spans == [[6, 7], [8, 9, 10, 11], [12, 13, 14, 15, 16], list(range(17, 25))]
    estimates = YieldEstimates(max_draft=4, max_key_len=24)
    assert estimates.position_trials.shape == (10, 4)


def test_draft_yields_decay_per_verified_draft_not_per_step():
    """A step of 32 drafts weighs the evidence before it down as much as 32 steps of one
    (at batch 1 the window holds as many drafts as at batch 32)."""
    def outcome(drafts: int, accepted: int) -> StepOutcome:
        return StepOutcome(tokens=drafts * 5, seconds=0.01, lane_tokens=0, lane_accepted=0, text_accepted=0,
                           decoding_requests=drafts, draft_lengths=np.full(drafts, 4), accepted_lengths=np.full(drafts, accepted),
                           key_lens=np.ones(drafts, dtype=np.int64))

    batched, serial = (YieldEstimates(max_draft=4, max_key_len=4, draft_decay=0.99) for _ in range(2))
    for estimates in (batched, serial):
        estimates.observe(outcome(1, 4))
    batched.observe(outcome(32, 0))
    for _ in range(32):
        serial.observe(outcome(1, 0))
    # the first draft's weight after 32 more drafts: 0.99 ** 32 either way (decayed per
    # step it would keep 0.99 in one step of 32)
    first_hits = 0.99 ** 32
    np.testing.assert_allclose(batched.position_hits[1], [first_hits] * 4)
    np.testing.assert_allclose(serial.position_hits[1], [first_hits] * 4)


# Padded draft tiers (pad_drafts under the goodput controller) -----------------------------
TIERS = draft_tiers(16)


def simulate_tiers(cost: Callable[[int, int], float], requests: int, accept: float, steps: int,
                   controller: GoodputController | None = None, fixed_tier: int | None = None,
                   seed: int = 0) -> tuple[float, list[int]]:
    """Uniform decode steps of ``requests`` requests whose found drafts are all 16 tokens,
    each position accepted with ``accept`` once the ones before were; a step of tier t
    costs ``cost(requests, t)`` seconds. Returns (tokens per second, the tiers chosen)."""
    rng = np.random.default_rng(seed)
    controller = controller or GoodputController(LANE_LEN, 16, MAX_KEY_LEN)
    tokens = seconds = 0.0
    chosen = []
    key_lens = np.full(requests, MAX_KEY_LEN)
    for _ in range(steps):
        tier = fixed_tier if fixed_tier is not None else controller.choose_tier(
            requests, key_lens, np.full(requests, 16))
        chosen.append(tier)
        runs = np.minimum(rng.geometric(1 - accept, requests) - 1, 16)  # the text matches this much of each draft
        accepted = np.minimum(runs, tier)
        step_seconds = cost(requests, tier)
        tokens += requests + accepted.sum()
        seconds += step_seconds
        controller.observe(StepOutcome(
            tokens=requests * (1 + tier), seconds=step_seconds, lane_tokens=0, lane_accepted=0,
            text_accepted=int(accepted.sum()), decoding_requests=requests, draft_lengths=np.full(requests, 16),
            accepted_lengths=runs, key_lens=key_lens, uniform_draft_len=tier))
    return tokens / seconds, chosen


def gpu_like(requests: int, tier: int) -> float:
    """A graphed step: flat up to a knee of 512 tokens, then a cost per token."""
    return (4.0 + 0.02 * max(0, requests * (1 + tier) - 512)) / 1000


def test_draft_tiers_are_the_fixed_ones_up_to_the_longest_draft_and_it():
    assert draft_tiers(16).tolist() == [0, 4, 8, 16]
    assert draft_tiers(6).tolist() == [0, 4, 6]
    assert draft_tiers(32).tolist() == [0, 4, 8, 16, 32]
    assert draft_tiers(1).tolist() == [0, 1]


def test_tier_is_the_longest_where_tokens_are_free_and_none_where_drafts_do_not_pay():
    _, chosen = simulate_tiers(gpu_like, 1, accept=0.8, steps=200)
    assert np.mean(np.array(chosen[50:]) == 16) > 0.9
    _, chosen = simulate_tiers(gpu_like, 256, accept=0.05, steps=300)  # 256 x 17 tokens: far past the knee
    assert np.mean(np.array(chosen[100:]) == 0) > 0.9


@pytest.mark.parametrize("requests, accept", [(1, 0.8), (8, 0.6), (32, 0.5), (64, 0.3), (128, 0.6)])
def test_tiers_chosen_come_near_the_best_fixed_tier(requests, accept):
    best = max(simulate_tiers(gpu_like, requests, accept, 400, fixed_tier=tier)[0] for tier in TIERS.tolist())
    realised, _ = simulate_tiers(gpu_like, requests, accept, 400)
    assert realised >= 0.93 * best


def test_a_tier_is_priced_by_its_own_steps_not_by_its_token_count():
    """Tier 8's graphs are missing on this machine (its steps cost 3x): the token curve
    would price it between 4 and 16, its own steps teach the controller to skip it."""
    def missing_graph(requests: int, tier: int) -> float:
        return gpu_like(requests, tier) * (3.0 if tier == 8 else 1.0) + 0.0002 * requests * tier / 1000

    controller = GoodputController(LANE_LEN, 16, MAX_KEY_LEN)
    _, chosen = simulate_tiers(missing_graph, 24, accept=0.55, steps=300, controller=controller)
    assert 8 in chosen[:50]  # tried while unpriced
    assert chosen[100:].count(8) == 0
    assert controller.tier_cost[8].predict(24) > 2.5 * controller.tier_cost[16].predict(24)
    assert set(controller.summary()["tier_cost"]) >= {"8", "16"}


def test_kernels_choose_and_count_as_the_numpy_code_they_replaced():
    """choose_lengths and count_chains against the numpy code they replaced (kept here
    as the reference): random reach tables, found drafts, key lengths and step prices,
    half the cases with requests worth alike (the cut falls among equals: the earliest get them)."""
    from vllm_fafo.control.kernels import choose_lengths, count_chains

    rng = np.random.default_rng(5)
    max_draft, max_key_len = 16, 23
    share = GoodputController(LANE_LEN, max_draft, max_key_len)._worth_share
    for case in range(400):
        requests = int(rng.integers(1, 40))
        table = np.cumprod(rng.random((8, max_draft)) ** 0.3, axis=1)
        # every other case few rows and key lengths: many requests worth alike (ties at the cut)
        rows = rng.integers(0, 8 if case % 2 else 2, requests)
        key_lens = rng.integers(0, max_key_len + 1 if case % 2 else 3, requests)
        available = rng.integers(0, max_draft + 1, requests)
        count = int(available.sum())
        seconds = 0.01 + np.cumsum(rng.random(count + 1) * rng.choice([0.0, 1e-4, 1e-3]))
        # the numpy code choose_draft_lens ran before the kernel
        owners, positions = np.nonzero(np.arange(max_draft) < available[:, None])
        worth = (table[rows] * share[key_lens])[owners, positions]
        order = np.argsort(-worth, kind="stable")
        rates = (requests + np.concatenate([[0.0], np.cumsum(worth[order])])) / seconds
        expected = np.bincount(owners[order[: int(rates.argmax())]], minlength=requests)
        got = np.zeros(requests, dtype=np.int64)
        choose_lengths(table, rows, share, key_lens, available, float(requests), seconds, got)
        np.testing.assert_array_equal(got, expected)

        lengths, accepted = rng.integers(0, max_draft + 1, requests), rng.integers(0, max_draft + 1, requests)
        positions = np.arange(1, max_draft + 1)
        trials, hits = rng.random((8, max_draft)), rng.random((8, max_draft))
        expected_trials, expected_hits = trials.copy(), hits.copy()
        np.add.at(expected_trials, rows, (lengths[:, None] >= positions) & (accepted[:, None] >= positions - 1))
        np.add.at(expected_hits, rows, accepted[:, None] >= positions)
        count_chains(trials, hits, rows, lengths, accepted)
        np.testing.assert_array_equal(trials, expected_trials)
        np.testing.assert_array_equal(hits, expected_hits)


def choose_tier_reference(controller: GoodputController, step_tokens: int, key_lens: np.ndarray,
                          available: np.ndarray) -> int:
    """The tier as numpy chose it before the kernel (the reference): the gains of each tier
    from the found tokens' worth, the seconds from its own curve, else the dearest shorter
    tier's, else the plain curve's price of its tokens."""
    tiers, requests, plain = controller.tiers, len(available), controller._plain_cost()
    if not requests or not plain.has_data:
        return int(tiers[-1])
    reach = controller.yields.reach_probability(key_lens)
    matched = np.minimum(key_lens, len(controller._worth_share) - 1)
    worth = np.where(np.arange(controller.max_draft) < available[:, None], reach * controller._worth_share[matched],
                     0.0)
    gains = requests + np.concatenate([[0.0], np.cumsum(worth.sum(axis=0))])[tiers]
    seconds, shorter = np.zeros(len(tiers)), 0.0
    for i, tier in enumerate(tiers.tolist()):
        costs = controller.tier_cost[tier]
        if costs.has_data:
            seconds[i] = float(costs.predict(requests))
            shorter = max(shorter, seconds[i])
        else:
            seconds[i] = shorter or float(plain.predict(step_tokens + requests * tier))
    return int(tiers[int((gains / seconds).argmax())])


def test_the_tier_kernel_chooses_as_the_numpy_code_it_replaced():
    """choose_tier against the numpy code it replaced: controllers that learned random
    drafts' yields, some tiers' costs (at random batch sizes) and the plain curve's, asked
    for random batches' found drafts and key lengths; and where nothing is priced, the
    longest tier."""
    rng = np.random.default_rng(11)
    max_draft, max_key_len = 16, 23
    chosen = set()
    for case in range(200):
        controller = GoodputController(LANE_LEN, max_draft, max_key_len)
        for _ in range(int(rng.integers(1, 6))):
            lengths = rng.integers(0, max_draft + 1, 30)
            controller.observe(StepOutcome(
                tokens=int(rng.integers(1, 400)), seconds=float(rng.uniform(0.005, 0.05)), lane_tokens=0,
                lane_accepted=0, text_accepted=0, decoding_requests=30, draft_lengths=lengths,
                accepted_lengths=np.minimum(lengths, rng.geometric(0.3, 30) - 1),
                key_lens=rng.integers(0, max_key_len + 1, 30),
                uniform_draft_len=int(rng.choice([-1, *controller.tiers.tolist()]))))
        requests = int(rng.integers(0, 40))
        key_lens = rng.integers(0, max_key_len + 1, requests)
        available = rng.integers(0, max_draft + 1, requests)
        step_tokens = int(rng.integers(requests, 2 * requests + 1))
        expected = choose_tier_reference(controller, step_tokens, key_lens, available)
        assert controller.choose_tier(step_tokens, key_lens, available) == expected, f"case {case}"
        assert controller.last.draft_len == expected
        chosen.add(expected)
    assert chosen == set(controller.tiers.tolist())  # every tier was chosen in some case
    assert GoodputController(LANE_LEN, max_draft, max_key_len).choose_tier(4, np.zeros(2), np.ones(2)) == max_draft


def cost_curve_reference(observations, weight, stale_after, forget_after):
    """The cost curve after ``observations`` ((tokens, seconds), one per step), by the rule
    in numpy over every grid point: each step the nearest point in log tokens takes the
    sample (its decayed mean, or the sample alone where it is new or stale); the curve is
    the points observed in the last ``forget_after`` steps, seconds made non-decreasing."""
    grid = np.log(np.unique(np.round(np.geomspace(1, 1 << 17, 69)).astype(np.int64)))
    means, samples, updated = np.zeros((2, len(grid))), np.zeros(len(grid)), np.zeros(len(grid), dtype=np.int64)
    for step, (tokens, seconds) in enumerate(observations, start=1):
        point = int(np.argmin(np.abs(grid - np.log(tokens))))
        if samples[point] == 0 or step - updated[point] > stale_after:
            means[:, point], samples[point] = (tokens, seconds), 1.0
        else:
            means[:, point] += weight * (np.array([tokens, seconds]) - means[:, point])
            samples[point] = min(samples[point] + 1, 1 / weight)
        updated[point] = step
    on = (samples > 0) & (len(observations) - updated <= forget_after)
    return means[0, on], isotonic_reference(means[1, on], samples[on])


def test_the_cost_curve_is_the_rules_over_every_grid_point():
    """Random step sizes and costs, with sizes left unobserved long enough to go stale and to
    be forgotten, then observed again: the model's curve, kept from its live points only, is
    the rule's over every grid point at each of many checkpoints."""
    rng = np.random.default_rng(8)
    model, observations = StepCostModel(), []
    model.stale_after, model.forget_after = 5, 12
    for step in range(400):
        sizes = (3, 40) if (step // 50) % 2 else (1, 7, 300, 5000)
        tokens = int(rng.choice(sizes)) + int(rng.integers(0, 3))
        seconds = float(rng.uniform(0.01, 0.05) + 1e-5 * tokens)
        model.observe(tokens, seconds)
        observations.append((tokens, seconds))
        if step % 7 == 0 or step == 399:
            tokens_want, seconds_want = cost_curve_reference(observations, model.weight, model.stale_after,
                                                             model.forget_after)
            got_tokens, got_seconds = model.curve()
            np.testing.assert_allclose(got_tokens, tokens_want, rtol=1e-12, err_msg=f"step {step}")
            np.testing.assert_allclose(got_seconds, seconds_want, rtol=1e-12, atol=1e-15, err_msg=f"step {step}")
    assert 2 <= model.num_points < 6
