"""The goodput controller's per-step arithmetic, as numba kernels.

The controller runs on every step, between two forwards, for the whole batch:
counting the judged drafts into the yield table, turning the table into reach
probabilities, and choosing the draft tokens that pay. In numpy each was a
dozen calls (about 80, 75 and 120 us per step at batch 1 in the 2-core CPU
engine, docs/results/host-time.md); here each is one call, with the same
arithmetic in the same order. :func:`load_kernels` runs them once while the
engine starts.
"""

from __future__ import annotations

import numpy as np
from numba import njit


def as_int64(values) -> np.ndarray:
    """``values`` as the contiguous int64 array the kernels take (no copy where it is one)."""
    return np.ascontiguousarray(values, dtype=np.int64)


@njit(cache=True)
def count_chains(trials: np.ndarray, hits: np.ndarray, rows: np.ndarray, lengths: np.ndarray,
                 accepted: np.ndarray) -> None:
    """Add chains (drafts or branches, one per entry of ``rows``) to their row's counts:
    a chain reached position k (1-based) if it was that long and its first k - 1 tokens
    were accepted; it hit k if its first k were."""
    for i in range(len(rows)):
        row, length, matched = rows[i], lengths[i], accepted[i]
        for k in range(trials.shape[1]):
            if length >= k + 1 and matched >= k:
                trials[row, k] += 1.0
            if matched >= k + 1:
                hits[row, k] += 1.0


@njit(cache=True)
def observe_chains(trials: np.ndarray, hits: np.ndarray, decay: float, row_of_key: np.ndarray, keys: np.ndarray,
                   lengths: np.ndarray, accepted: np.ndarray) -> None:
    """Decay a yield table by ``decay`` and add chains to it (:func:`count_chains`), the
    row of chain i being ``row_of_key[min(keys[i], len(row_of_key) - 1)]``."""
    trials *= decay
    hits *= decay
    rows = np.empty(len(keys), dtype=np.int64)
    for i in range(len(keys)):
        rows[i] = row_of_key[min(keys[i], len(row_of_key) - 1)]
    count_chains(trials, hits, rows, lengths, accepted)


@njit(cache=True, inline="always")
def _rate_after(hits: float, trials: float, weight: float, prior: float) -> float:
    """A position's continuation rate: ``hits`` of ``trials`` and ``weight`` pseudo-trials at ``prior``."""
    return (hits + weight * prior) / (trials + weight)


@njit(cache=True, inline="always")
def _reach_row(trials: np.ndarray, hits: np.ndarray, weight: float, prior: float, out: np.ndarray) -> None:
    """One row of :func:`reach`: the running product of the continuation rates into ``out``."""
    rate, product = prior, 1.0
    for k in range(len(out)):
        rate = _rate_after(hits[k], trials[k], weight, rate)
        product *= rate
        out[k] = product


@njit(cache=True)
def reach(trials: np.ndarray, hits: np.ndarray, first_prior: np.ndarray, weights: np.ndarray,
          out: np.ndarray) -> None:
    """Per row, P(positions 1..k all accepted) into ``out``: the running product of the
    continuation rates (hits + w x prior) / (trials + w), w the row's pseudo-trials
    (``weights``), the prior being the row's rate at the position before (``first_prior``
    at the first)."""
    for row in range(trials.shape[0]):
        _reach_row(trials[row], hits[row], weights[row], first_prior[row], out[row])


@njit(cache=True)
def draft_reach(trials: np.ndarray, hits: np.ndarray, overall: np.ndarray, by_row: np.ndarray) -> None:
    """The draft yields' reach probabilities: over all drafts (``overall``: the rows' sums, a
    quarter of a pseudo-trial, prior 1) and per key length's row (``by_row``: one
    pseudo-trial, prior the rate over all drafts at the first position). :func:`reach`'s
    rule, allocating nothing: it runs in every step's choice, cold."""
    rate, product, first = 1.0, 1.0, 1.0
    for k in range(trials.shape[1]):
        total_trials, total_hits = 0.0, 0.0
        for row in range(trials.shape[0]):  # row by row, as numpy's sum over axis 0 adds
            total_trials += trials[row, k]
            total_hits += hits[row, k]
        rate = _rate_after(total_hits, total_trials, 0.25, rate)
        product *= rate
        overall[k] = product
        if k == 0:
            first = rate
    for row in range(trials.shape[0]):
        _reach_row(trials[row], hits[row], 1.0, first, by_row[row])


@njit(cache=True, error_model="numpy")  # a step priced at 0 s: rates of inf, as numpy's division gives
def choose_lengths(reach_by_row: np.ndarray, rows: np.ndarray, worth_share: np.ndarray, matched: np.ndarray,
                   available: np.ndarray, base_gain: float, seconds: np.ndarray, lengths: np.ndarray) -> None:
    """Into ``lengths``, per request, how many of its draft's first tokens to keep: the
    batch's tokens in order of worth (request r's token k is worth
    ``reach_by_row[rows[r], k] * worth_share[matched[r], k]``, ties to the earlier
    token), as many as maximise (``base_gain`` + their worth) / ``seconds[n]`` for n
    tokens (the first maximum)."""
    count = 0
    for r in range(len(available)):
        count += available[r]
    worth = np.empty(count)
    owners = np.empty(count, dtype=np.int64)
    i = 0
    for r in range(len(available)):
        for k in range(available[r]):
            worth[i] = reach_by_row[rows[r], k] * worth_share[matched[r], k]
            owners[i] = r
            i += 1
    order = np.argsort(-worth, kind="mergesort")
    gain, best, best_rate = base_gain, 0, base_gain / seconds[0]
    for n in range(count):
        gain += worth[order[n]]
        rate = gain / seconds[n + 1]
        if rate > best_rate:
            best, best_rate = n + 1, rate
    lengths[:] = 0
    for n in range(best):
        lengths[owners[order[n]]] += 1


@njit(cache=True)
def fit_isotonic(values: np.ndarray, weights: np.ndarray, out: np.ndarray) -> None:
    """Into ``out``, the non-decreasing sequence nearest ``values`` in weighted least
    squares (pool adjacent violators: a run that decreases becomes its weighted mean)."""
    n = len(values)
    means = np.empty(n)
    masses = np.empty(n)
    runs = np.empty(n, dtype=np.int64)
    top = 0
    for i in range(n):
        means[top], masses[top], runs[top] = values[i], weights[i], 1
        top += 1
        while top > 1 and means[top - 2] > means[top - 1]:
            mass = masses[top - 2] + masses[top - 1]
            means[top - 2] = (means[top - 2] * masses[top - 2] + means[top - 1] * masses[top - 1]) / mass
            masses[top - 2] = mass
            runs[top - 2] += runs[top - 1]
            top -= 1
    i = 0
    for run in range(top):
        for _ in range(runs[run]):
            out[i] = means[run]
            i += 1


@njit(cache=True)
def observe_cost(log_grid: np.ndarray, points: np.ndarray, updated_at: np.ndarray, steps: np.ndarray,
                 tokens: float, seconds: float, weight: float, stale_after: int, forget_after: int,
                 curve: np.ndarray) -> int:
    """A step cost model's update (:class:`~vllm_fafo.control.goodput.StepCostModel`):
    the nearest grid point's decayed mean (``points``: tokens, seconds and samples
    rows) takes the step of ``tokens`` tokens and ``seconds``; the recent points are
    fitted into ``curve`` (tokens row, seconds row); how many there are is written into
    ``steps[1]`` (``steps[0]`` counts the steps) and returned."""
    steps[0] += 1
    target = np.log(tokens)
    point, nearest = 0, np.inf
    for i in range(len(log_grid)):
        distance = abs(log_grid[i] - target)
        if distance < nearest:
            point, nearest = i, distance
    stale = steps[0] - updated_at[point] > stale_after
    updated_at[point] = steps[0]
    if stale or points[2, point] == 0.0:
        points[0, point], points[1, point], points[2, point] = tokens, seconds, 1.0
    else:
        points[0, point] += weight * (tokens - points[0, point])
        points[1, point] += weight * (seconds - points[1, point])
        points[2, point] = min(points[2, point] + 1.0, 1.0 / weight)
    count = 0
    for i in range(len(log_grid)):
        if points[2, i] > 0.0 and steps[0] - updated_at[i] <= forget_after:
            curve[0, count] = points[0, i]
            curve[2, count] = points[1, i]
            curve[3, count] = points[2, i]
            count += 1
    fit_isotonic(curve[2, :count], curve[3, :count], curve[1, :count])
    steps[1] = count
    return count


@njit(cache=True, inline="always")
def _price(known: np.ndarray, seconds: np.ndarray, count: int, x: float) -> float:
    """The seconds of a step of ``x`` tokens on a fitted curve (:func:`prices`' rule)."""
    if count == 0:
        return 1.0
    if x < known[0]:
        return seconds[0] * x / known[0]
    if x >= known[count - 1]:
        return seconds[count - 1]
    j = np.searchsorted(known[:count], x, side="right") - 1  # known[j] <= x < known[j + 1]
    if x == known[j]:
        return seconds[j]
    return (seconds[j + 1] - seconds[j]) / (known[j + 1] - known[j]) * (x - known[j]) + seconds[j]


@njit(cache=True)
def prices(curve: np.ndarray, count: int, tokens: np.ndarray, out: np.ndarray, dearer: bool) -> None:
    """``out[i]``: the seconds of a step of ``tokens[i]`` tokens on a fitted curve of
    ``count`` points (or the dearer of them and ``out[i]``): interpolated as ``np.interp``
    does, flat above the largest size, proportional below the smallest, 1 where the
    curve is empty (:meth:`~vllm_fafo.control.goodput.StepCostModel.predict`)."""
    for i in range(len(tokens)):
        price = _price(curve[0], curve[1], count, tokens[i])
        out[i] = max(out[i], price) if dearer else price


@njit(cache=True)
def step_seconds(plain: np.ndarray, plain_count: int, lanes: np.ndarray, lane_count: int, start: int,
                 out: np.ndarray) -> None:
    """Into ``out[i]``, the price of a step of ``start + i`` tokens on the plain curve, or,
    with a lane curve (``lane_count`` > 0), the dearer of both."""
    for i in range(len(out)):
        x = float(start + i)
        price = _price(plain[0], plain[1], plain_count, x)
        out[i] = max(price, _price(lanes[0], lanes[1], lane_count, x)) if lane_count > 0 else price


@njit(cache=True)
def _lane_step_price(plain: np.ndarray, plain_count: int, lanes: np.ndarray, lane_count: int, tokens: float,
                     scratch: np.ndarray) -> float:
    """The price of one step with lanes of ``tokens`` tokens (:func:`step_seconds`'s rule;
    ``scratch``: two entries)."""
    scratch[0] = tokens
    prices(plain, plain_count, scratch[:1], scratch[1:], False)
    if lane_count > 0:
        prices(lanes, lane_count, scratch[:1], scratch[1:], True)
    return scratch[1]


@njit(cache=True, error_model="numpy")
def choose_lane_count(options: np.ndarray, lane_len: int, lane_requests: int, real_tokens: int,
                      decoding_requests: int, tokens_per_request: float, lane_yield: float, lane_yield_seen: float,
                      plain: np.ndarray, plain_count: int, lanes: np.ndarray, lane_count: int, probe_due: bool,
                      probe_anyway: bool, seconds: np.ndarray) -> tuple[int, bool]:
    """The goodput controller's choice of lanes per request in one call
    (:meth:`~vllm_fafo.control.goodput.GoodputController.choose_lanes`): of ``options``
    (0 first), the one with the most expected tokens per second, a step of ``o`` lanes
    priced as a step with lanes of ``real_tokens + o * lane_len * lane_requests`` tokens,
    0 as a plain step. Where that is 0 and a probe is due, the most lanes priced at no
    more than twice the plain step, if ``probe_anyway`` (in a burst, or overdue) or they
    could pay at ``lane_yield_seen`` behind the step's tokens or its decoding requests
    alone. Returns (lanes, probed); ``seconds``: scratch of ``len(options) + 2``."""
    count = len(options)
    scratch = seconds[count:]
    base = decoding_requests * tokens_per_request
    seconds[0] = real_tokens
    prices(plain, plain_count, seconds[:1], seconds[:1], False)
    best, best_rate = 0, np.nan
    for i in range(count):
        lane_tokens = options[i] * lane_len * lane_requests
        if i > 0:
            seconds[i] = _lane_step_price(plain, plain_count, lanes, lane_count, float(real_tokens + lane_tokens),
                                          scratch)
        rate = (base + lane_tokens * lane_yield) / seconds[i]
        if np.isnan(rate):  # as np.argmax: the first nan
            if not np.isnan(best_rate):
                best, best_rate = i, rate
        elif i == 0 or (not np.isnan(best_rate) and rate > best_rate):
            best, best_rate = i, rate
    chosen = options[best]
    if chosen != 0 or not probe_due:
        return chosen, False
    size = 1
    for i in range(count):
        if seconds[i] <= 2 * seconds[0]:
            size = max(size, options[i])
    probe = probe_anyway
    if not probe:
        lane_tokens = size * lane_len * lane_requests
        for tokens in (real_tokens, decoding_requests):
            with_lanes = (base + lane_tokens * lane_yield_seen) / _lane_step_price(
                plain, plain_count, lanes, lane_count, float(tokens + lane_tokens), scratch)
            scratch[0] = tokens
            prices(plain, plain_count, scratch[:1], scratch[1:], False)
            if with_lanes >= base / scratch[1]:
                probe = True
                break
    return (size if probe else 0), probe


(C_LANES, C_ASK_REQUESTS, C_ASK_DECODING, C_ASK_MAX_LANES, C_PROBE_DUE, C_PROBE_ANYWAY, C_DRAFT_LEN, C_DRAFT_TOTAL,
 C_DRAFT_REQUESTS, C_DRAFTS_CUT, C_SAMPLED_STEPS, C_MAX_DRAFT, C_LANE_LEN, CONTROL_SIZE) = range(14)
"""The entries of a controller's ``control`` array (int64), which the step's kernel reads and
writes in place, so that no Python runs for the controller around it: the lanes per
request this step, the last lane question (requests with lanes, decoding requests, most
lanes; zeros: none asked) and the probe's state for the next (due, run anyway), which
:meth:`~vllm_fafo.control.goodput.GoodputController.choose_lanes` writes in one (in this
order); the draft lengths chosen last (the longest, their sum, the requests), whether that
choice cut drafts found (1) or kept every token found (0), and the steps whose drafts were
found for a sample of the batch (:data:`~vllm_fafo.propose_kernel.SAMPLED_DRAFTS`), which
the kernel writes; then the controller's settings (``num_speculative_tokens``, the lanes' length)."""

MIN_DRAFT_ROOM = 4
"""The shortest room the goodput controller asks drafts to be found in
(:func:`draft_room`): twice the longest it chose, at least this."""


@njit(cache=True, inline="always")
def draft_room(control: np.ndarray) -> int:
    """The longest drafts worth finding for the next step: twice the longest chosen last
    (at least :data:`MIN_DRAFT_ROOM`), at most ``num_speculative_tokens``
    (:meth:`~vllm_fafo.control.goodput.GoodputController.draft_room`)."""
    return min(control[C_MAX_DRAFT], max(MIN_DRAFT_ROOM, 2 * control[C_DRAFT_LEN]))


TOTAL_LANE_TOKENS, TOTAL_LANE_ACCEPTED, TOTAL_DECODE_ROWS, TOTAL_TEXT_ACCEPTED, LANE_PRIOR_TOKENS, LANE_YIELD_UNSEEN = \
    range(6)
"""The entries of :attr:`~vllm_fafo.control.goodput.YieldEstimates.totals`: a step's totals,
decayed (:func:`count_totals`), then the lane yield's prior (pseudo lane tokens that earned
nothing) and the yield a probe assumes before lanes ran lately."""


@njit(cache=True, inline="always")
def count_totals(totals: np.ndarray, decay: float, lane_tokens: int, lane_accepted: int, decoding_requests: int,
                 text_accepted: int) -> None:
    """Decay a step's totals and add this step's."""
    totals[TOTAL_LANE_TOKENS] = decay * totals[TOTAL_LANE_TOKENS] + lane_tokens
    totals[TOTAL_LANE_ACCEPTED] = decay * totals[TOTAL_LANE_ACCEPTED] + lane_accepted
    totals[TOTAL_DECODE_ROWS] = decay * totals[TOTAL_DECODE_ROWS] + decoding_requests
    totals[TOTAL_TEXT_ACCEPTED] = decay * totals[TOTAL_TEXT_ACCEPTED] + text_accepted


@njit(cache=True)
def observe_totals(totals: np.ndarray, decay: float, lane_tokens: int, lane_accepted: int, decoding_requests: int,
                   text_accepted: int) -> None:
    """:func:`count_totals`, called from Python."""
    count_totals(totals, decay, lane_tokens, lane_accepted, decoding_requests, text_accepted)


@njit(cache=True, inline="always")
def lane_yield(totals: np.ndarray) -> float:
    """Accepted lane-n-gram tokens per lane token run, shrunk by the prior's pseudo tokens
    (:meth:`~vllm_fafo.control.goodput.YieldEstimates.lane_yield`)."""
    return totals[TOTAL_LANE_ACCEPTED] / (totals[TOTAL_LANE_TOKENS] + totals[LANE_PRIOR_TOKENS])


@njit(cache=True, inline="always")
def lane_yield_seen(totals: np.ndarray) -> float:
    """Accepted lane-n-gram tokens per lane token run, as measured, the unseen yield before
    lanes ran lately (:meth:`~vllm_fafo.control.goodput.YieldEstimates.lane_yield_seen`)."""
    if totals[TOTAL_LANE_TOKENS] <= 0.0:
        return totals[LANE_YIELD_UNSEEN]
    return totals[TOTAL_LANE_ACCEPTED] / totals[TOTAL_LANE_TOKENS]


@njit(cache=True, inline="always")
def tokens_per_request(totals: np.ndarray) -> float:
    """Tokens a decoding request yields per step without lanes: 1 + accepted text drafts."""
    rows = totals[TOTAL_DECODE_ROWS]
    return 1.0 + (totals[TOTAL_TEXT_ACCEPTED] / rows if rows > 1e-6 else 0.0)


@njit(cache=True)
def yield_figures(totals: np.ndarray) -> tuple[float, float, float]:
    """(:func:`lane_yield`, :func:`lane_yield_seen`, :func:`tokens_per_request`), called from Python."""
    return lane_yield(totals), lane_yield_seen(totals), tokens_per_request(totals)


@njit(cache=True, inline="always")
def lane_options(max_lanes: int, out: np.ndarray) -> int:
    """Into ``out``, the lanes per request the lane choice weighs: 0, the powers of two
    below ``max_lanes`` and ``max_lanes``; returns how many."""
    out[0] = 0
    count, power = 1, 1
    while power < max_lanes:
        out[count] = power
        count += 1
        power *= 2
    out[count] = max_lanes
    return count + 1


@njit(cache=True, error_model="numpy")
def choose_lanes(totals: np.ndarray, lane_len: int, lane_requests: int, real_tokens: int, decoding_requests: int,
                 max_lanes: int, plain: np.ndarray, plain_count: int, lanes: np.ndarray, lane_count: int,
                 probe_due: bool, probe_anyway: bool) -> tuple[int, bool]:
    """:func:`choose_lane_count` over :func:`lane_options` of ``max_lanes`` (at least 1), the
    yields read from ``totals``: the goodput controller's whole lane choice in one call,
    from Python (:meth:`~vllm_fafo.control.goodput.GoodputController.choose_lanes`) or
    inside the step's kernel for the next step's expected batch."""
    options = np.empty(66, dtype=np.int64)
    count = lane_options(max_lanes, options)
    return choose_lane_count(options[:count], lane_len, lane_requests, real_tokens, decoding_requests,
                             tokens_per_request(totals), lane_yield(totals), lane_yield_seen(totals), plain,
                             plain_count, lanes, lane_count, probe_due, probe_anyway, np.empty(count + 2))


@njit(cache=True, inline="always")
def _yield_row(row_of_key_len: np.ndarray, worth_share: np.ndarray, key_len: int) -> tuple[int, int]:
    """A draft matched under a key of ``key_len`` tokens: its row of the draft yields, and its
    row of ``worth_share`` (the longer keys share the longest's)."""
    return row_of_key_len[min(key_len, len(row_of_key_len) - 1)], min(key_len, worth_share.shape[0] - 1)


@njit(cache=True, error_model="numpy")
def choose_draft_lengths(trials: np.ndarray, hits: np.ndarray, reach_overall: np.ndarray,
                         reach_by_row: np.ndarray, refresh: bool, row_of_key_len: np.ndarray,
                         worth_share: np.ndarray, key_lens: np.ndarray, available: np.ndarray,
                         plain: np.ndarray, plain_count: int, lanes: np.ndarray, lane_count: int,
                         step_tokens: int, lengths: np.ndarray) -> tuple[int, int]:
    """The goodput controller's whole choice of draft lengths in one call: the reach
    tables brought up to date (``refresh``: :func:`draft_reach`), each request's row and
    worth share by its key length, the next step's price per token count on the cost
    curves (:func:`step_seconds`), then :func:`choose_lengths`. Returns the longest
    length chosen and their sum."""
    if refresh:
        draft_reach(trials, hits, reach_overall, reach_by_row)
    count = len(available)
    rows = np.empty(count, dtype=np.int64)
    matched = np.empty(count, dtype=np.int64)
    total = 0
    for r in range(count):
        rows[r], matched[r] = _yield_row(row_of_key_len, worth_share, key_lens[r])
        total += available[r]
    seconds = np.empty(total + 1)
    step_seconds(plain, plain_count, lanes, lane_count, step_tokens, seconds)
    choose_lengths(reach_by_row, rows, worth_share, matched, available, float(count), seconds, lengths)
    longest, total = 0, 0
    for r in range(count):
        longest, total = max(longest, lengths[r]), total + lengths[r]
    return longest, total


@njit(cache=True, error_model="numpy")  # a tier priced at 0 s: a rate of inf, as numpy's division gives
def choose_tier(trials: np.ndarray, hits: np.ndarray, reach_overall: np.ndarray, reach_by_row: np.ndarray,
                row_of_key_len: np.ndarray, worth_share: np.ndarray, key_lens: np.ndarray, available: np.ndarray,
                tiers: np.ndarray, tier_steps: np.ndarray, tier_curves: np.ndarray, plain: np.ndarray,
                plain_count: int, step_tokens: int) -> int:
    """The goodput controller's tier for the next step (``pad_drafts``;
    :meth:`~vllm_fafo.control.goodput.GoodputController.choose_tier` says the rule), of
    ``tiers`` (ascending), tier t's cost curve ``tier_curves[t]`` with ``tier_steps[t, 1]``
    points; the reach tables brought up to date first (:func:`draft_reach`). Each request's
    found tokens, up to ``available``, are worth their reach by its key length's row times
    the worth share of its matched length; the tier's gain is the requests plus its
    positions' worth, summed over requests position by position, then over positions."""
    draft_reach(trials, hits, reach_overall, reach_by_row)
    count = len(available)
    if count == 0 or plain_count == 0:
        return tiers[-1]
    positions = reach_by_row.shape[1]
    worth = np.zeros(positions + 1)  # worth[k + 1]: position k's, over the requests; then summed up to k
    for r in range(count):
        row, matched = _yield_row(row_of_key_len, worth_share, key_lens[r])
        for k in range(min(available[r], positions)):
            worth[k + 1] += reach_by_row[row, k] * worth_share[matched, k]
    for k in range(positions):
        worth[k + 1] += worth[k]
    best, best_rate, shorter = 0, -np.inf, 0.0  # shorter: the dearest shorter tier that ran lately
    for t in range(len(tiers)):
        if tier_steps[t, 1] > 0:
            seconds = _price(tier_curves[t, 0], tier_curves[t, 1], tier_steps[t, 1], float(count))
            shorter = max(shorter, seconds)
        elif shorter > 0.0:
            seconds = shorter
        else:
            seconds = _price(plain[0], plain[1], plain_count, float(step_tokens + count * tiers[t]))
        rate = (count + worth[tiers[t]]) / seconds
        if rate > best_rate:
            best, best_rate = t, rate
    return tiers[best]


def load_kernels() -> None:
    """Run every kernel once on small arrays of the step's types, so that numba loads
    them (on a new machine: compiles them) while the engine starts."""
    table = np.zeros((2, 3))
    index = np.zeros(1, dtype=np.int64)
    count_chains(table, table.copy(), index, index, index)
    observe_chains(table, table.copy(), 0.5, index, index, index, index)
    draft_reach(table, table.copy(), np.zeros(3), np.zeros((2, 3)))
    reach(table, table.copy(), np.ones(2), np.ones(2), np.zeros((2, 3)))
    reach_table = np.ones((2, 3))
    reach_table.flags.writeable = False  # the controller hands its reach table out read-only
    choose_lengths(reach_table, index, np.ones((2, 3)), index, np.ones(1, dtype=np.int64), 1.0, np.ones(2),
                   np.zeros(1, dtype=np.int64))
    grid, curve = np.zeros(3), np.zeros((4, 3))
    count = observe_cost(grid, np.zeros((3, 3)), np.zeros(3, dtype=np.int64), np.zeros(2, dtype=np.int64), 1.0, 1.0,
                         0.5, 1, 1, curve)
    step_seconds(curve, count, curve, count, 1, np.zeros(2))
    choose_lane_count(np.arange(2), 1, 1, 1, 1, 1.0, 0.1, 0.1, curve, count, curve, count, True, False, np.zeros(4))
    totals = np.zeros(6)
    observe_totals(totals, 0.5, 1, 1, 1, 1)
    yield_figures(totals)
    choose_lanes(totals, 1, 1, 1, 1, 2, curve, count, curve, count, True, False)
    prices(curve, count, np.ones(2), np.zeros(2), False)
    choose_draft_lengths(table, table.copy(), np.zeros(3), np.zeros((2, 3)), True, np.zeros(2, dtype=np.int64),
                         np.ones((2, 3)), index, np.ones(1, dtype=np.int64), curve, count, curve, 0, 1,
                         np.zeros(1, dtype=np.int64))
    choose_tier(table, table.copy(), np.zeros(3), np.zeros((2, 3)), np.zeros(2, dtype=np.int64), np.ones((2, 3)), index,
                np.ones(1, dtype=np.int64), np.arange(2, dtype=np.int64), np.zeros((2, 2), dtype=np.int64),
                np.zeros((2, 4, 3)), curve, count, 1)
