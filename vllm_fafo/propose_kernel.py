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

from numba import njit

from vllm_fafo.control.draft_judge import judge_drafts, queue_drafts
from vllm_fafo.control.kernels import choose_draft_lengths, choose_lanes, count_totals, observe_chains, observe_cost
from vllm_fafo.drafting.step_kernel import ROOM_OK, file_and_draft
from vllm_fafo.request_table import keep_drafts, settle_drafts

ROOM_JUDGE = 4
"""The judge's table lacks room for this step's drafts, or its slot map for a slot
(after :data:`~vllm_fafo.drafting.step_kernel.ROOM_OUTPUTS`): nothing was done."""
LENGTHS_CHOSEN, LENGTHS_FOUND, LENGTHS_LATER, LENGTHS_PADDED = range(4)
"""What :func:`propose_step` does with the drafts found: cut them to the lengths the
goodput controller chooses, keep them as found (nothing learned yet, or the fixed
controller), neither, leaving the cut and the keeping to the caller (the goodput
controller's tiers under ``pad_drafts``), or pad each to its whole room and keep it
(the fixed controller under ``pad_drafts``: the CUDA defaults)."""


@njit(cache=True)
def pad_found_drafts(history, rows, num_tokens, pad_to, max_len, pad, drafts, origins, lengths):
    """Fill request i's draft up to ``min(pad_to, max_len - num_tokens[i])`` tokens by
    repeating its last token (the text's, where it is empty), the filler's origin
    ``pad``, in place (``pad_drafts``: every request of the step drafts as many tokens,
    a uniform decode batch). Lossless: verification stops at the first token the target
    does not produce."""
    for i in range(len(lengths)):
        room = min(pad_to, max_len - num_tokens[i])
        found = lengths[i]
        last = drafts[i, found - 1] if found > 0 else history[rows[i], num_tokens[i] - 1]
        for j in range(found, room):
            drafts[i, j] = last
            origins[i, j] = pad
        lengths[i] = max(found, room)


@njit(cache=True)
def propose_step(batch, num_tokens_no_spec, history, held, max_draft, judge_count, branch_trials, mode, observe,
                 observed_curve, tokens, seconds, plain_curve, plain_count, lane_points, lanes_on, step_tokens,
                 plain_observed, lane_tokens, lane_len, ask_requests, ask_decoding, ask_max_lanes, probe_due,
                 probe_anyway):
    """One step for the decoding requests of ``batch``, rows (slots, batch rows, tokens
    vLLM took, drafts it verified, then written here: text lengths, drafts accepted),
    whose texts are the first ``num_tokens_no_spec[row]`` tokens of ``history[row]``,
    drafts of up to ``max_draft`` tokens. ``held``: the owners' arrays
    (:class:`~vllm_fafo.step_arrays.StepArrays`); ``judge_count``: the drafts queued;
    ``branch_trials``: the draft tree's branches verified (rows: ranks, tokens, tokens
    accepted); the rest the controller's numbers of the step
    (:meth:`~vllm_fafo.control.goodput.GoodputController.kernel_arguments`' last tuple):

    1. file their new n-grams and draft (:func:`~vllm_fafo.drafting.step_kernel.file_and_draft`,
       ``index`` and ``outputs``: :meth:`DraftIndex.kernel_arguments`);
    2. the controller's cost curve ``observed_curve`` observes the step (of ``curves``: the plain
       steps', the lane steps', the tree steps' :meth:`~vllm_fafo.control.goodput.StepCostModel.kernel_arrays`);
    3. settle what vLLM accepted of their last drafts (:func:`~vllm_fafo.request_table.settle_drafts`,
       ``table`` and ``counts``: :meth:`RequestTable.kernel_arguments`);
    4. judge the queued drafts their text now decides (:func:`~vllm_fafo.control.draft_judge.judge_drafts`,
       ``judge``: :meth:`DraftJudge.kernel_arguments`) and, where ``learning`` says so,
       teach the controller's draft yields those and the branches' trials
       (:func:`~vllm_fafo.control.kernels.observe_chains`) and count the step's totals
       (:func:`~vllm_fafo.control.kernels.count_totals`, ``lane_tokens`` in its tail);
    5. queue the drafts found, whole, for judging later;
    6. cut them to the lengths the controller chooses (``choice``, the step priced by curve
       ``plain_curve`` and the lane steps', :func:`~vllm_fafo.control.kernels.choose_draft_lengths`), or pad them
       (:func:`pad_found_drafts`), and keep them for settling next step
       (:func:`~vllm_fafo.request_table.keep_drafts`), as its mode
       (:data:`LENGTHS_CHOSEN` ...) says;
    7. where ``ask_requests`` > 0 (and the drafts are kept here), ask the controller's lane
       question of the next step as the lanes will (:func:`~vllm_fafo.control.kernels.choose_lanes`):
       its tokens the requests and their drafts, ``ask_requests`` of them with lanes, of up to
       ``ask_max_lanes`` lanes of ``lane_len`` tokens; a plain or a lane step priced as the
       controller will price it once this step is learned (the lane curve has ``lane_points``
       before it; ``lanes_on``: the next step's drafts are priced as a step with lanes).
       Asked between two forwards anyway, it saves the lanes' planning a cold call.

    Returns (room status, keys filed, the cost curve's points, the judge's new count,
    longest and total length chosen, the lane question's real tokens (-1: none asked),
    its lanes and probe). A status
    other than ``ROOM_OK`` changed nothing but the text lengths: the caller grows what
    lacks room and calls again."""
    slots, rows, taken, verified, num_tokens, accepted = batch[0], batch[1], batch[2], batch[3], batch[4], batch[5]
    draft_len, draft_origins, prompt_lens, next_anchors, owners = held.table
    accepted_counts, proposed_counts, draft_counts, pad, lane = held.counts
    st, frozen, frozen_owner, prior, prior_lens, texts, max_len, ngram_len, seed_from_output, scratch = held.index
    drafts, origins, found_lens, key_lens, context = held.outputs
    judge_table, index_of_slot, judged = held.judge
    (learn, trials, hits, draft_decay, row_of_key_len, branch_counts, branch_hits, branch_decay, branch_rows,
     totals) = held.learning
    curves = held.curves
    log_grid, points, updated_at, steps, weight, stale_after, forget_after, curve = curves[observed_curve]
    plain, lanes = curves[plain_curve][7], curves[1][7]
    reach_overall, reach_by_row, worth_share, lengths = held.choice

    count = len(slots)
    if judge_count + count > judge_table.shape[0]:
        return ROOM_JUDGE, 0, 0, judge_count, 0, 0, -1, 0, False
    for i in range(count):
        if slots[i] >= len(index_of_slot):
            return ROOM_JUDGE, 0, 0, judge_count, 0, 0, -1, 0, False
        num_tokens[i] = num_tokens_no_spec[rows[i]]
    status, num_keys = file_and_draft(st, frozen, frozen_owner, prior, prior_lens, texts, history, rows, num_tokens,
                                      slots, prompt_lens, next_anchors, owners, max_draft, max_len, ngram_len,
                                      seed_from_output, drafts, origins, found_lens, key_lens, scratch, context)
    if status != ROOM_OK:
        return status, num_keys, 0, judge_count, 0, 0, -1, 0, False
    points_now = 0
    if observe:
        points_now = observe_cost(log_grid, points, updated_at, steps, tokens, seconds, weight, stale_after,
                                  forget_after, curve)
        if plain_observed:
            plain_count = points_now
        if observed_curve == 1:
            lane_points = points_now
    lane_count = lane_points if lanes_on else 0
    lane_before = accepted_counts[lane]
    settle_drafts(slots, taken, verified, draft_len, draft_origins, accepted_counts, accepted)
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
    judge_count = queue_drafts(judge_table, judge_count, slots, num_tokens, drafts, found_lens[:count],
                               key_lens[:count])
    longest, total = 0, 0
    if mode == LENGTHS_CHOSEN:
        longest, total = choose_draft_lengths(trials, hits, reach_overall, reach_by_row, True, row_of_key_len,
                                              worth_share, key_lens[:count], found_lens[:count], plain,
                                              plain_count, lanes, lane_count, step_tokens, lengths[:count])
        for i in range(count):
            found_lens[i] = min(found_lens[i], lengths[i])
    elif mode == LENGTHS_PADDED:
        pad_found_drafts(history, rows, num_tokens, max_draft, max_len, pad, drafts, origins, found_lens[:count])
    if mode != LENGTHS_LATER:
        keep_drafts(slots, origins[:count], found_lens[:count], draft_len, draft_origins, pad, proposed_counts,
                    draft_counts)
    asked_tokens, lanes_chosen, probed = -1, 0, False
    if ask_requests > 0 and ask_max_lanes > 0 and mode != LENGTHS_LATER:
        asked_tokens = count + found_lens[:count].sum()
        lanes_chosen, probed = choose_lanes(totals, lane_len, ask_requests, asked_tokens, ask_decoding, ask_max_lanes,
                                            plain, plain_count, lanes, lane_points, probe_due, probe_anyway)
    return ROOM_OK, num_keys, points_now, judge_count, longest, total, asked_tokens, lanes_chosen, probed
