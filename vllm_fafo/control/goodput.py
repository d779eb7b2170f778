"""Goodput controller: spend lane and draft tokens only where they pay, on this machine.

A step's tokens (real + drafts + lanes) cost what this machine charges for
them: on a GPU about nothing up to a knee, on a CPU every token. Lane tokens
earn later (their n-grams are accepted in later steps), draft tokens earn if
accepted. Each step the controller picks, for the whole batch, the lanes per
request, the draft length and the draft tree's branch tokens that maximise
expected accepted tokens per second (SmartSpec / TurboSpec's goodput
objective), down to no lanes, no branches and no drafts when nothing pays.
Everything is learned from the engine's own steps:

- :class:`StepCostModel`: seconds per step against tokens in the forward,
  one decayed mean per point of a geometric grid of token counts, read as a
  monotone piecewise-linear curve (no hardware table).
- :class:`YieldEstimates`: decayed continuation rates per draft position and
  matched key length, and per branch position and rank among sibling branches;
  accepted tokens per decoding request from text n-grams, and accepted
  lane-n-gram tokens per lane token run.
- Two more :class:`StepCostModel`: one for steps with lanes, one for steps with
  draft-tree branches, whose attention (the plugin's own) costs more than their
  token count says; they never teach the curve plain steps are priced by.

Draft lengths are chosen per request from the candidate's support (suffix
decoding's rule, learned): every draft token has an estimated probability of
being accepted, from its position and the length of the key its draft was
found under; the controller keeps the most likely tokens of the whole batch,
as many as maximise expected accepted tokens per second. A draft found under
a long key runs long, one found under a single token is cut early, and where
tokens are free on this machine every request drafts up to
``num_speculative_tokens``. Tokens past twice the matched context count for a
quarter of their estimate (:data:`DRAFT_PER_MATCHED_TOKEN`), so where tokens
cost a draft grows with its match, as suffix decoding's drafts do.

Exploration: the cost model extrapolates flat past the largest token count it
has seen (so untried sizes look cheap and get tried once). Draft yields need
no probing: every found draft is judged against the text, drafted or not
(vllm_fafo.control.draft_judge). With lanes off the controller probes them (the most
lanes it prices at no more than twice the plain step, for ``probe_burst``
steps) after ``probe_interval`` steps, doubling the interval after each probe
that did not pay (bounded by ``max_probe_interval``), so a change in cost or
lane yield is followed within a bounded number of steps at a cost amortised
to a few percent. A lane probe
runs only where its lanes could pay at the lane yield last measured (before
any lane ran: :data:`LANE_YIELD_UNSEEN`), or once lanes were off for ``max_probe_interval``
steps: on a machine where lane tokens cost more than they ever earned, the
probes' own cost stops there.

``"controller": "fixed"`` (:class:`FixedController`) keeps the configured
sizes: the lanes the free token slots allow and ``num_speculative_tokens``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

from vllm_fafo.control import kernels
from vllm_fafo.control.kernels import (
    C_DRAFT_LEN,
    C_DRAFT_REQUESTS,
    C_DRAFT_TOTAL,
    C_DRAFTS_CUT,
    C_LANE_LEN,
    C_LANES,
    C_MAX_DRAFT,
    C_PROBE_ANYWAY,
    C_SAMPLED_STEPS,
    CONTROL_SIZE,
    MIN_DRAFT_ROOM,
)

CONTROLLERS = ("goodput", "fixed")

BRANCH_RANKS = 8
"""Branch ranks (place among the branches off one node) with their own yields; higher
ranks share the last row."""

EXACT_EVIDENCE = 5
"""Matched context lengths up to this many tokens (the pool's keys, the shortest deep
match) have a row of draft yields each; longer ones share rows whose ends grow by
half (6-7, 8-11, 12-16, 17-25, ...): a batch-1 engine sees a few hundred drafts a
minute, too few to learn 24 rows of 16 positions apiece."""


def evidence_rows(max_key_len: int) -> np.ndarray:
    """Row of draft yields for each matched context length 0..``max_key_len``."""
    lengths = np.arange(max_key_len + 1)
    beyond = np.ceil(np.log(np.maximum(lengths, EXACT_EVIDENCE) / EXACT_EVIDENCE) / math.log(1.5) - 1e-9)
    return np.where(lengths <= EXACT_EVIDENCE, lengths, EXACT_EVIDENCE + beyond).astype(np.int64)


DRAFT_PER_MATCHED_TOKEN = 2
"""Draft tokens per token of matched context at full worth; the tokens past them count
for :data:`TAIL_WORTH` of their estimated reach (suffix decoding's ``max_spec_factor``,
which vLLM ``suffix`` sets to 1, as a discount instead of a cut).

The estimate prices a token by what it yields in this step. A draft's tail found
under a short match is paid for by every draft that breaks early; where its first
tokens are accepted instead, the next step finds the continuation under a match
that much deeper, where the evidence for the rest is stronger. Replayed over
plain vLLM's outputs (docs/results/goodput-controller.md, "Drafts grow with their match"), 2 with a quarter
of the worth came within 0.3 % of the better of no discount and a hard cut at 2
in every cell at CPU-like token prices (up to 4.7 % above no discount), and lost
nothing where tokens are nearly free, where the hard cut lost up to 2.2 % (a
discounted token that costs nothing still pays)."""
TAIL_WORTH = 0.25
"""Share of its estimated reach a token past ``DRAFT_PER_MATCHED_TOKEN`` x the
matched context is worth to :meth:`GoodputController.choose_draft_lens`."""


DRAFT_TIERS = (0, 4, 8, 16)
"""Draft lengths a padded step may take under the goodput controller (``pad_drafts``),
``num_speculative_tokens`` added where it is not one of them: each is a uniform decode
batch, so on CUDA each is one set of whole graphs (vllm_fafo.patches.cudagraph_dispatcher),
and 0 is plain vLLM's step. A padded step of 16 drafts cost about what one of 4 did at
batch 1 on the H200 (docs/results/gpu.md "Padded draft length"), so a tier between them
pays only where the batch makes tokens dear; each tier costs one more capture per batch
size."""


def draft_tiers(max_draft: int) -> np.ndarray:
    """The padded steps' draft lengths (:data:`DRAFT_TIERS` up to ``max_draft``, and ``max_draft``), ascending."""
    return np.unique(np.array([tier for tier in DRAFT_TIERS if tier <= max_draft] + [max_draft], dtype=np.int64))


LANE_YIELD_UNSEEN = 0.05
"""Accepted lane-n-gram tokens per lane token a probe is judged by before any lane ran:
six to seven times what lanes earned with lanes pinned on (SmolLM2 on the CPU, MT-Bench
and HumanEval: 0.007-0.008 on top of the uncut drafts; docs/results/goodput-controller.md, "Lane probes before any
lane ran"). Where lane tokens cost next to nothing (a GPU below its knee) lanes could
pay at that yield and are probed when first due; where every lane token costs a share
of the step (the 2-core CPU: about 1.1 ms per lane token against 53 ms for a
1-request step yielding 3.7 tokens, a break-even yield of 0.075) they could not, once
the cost curve has priced a large forward (the first prefill), and the first probe
waits until the curve has forgotten the sizes it priced, as later probes do. (With
1.0, the first probe always ran: on that CPU its 4 steps took 0.85 s of a 12.3-second
HumanEval batch-8 run.)"""


_GRID = np.unique(np.round(np.geomspace(1, 1 << 17, 69)).astype(np.int64))
"""Token counts the cost model keeps a mean for: 1 .. 131072, about 4 per doubling."""
_LOG_GRID = np.log(_GRID)


def isotonic_fit(values: np.ndarray, weights: np.ndarray) -> np.ndarray:
    """The non-decreasing sequence nearest ``values`` in weighted least squares (pool
    adjacent violators, :func:`~vllm_fafo.control.kernels.fit_isotonic`). SciPy's
    ``isotonic_regression`` does the same but is not otherwise a dependency of vLLM or
    this plugin."""
    out = np.empty(len(values))
    kernels.fit_isotonic(np.ascontiguousarray(values, dtype=np.float64),
                         np.ascontiguousarray(weights, dtype=np.float64), out)
    return out


class StepCostModel:
    """Seconds per step as a monotone function of the tokens in the forward.

    Kept as arrays worked by kernels (:func:`~vllm_fafo.control.kernels.observe_cost`):
    each step's observation refits the curve once, and the controller's questions read
    it without Python arithmetic."""

    weight = 0.2
    """Weight of a new sample in its grid point's decayed mean."""
    stale_after = 64
    """Steps after which a point's mean is replaced by its next sample, not averaged
    with it: sizes that are tried rarely (probes) must not keep an old machine's cost."""
    forget_after = 512
    """Steps after which a point no longer counts at all: the curve is read from
    what the machine did lately, and an old expensive size gets tried again."""

    def __init__(self, storage: tuple[np.ndarray, ...] | None = None) -> None:
        """``storage``: the model's four arrays (:func:`stacked_cost_models`' views), else its own."""
        steps, updated_at, points, fitted = storage or _cost_model_arrays(1)
        self._steps = steps.reshape(2)
        """The steps observed, then the points on the curve (written by the kernels)."""
        self._updated_at = updated_at.reshape(len(_GRID))
        self._points = points.reshape(3, len(_GRID))
        """Each grid point's decayed mean tokens and seconds, and the samples behind it (up to
        the ``1 / weight`` its decay keeps; 0: never seen)."""
        self.fitted = fitted.reshape(4, len(_GRID))
        """The curve: recent points' tokens, fitted seconds (then the kernel's scratch)."""
        self._arrays = (_LOG_GRID, self._points, self._updated_at, self._steps, self.weight, self.stale_after,
                        self.forget_after, self.fitted)

    def observe(self, tokens: int, seconds: float) -> None:
        if tokens < 1:
            return  # a step without tokens prices nothing
        kernels.observe_cost(_LOG_GRID, self._points, self._updated_at, self._steps, float(tokens), float(seconds),
                             self.weight, self.stale_after, self.forget_after, self.fitted)

    def kernel_arrays(self) -> tuple:
        """:meth:`observe`'s arrays and settings as :func:`~vllm_fafo.propose_kernel.propose_step`
        takes them (the step's tokens and seconds beside them): the same tuple for the model's life."""
        return self._arrays

    @property
    def num_points(self) -> int:
        """Points on the curve."""
        return int(self._steps[1])

    @property
    def has_data(self) -> bool:
        return int(self._steps[1]) > 0

    def curve(self) -> tuple[np.ndarray, np.ndarray]:
        """The recent (tokens, seconds) points, seconds made non-decreasing by a least-squares
        fit weighted by each point's samples (views, valid until the next :meth:`observe`).
        (A running maximum let one slow sample at a size seldom run set the price of every
        larger size: on the 2-core CPU the 8-token point's latest sample, 58.8 ms, priced
        every step of 8-17 tokens, whose 11- and 17-token steps had medians of 45.7 and
        53.8 ms.)"""
        return self.fitted[0, : self.num_points], self.fitted[1, : self.num_points]

    def predict(self, tokens: np.ndarray | int) -> np.ndarray:
        """Seconds of a step with ``tokens`` tokens, interpolated between the sizes seen.

        Outside them it is optimistic, so the controller goes and looks: flat
        above the largest size seen, proportional to the tokens below the smallest."""
        tokens = np.asarray(tokens, dtype=np.float64)
        out = np.empty(tokens.shape)
        kernels.prices(self.fitted, self.num_points, tokens.reshape(-1), out.reshape(-1), False)
        return out


def _cost_model_arrays(count: int) -> tuple[np.ndarray, ...]:
    """``count`` cost models' arrays, stacked (model first): steps, update stamps, points, curves."""
    return (np.zeros((count, 2), dtype=np.int64), np.zeros((count, len(_GRID)), dtype=np.int64),
            np.zeros((count, 3, len(_GRID))), np.zeros((count, 4, len(_GRID))))


def stacked_cost_models(count: int) -> tuple[tuple[np.ndarray, ...], list[StepCostModel]]:
    """``count`` cost models whose arrays are rows of four stacked arrays (steps, update stamps,
    points, curves), returned with them: a kernel prices any of them by number
    (:func:`~vllm_fafo.control.kernels.choose_tier`)."""
    arrays = _cost_model_arrays(count)
    return arrays, [StepCostModel(tuple(array[i] for array in arrays)) for i in range(count)]


_NONE = np.zeros(0, dtype=np.int64)
"""No entries (empty: nothing in it can change)."""


class StepOutcome(NamedTuple):
    """What one step cost and earned, as the proposer saw it (a tuple: built every step,
    where a frozen dataclass's fields cost a call each)."""

    tokens: int  # in the forward: real + drafts + lanes + branches
    seconds: float  # from the start of the step to the end of proposing
    lane_tokens: int
    lane_accepted: int  # accepted tokens whose candidate a lane filed
    text_accepted: int  # accepted tokens from the prompt's and output's n-grams
    decoding_requests: int  # requests that decoded a token this step
    # the drafts judged this step (vllm_fafo.control.draft_judge: found drafts, whole, against the text):
    draft_lengths: np.ndarray  # their tokens
    accepted_lengths: np.ndarray  # their tokens the text matched from the first on
    key_lens: np.ndarray  # length of the key each was found under (0: none)
    tree_tokens: int = 0  # draft-tree branch tokens in the forward
    uniform_draft_len: int = -1  # every request decoded with this many drafts, nothing else ran (-1: not so,
    # or the proposer does not pad drafts to tiers: then no tier's cost is ever asked)
    # draft-tree branches off the node where their spine stopped, one entry each:
    branch_ranks: np.ndarray = _NONE  # place among siblings
    branch_lengths: np.ndarray = _NONE  # tokens
    branch_matches: np.ndarray = _NONE  # tokens accepted


def _total(index: int, doc: str | None = None) -> property:
    """Entry ``index`` of :attr:`YieldEstimates.totals`, as an attribute."""
    return property(lambda self: float(self.totals[index]), lambda self, value: self.totals.__setitem__(index, value),
                    doc=doc)


@dataclass
class YieldEstimates:
    """What drafts and lanes earned, decayed per step (a window of ~1/(1-decay) steps),
    the draft yields per judged draft (a window of ~1/(1-draft_decay) drafts, so a
    batch-1 engine keeps as much evidence as a batch-32 one).

    Drafts are estimated as chains: per matched key length (:func:`evidence_rows`) and position k, how
    often a draft that reached position k (found that long, the positions
    before it matched) had it matched, every found draft judged whole against
    the text (vllm_fafo.control.draft_judge), however much of it was verified. A position not tried lately is judged
    like the position before it, so drafts that run true are tried further and
    drafts that break early are not. (Estimating P(reach k | drafted k)
    directly, as before, trapped the controller: a position that did badly
    once kept its low rate however long it went untried, since decaying trials
    and hits alike keeps their ratio, and was never drafted again.)"""

    max_draft: int
    max_key_len: int
    decay: float = 0.98
    draft_decay: float = 0.999
    """Per judged draft, for the draft yields (a batch of n drafts decays them by
    draft_decay ** n). 0.9995 (2,000 drafts) once kept drafts off for good after one
    bad stretch in a replay; 0.98 per step was 50 drafts at batch 1 (docs/results/goodput-controller.md, "Draft
    yields kept per verified draft")."""
    totals: np.ndarray = field(init=False)
    """The steps' lane tokens, lane tokens accepted, decoding requests and text drafts'
    tokens accepted, decayed per step, then :attr:`lane_prior_tokens` and
    :attr:`lane_yield_unseen` (:data:`~vllm_fafo.control.kernels.TOTAL_LANE_TOKENS` ...): one
    array, which the step's kernel counts into and asks the lane choice from."""
    row_of_key_len: np.ndarray = field(init=False)
    """Row of :attr:`position_trials` for each matched key length 0..max_key_len."""
    position_trials: np.ndarray = field(init=False)
    """Decayed drafts that reached each position, by matched key length's row."""
    position_hits: np.ndarray = field(init=False)
    """Decayed drafts whose token at each position was accepted, by matched key length's row."""
    branch_prior: float = 0.5
    """A branch's first token's rate before any branch ran (one pseudo-trial): optimistic,
    so branches are tried; the evidence soon outweighs it."""
    branch_trials: np.ndarray = field(init=False)
    """Decayed branches off the node where their spine stopped that reached each of
    their positions, by rank among their siblings."""
    branch_hits: np.ndarray = field(init=False)
    _reach_overall: np.ndarray = field(init=False, repr=False)
    """Reach probabilities over all drafts, then per key length's row, and per branch rank:
    written by the kernels when stale (after :meth:`observe`), handed out read-only."""
    _reach_by_row: np.ndarray = field(init=False, repr=False)
    _branch_reach: np.ndarray = field(init=False, repr=False)
    _read_only_views: tuple[np.ndarray, np.ndarray, np.ndarray] = field(init=False, repr=False)
    _branch_rows: np.ndarray = field(init=False, repr=False)
    """Row of :attr:`branch_trials` by rank (higher ranks share the last)."""
    stale: np.ndarray = field(init=False, repr=False)
    """Whether the draft reach tables and the branch reach table are stale (1) since the
    counts last changed: written by the step's kernel too."""
    _learning: tuple = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.totals = np.array([0.0, 0.0, 0.0, 0.0, 96.0, LANE_YIELD_UNSEEN])
        self.row_of_key_len = evidence_rows(self.max_key_len)
        self._branch_rows = np.arange(BRANCH_RANKS, dtype=np.int64)
        shape = (int(self.row_of_key_len[-1]) + 1, self.max_draft)  # by matched key length's row, then position
        self.position_trials, self.position_hits = np.zeros(shape), np.zeros(shape)
        self.branch_trials = np.zeros((BRANCH_RANKS, self.max_draft))
        self.branch_hits = np.zeros((BRANCH_RANKS, self.max_draft))
        self._reach_overall, self._reach_by_row = np.zeros(self.max_draft), np.zeros(shape)
        self._branch_reach = np.zeros((BRANCH_RANKS, self.max_draft))
        self._read_only_views = tuple(_read_only(table.view()) for table in (
            self._reach_overall, self._reach_by_row, self._branch_reach))
        self.stale = np.ones(2, dtype=np.int64)
        self._learning = (True, self.position_trials, self.position_hits, self.draft_decay, self.row_of_key_len,
                          self.branch_trials, self.branch_hits, self.decay, self._branch_rows, self.totals, self.stale)

    lane_prior_tokens = _total(kernels.LANE_PRIOR_TOKENS,
                               "Pseudo lane tokens that earned nothing (16 lanes of 6 tokens, one step at batch 1).")
    lane_yield_unseen = _total(kernels.LANE_YIELD_UNSEEN, "What :meth:`lane_yield_seen` says before lanes ran lately.")
    lane_tokens = _total(kernels.TOTAL_LANE_TOKENS)
    lane_accepted = _total(kernels.TOTAL_LANE_ACCEPTED)
    decode_rows = _total(kernels.TOTAL_DECODE_ROWS)
    text_accepted = _total(kernels.TOTAL_TEXT_ACCEPTED)

    def observe(self, outcome: StepOutcome) -> None:
        self.observe_counts(outcome.lane_tokens, outcome.lane_accepted, outcome.text_accepted,
                            outcome.decoding_requests)
        drafted = kernels.as_int64(outcome.draft_lengths)
        kernels.observe_chains(self.position_trials, self.position_hits, self.draft_decay ** len(drafted),
                               self.row_of_key_len, kernels.as_int64(outcome.key_lens), drafted,
                               kernels.as_int64(outcome.accepted_lengths))
        kernels.observe_chains(self.branch_trials, self.branch_hits, self.decay, self._branch_rows,
                               kernels.as_int64(outcome.branch_ranks), kernels.as_int64(outcome.branch_lengths),
                               kernels.as_int64(outcome.branch_matches))

    def observe_counts(self, lane_tokens: int, lane_accepted: int, text_accepted: int,
                       decoding_requests: int) -> None:
        """A step's totals (:func:`~vllm_fafo.control.kernels.count_totals`); its drafts' and
        branches' chains are counted by :meth:`observe`; the step's kernel counts all of them
        (:meth:`learning_arguments`, then :meth:`counted`)."""
        kernels.observe_totals(self.totals, self.decay, lane_tokens, lane_accepted, decoding_requests, text_accepted)
        self.counted()

    def counted(self) -> None:
        """A step's totals were counted (the reach tables are stale until refreshed)."""
        self.stale[:] = 1

    def learning_arguments(self) -> tuple:
        """What :func:`~vllm_fafo.propose_kernel.propose_step` counts the step's judged drafts,
        branch trials and totals into, as :meth:`observe` does, and marks :attr:`stale`: the
        same tuple for the estimates' life."""
        return self._learning

    def lane_yield(self) -> float:
        """Accepted lane-n-gram tokens per lane token run, shrunk towards 0 by
        ``lane_prior_tokens`` pseudo-tokens that earned nothing (0 before any lane ran).

        Lanes mostly run in short probes: a ratio of a few dozen lane tokens is
        noise, and with lanes off it is kept (trials and hits decay alike), so one
        lucky probe would turn lanes on over and over where they do not pay."""
        return kernels.yield_figures(self.totals)[0]

    def lane_yield_seen(self) -> float:
        """Accepted lane-n-gram tokens per lane token run, as measured, without the
        prior (:attr:`lane_yield_unseen` before lanes ran lately). What a probe is
        judged by: whether lanes could pay at the yield they last showed."""
        return kernels.yield_figures(self.totals)[1]

    def tokens_per_request(self) -> float:
        """Tokens a decoding request yields per step without lanes: 1 + accepted text drafts."""
        return kernels.yield_figures(self.totals)[2]

    def reach_probability(self, key_lens: np.ndarray | None = None) -> np.ndarray:
        """P(positions 1..k all accepted), k = 1..max_draft, non-increasing: over all
        drafts, or (one row each) for drafts found under keys of ``key_lens`` tokens.

        The product of the positions' continuation rates. Each rate is smoothed
        towards the rate of the position before it, over all drafts with a
        quarter of a pseudo-trial (1 before the first position), per key length
        with one pseudo-trial (the rate over all drafts before the first), so a
        position seldom reached is judged like its neighbour until its own
        evidence outweighs that. Computed for every row once per step (the
        estimates change only in :meth:`observe`) and read per question; the
        overall row is the table itself, read-only, valid until the next
        :meth:`observe` (copy it to keep it)."""
        overall, by_row = self._read_only_views[0], self.reach_table()
        return overall if key_lens is None else by_row[self.rows_of(key_lens)]

    def reach_table(self) -> np.ndarray:
        """(key length rows, max_draft) reach probabilities (:meth:`reach_probability`),
        read-only; a request's row is :meth:`rows_of` its key length."""
        if self.stale[0]:
            kernels.draft_reach(self.position_trials, self.position_hits, self._reach_overall, self._reach_by_row)
            self.stale[0] = 0
        return self._read_only_views[1]

    def reach_arrays(self) -> tuple[np.ndarray, np.ndarray, bool]:
        """The reach tables, writable, and whether they are stale, for a kernel that brings
        them up to date (:func:`~vllm_fafo.control.kernels.choose_draft_lengths`): they are
        counted fresh from the call on."""
        stale = bool(self.stale[0])
        self.stale[0] = 0
        return self._reach_overall, self._reach_by_row, stale

    def reach_buffers(self) -> tuple[np.ndarray, np.ndarray]:
        """The reach tables, writable, for the step's kernel, which refreshes them when it
        chooses from them and marks them in :attr:`stale`."""
        return self._reach_overall, self._reach_by_row

    def rows_of(self, key_lens: np.ndarray) -> np.ndarray:
        """Rows of the draft yields for drafts found under ``key_lens``."""
        return self.row_of_key_len[np.minimum(np.asarray(key_lens, dtype=np.int64), self.max_key_len)]

    def branch_reach_probability(self) -> np.ndarray:
        """(BRANCH_RANKS, max_draft): P(a branch's tokens 1..i all accepted | its spine
        stopped at the branch's node), by the branch's rank among its siblings.

        Continuation rates as for drafts, the first position smoothed towards
        ``branch_prior`` and each later one towards the position before it (one
        pseudo-trial each). With branches off, the trials decay and the rates drift
        back to the prior, so branches are tried again now and then."""
        if self.stale[1]:
            kernels.reach(self.branch_trials, self.branch_hits, np.full(BRANCH_RANKS, self.branch_prior),
                          np.ones(BRANCH_RANKS), self._branch_reach)
            self.stale[1] = 0
        return self._read_only_views[2]


def _read_only(array: np.ndarray) -> np.ndarray:
    """``array``, frozen: a table kept for the step is handed out, not copied."""
    array.flags.writeable = False
    return array


@dataclass(frozen=True)
class BranchSet:
    """The draft-tree branches grown for the next step, one entry per branch."""

    owners: np.ndarray  # index of its request among the decoding requests
    nodes: np.ndarray  # the spine node it hangs off
    ranks: np.ndarray  # its place among the branches off that node
    lengths: np.ndarray  # its tokens


def control_array(max_draft: int, lane_len: int) -> np.ndarray:
    """A controller's ``control`` array (:data:`~vllm_fafo.control.kernels.CONTROL_SIZE`
    entries): no lanes, no question asked, ``max_draft`` chosen last by one request."""
    control = np.zeros(CONTROL_SIZE, dtype=np.int64)
    control[C_DRAFT_LEN] = control[C_DRAFT_TOTAL] = control[C_MAX_DRAFT] = max_draft
    control[C_DRAFT_REQUESTS] = 1
    control[C_LANE_LEN] = lane_len
    return control


class Decision:
    """A controller's latest choices: the lanes and draft lengths read from its ``control``
    array (the step's kernel writes them there), the rest kept here."""

    def __init__(self, control: np.ndarray) -> None:
        self.control = control
        self.probe = False
        self.tree_tokens = 0
        """Branch tokens the last step planned, all requests together."""

    @property
    def lanes(self) -> int:
        """Lanes per request this step."""
        return int(self.control[C_LANES])

    @property
    def draft_len(self) -> int:
        """The longest draft chosen last."""
        return int(self.control[C_DRAFT_LEN])

    @property
    def mean_draft_len(self) -> float:
        """The draft lengths chosen last, on average per request."""
        return int(self.control[C_DRAFT_TOTAL]) / int(self.control[C_DRAFT_REQUESTS])

    @property
    def sampled_steps(self) -> int:
        """Steps whose drafts were found for a sample of the batch, the last choice having
        cut drafts found (:data:`~vllm_fafo.propose_kernel.SAMPLED_DRAFTS`)."""
        return int(self.control[C_SAMPLED_STEPS])

    def chose(self, longest: int, total: int, requests: int) -> None:
        """Draft lengths were chosen: ``longest`` the longest, ``total`` their sum over ``requests``."""
        self.control[C_DRAFT_LEN:C_DRAFT_REQUESTS + 1] = longest, total, requests


class FixedController:
    """The configured sizes, always: lanes as the free token slots allow, full drafts."""

    name = "fixed"

    def __init__(self, max_draft: int) -> None:
        self.max_draft = max_draft
        self.kernel_answer: tuple[int, int, bool] | None = None
        """The step kernel's answer to a lane question (none asked: the lanes are as the slots allow)."""
        self.control = control_array(max_draft, 0)
        self.last = Decision(self.control)
        table, index = np.zeros((1, 1)), np.zeros(1, dtype=np.int64)
        self._learning = (False, table, table, 1.0, index, table, table, 1.0, index, np.zeros(6),
                          np.zeros(2, dtype=np.int64))
        curve = StepCostModel().kernel_arrays()  # never observed (learning's first entry says so)
        self._curves = (curve, curve, curve)
        tier_arrays = _cost_model_arrays(1)  # never asked (the kernel pads to max_draft)
        self._choice = (np.zeros(1), table, table, self.control, (draft_tiers(max_draft)[-1:], *tier_arrays))

    def draft_room(self) -> int:
        """Drafts are found whole: ``max_draft`` tokens at most."""
        return self.max_draft

    def choose_lanes(self, real_tokens: int, lane_requests: int, decoding_requests: int, max_lanes: int) -> int:
        self.control[C_LANES] = max_lanes
        return max_lanes

    def choose_draft_lens(self, step_tokens: int, key_lens: np.ndarray, available: np.ndarray) -> np.ndarray:
        """Every draft as found (the pool's drafts are at most ``num_speculative_tokens``)."""
        return np.asarray(available, dtype=np.int64)

    def choose_branches(self, step_tokens: int, spine_lens: np.ndarray, branches: BranchSet) -> np.ndarray:
        """Every branch as grown (``num_candidates`` and ``max_tree_tokens`` bound them)."""
        return np.asarray(branches.lengths, dtype=np.int64)

    def observe(self, outcome: StepOutcome) -> None:
        return None

    def kernel_arguments(self) -> tuple[tuple, tuple, tuple]:
        """Nothing learned (the learning's first entry), every draft as found, or padded to
        ``max_draft`` (``pad_drafts``) in the kernel, no lane question asked
        (:meth:`GoodputController.kernel_arguments`' types, so that both controllers run one
        compiled kernel)."""
        return self._learning, self._curves, self._choice

    def summary(self) -> dict:
        return {"controller": self.name, "lanes": self.last.lanes, "draft_len": self.max_draft}


class GoodputController:
    """Chooses lanes per request and the draft length that maximise accepted tokens per second."""

    name = "goodput"

    def __init__(
        self,
        lane_len: int,
        max_draft: int,
        max_key_len: int,
        probe_interval: int = 16,
        max_probe_interval: int = 1024,
        probe_burst: int = 4,
        decay: float = 0.98,
    ) -> None:
        self.lane_len = lane_len
        self.max_draft = max_draft
        self.cost = StepCostModel()
        self.yields = YieldEstimates(max_draft, max_key_len, decay)
        self._lane_probe = _Probe(probe_interval, max_probe_interval, burst=probe_burst)
        self.tree_cost = StepCostModel()
        """Seconds per step against tokens, of steps with draft-tree branches."""
        self.lane_cost = StepCostModel()
        """Seconds per step against tokens, of steps with lanes (and no branches)."""
        self.tiers = draft_tiers(max_draft)
        """The draft lengths a padded step may take (``pad_drafts``; :data:`DRAFT_TIERS`)."""
        self._tier_arrays, tier_models = stacked_cost_models(len(self.tiers))
        self.tier_cost: dict[int, StepCostModel] = dict(zip(self.tiers.tolist(), tier_models))
        """Seconds per uniform step against its decoding requests, by its draft length
        (:meth:`choose_tier`): on CUDA each tier is its own graphs, whose cost the
        token count alone does not tell (graph sizes are padded, attention differs)."""
        self._spine_key_lens = np.zeros(0, dtype=np.int64)
        """The key lengths :meth:`choose_draft_lens` chose this step's spines by, one per request."""
        lengths = np.arange(max_key_len + 1)[:, None]
        self._worth_share = np.where((lengths > 0) & (np.arange(max_draft) >= DRAFT_PER_MATCHED_TOKEN * lengths),
                                     TAIL_WORTH, 1.0)
        """Share of its reach each draft position is worth, by matched key length (0: no match)."""
        self.control = control_array(max_draft, lane_len)
        """The lanes and draft lengths chosen last, the last lane question and the probe's
        state for the next (:data:`~vllm_fafo.control.kernels.C_LANES` ...): read and written
        by the step's kernel, so that no Python runs for the controller around it."""
        self.last = Decision(self.control)
        self._lane_numbers = (0, 0, 0, 0, *self._lane_probe.flags())
        """The control array's entries :data:`~vllm_fafo.control.kernels.C_LANES` ..
        ``C_PROBE_ANYWAY`` (the lanes, the last question, the probe's state), as
        :meth:`choose_lanes` wrote them last."""
        self.control[C_LANES:C_PROBE_ANYWAY + 1] = self._lane_numbers
        self.kernel_answer: tuple[int, int, bool] | None = None
        """The step kernel's answer to the next lane question (its real tokens, -1 where it asked
        none; lanes; probe), set by the proposer; None once taken, or once the controller
        learned anything after it."""
        self._curves = (self.cost.kernel_arrays(), self.lane_cost.kernel_arrays(), self.tree_cost.kernel_arrays())
        """The plain, lane and tree steps' cost curves, as the step's kernel takes them (by number)."""
        self._choice = (*self.yields.reach_buffers(), self._worth_share, self.control,
                        (self.tiers, *self._tier_arrays))
        """What the step's kernel chooses draft lengths and the next lane question with."""

    # Decisions -----------------------------------------------------------------------
    def draft_room(self) -> int:
        """The longest drafts worth finding for the next step: twice the longest it chose
        last (at least :data:`MIN_DRAFT_ROOM`), at most ``max_draft``. Tokens found past
        what it may choose cost the index's time and are cut (at high load most are:
        docs/results/host-time.md); the yields learn each position only from the drafts
        that reached it (:func:`~vllm_fafo.control.kernels.count_chains`), so shorter
        drafts leave them unbiased, and the room doubles a step while the choices grow."""
        return min(self.max_draft, max(MIN_DRAFT_ROOM, 2 * self.last.draft_len))

    def choose_lanes(self, real_tokens: int, lane_requests: int, decoding_requests: int, max_lanes: int) -> int:
        """Lanes per request for this forward (0..max_lanes), which has ``real_tokens``
        tokens (drafts included) and ``lane_requests`` requests that can run lanes: of 0,
        the powers of two and ``max_lanes``, the most expected tokens per second, in one
        kernel call (:func:`~vllm_fafo.control.kernels.choose_lane_count`).

        A step with lanes is priced by the dearer of the lane steps' curve and the plain
        one (lanes add attention over each request's region to the tokens' price, never
        take from it; the lane curve is flat past the largest lane step it saw); the
        plain curve alone until a lane step ran. With lanes off and a probe due, the
        most lanes priced at no more than twice a plain step run, in a burst, where they
        would pay at the lane yield last measured, unshrunk (asked behind the step's
        tokens and behind its decoding requests alone, as if drafts made room: lanes can
        take their place). A probe costs up to twice a plain step for ``probe_burst``
        steps; where the cost curve says lanes could not pay even at the yield they
        showed (a CPU, where every lane token costs), probing again only spends: such
        probes wait for the longest interval (or for the curve or the yield to change)."""
        if max_lanes <= 0 or lane_requests <= 0:
            self._note_lanes((0, *self._lane_numbers[1:]))
            self.last.probe = False
            return 0
        answer, self.kernel_answer = self.kernel_answer, None
        asked = (lane_requests, decoding_requests, max_lanes)
        if answer is not None and answer[0] == real_tokens and self._lane_numbers[1:4] == asked:
            best, probed = answer[1], answer[2]  # asked by the step's kernel, of the same state
        else:
            plain, probe = self._plain_cost(), self._lane_probe
            best, probed = kernels.choose_lanes(
                self.yields.totals, self.lane_len, lane_requests, real_tokens, decoding_requests, max_lanes,
                plain.fitted, plain.num_points, self.lane_cost.fitted, self.lane_cost.num_points, probe.due(),
                probe.in_burst() or probe.overdue())
        self._note_lanes((best, *asked, *self._lane_probe.step(chosen=best > 0, probe=probed)))
        self.last.probe = probed
        return best

    def _note_lanes(self, numbers: tuple[int, ...]) -> None:
        """The lanes chosen, the question asked and the probe's state for the next into the
        control array, where they changed (a cold step pays for each write)."""
        if numbers != self._lane_numbers:
            self._lane_numbers = numbers
            self.control[C_LANES:C_PROBE_ANYWAY + 1] = numbers

    def _plain_cost(self) -> StepCostModel:
        """The curve steps without lanes or branches are priced by: their own, or, where
        lanes ran in every recent step (its points all forgotten), the lane steps' (the
        step's kernel picks it so too)."""
        if self.cost.has_data:
            return self.cost
        return self.lane_cost if self.lane_cost.has_data else self.cost

    def _tree_step_seconds(self, tokens: np.ndarray) -> np.ndarray:
        """Seconds of steps with branches of ``tokens`` tokens: the dearer of the tree
        steps' curve and the plain one plus the least that tree steps cost over plain
        steps of their size, among the sizes both curves saw (the branches' attention
        costs per layer and step, not per token: below the sizes it saw, the tree curve
        alone scales that down with the tokens, and one branch token behind a short spine
        would look cheaper than the plain step without it). Sizes only the tree curve saw
        teach no extra: the plain curve is flat past what it saw. The plain curve alone
        until a tree step ran."""
        plain = self._plain_cost()
        if not self.tree_cost.has_data:
            return plain.predict(tokens)
        tree_tokens, tree_seconds = self.tree_cost.curve()
        both = tree_tokens <= plain.curve()[0].max(initial=0.0)
        extra = max(0.0, float(np.min(tree_seconds[both] - plain.predict(tree_tokens[both])))) if both.any() else 0.0
        return np.maximum(self.tree_cost.predict(tokens), plain.predict(tokens) + extra)

    def choose_draft_lens(self, step_tokens: int, key_lens: np.ndarray, available: np.ndarray) -> np.ndarray:
        """Draft length per request for the next step (at most ``available``, the draft
        each found): the batch's draft tokens most likely to be accepted, as many as
        maximise expected accepted tokens per second.

        A request's token at position k is worth P(positions 1..k accepted) given
        its key length (a quarter of it past twice the key length:
        :data:`DRAFT_PER_MATCHED_TOKEN`); the step with the n best tokens yields
        (requests + their sum) tokens in predict(step_tokens + n) seconds, on the curve of
        steps with lanes where this step ran lanes (``step_tokens`` counts them)."""
        available = kernels.as_int64(available)
        lanes_on = self.last.lanes > 0  # this step ran lanes: the next is priced as a step with lanes
        plain = self._plain_cost()
        if not len(available) or not (lanes_on or plain.has_data):
            self.control[C_DRAFTS_CUT] = 0
            return available
        key_lens = self._spine_key_lens = kernels.as_int64(key_lens)
        yields, lane_curve = self.yields, self.lane_cost
        lengths = np.zeros(len(available), dtype=np.int64)
        # ties: the earlier token first, so each request keeps a prefix
        longest, total = kernels.choose_draft_lengths(
            yields.position_trials, yields.position_hits, *yields.reach_arrays(), yields.row_of_key_len,
            self._worth_share, key_lens, available, plain.fitted, plain.num_points, lane_curve.fitted,
            lane_curve.num_points if lanes_on else 0, step_tokens, lengths)
        self.last.chose(longest, total, len(lengths))
        self.control[C_DRAFTS_CUT] = total < available.sum()
        return lengths

    def choose_tier(self, step_tokens: int, key_lens: np.ndarray, available: np.ndarray) -> int:
        """One draft length for every request of the next step, of :attr:`tiers`: the one
        that maximises expected accepted tokens per second (``pad_drafts``: each request's
        found draft, at most ``available``, is padded to it, so the step is a uniform decode
        batch; :data:`DRAFT_TIERS` says why tiers). The step's kernel chooses so itself
        (:func:`~vllm_fafo.control.kernels.choose_tier`); this asks it from Python.

        A tier of t tokens yields the requests plus the worth of every request's found
        draft tokens up to t (as :meth:`choose_draft_lens` prices them; filler is worth
        nothing), in the seconds its own steps took at this many requests
        (:attr:`tier_cost`). A tier not run lately is priced optimistically, so it gets
        tried: at what the dearest shorter tier costs (a step costs no less with more
        tokens; a GPU below its knee charges nothing more), or where no shorter tier
        ran, the plain curve's price of its tokens. The longest tier before any step
        was priced."""
        yields, plain = self.yields, self._plain_cost()
        steps, _, _, curves = self._tier_arrays
        tier = kernels.choose_tier(yields.position_trials, yields.position_hits, *yields.reach_buffers(),
                                   yields.row_of_key_len, self._worth_share, kernels.as_int64(key_lens),
                                   kernels.as_int64(available), self.tiers, steps, curves, plain.fitted,
                                   plain.num_points, step_tokens)
        yields.stale[0] = 0  # the kernel refreshed the reach tables
        self.last.chose(tier, tier, 1)
        return tier

    def choose_branches(self, step_tokens: int, spine_lens: np.ndarray, branches: BranchSet) -> np.ndarray:
        """Tokens to keep of each grown branch for the next step (a prefix of it, 0 drops
        it): the branch tokens most likely to be accepted, as many as maximise expected
        accepted tokens per second on top of the spines already chosen.

        Called after :meth:`choose_draft_lens` of the same step, whose reach
        probabilities it reuses: ``spine_lens`` are the lengths that chose, one per
        decoding request, ``step_tokens`` the next step's tokens with the spines. A branch off node j
        pays only where its spine stops exactly at j, so its token i is worth
        P(spine stops at j) x P(branch tokens 1..i accepted | that), the first from
        the spine's reach probabilities, the second learned per rank. A step with
        branches is priced by :meth:`_tree_step_seconds`. Where tokens cost next to nothing (a GPU below its knee) whole trees run;
        elsewhere only branches whose worth beats their cost, or none."""
        lengths = np.asarray(branches.lengths, dtype=np.int64)
        cost = self._plain_cost()
        if not len(lengths) or not cost.has_data:  # a step without branches first
            return np.zeros_like(lengths)
        reach = self.yields.reach_table()[self.yields.rows_of(self._spine_key_lens)]  # as choose_draft_lens read it
        spine_lens = np.asarray(spine_lens, dtype=np.int64)
        spine_worth = np.where(np.arange(self.max_draft) < spine_lens[:, None], reach, 0.0).sum()
        reached = np.concatenate([np.ones((len(reach), 1)), reach], axis=1)  # P(first j accepted), j = 0..
        stops = reached[:, :-1] - reached[:, 1:]  # P(exactly j accepted), j < the spine's length
        token_branch = np.repeat(np.arange(len(lengths)), lengths)
        depth = np.arange(len(token_branch)) - np.repeat(np.cumsum(lengths) - lengths, lengths)
        ranks = np.minimum(np.asarray(branches.ranks, dtype=np.int64), BRANCH_RANKS - 1)
        owners, nodes = np.asarray(branches.owners), np.asarray(branches.nodes)
        worth = (stops[owners[token_branch], nodes[token_branch]]
                 * self.yields.branch_reach_probability()[ranks[token_branch], depth])
        order = np.argsort(-worth, kind="stable")  # ties: shallower first, so each branch keeps a prefix
        gains = len(spine_lens) + spine_worth + np.concatenate([[0.0], np.cumsum(worth[order])])
        seconds = np.concatenate([cost.predict([step_tokens]),
                                  self._tree_step_seconds(step_tokens + np.arange(1, len(order) + 1))])
        rates = gains / seconds
        best = int(rates.argmax())
        self.last.tree_tokens = best
        return np.bincount(token_branch[order[:best]], minlength=len(lengths))

    # Learning --------------------------------------------------------------------------
    def observe(self, outcome: StepOutcome) -> None:
        """Plain steps teach the cost curve, steps with branches the tree's own and steps
        with lanes the lanes' own: branch and lane attention are the plugin's, not vLLM's
        kernel, and cost an amount per layer and step that one curve over token counts
        could not tell from the price of the tokens. (On the 2-core CPU a step with a
        lane probe took 15-26 % more than a plain step of as many tokens; in the plain
        curve such steps made the drafts after a probe look dearer than they were.)"""
        self.kernel_answer = None
        self._curve_of(outcome.lane_tokens, outcome.tree_tokens).observe(outcome.tokens, outcome.seconds)
        self.observe_tiers(outcome.uniform_draft_len, outcome.decoding_requests, outcome.seconds)
        self.yields.observe(outcome)

    def _curve_of(self, lane_tokens: int, tree_tokens: int) -> StepCostModel:
        """The cost curve a step with these tail tokens teaches (:meth:`observe`)."""
        return self.tree_cost if tree_tokens else self.lane_cost if lane_tokens else self.cost

    def observe_tiers(self, uniform_draft_len: int, decoding_requests: int, seconds: float) -> None:
        """:meth:`observe`'s tier costs (``pad_drafts``; -1: not a uniform decode step; a
        length that is not a tier prices nothing, as in the step's kernel)."""
        if uniform_draft_len in self.tier_cost:
            self.tier_cost[uniform_draft_len].observe(decoding_requests, seconds)

    def kernel_arguments(self) -> tuple[tuple, tuple, tuple]:
        """The learning, the cost curves and the choice of :func:`~vllm_fafo.propose_kernel.propose_step`,
        the same objects for the controller's life (:mod:`vllm_fafo.step_arrays`). The kernel
        does what :meth:`observe` and :meth:`choose_draft_lens` do: the cost curve of the step's
        kind observes it, the yields learn the judged drafts and the step's branch trials, the
        drafts are cut as :meth:`choose_draft_lens` would cut them (where the proposer does
        not pad them to tiers); it notes what it chose, and asks the next step's lane
        question (:meth:`choose_lanes`) where the last step asked one, in :attr:`control`."""
        return self.yields.learning_arguments(), self._curves, self._choice

    def note_spine_keys(self, key_lens: np.ndarray) -> None:
        """The step's kernel chose the spines' lengths by these key lengths, one per request
        (:meth:`choose_branches` reads them as :meth:`choose_draft_lens` left them)."""
        self._spine_key_lens = key_lens

    def summary(self) -> dict:
        tokens, seconds = self.cost.curve()
        return {
            "controller": self.name,
            "lanes": self.last.lanes,
            "draft_len": self.last.draft_len,
            "mean_draft_len": round(self.last.mean_draft_len, 3),
            "sampled_draft_steps": self.last.sampled_steps,
            "tree_tokens": self.last.tree_tokens,
            "lane_cost_curve_tokens": self.lane_cost.curve()[0].round(1).tolist(),
            "lane_cost_curve_ms": (1000 * self.lane_cost.curve()[1]).round(3).tolist(),
            "tree_cost_curve_tokens": self.tree_cost.curve()[0].round(1).tolist(),
            "tree_cost_curve_ms": (1000 * self.tree_cost.curve()[1]).round(3).tolist(),
            "branch_first_token_rate": self.yields.branch_reach_probability()[:, 0].round(4).tolist(),
            "lane_yield": self.yields.lane_yield(),
            "tokens_per_request": self.yields.tokens_per_request(),
            "reach_probability": self.yields.reach_probability().round(4).tolist(),
            "cost_curve_tokens": tokens.round(1).tolist(),
            "cost_curve_ms": (1000 * seconds).round(3).tolist(),
            "tier_cost": {str(tier): {"requests": costs.curve()[0].round(1).tolist(),
                                      "ms": (1000 * costs.curve()[1]).round(3).tolist()}
                          for tier, costs in self.tier_cost.items() if costs.has_data},
        }


@dataclass
class _Probe:
    """When a choice that is off gets tried again: after ``interval`` steps off, for ``burst`` steps in a row (lane yields
    are sparse and arrive late: one step shows little), the interval doubling
    after each probe that was not followed by the choice being kept."""

    base: int
    max_interval: int
    burst: int = 1
    interval: int = 0
    steps_off: int = 0
    burst_left: int = 0

    def __post_init__(self) -> None:
        self.interval = self.base

    def due(self) -> bool:
        return bool(self.flags()[0])

    def in_burst(self) -> bool:
        return self.burst_left > 0

    def overdue(self) -> bool:
        """Off for the longest interval: tried whatever the estimates say."""
        return self.steps_off >= self.max_interval

    def flags(self) -> tuple[int, int]:
        """Whether it is due, and whether it runs whatever the estimates say (in a burst, or
        overdue), as the step's kernel reads them (:data:`~vllm_fafo.control.kernels.C_PROBE_DUE`):
        :meth:`in_burst` and :meth:`overdue` written out (asked every step, between two
        forwards, where each call of a method costs about a microsecond)."""
        burst = self.burst_left > 0
        return int(burst or self.steps_off >= self.interval), int(burst or self.steps_off >= self.max_interval)

    def step(self, chosen: bool, probe: bool) -> tuple[int, int]:
        """A lane choice was made (lanes ``chosen``, or a ``probe`` run); returns :meth:`flags` after it."""
        if probe:
            self.burst_left = (self.burst_left or self.burst) - 1
            if self.burst_left == 0:
                self.steps_off = 0
                self.interval = min(2 * self.interval, self.max_interval)
        elif chosen:
            self.steps_off, self.burst_left, self.interval = 0, 0, self.base
        else:
            self.steps_off += 1
        return self.flags()


def make_controller(name: str, lane_len: int, max_draft: int, max_key_len: int) -> FixedController | GoodputController:
    if name == "fixed":
        return FixedController(max_draft)
    if name == "goodput":
        return GoodputController(lane_len, max_draft, max_key_len)
    raise ValueError(f"unknown controller {name!r}; allowed: {', '.join(CONTROLLERS)}")
