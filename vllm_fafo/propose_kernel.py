"""The step's work after vLLM's lists are read, in one numba call.

Between two forwards the processor's caches are cold: on the 2-core CPU a
numba call from Python cost 5-20 us before its first instruction of work
(0.2-0.9 us warm), and 0.5-1 us more per array it takes
(``benchmarks/cold_calls.py``, docs/results/host-time.md).
:meth:`FafoProposer.propose` made eight such calls (the request table's settling
and keeping, the draft index's filing and drafting, the judge's judging and
queueing, the controller's learning and choosing); :func:`propose_step` runs the
same kernels, in the same order, in one. Its arguments come in tuples by owner,
each built by that owner's ``kernel_arguments``; the tuples that persist between
steps in one object (:mod:`vllm_fafo.step_arrays`).
"""

from __future__ import annotations

import numpy as np
from numba import njit

from vllm_fafo.control.draft_judge import judge_drafts, queue_drafts
from vllm_fafo.control.kernels import (
    C_ASK_DECODING,
    C_ASK_MAX_LANES,
    C_ASK_REQUESTS,
    C_DRAFT_LEN,
    C_DRAFT_REQUESTS,
    C_DRAFT_TOTAL,
    C_DRAFTS_CUT,
    C_LANE_LEN,
    C_LANES,
    C_PROBE_ANYWAY,
    C_PROBE_DUE,
    C_SAMPLED_STEPS,
    choose_draft_lengths,
    choose_lanes,
    choose_tier,
    count_totals,
    draft_room,
    observe_chains,
    observe_cost,
)
from vllm_fafo.drafting.step_kernel import ROOM_OK, file_and_draft
from vllm_fafo.request_table import keep_drafts, settle_drafts

ROOM_JUDGE = 4
"""The judge's table lacks room for this step's drafts, or its slot map for a slot
(after :data:`~vllm_fafo.drafting.step_kernel.ROOM_OUTPUTS`): nothing was done."""
LENGTHS_CHOSEN, LENGTHS_FOUND, LENGTHS_TIER, LENGTHS_PADDED = range(4)
"""What :func:`propose_step` does with the drafts found: cut them to the lengths the
goodput controller chooses, keep them as found (nothing learned yet, or the fixed
controller), cut and pad every one to the tier the goodput controller chooses for the
batch (``pad_drafts``), or pad each to its whole room (the fixed controller under
``pad_drafts``: the CUDA defaults); and keep them."""
SAMPLED_DRAFTS = 8
"""Where the goodput controller's last choice cut drafts found (their tokens cost more than
they earn: on the 2-core CPU at batch 32 it kept a mean of 0.0-1.4 tokens per request) and the
batch has more requests than this, a step finds drafts only for the requests whose draft it
kept last step and for this many others, every stride-th request from a phase that moves
each step; the rest file their n-grams and draft nothing. A request that starts to match
is found within the stride's steps; a choice that keeps every token found ends it. Finding
the drafts that would be cut was most of the step's kernel at batch 32
(docs/results/host-time.md)."""


@njit(cache=True)
def pad_found_drafts(history, rows, num_tokens, pad_to, max_len, pad, drafts, origins, lengths):
    """Make request i's draft exactly ``min(pad_to, max_len - num_tokens[i])`` tokens: the
    found tokens past that cut, the rest filled by repeating its last token (the text's,
    where it is empty), the filler's origin ``pad``, in place (``pad_drafts``: every
    request of the step drafts as many tokens, a uniform decode batch). Lossless:
    verification stops at the first token the target does not produce."""
    for i in range(len(lengths)):
        room = min(pad_to, max_len - num_tokens[i])
        found = min(lengths[i], room)
        last = drafts[i, found - 1] if found > 0 else history[rows[i], num_tokens[i] - 1]
        for j in range(found, room):
            drafts[i, j] = last
            origins[i, j] = pad
        lengths[i] = room


@njit(cache=True)
def propose_step(batch, num_tokens_no_spec, history, held, branch_trials, count, judge_count, choose, tokens,
                 seconds, lane_tokens, tree_tokens, step_tokens, uniform_draft_len):
    """One step for the ``count`` decoding requests in the first columns of ``batch``, rows
    (slots, batch rows, tokens vLLM took, where that is 0 the spine's tokens before a won
    branch (read nowhere else), then written here: text lengths, drafts accepted),
    whose texts are the first ``num_tokens_no_spec[row]`` tokens of ``history[row]``.
    ``held``: the owners' arrays (:class:`~vllm_fafo.step_arrays.StepArrays`); ``judge_count``:
    the drafts queued; ``branch_trials``: the draft tree's branches verified (rows: ranks,
    tokens, tokens accepted). The arrays come first and stay the same objects step to step
    (the proposer calls it through :class:`~vllm_fafo.direct_call.DirectCall`). The step
    had ``tokens`` tokens (``lane_tokens`` and ``tree_tokens`` of them in its tail) and took
    ``seconds``; the next has ``step_tokens`` before its drafts; where every request decoded
    ``uniform_draft_len`` drafts and nothing else ran (-1: not so, or drafts are not padded),
    the step teaches that tier's cost. The controller's numbers
    are read from and written to its ``control`` array (``held.choice``; :data:`~vllm_fafo.control.kernels.C_LANES` ...).

    1. file their new n-grams and draft up to the controller's room (:func:`~vllm_fafo.control.kernels.draft_room`;
       :func:`~vllm_fafo.drafting.step_kernel.file_and_draft`, ``index`` and ``outputs``:
       :meth:`DraftIndex.kernel_arguments`): every request, or where the last choice cut
       drafts, the requests :data:`SAMPLED_DRAFTS` says;
    2. where the controller learns (``learning``'s first entry) and the step had tokens, the
       cost curve of its kind (the tree steps', the lane steps', the plain steps' of
       ``curves``: :meth:`~vllm_fafo.control.goodput.StepCostModel.kernel_arrays`) observes it,
       and a uniform step's tier's curve (``choice``'s last entry: the tiers and their curves,
       :func:`~vllm_fafo.control.goodput.stacked_cost_models`) its seconds at its requests;
    3. settle what vLLM accepted of their last drafts (:func:`~vllm_fafo.request_table.settle_drafts`,
       ``table`` and ``counts``: :meth:`RequestTable.kernel_arguments`);
    4. judge the queued drafts their text now decides (:func:`~vllm_fafo.control.draft_judge.judge_drafts`,
       ``judge``: :meth:`DraftJudge.kernel_arguments`) and, where the controller learns,
       teach its draft yields those and the branches' trials
       (:func:`~vllm_fafo.control.kernels.observe_chains`) and count the step's totals
       (:func:`~vllm_fafo.control.kernels.count_totals`), marking its reach tables stale;
    5. queue the drafts found, whole, for judging later;
    6. as the mode (:data:`LENGTHS_CHOSEN` ...) says: cut them to the lengths the
       controller chooses (``choice``, the step priced by the plain steps' curve, or the
       lane steps' where no plain step is on it, and the lane steps' where this step ran
       lanes: :func:`~vllm_fafo.control.kernels.choose_draft_lengths`), noting the longest,
       their sum and whether it cut any; or cut and pad them to the tier it chooses
       (:func:`~vllm_fafo.control.kernels.choose_tier`), noting it; or pad them
       (:func:`pad_found_drafts`); and keep them for settling next step
       (:func:`~vllm_fafo.request_table.keep_drafts`);
    7. where the last lane question asked for lanes, ask the
       next step's as the lanes will (:func:`~vllm_fafo.control.kernels.choose_lanes`): its
       tokens the requests and their drafts, as many requests with lanes and most lanes as
       last asked. Asked between two forwards anyway, it saves the lanes' planning a cold call.

    Returns (room status, keys filed, the judge's new count, the mode, the longest and the
    shortest draft's length, the lane question's answer: its real tokens, -1 where none was
    asked; lanes; probe). A status other than ``ROOM_OK`` changed nothing but the text
    lengths: the caller grows what lacks room and calls again."""
    slots, rows, taken, won = batch[0, :count], batch[1, :count], batch[2, :count], batch[3, :count]
    num_tokens, accepted = batch[4, :count], batch[5, :count]
    draft_len, draft_origins, prompt_lens, next_anchors, owners = held.table
    accepted_counts, proposed_counts, draft_counts, pad, lane = held.counts
    st, frozen, frozen_owner, prior, prior_lens, texts, max_len, ngram_len, seed_from_output, scratch = held.index
    drafts, origins, found_lens, key_lens, context = held.outputs
    judge_table, index_of_slot, judged = held.judge
    (learn, trials, hits, draft_decay, row_of_key_len, branch_counts, branch_hits, branch_decay, branch_rows,
     totals, stale) = held.learning
    curves = held.curves
    reach_overall, reach_by_row, worth_share, control, (tiers, tier_steps, tier_updated, tier_points, tier_curves) = \
        held.choice
    max_draft = draft_room(control)

    if judge_count + count > judge_table.shape[0]:
        return ROOM_JUDGE, 0, judge_count, LENGTHS_FOUND, 0, 0, (-1, 0, False)
    for i in range(count):
        if slots[i] >= len(index_of_slot):
            return ROOM_JUDGE, 0, judge_count, LENGTHS_FOUND, 0, 0, (-1, 0, False)
        num_tokens[i] = num_tokens_no_spec[rows[i]]
    draft_stride, draft_phase = 1, 0
    if count > SAMPLED_DRAFTS and control[C_DRAFTS_CUT] != 0:
        draft_stride = (count + SAMPLED_DRAFTS - 1) // SAMPLED_DRAFTS
        draft_phase = control[C_SAMPLED_STEPS] % draft_stride
    status, num_keys = file_and_draft(st, frozen, frozen_owner, prior, prior_lens, texts, history, rows, num_tokens,
                                      slots, prompt_lens, next_anchors, owners, max_draft, max_len, ngram_len,
                                      seed_from_output, drafts, origins, found_lens, key_lens, scratch, context,
                                      draft_len, draft_stride, draft_phase)
    if status != ROOM_OK:
        return status, num_keys, judge_count, LENGTHS_FOUND, 0, 0, (-1, 0, False)
    if draft_stride > 1:  # counted once the step ran (a step short of room runs again, in the same phase)
        control[C_SAMPLED_STEPS] += 1
    if learn and tokens >= 1:  # a step of no tokens prices nothing
        log_grid, points, updated_at, steps, weight, stale_after, forget_after, curve = \
            curves[2 if tree_tokens else 1 if lane_tokens else 0]
        observe_cost(log_grid, points, updated_at, steps, tokens, seconds, weight, stale_after, forget_after, curve)
        for t in range(len(tiers)):  # a uniform step's own tier (GoodputController.observe_tiers)
            if tiers[t] == uniform_draft_len and count > 0:
                observe_cost(log_grid, tier_points[t], tier_updated[t], tier_steps[t], float(count), seconds, weight,
                             stale_after, forget_after, tier_curves[t])
    plain_curve = 0 if curves[0][3][1] > 0 or curves[1][3][1] == 0 else 1  # GoodputController._plain_cost
    plain, plain_count = curves[plain_curve][7], curves[plain_curve][3][1]
    lanes, lane_points = curves[1][7], curves[1][3][1]
    lanes_on = control[C_LANES] > 0  # this step ran lanes: the next is priced as a step with lanes
    if not learn:
        mode = LENGTHS_FOUND if choose else LENGTHS_PADDED
    elif not choose:
        mode = LENGTHS_TIER
    else:
        mode = LENGTHS_CHOSEN if count > 0 and (lanes_on or plain_count > 0) else LENGTHS_FOUND
    lane_before = accepted_counts[lane]
    settle_drafts(slots, taken, won, draft_len, draft_origins, accepted_counts, accepted)
    lane_accepted = accepted_counts[lane] - lane_before
    done = judge_drafts(judge_table, judge_count, slots, rows, index_of_slot, num_tokens, history, judged)
    judge_count -= done
    if learn:
        # the yields' per-step decay (the branches' too)
        count_totals(totals, branch_decay, lane_tokens, lane_accepted, count, accepted.sum() - lane_accepted)
        observe_chains(trials, hits, draft_decay ** done, row_of_key_len, judged[2, :done], judged[0, :done],
                       judged[1, :done])
        observe_chains(branch_counts, branch_hits, branch_decay, branch_rows, branch_trials[0], branch_trials[1],
                       branch_trials[2])
        stale[0], stale[1] = mode != LENGTHS_CHOSEN, 1  # choose_draft_lengths refreshes the draft reach
    judge_count = queue_drafts(judge_table, judge_count, slots, num_tokens, drafts, found_lens[:count],
                               key_lens[:count])
    cut = False
    if mode == LENGTHS_CHOSEN:
        lengths = np.empty(count, dtype=np.int64)
        longest, total = choose_draft_lengths(trials, hits, reach_overall, reach_by_row, True, row_of_key_len,
                                              worth_share, key_lens[:count], found_lens[:count], plain,
                                              plain_count, lanes, lane_points if lanes_on else 0, step_tokens,
                                              lengths)
        for i in range(count):  # a chosen length is at most the length found
            if lengths[i] < found_lens[i]:
                found_lens[i], cut = lengths[i], True
        control[C_DRAFT_LEN], control[C_DRAFT_TOTAL], control[C_DRAFT_REQUESTS] = longest, total, count
    elif mode == LENGTHS_TIER:
        tier = choose_tier(trials, hits, reach_overall, reach_by_row, row_of_key_len, worth_share, key_lens[:count],
                           found_lens[:count], tiers, tier_steps, tier_curves, plain, plain_count, step_tokens)
        stale[0] = 0  # choose_tier refreshed the draft reach
        pad_found_drafts(history, rows, num_tokens, tier, max_len, pad, drafts, origins, found_lens[:count])
        control[C_DRAFT_LEN], control[C_DRAFT_TOTAL], control[C_DRAFT_REQUESTS] = tier, tier, 1
    elif mode == LENGTHS_PADDED:
        pad_found_drafts(history, rows, num_tokens, max_draft, max_len, pad, drafts, origins, found_lens[:count])
    control[C_DRAFTS_CUT] = cut
    keep_drafts(slots, origins[:count], found_lens[:count], draft_len, draft_origins, pad, proposed_counts,
                draft_counts)
    asked_tokens, lanes_chosen, probed = -1, 0, False
    ask_requests, ask_max_lanes = control[C_ASK_REQUESTS], control[C_ASK_MAX_LANES]
    if ask_requests > 0 and ask_max_lanes > 0:
        asked_tokens = count + found_lens[:count].sum()
        lanes_chosen, probed = choose_lanes(totals, control[C_LANE_LEN], ask_requests, asked_tokens,
                                            control[C_ASK_DECODING], ask_max_lanes, plain, plain_count, lanes,
                                            lane_points, control[C_PROBE_DUE] != 0, control[C_PROBE_ANYWAY] != 0)
    longest, shortest = 0, max_draft
    for i in range(count):
        longest, shortest = max(longest, found_lens[i]), min(shortest, found_lens[i])
    return ROOM_OK, num_keys, judge_count, mode, longest, shortest, (asked_tokens, lanes_chosen, probed)
