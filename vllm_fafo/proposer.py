"""FafoProposer: one decoding step of FAFO, start to end, in vLLM's order.

vLLM's custom-proposer contract is one call, :meth:`FafoProposer.propose`,
after sampling, with no request ids. The runner patches
(``vllm_fafo.patches.gpu_model_runner``) call the step's other hooks at the
points of vLLM's step where the information exists; in order:

1. :meth:`~FafoProposer.begin_step` after vLLM applied the scheduler output:
   free finished requests, open this step's :class:`FafoStep`.
2. :meth:`~FafoProposer.plan_forward` once vLLM has prepared the batch: the
   lanes plan the region updates and the tail (how many tokens it adds).
3. :meth:`~FafoProposer.attention_plan` when vLLM builds the attention
   metadata: the plan rides on it to every attention layer.
4. :meth:`~FafoProposer.tail_inputs` after vLLM wrote the token ids and
   positions: the tail's are written behind the real tokens.
   With a draft tree (``num_candidates`` > 1) the branches grown last step
   ride behind the lanes (:meth:`~FafoProposer.branch_plan`); after the
   forward :meth:`~FafoProposer.take_branch_logits` takes the target's
   choices at the branch tokens and, once vLLM sampled the spines,
   :meth:`~FafoProposer.accept_branches` swaps in a branch that got further.
5. :meth:`~FafoProposer.finish_forward` before drafting: the row order of
   the batch, and the lanes read their next tokens off the hidden states.
6. :meth:`~FafoProposer.propose`: in one kernel call
   (:func:`~vllm_fafo.propose_kernel.propose_step`) file new n-grams and draft,
   settle what vLLM accepted, judge earlier drafts against the text
   (:class:`~vllm_fafo.control.draft_judge.DraftJudge`, what the controller learns
   from), cut the drafts to what pays; then grow the next step's branches; the
   step ends.

Per step and request the work is bounded by the tokens accepted this step
times K: new n-grams are filed from a short window of the history row vLLM
already keeps, never from a scan of the whole sequence.
"""

from __future__ import annotations

import operator
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from vllm.config import VllmConfig

from vllm_fafo import propose_kernel
from vllm_fafo.attention.paged_kv import VERIFIED_CPU_ISAS, paged_kv_readable
from vllm_fafo.config import FafoConfig, FafoConfigError, RegionSpec, fafo_settings
from vllm_fafo.control import kernels as controller_kernels
from vllm_fafo.control.draft_judge import DraftJudge
from vllm_fafo.control.goodput import BranchSet, make_controller
from vllm_fafo.direct_call import DirectCall
from vllm_fafo.drafting.deep_match import MATCH_DEPTH, TenantTexts
from vllm_fafo.drafting.frozen_table import load_table
from vllm_fafo.drafting.index import DraftIndex, first_anchor, load_kernels
from vllm_fafo.drafting.pool import Origin, RequestPool, file_each_in
from vllm_fafo.drafting.prior_table import OFF as PRIOR_TABLE_OFF
from vllm_fafo.drafting.prior_table import resolve as resolve_prior_table
from vllm_fafo.drafting.shared_pool import TenantPools
from vllm_fafo.lanes.planner import BatchView, FumbleLanes
from vllm_fafo.lanes.step_plan import StepPlan
from vllm_fafo.log import init_logger
from vllm_fafo.propose_kernel import LENGTHS_CHOSEN, LENGTHS_PADDED, LENGTHS_TIER
from vllm_fafo.request_table import RequestTable
from vllm_fafo.request_table import load_kernels as request_table_kernels
from vllm_fafo.serving.metrics import FafoMetrics
from vllm_fafo.serving.metrics import load_kernels as metrics_kernels
from vllm_fafo.serving.metrics_export import SnapshotPublisher
from vllm_fafo.serving.tp_sync import RankZeroStepTime
from vllm_fafo.step_arrays import StepArrays, same_or_new
from vllm_fafo.verification.draft_tree import (
    PLACEHOLDER,
    Branch,
    BranchPlan,
    accept_greedy,
    accept_sampled,
    branch_positions,
    greedy_matches,
    grow_branches,
    is_sampled,
    layout_request,
    sampling_probs,
    stop_node,
)

logger = init_logger(__name__)

LOG_INTERVAL_S = 10.0
"""Seconds between the goodput controller's INFO lines."""


@dataclass
class RequestState:
    """What the proposer keeps for one running request as objects; its numbers are in
    the :class:`~vllm_fafo.request_table.RequestTable` at ``slot``."""

    pool: RequestPool
    """Where the request files and drafts from: its tenant's pool under its tag (when
    sharing is on), else its own."""
    slot: int
    branches: list[Branch] = field(default_factory=list)
    """The draft tree's branches off the last draft, verified next step."""


_NO_TRIALS = np.zeros((3, 0), dtype=np.int64)
"""A step without branch trials (rows: ranks, tokens, tokens accepted; empty: nothing in it can change)."""


def longest_match(config: FafoConfig) -> int:
    """The longest matched context a draft reports as its evidence (the goodput
    controller keeps a row per length): the pool's key or the deep match."""
    return MATCH_DEPTH if config.deep_match else config.max_key_len


def key_context(history: np.ndarray, num_tokens: int, max_key_len: int) -> list[int]:
    """The text's last ``max_key_len`` tokens: what pool keys and branches match against."""
    return history[max(0, num_tokens - max_key_len) : num_tokens].tolist()


@dataclass(slots=True)
class FafoStep:
    """Everything about one engine step, from ``begin_step`` to ``propose``.

    Opened by :meth:`FafoProposer.begin_step`, dropped when ``propose`` ends
    or the next step begins: nothing of a step outlives it. The attention
    layers never see this object, only its plan, on the forward's metadata.
    """

    num_scheduled_tokens: int
    scheduled_spec_tokens: dict[str, list[int]]
    """Draft tokens vLLM scheduled this step, by request."""
    started: float
    """When the step began, on the proposer's clock (its forward, sampling and
    proposing are timed)."""
    planned: bool = False
    plan: StepPlan | None = None
    """The lanes' plan, once the batch is prepared (None: pool only, or not yet)."""
    lane_tokens: int = 0
    """The lanes' tokens in the forward's tail (the plan's)."""
    tree_tokens: int = 0
    """The draft tree's branch tokens in the forward's tail, behind the lanes'."""
    plan_attached: bool = False
    branches: BranchPlan | None = None
    """The draft tree's branches riding behind the lanes (None: spine only)."""
    branches_attached: bool = False
    branch_argmax: np.ndarray | None = None
    """The target's argmax after each branch token, once the forward ran."""
    branch_probs: dict[str, torch.Tensor] | None = None
    """Sampled requests: the target's distribution after each of their branch tokens.
    This and the next two are made where branches are planned (None: no branches):
    making the three containers every step cost 2-4 us of a step after a CPU forward
    (docs/results/host-time.md)."""
    branch_wins: dict[str, tuple[int, int]] | None = None
    """Requests whose branch beat the spine: (spine tokens, branch tokens) accepted."""
    branch_trials: list[tuple[int, int, int]] | None = None
    """(rank, tokens, tokens accepted) of each branch off the node where its spine
    stopped: what the controller learns branch yields from."""
    tree_eligible: frozenset[str] = frozenset()
    """Requests whose sampling a branch can reproduce exactly (vllm_fafo.verification.draft_tree)."""
    tail_written: bool = False
    req_ids: Sequence[str] | None = None
    """Row order of the batch that ``propose`` receives."""

    @property
    def tail_tokens(self) -> int:
        """Tokens behind the real ones: lanes and branches."""
        return self.lane_tokens + self.tree_tokens


def _uniform_draft_len(step: FafoStep, decoding_requests: int) -> int:
    """The draft length every request of ``step`` decoded with, where the step was that
    uniform decode batch and nothing else (no prefill, lanes or branches); -1 otherwise.
    What a tier's cost is learned from (:meth:`GoodputController.choose_tier`)."""
    lengths = set(map(len, step.scheduled_spec_tokens.values())) or {0}
    if len(lengths) > 1 or step.tail_tokens:
        return -1
    draft_len = lengths.pop()
    return draft_len if step.num_scheduled_tokens == decoding_requests * (1 + draft_len) else -1


class FafoProposer:
    """Proposes one draft chain per request per step (FAFO Alg. 3), the spine of a
    draft tree where ``num_candidates`` > 1.

    Serves ``fafo``, ``lookahead`` and ``cacheback`` (see vllm_fafo.modes):
    they differ only in the configuration of the pool and the lanes.
    """

    def __init__(self, vllm_config: VllmConfig) -> None:
        spec_config = vllm_config.speculative_config
        assert spec_config is not None
        settings = fafo_settings(vllm_config)
        if settings is None:
            raise RuntimeError(
                "FafoProposer needs additional_config['fafo']; enable FAFO with "
                "speculative_config={'method': 'fafo', ...} and the vllm-fafo plugin "
                "loaded, not by naming this class directly"
            )
        self.config = FafoConfig.from_dict(settings)
        self.num_speculative_tokens = spec_config.num_speculative_tokens
        self.max_model_len = vllm_config.model_config.max_model_len
        self.metrics = FafoMetrics()
        self.controller = make_controller(self.config.controller, self.config.lane_len, self.num_speculative_tokens,
                                          longest_match(self.config))
        self.judge = DraftJudge(self.num_speculative_tokens)
        """Every found draft, judged against the text: what the controller learns draft yields from."""
        self.clock: Callable[[], float] = time.perf_counter
        """What steps are timed with (seconds): the step cost the controller learns.
        benchmarks/proposer_step_cost.py swaps in a modelled machine so that the
        controller's choices, and so the host time measured, repeat run to run."""
        self._last_log = time.monotonic()
        self._next_report = float("-inf")
        """When the metrics' publishing or the controller's log line is next due (monotonic seconds)."""
        self.publisher = SnapshotPublisher.for_worker(vllm_config)
        self._step_time = RankZeroStepTime.for_worker()
        self._requests: dict[str, RequestState] = {}
        self._table = RequestTable(self.num_speculative_tokens)
        self._tenants: dict[str, str | None] = {}
        """Each new request's cache_salt, from its first step until its state is made."""
        self.step: FafoStep | None = None
        self._model = None
        self.tree_enabled = self.config.num_candidates > 1
        if self.tree_enabled:
            if not paged_kv_readable(vllm_config):
                raise FafoConfigError(
                    f"speculative_config['num_candidates']={self.config.num_candidates}: draft-tree "
                    "branches read vLLM's paged KV cache, which this engine's cache dtype or CPU "
                    "attention ISA does not allow; set num_candidates to 1"
                )
        frozen = None if self.config.frozen_table is None else load_table(
            self.config.frozen_table, self.config.max_key_len, self.config.ngram_len)
        prior = None if self.config.prior_table == PRIOR_TABLE_OFF else resolve_prior_table(
            self.config.prior_table, vllm_config.model_config.model, vllm_config.model_config.get_vocab_size())
        load_kernels(self.config)
        controller_kernels.load_kernels()
        metrics_kernels()
        request_table_kernels()
        self.index = DraftIndex(self.config, frozen=frozen, prior=prior)
        """The tenants' pools (or the requests'), the deep matches' texts and the tables drafted
        from where they miss: filed and drafted once per step for the whole batch."""
        self._held_parts: tuple | None = None
        self._held_object: StepArrays | None = None
        self._held: StepArrays | None = None
        """The step kernel's arrays while no owner may have grown (None: gather them again)."""
        self._choose_lengths = not self.config.pad_drafts
        """Whether the step's kernel cuts the drafts to the controller's lengths (else it pads
        them, to the goodput controller's tier or whole: ``pad_drafts``)."""
        self._numbers = np.zeros((6, 64), dtype=np.int64)
        self._row_numbers = np.arange(64, dtype=np.int64)
        self._batch_ids: list[str] | None = None
        self._batch: np.ndarray = self._numbers[:, :0]
        """The last step's decoding requests (where every row decoded) and its batch's numbers,
        whose slots and rows stand while the same requests decode in the same order and none
        was removed (None: look them up)."""
        self._step_call = DirectCall(propose_kernel.propose_step, 5)
        """The step's kernel, called past numba's dispatcher while its arrays stand."""
        self._load_step_kernel()
        self.lanes: FumbleLanes | None = None
        region = RegionSpec.from_vllm_config(vllm_config)
        if region is not None:
            readable = paged_kv_readable(vllm_config)
            if vllm_config.cache_config.enable_prefix_caching and not readable:
                logger.warning(
                    "vllm-fafo: this engine's paged KV cache cannot be read back into the lanes' "
                    "region (kv_cache_dtype %r, or a CPU attention ISA other than %s); requests "
                    "whose prompt starts with a prefix-cache hit run without lanes",
                    vllm_config.cache_config.cache_dtype, "/".join(VERIFIED_CPU_ISAS),
                )
            self.lanes = FumbleLanes(
                num_lanes=self.config.num_lanes,
                lane_len=self.config.lane_len,
                max_key_len=self.config.max_key_len,
                max_drafts=region.staged_slots,
                max_model_len=region.max_model_len,
                region_rows=region.rows,
                policy=region.policy,
                stagger_lanes=self.config.stagger_lanes,
                park_when_off=self.config.controller == "goodput" and readable,
                paged_cache_readable=readable,
                device=vllm_config.device_config.device,
            )

    # One decoding step, in the order vLLM's runner reaches each hook ----------------
    def begin_step(
        self,
        finished_req_ids: Iterable[str],
        num_scheduled_tokens: int,
        scheduled_spec_tokens: dict[str, list[int]],
        new_request_tenants: dict[str, str | None],
    ) -> None:
        """1. vLLM applied the scheduler output: free finished or aborted requests; note
        the tenant (``cache_salt``) of each new one."""
        if finished_req_ids:
            had_requests = bool(self._requests)
            self.remove_requests(finished_req_ids)
            if self.publisher is not None and had_requests and not self._requests:
                self.publisher.publish(self.metrics_snapshot)  # going idle: no periodic publish follows
        if new_request_tenants:
            self._tenants.update(new_request_tenants)
        self.step = FafoStep(num_scheduled_tokens, scheduled_spec_tokens, self.clock())

    @property
    def plans_forward(self) -> bool:
        """Whether :meth:`plan_forward` has anything to plan (lanes or a draft tree): else the
        runner patch builds no :class:`BatchView` (a lookup per request, every step)."""
        return self.lanes is not None or self.tree_enabled

    def plan_forward(self, batch: BatchView) -> int:
        """2. The batch is prepared: plan the lanes' region updates and tail, then the
        draft tree's branches behind them; returns the tokens they add.

        Only the step's own forward is planned (a dummy forward vLLM runs in
        between has another token count), and only once."""
        step = self.step
        if step is None or step.planned or batch.num_tokens != step.num_scheduled_tokens:
            return 0
        step.planned = True
        if self.lanes is not None:
            step.plan = self.lanes.plan_step(batch, self.controller.choose_lanes)
            if step.plan is not None:
                step.lane_tokens = step.plan.num_tail_tokens
                self.metrics.caught_up_positions += sum(len(c.positions) for c in step.plan.catch_up)
                self.metrics.tail_tokens += step.lane_tokens
        if self.tree_enabled:
            step.branches = self._plan_branches(batch, batch.num_tokens + step.lane_tokens)
            if step.branches is not None:
                step.tree_tokens = step.branches.num_tokens
                step.branch_probs, step.branch_wins, step.branch_trials = {}, {}, []
        return step.lane_tokens + step.tree_tokens

    def attention_plan(self) -> StepPlan | None:
        """3. vLLM builds this forward's attention metadata: the lanes' plan to attach, once."""
        step = self.step
        if step is None or step.plan is None or step.plan_attached or not step.plan.has_region_work:
            return None
        step.plan_attached = True
        return step.plan

    def branch_plan(self) -> BranchPlan | None:
        """3. Also: the draft tree's branches to attach, once."""
        step = self.step
        if step is None or step.branches is None or step.branches_attached:
            return None
        step.branches_attached = True
        return step.branches

    def tail_inputs(self) -> tuple[np.ndarray, np.ndarray] | None:
        """4. vLLM wrote the real tokens' ids and positions: the tail's, once."""
        step = self.step
        if step is None or step.tail_written or not step.tail_tokens:
            return None
        step.tail_written = True
        parts = [part for part in (step.plan, step.branches) if part is not None]
        ids = np.concatenate([p.tail_ids if p is step.plan else p.ids for p in parts])
        positions = np.concatenate([p.tail_positions if p is step.plan else p.positions for p in parts])
        return ids, positions

    def branch_hidden_states(self, hidden_states: torch.Tensor) -> torch.Tensor | None:
        """4b. The forward ran: its hidden states at this step's branch tokens, while the
        target's choices there are not taken yet (None: no branches, taken, or the
        hidden states of another forward than the one planned, such as a dummy run)."""
        step = self.step
        if step is None or step.branches is None or step.branch_argmax is not None:
            return None
        if len(hidden_states) != step.num_scheduled_tokens + step.tail_tokens:
            return None
        plan = step.branches
        return hidden_states[plan.first_token : plan.first_token + plan.num_tokens]

    def take_branch_logits(self, logits: torch.Tensor, sampling_params_of: Callable[[str], Any]) -> None:
        """4b. The target's logits at the branch tokens (vLLM computes them with the
        real tokens', one pass over the output embedding): its choice after each branch
        token (greedy requests), or its distribution there (sampled ones)."""
        step = self.step
        assert step is not None and step.branches is not None
        step.branch_argmax = logits.argmax(dim=-1).cpu().numpy()
        for request in step.branches.requests:
            params = sampling_params_of(request.req_id)
            if is_sampled(params):
                first = request.start - step.branches.first_token
                step.branch_probs[request.req_id] = sampling_probs(logits[first : first + request.num_tokens], params)

    def accept_branches(self, sampled_token_ids: torch.Tensor, generators: dict[int, torch.Generator]) -> None:
        """4c. vLLM sampled the spines: where a branch got further, its tokens replace the
        row (in place) and its keys and values replace the rejected spine tokens' in the
        paged cache, so vLLM sees nothing but more accepted drafts. ``generators``: the
        seeded requests' own, by batch row."""
        step = self.step
        if step is None or step.branches is None or step.branch_argmax is None:
            return
        plan = step.branches
        rows = sampled_token_ids.cpu().numpy()
        for request in plan.requests:
            first = request.start - plan.first_token
            probs = step.branch_probs.get(request.req_id)
            row = rows[request.batch_row]
            if probs is None:
                argmax = step.branch_argmax[first : first + request.num_tokens]
                matches = greedy_matches(row, request, argmax)
                win = accept_greedy(row, request, matches, argmax)
            else:
                win = accept_sampled(row, request, probs, generators.get(request.batch_row))
                matches = np.zeros(len(request.branches), dtype=np.int64)
                if win is not None:
                    matches[win[0]] = win[1]
            stopped = stop_node(row)
            step.branch_trials.extend((branch.rank, len(branch.tokens), int(count))
                                      for branch, count in zip(request.branches, matches) if branch.node == stopped)
            if win is None:
                continue
            index, matches, tokens = win
            branch = request.branches[index]
            new_row = np.full(rows.shape[1], PLACEHOLDER, dtype=rows.dtype)
            new_row[: len(tokens)] = tokens
            sampled_token_ids[request.batch_row] = torch.from_numpy(new_row).to(sampled_token_ids.device)
            source = first + request.offsets()[index] + torch.arange(matches)
            positions = request.x_position + branch.node + 1 + torch.arange(matches)
            for reader, key, value in plan.kv_stash:
                src = source.to(key.device)
                reader.write(request.batch_row, positions.to(key.device), key[src], value[src])
            if self.lanes is not None:
                self.lanes.spine_accepted(request.req_id, branch.node)
            step.branch_wins[request.req_id] = (branch.node, matches)
            self.metrics.branch_wins += 1
            self.metrics.branch_accepted_tokens += matches

    def finish_forward(self, req_ids: Sequence[str], hidden_states: torch.Tensor | None,
                       tree_eligible: Iterable[str] = ()) -> None:
        """5. Before drafting: the batch's row order and which requests may get branches;
        lanes advance and file their n-grams."""
        step = self.step
        if step is None:
            raise RuntimeError(
                "FafoProposer.finish_forward without begin_step: the vllm_fafo runner "
                "patches are not applied in this process"
            )
        step.req_ids = req_ids
        if tree_eligible:  # else the step's empty default (a frozenset made every step cost 1-3 us cold)
            step.tree_eligible = frozenset(tree_eligible)
        if step.plan is None or not step.plan.tails:
            return
        assert self.lanes is not None and hidden_states is not None
        targets, filed = [], []
        for req_id, ngrams in self.lanes.consume_tail(step.plan, hidden_states, self._model.compute_logits):
            targets += [self._requests[req_id].pool] * len(ngrams)
            filed += ngrams
        arena = self.index.arena.state
        file_each_in(targets, filed, Origin.LANE)
        if self.index.arena.state is not arena:  # the pools' arena grew
            self._held = None

    def remove_requests(self, req_ids: Iterable[str]) -> None:
        """Free the state of finished or aborted requests."""
        req_ids = list(req_ids)
        self._batch_ids = None  # a request id may come back in a new request
        freed = []
        for req_id in req_ids:
            self._tenants.pop(req_id, None)
            state = self._requests.pop(req_id, None)
            if state is None:  # it never decoded
                self.index.stop(req_id, None)
                continue
            slot = state.slot
            self.index.stop(req_id, state.pool, int(self._table.prompt_len[slot]), int(self._table.next_anchor[slot]))
            self._table.remove(req_id)
            freed.append(slot)
            self.metrics.requests_freed += 1
        self.judge.forget(freed)  # before the slots are given to new requests
        if self.lanes is not None:
            self.lanes.remove_requests(req_ids)

    @property
    def num_tracked_requests(self) -> int:
        return len(self._requests)

    def metrics_snapshot(self) -> dict[str, Any]:
        """The counters, with gauges of what the proposer holds and the controller's
        latest choices (vllm_fafo.serving.metrics.collect_metrics documents the keys)."""
        return {
            **self.metrics.as_dict(),
            "requests_tracked": len(self._requests),
            "requests_with_region": 0 if self.lanes is None else self.lanes.num_regions_in_use,
            "shared_pool_tenants": 0 if self.shared is None else self.shared.num_tenants,
            "shared_pool_keys": 0 if self.shared is None else self.shared.num_keys(),
            "kept_answers": 0 if self.texts is None else self.texts.num_kept_answers(),
            "index_bytes": self.index.nbytes(),
            "controller": self.controller.summary(),
        }

    @property
    def shared(self) -> TenantPools | None:
        """The tenants' pools (None: sharing off, a pool per request)."""
        return self.index.shared

    @property
    def texts(self) -> TenantTexts | None:
        """The texts deep matches are drafted from (None: the modes)."""
        return self.index.texts

    def forget_shared_pool(self) -> None:
        """Empty every tenant's pool (and the answers kept for deep matches), so a benchmark's runs
        do not learn each other's answers."""
        self.index.forget_shared()
        self._held = None

    # vLLM's custom proposer contract ----------------------------------------------
    def load_model(self, model, *args, **kwargs) -> None:
        """Nothing to load (FAFO is draftless); lanes read the target's logits."""
        self._model = model

    def propose(
        self,
        sampled_token_ids: list[list[int]],
        num_tokens_no_spec: np.ndarray,
        token_ids_cpu: np.ndarray,
        slot_mappings=None,
    ) -> list[list[int]]:
        """6. File the new n-grams of every request and draft, learn from the step, cut the
        drafts to what pays; the step ends."""
        step, self.step = self.step, None
        req_ids = step.req_ids if step is not None else None
        if req_ids is None or len(req_ids) < len(sampled_token_ids):
            raise RuntimeError(
                "FafoProposer.propose was called without the batch's request ids; "
                "the vllm_fafo runner patches are not applied in this process"
            )
        self.metrics.propose_calls += 1
        table, spec_tokens, wins = self._table, step.scheduled_spec_tokens, step.branch_wins
        taken = list(map(len, sampled_token_ids))
        whole = 0 not in taken  # every row decodes (the usual step): rows are 0..count-1
        if whole:
            rows = None
            decoding_ids = req_ids[: len(taken)]
        else:  # prefill chunks sample nothing
            rows = [row for row, num_sampled in enumerate(taken) if num_sampled]
            decoding_ids = [req_ids[row] for row in rows]
            taken = [taken[row] for row in rows]
        count = len(taken)
        if whole and decoding_ids == self._batch_ids:  # last step's requests, in its order: slots and rows kept
            numbers = self._batch
        else:
            slot_of = table.slot_of
            slots = [slot_of.get(req_id, -1) for req_id in decoding_ids]
            if -1 in slots:  # requests decoding for the first time
                slots = [slot if slot >= 0 else self._start_request(req_id, i if whole else rows[i], num_tokens_no_spec,
                                                                    sampled_token_ids, token_ids_cpu).slot
                         for i, (slot, req_id) in enumerate(zip(slots, decoding_ids))]
            numbers = self._batch = self._batch_numbers(count)
            numbers[0] = slots
            numbers[1] = self._row_numbers[:count] if whole else rows
            self._batch_ids = decoding_ids if whole else None
        # What vLLM accepted: len(sampled) - 1 of the drafts, or the spine's tokens before a
        # won branch (taken 0; RequestTable.settle); the kernel writes the last two rows.
        numbers[2] = taken
        if wins:
            for i, req_id in enumerate(decoding_ids):
                if req_id in wins:
                    numbers[2, i], numbers[3, i] = 0, wins[req_id][0]
        # the step's tokens in the forward (lanes and branches in its tail) and the next step's
        # before its drafts; its seconds, to now (the rank-zero worker's under tensor parallelism)
        lane_tokens, tree_tokens = step.lane_tokens, step.tree_tokens
        tokens = step.num_scheduled_tokens + lane_tokens + tree_tokens
        step_tokens = tokens - sum(map(len, spec_tokens.values()))
        seconds = self.clock() - step.started
        if self._step_time is not None:
            seconds = self._step_time.share(seconds)
        uniform_draft_len = _uniform_draft_len(step, count) if self.config.pad_drafts else -1
        mode, longest, shortest = self._run_step_kernel(numbers, num_tokens_no_spec, token_ids_cpu, step.branch_trials,
                                                        tokens, seconds, lane_tokens, tree_tokens, step_tokens,
                                                        uniform_draft_len)
        found = self.index.drafts(count)
        now = time.monotonic()
        if now >= self._next_report:
            self._publish_and_log(now)
        lengths = found.lengths
        if mode == LENGTHS_TIER:  # every request the goodput controller's tier: a uniform decode batch
            self.metrics.record_padded_step(self.controller.last.draft_len, count)
        elif mode == LENGTHS_PADDED:  # the fixed controller's: padded whole
            self.metrics.record_padded_step(self.num_speculative_tokens, count)
        # cut, or padded (pad_drafts); the buffer's columns past the longest are never read
        found_drafts = found.tokens[:, :longest].tolist()
        if shortest < longest:  # not all as long (padded drafts are): each list cut in place
            for tokens, length in zip(found_drafts, lengths.tolist()):
                del tokens[length:]
        drafts: list[list[int]] = found_drafts
        if not whole:
            drafts = [[] for _ in sampled_token_ids]
            for row, draft in zip(rows, found_drafts):
                drafts[row] = draft
        if self.tree_enabled:
            decoding, num_tokens = numbers[1], numbers[4]
            states = [self._requests[req_id] for req_id in decoding_ids]
            for i, (row, state) in enumerate(zip(decoding.tolist(), states)):
                if req_ids[row] in step.tree_eligible:
                    state.branches = grow_branches(
                        state.pool, key_context(token_ids_cpu[row], int(num_tokens[i]), self.config.max_key_len),
                        drafts[row], self.config.num_candidates - 1, self.config.tree_tokens - len(drafts[row]),
                    )
            if mode == LENGTHS_CHOSEN:
                self.controller.note_spine_keys(found.key_lens)
            self._size_branches(step_tokens + int(lengths.sum()), states, lengths)
        return drafts

    def _run_step_kernel(self, numbers: np.ndarray, num_tokens_no_spec: np.ndarray, token_ids: np.ndarray,
                         branch_trials: list[tuple[int, int, int]] | None, tokens: int, seconds: float, lane_tokens: int,
                         tree_tokens: int, step_tokens: int, uniform_draft_len: int = -1) -> tuple[int, int, int]:
        """:func:`~vllm_fafo.propose_kernel.propose_step` for the decoding requests of
        ``numbers`` (its ``batch``), with the arguments of the request table, the draft
        index, the judge and the controller (which learns the step's ``branch_trials``, and
        that its ``tokens``, ``lane_tokens`` and ``tree_tokens`` of them in its tail, took
        ``seconds``; the next step has ``step_tokens`` before its drafts; a uniform step's
        ``uniform_draft_len``, else -1), growing what it
        finds short; returns what it did with the drafts' lengths (the mode), and the longest
        and the shortest draft's length. ``numbers`` is :meth:`_batch_numbers`' view: the
        kernel is handed the buffer under it whole, with the batch's count."""
        count = numbers.shape[1]
        trials = np.array(branch_trials, dtype=np.int64).reshape(-1, 3).T.copy() if branch_trials else _NO_TRIALS
        for _ in range(5):  # each shortage is made good once
            held = self._held if self._held is not None else self._hold_step_arrays()
            args = (self._numbers, num_tokens_no_spec, token_ids, held, trials, count, len(self.judge),
                    self._choose_lengths, float(tokens), float(seconds), lane_tokens, tree_tokens, step_tokens,
                    uniform_draft_len)
            call = self._step_call  # past numba's dispatcher where the arrays stand (without a frame of its own)
            status, num_keys, queued, mode, longest, shortest, lane_answer = \
                call.entry(*args) if all(map(operator.is_, args, call.arrays)) else call(*args)
            if status == propose_kernel.ROOM_OK:
                break
            self._held = None  # what lacked room grows
            if status == propose_kernel.ROOM_JUDGE:
                self.judge.make_room(count, int(numbers[0].max(initial=0)))
            else:  # the kernel wrote the text lengths (numbers[4]) before it found the index short
                self.index.make_room(status, num_keys, self._table.owners[numbers[0]], numbers[4],
                                     self.num_speculative_tokens, self.max_model_len)
        else:
            raise RuntimeError(f"FafoProposer: the step's kernel still lacks room ({status}) after growing")
        self.judge.finish_step(queued)
        self.controller.kernel_answer = lane_answer
        return mode, longest, shortest

    def step_parts(self) -> tuple:
        """The owners' arrays for the step's kernel (:mod:`vllm_fafo.step_arrays`): gathered anew from each owner."""
        return (*self._table.kernel_arguments(self.metrics), *self.index.kernel_arguments(self.max_model_len),
                self.judge.kernel_arguments(), *self.controller.kernel_arguments())

    def _hold_step_arrays(self) -> StepArrays:
        """The step kernel's :class:`StepArrays`, held until an owner may have grown (a request
        started, the kernel found room short, the lanes filed): gathering and comparing the
        owners' arrays every step cost more than the kernel's work at batch 1 in an engine
        (docs/results/host-time.md). The last step's object where nothing it holds changed."""
        parts = self.step_parts()
        if same_or_new(self._held_parts, parts) is not self._held_parts:
            self._held_parts, self._held_object = parts, StepArrays(*parts)
        self._held = self._held_object
        return self._held

    def _batch_numbers(self, count: int) -> np.ndarray:
        """The step's batch (:func:`~vllm_fafo.propose_kernel.propose_step`'s ``batch``): the
        first ``count`` columns of a (6, capacity) int64 buffer that the kernel is handed whole,
        the same object step to step (grown only where ``count`` passes its capacity)."""
        if count > self._numbers.shape[1]:
            self._numbers = np.zeros((6, 2 * count), dtype=np.int64)
            self._row_numbers = np.arange(2 * count, dtype=np.int64)
        return self._numbers[:, :count]

    def _load_step_kernel(self) -> None:
        """Run the step's kernel once on an empty batch of the step's types (vLLM's token rows
        are int32), so that numba loads it (on a new machine: compiles it) while the engine
        starts, not in its first request's step."""
        self._run_step_kernel(self._batch_numbers(0), np.zeros(1, dtype=np.int32), np.zeros((1, 1), dtype=np.int32), [],
                              0, 0.0, 0, 0, 0)

    def _size_branches(self, step_tokens: int, states: list[RequestState], spine_lens: np.ndarray) -> None:
        """Cut the branches just grown to what the controller says pays next step
        (``step_tokens``: its tokens with the spines; ``states``: the decoding requests,
        with their spine lengths)."""
        owners, nodes, ranks, branch_lens = [], [], [], []
        for owner, state in enumerate(states):
            for branch in state.branches:
                owners.append(owner)
                nodes.append(branch.node)
                ranks.append(branch.rank)
                branch_lens.append(len(branch.tokens))
        if not owners:
            return
        kept = iter(self.controller.choose_branches(
            step_tokens, spine_lens,
            BranchSet(*(np.array(values, dtype=np.int64) for values in (owners, nodes, ranks, branch_lens))),
        ).tolist())
        for state in states:
            grown, state.branches = state.branches, []
            for branch in grown:
                keep = next(kept)
                if keep:
                    state.branches.append(Branch(branch.node, branch.tokens[:keep], branch.rank))

    def _plan_branches(self, batch: BatchView, start: int) -> BranchPlan | None:
        """Lay out the branches grown last step behind the tail, for the requests whose
        spine vLLM scheduled (a branch is cut where vLLM cut the spine), as many as the
        forward's token capacity holds."""
        requests, ids, positions = [], [], []
        room = batch.capacity - start
        for row, req_id in enumerate(batch.req_ids):
            state = self._requests.get(req_id)
            if state is None or not state.branches:
                continue
            branches, state.branches = state.branches, []
            depth = batch.num_drafts[row]
            kept, size = [], 0
            for branch in branches:
                if branch.node + len(branch.tokens) <= depth and size + len(branch.tokens) <= room:
                    kept.append(branch)
                    size += len(branch.tokens)
            if not kept:
                continue
            request = layout_request(req_id, row, int(batch.query_start_loc[row]),
                                     int(batch.num_computed_tokens[row]), start, kept)
            requests.append(request)
            ids.extend(token for branch in kept for token in branch.tokens)
            positions.append(branch_positions(request))
            start += size
            room -= size
        if not requests:
            return None
        self.metrics.tree_tokens += len(ids)
        return BranchPlan(np.array(ids, dtype=np.int64), np.concatenate(positions), tuple(requests))

    def _publish_and_log(self, now: float) -> None:
        """Publish the metrics to the API server and log the controller's state, when due
        (:attr:`_next_report`: the earliest either is due next)."""
        if self.publisher is not None and self.publisher.is_due(now):
            self.publisher.publish(self.metrics_snapshot, now)
        if now - self._last_log >= LOG_INTERVAL_S:
            self._last_log = now
            summary = self.controller.summary()
            logger.info(
                "vllm-fafo %s controller: lanes per request %d (of %d), draft length up to %d (of %d), "
                "mean %.2f%s%s%s",
                summary["controller"], summary["lanes"], self.config.num_lanes, summary["draft_len"],
                self.num_speculative_tokens, summary.get("mean_draft_len", summary["draft_len"]),
                "" if "sampled_draft_steps" not in summary else
                f", drafts found for a sample of the batch in {summary['sampled_draft_steps']} steps",
                "" if not self.tree_enabled or "tree_tokens" not in summary else
                f", branch tokens {summary['tree_tokens']} in the batch",
                "" if "lane_yield" not in summary else
                f", lane yield {summary['lane_yield']:.4f} accepted per lane token, "
                f"{summary['tokens_per_request']:.2f} tokens per request-step without lanes",
            )
        self._next_report = self._last_log + LOG_INTERVAL_S
        if self.publisher is not None:
            self._next_report = min(self._next_report, self.publisher.next_due())

    # Internals -----------------------------------------------------------------------
    def _start_request(self, req_id: str, row: int, num_tokens_no_spec: np.ndarray,
                       sampled_token_ids: list[list[int]], token_ids_cpu: np.ndarray) -> RequestState:
        """The state of a request decoding for the first time (row ``row``): its prompt is
        its text up to the tokens sampled this step."""
        prompt_len = int(num_tokens_no_spec[row]) - len(sampled_token_ids[row])
        history = token_ids_cpu[row]
        if self.lanes is not None:
            self.lanes.start_lanes(req_id, history[:prompt_len].tolist())
        try:
            tenant = self._tenants.pop(req_id)
        except KeyError:
            raise RuntimeError(
                f"FafoProposer: request {req_id!r} decodes without having been announced "
                "by begin_step (the runner patches are not applied in this process)"
            ) from None
        target = self.index.start(req_id, tenant, history[:prompt_len])
        slot = self._table.add(req_id, self.index.owners(req_id, target), prompt_len,
                               first_anchor(self.config, prompt_len))
        state = self._requests[req_id] = RequestState(target, slot)
        self.metrics.requests_started += 1
        self._held = None  # the table and the index may have grown
        return state
