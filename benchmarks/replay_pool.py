"""Offline tau of pool settings: plain vLLM's greedy outputs replayed through FAFO's pool.

A matrix run keeps every cell's tokens; its ``none`` cell is what plain vLLM
decoded. Under greedy decoding a draft is accepted up to its first token that
differs from that text, so replaying the text through the proposer's own
draft index (:class:`~vllm_fafo.drafting.index.DraftIndex`: the pools, the deep
matches, the shared pool, the prior table) gives the tau
of any pool setting in seconds, without an engine: how long drafts could be,
which key length, how many candidates per key, sharing on or off. Drafts are
not cut: this is the tau the goodput controller starts from (it cuts drafts
whose tokens do not pay on the machine), and the draft tokens per step say
what the verification would cost.

    python benchmarks/replay_pool.py --cells benchmarks/results/cpu_shared_mtbench \\
        --dataset mtbench --setting 'k4={"num_speculative_tokens":4}' \\
        --setting 'k16={"num_speculative_tokens":16}'

``--cost-ms 46,12,2.5`` also runs the goodput controller on a machine whose
forward costs 46 ms, 12 ms more with a draft, 2.5 ms per further draft token
(what it learned on a 2-core CPU with SmolLM2 at batch 1, docs/results/goodput-controller.md "Draft
length") and per further request of a batch: its cuts, the tau they leave and
the simulated tokens per second. A fourth value is a knee: forwards of up to
that many tokens cost STEP, only the tokens past it are priced (``--cost-ms
41,1.3,1.3,8`` and ``50,1.6,1.6,3``: about two 2-core CPUs' measured curves,
docs/results/goodput-controller.md "What the cut leaves at this machine's token price").
``--noise 0.05,0.02,1.5`` scatters each forward's time as a real machine's
(lognormal, and a pause now and then), which is what the controller learns
its cost curve from.

``--vllm-suffix`` adds vLLM's own ``suffix`` method replayed the same way (its
tau equals the engine's): the reference a setting has to beat, at the same
draft tokens per forward.

Requests are replayed one after another, as the matrix's batch-1 cells send
them (the shared pool learns from the earlier ones), or B at a time as vLLM
schedules a batch (``--batch-sizes 1,8,32``; a new request starts when one
finishes; every running request drafts each forward, and the controller sizes
the batch's drafts together, as in the engine's batch-B cells). With several
batch sizes one controller per setting runs through them in order, as a
matrix run's engine does (its batch-8 cells start with what the batch-1 ones
taught it). Lanes and the frozen table are not replayed; the prior table is,
as the setting's ``prior_table`` names it for the SmolLM2 build (``auto``: the
one ``vllm-fafo-prior-table`` built into the cache, if any).

With ``"num_candidates"`` > 1 in a setting, each draft is the spine of a draft
tree whose branches grow as the engine grows them (``grow_branches``: the
pool's other candidates at each spine node) and every branch runs (the
regime where tokens are free; trees are replayed uncut only): where the
spine stops at node j, the branch off j that the text follows furthest is
accepted too.

"""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from vllm_fafo.config import FafoConfig
from vllm_fafo.control.draft_judge import DraftJudge
from vllm_fafo.control.goodput import GoodputController, StepOutcome
from vllm_fafo.drafting.index import DraftIndex, first_anchor
from vllm_fafo.drafting.pool import alternatives_in
from vllm_fafo.drafting.prior_table import PriorTable
from vllm_fafo.drafting.prior_table import resolve as resolve_prior_table
from vllm_fafo.proposer import key_context, longest_match
from vllm_fafo.verification.draft_tree import Branch, grow_branches

SUFFIX_TREE_DEPTH = 24
"""vLLM 0.32.0's ``suffix_decoding_max_tree_depth`` default (and its draft length)."""


class _Running:
    """One request being replayed: its text (prompt + plain vLLM's output) and how far it got.
    (A plain class: the tests load this script by path, where dataclasses cannot find its module.)"""

    def __init__(self, req_id: str, history: np.ndarray, prompt_len: int, output: list[int]) -> None:
        self.req_id = req_id
        self.history = history  # prompt and output; read only up to the tokens decoded so far
        self.prompt_len = prompt_len
        self.output = output
        self.done = 1  # output tokens decoded: the prefill's forward gave the first
        self.pool = None  # its RequestPool in the draft index
        self.next_anchor = 0
        self.slot = int(req_id)  # the draft judge's key: each request's own (ids are their order)

    @property
    def num_tokens(self) -> int:
        return self.prompt_len + self.done


def scheduled(requests: list[tuple[list[int], list[int]]], batch_size: int) -> Iterator[tuple[str, Any]]:
    """Run the requests ``batch_size`` at a time, in order, as vLLM schedules a batch of
    them: a new one starts as soon as one finishes. Yields ("start", request) when a
    request's prefill ran, ("step", running requests) per decoding forward (the caller
    advances them), ("finish", request) when its output is complete."""
    waiting = list(enumerate(requests))
    running: list[_Running] = []
    while waiting or running:
        while waiting and len(running) < batch_size:
            index, (prompt, output) = waiting.pop(0)
            running.append(_Running(str(index), np.array([*prompt, *output], dtype=np.int32), len(prompt), output))
            yield "start", running[-1]
        decoding = [request for request in running if request.done < len(request.output)]
        if decoding:
            yield "step", decoding
        for request in running:
            if request.done >= len(request.output):
                yield "finish", request
        running = [request for request in running if request.done < len(request.output)]


def new_controller(config: FafoConfig) -> GoodputController:
    """A fresh goodput controller, as the engine makes for ``config``."""
    return GoodputController(config.lane_len, config.num_speculative_tokens, longest_match(config))


def replay(config: FafoConfig, requests: list[tuple[list[int], list[int]]],
           cost_ms: tuple[float, ...] | None = None, batch_size: int = 1,
           controller: GoodputController | None = None, oracle: bool = False,
           prior: PriorTable | None = None, noise: StepNoise | None = None) -> dict[str, float]:
    """tau (tokens per forward) and draft tokens per forward of ``config``'s pool over
    (prompt ids, plain vLLM's output ids) pairs, ``batch_size`` requests at a time
    (:func:`scheduled`).

    With ``cost_ms`` = (step, first draft token, each further token[, knee]) the
    goodput controller cuts the drafts as in the engine, learning from forwards
    that cost that much (:func:`step_seconds`), and the simulated tokens per
    second are reported too; without it drafts are kept whole. ``controller``:
    the one to cut with (default: a fresh one), so that one controller can run
    through several cells, warm, as a matrix run's engine runs its cells.
    ``noise``: the forwards' times scatter as a real machine's do (:class:`StepNoise`).

    ``oracle``: each step's draft is, among the draft the setting finds and every
    candidate of the request's pools under the text's suffixes (longest key first,
    :func:`~vllm_fafo.drafting.pool.alternatives_in`), the one the text follows furthest: the
    tau a perfect ranking of the candidates at hand would reach (uncut, spine only).

    ``prior``: the prior table drafted from where the pools miss, as the engine's
    proposer does (:func:`prior_table`)."""
    index = DraftIndex(config, prior=prior)
    k, max_key_len = config.num_speculative_tokens, config.max_key_len
    if cost_ms is None and controller is not None:
        raise ValueError("replay: a controller cuts drafts only on a step cost; pass cost_ms with it")
    if cost_ms is not None and controller is None:
        controller = new_controller(config)
    scatter = step_scatter(noise, cost_ms)
    grows_trees = config.num_candidates > 1
    if oracle and (grows_trees or cost_ms is not None):
        raise ValueError("replay: the oracle ranks single drafts, uncut; drop cost_ms and num_candidates")
    if grows_trees and cost_ms is not None:
        raise ValueError("replay: draft trees are replayed uncut (every branch runs); drop cost_ms or "
                         "set num_candidates to 1")
    judge = DraftJudge(k)
    forwards = tokens = drafted = branch_tokens = accepted_off_spine = 0
    seconds = 0.0
    for event, payload in scheduled(requests, batch_size):
        if event == "start":
            request = payload
            request.pool = index.start(request.req_id, None, request.history[: request.prompt_len])
            request.next_anchor = first_anchor(config, request.prompt_len)
            forwards += 1  # the prefill's forward gives the first token
            continue
        if event == "finish":
            index.stop(payload.req_id, payload.pool, payload.prompt_len, payload.next_anchor)
            judge.forget([payload.slot])
            tokens += len(payload.output)
            continue
        running = payload
        num_tokens = np.array([request.num_tokens for request in running], dtype=np.int64)
        next_anchors = np.array([request.next_anchor for request in running], dtype=np.int64)
        owners = np.stack([index.owners(request.req_id, request.pool) for request in running])
        batch = np.arange(len(running))
        room = k if controller is None else controller.draft_room()
        found = index.draft_batch(batch, owners, np.array([request.prompt_len for request in running], dtype=np.int64),
                                  next_anchors, _stacked(running), batch, num_tokens, room, int(num_tokens.max()) + k)
        key_lens = found.key_lens.tolist()
        drafts, contexts = [], []
        for i, request in enumerate(running):
            request.next_anchor = int(next_anchors[i])
            draft = found.tokens[i, : found.lengths[i]].tolist()
            context = key_context(request.history, request.num_tokens, max_key_len)
            contexts.append(context)
            if oracle:
                candidates = [draft, *(list(c[:k]) for c in alternatives_in(request.pool, context))]
                draft = max(candidates, key=lambda c: accepted_prefix(c, request.output, request.done))
            drafts.append(draft)
        draft_lens = np.array(list(map(len, drafts)), dtype=np.int64)
        if controller is not None:
            padded = np.zeros((len(drafts), k), dtype=np.int32)
            for row, draft in enumerate(drafts):
                padded[row, : len(draft)] = draft
            judge.add(np.array([request.slot for request in running]), np.array([request.num_tokens for request in running]),
                      padded, draft_lens, found.key_lens)
            draft_lens = controller.choose_draft_lens(len(running), np.array(key_lens), draft_lens)
            drafts = [draft[:length] for draft, length in zip(drafts, draft_lens.tolist())]
        accepted = []
        for request, draft, context in zip(running, drafts, contexts):
            branches = () if not grows_trees else grow_branches(
                request.pool, context, draft, config.num_candidates - 1, config.tree_tokens - len(draft))
            branch_tokens += sum(len(branch.tokens) for branch in branches)
            on_spine, off_spine = advance_tree(request, draft, branches)
            accepted.append(on_spine)
            accepted_off_spine += off_spine
        forwards += len(running)
        drafted += int(draft_lens.sum())
        if cost_ms is not None:
            step_s = scatter(step_seconds(cost_ms, int(draft_lens.sum()), len(running)))
            seconds += step_s
            judged = judge.judge(np.array([request.slot for request in running]), np.arange(len(running)),
                                 np.array([request.num_tokens for request in running]), _stacked(running))
            controller.observe(StepOutcome(
                tokens=len(running) + int(draft_lens.sum()), seconds=step_s, lane_tokens=0, lane_accepted=0,
                text_accepted=sum(accepted), decoding_requests=len(running), draft_lengths=judged[0],
                accepted_lengths=judged[1], key_lens=judged[2],
            ))
    result = {"tau": tokens / forwards, "draft_tokens_per_forward": drafted / forwards}
    if cost_ms is not None:
        result["tokens_per_s"] = tokens / seconds  # the prefills' forwards are not priced
    if grows_trees:
        result["branch_tokens_per_forward"] = branch_tokens / forwards
        result["accepted_off_spine"] = accepted_off_spine
    return result


def _stacked(running: list[_Running]) -> np.ndarray:
    """The running requests' texts as rows of one array, as vLLM keeps its batch's
    (padded; a row is read only up to its request's tokens decoded so far)."""
    token_ids = np.zeros((len(running), max(len(request.history) for request in running)), dtype=np.int32)
    for row, request in enumerate(running):
        token_ids[row, : len(request.history)] = request.history
    return token_ids


def advance(request: _Running, draft: list[int]) -> int:
    """Verify ``draft`` greedily against the request's output: the accepted tokens and
    the target's own next one are decoded. Returns the draft tokens accepted."""
    return advance_tree(request, draft, ())[0]


def advance_tree(request: _Running, spine: list[int], branches: Sequence[Branch]) -> tuple[int, int]:
    """Verify a draft tree greedily: the spine's accepted prefix and, where it stopped
    at node j, the branch off j the output follows furthest; the target's next token
    after them is decoded too. Returns (spine tokens, branch tokens) accepted."""
    on_spine = accepted_prefix(spine, request.output, request.done)
    off_spine = 0
    if on_spine < len(spine):
        off_spine = max((accepted_prefix(list(branch.tokens), request.output, request.done + on_spine)
                         for branch in branches if branch.node == on_spine), default=0)
    request.done += min(on_spine + off_spine + 1, len(request.output) - request.done)
    return on_spine, off_spine


def accepted_prefix(draft: list[int], output: list[int], done: int) -> int:
    """Draft tokens greedy verification accepts after ``output[:done]``."""
    accepted = 0
    while accepted < len(draft) and done + accepted < len(output) and draft[accepted] == output[done + accepted]:
        accepted += 1
    return accepted


def step_scatter(noise: StepNoise | None, cost_ms: tuple[float, ...] | None) -> Callable[[float], float]:
    """What a replay's forwards' times go through: ``noise``'s scatter, or unchanged."""
    if noise is None:
        return lambda seconds: seconds
    if cost_ms is None:
        raise ValueError("replay: noise scatters the step cost; pass cost_ms with it")
    return noise.sampler()


def cost_ms_argument(value: str) -> tuple[float, ...]:
    """``--cost-ms STEP,FIRST,PER[,KNEE]`` (milliseconds; KNEE in tokens), as :func:`step_seconds` takes it."""
    try:
        cost_ms = tuple(float(v) for v in value.split(","))
    except ValueError:
        cost_ms = ()
    if len(cost_ms) not in (3, 4) or min(cost_ms, default=-1.0) < 0 or (len(cost_ms) == 4 and (
            cost_ms[3] < 1 or not cost_ms[3].is_integer())):
        raise argparse.ArgumentTypeError(f"{value!r}: need three or four numbers >= 0, STEP,FIRST,PER "
                                         "(milliseconds) and optionally KNEE (a whole number of tokens >= 1)")
    return cost_ms


def noise_argument(value: str) -> StepNoise:
    """``--noise SD,P,FACTOR``, as :class:`StepNoise` takes them."""
    try:
        sd, probability, factor = (float(v) for v in value.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r}: need three numbers, SD,P,FACTOR") from None
    if sd < 0 or not 0 <= probability <= 1 or factor < 1:
        raise argparse.ArgumentTypeError(f"{value!r}: need SD >= 0, 0 <= P <= 1, FACTOR >= 1")
    return StepNoise(sd, probability, factor)


def step_seconds(cost_ms: tuple[float, ...], num_drafts: int, num_requests: int = 1) -> float:
    """A forward's synthetic cost: ``cost_ms[0]`` for one request, ``cost_ms[2]`` per
    further token (requests or drafts), ``cost_ms[1]`` instead for the step's first
    draft token (what turns speculation on costs more than each token after it). An
    optional fourth value, a knee: forwards of up to that many tokens cost what one
    of a single token does, and only the tokens past it are priced (a machine whose
    matrix products cost the same for a few rows as for one: one 2-core CPU's steps
    were flat to 8 tokens, another's to 3, docs/results/goodput-controller.md)."""
    step, first, per_token = cost_ms[:3]
    knee = int(cost_ms[3]) if len(cost_ms) > 3 else 1
    priced = max(0, num_requests + num_drafts - knee)  # past the knee; the requests' own tokens fill it first
    drafts = min(num_drafts, priced)
    extra = (first + per_token * (drafts - 1)) if drafts else 0.0
    return (step + per_token * (priced - drafts) + extra) / 1000


class StepNoise(NamedTuple):
    """Scatter of a real machine's step times, for the synthetic forwards: each one
    times exp(N(0, ``sd``)), and with probability ``pause_probability`` times
    ``pause_factor`` too (a pause: the garbage collector, the OS, the first step after
    a prefill, which took 52-74 ms against a 41 ms median on the 2-core CPU). The
    controller learns its cost curve from such times; the cuts it makes are what this
    shows."""

    sd: float
    pause_probability: float
    pause_factor: float
    seed: int = 0

    def sampler(self) -> Callable[[float], float]:
        rng = np.random.default_rng(self.seed)

        def noisy(seconds: float) -> float:
            pause = self.pause_factor if rng.random() < self.pause_probability else 1.0
            return seconds * pause * math.exp(rng.normal(0.0, self.sd))
        return noisy


def replay_vllm_suffix(requests: list[tuple[list[int], list[int]]], cost_ms: tuple[float, ...] | None = None,
                       batch_size: int = 1, noise: StepNoise | None = None) -> dict[str, float]:
    """The same figures for vLLM's own ``suffix`` method, the reference to beat: Arctic
    Inference's cache with vLLM 0.32.0's defaults (trees 24 deep, 10,000 answers kept,
    up to 24 draft tokens, at most one per matched token, cut below an estimated 0.1),
    fed and asked as vLLM's ``SuffixDecodingProposer`` does; its drafts are never cut
    by a controller. (On a matrix run's batch-1 cells its tau equals the engine's.)
    ``noise``: its forwards' times scatter as :func:`replay`'s do."""
    scatter = step_scatter(noise, cost_ms)
    from arctic_inference.suffix_decoding import SuffixDecodingCache

    cache = SuffixDecodingCache(max_tree_depth=SUFFIX_TREE_DEPTH, max_cached_requests=10000)
    forwards = tokens = drafted = 0
    seconds = 0.0
    for event, payload in scheduled(requests, batch_size):
        if event == "start":
            request = payload
            cache.start_request(request.req_id, request.history[: request.prompt_len])
            cache.add_active_response(request.req_id, request.history[request.prompt_len : request.num_tokens])
            forwards += 1
            continue
        if event == "finish":
            cache.stop_request(payload.req_id)
            tokens += len(payload.output)
            continue
        running = payload
        drafts = [cache.speculate(request.req_id, request.history[max(0, request.num_tokens - SUFFIX_TREE_DEPTH) :
                                                                  request.num_tokens],
                                  max_spec_tokens=SUFFIX_TREE_DEPTH, max_spec_factor=1.0,
                                  min_token_prob=0.1).token_ids for request in running]
        for request, draft in zip(running, drafts):
            before = request.num_tokens
            advance(request, draft)
            cache.add_active_response(request.req_id, request.history[before : request.num_tokens])
        forwards += len(running)
        drafted += sum(map(len, drafts))
        seconds += 0.0 if cost_ms is None else scatter(step_seconds(cost_ms, sum(map(len, drafts)), len(running)))
    result = {"tau": tokens / forwards, "draft_tokens_per_forward": drafted / forwards}
    if cost_ms is not None:
        result["tokens_per_s"] = tokens / seconds
    return result


def prior_table(config: FafoConfig) -> PriorTable | None:
    """The prior table the engine's proposer would use for ``config`` with the SmolLM2 build."""
    from transformers import AutoConfig

    from vllm_fafo.tools.assets import smollm2_dir

    model = str(smollm2_dir())
    return resolve_prior_table(config.prior_table, model, AutoConfig.from_pretrained(model).vocab_size)


def load_requests(cells: Path, dataset: str) -> list[tuple[list[int], list[int]]]:
    """The prompts (token ids, as the engine saw them) and plain vLLM's outputs of a
    matrix run's batch-1 ``none`` cell."""
    from transformers import AutoTokenizer

    from vllm_fafo.tools.assets import chat_prompt, load_prompts, smollm2_dir

    cell = json.loads((cells / "cells" / f"none__{dataset}__b1.json").read_text())
    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir())
    texts = load_prompts(dataset, cell["prompts"])
    prompts = [tokenizer(chat_prompt(tokenizer, text))["input_ids"] for text in texts]
    return list(zip(prompts, cell["token_ids"]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cells", required=True, help="a matrix.py --out folder with a batch-1 none cell")
    parser.add_argument("--dataset", required=True)
    parser.add_argument("--setting", action="append", default=[],
                        help='LABEL=JSON of fafo keys, e.g. k16={"num_speculative_tokens":16} (repeatable)')
    parser.add_argument("--vllm-suffix", action="store_true",
                        help="also replay vLLM's own suffix method (needs arctic-inference), the reference")
    parser.add_argument("--batch-sizes", default="1",
                        help="comma list of requests decoded together (a new one starts as one finishes); "
                             "with --cost-ms each setting's controller runs through them in this order, "
                             "warm, as a matrix run's engine runs its cells")
    parser.add_argument("--oracle", action="store_true",
                        help="also replay each setting with the best candidate at hand as the draft "
                             "(the text's own continuation picked among the pools' candidates): what a "
                             "perfect ranking would reach")
    parser.add_argument("--cost-ms", default=None, type=cost_ms_argument,
                        help="STEP,FIRST,PER[,KNEE]: cut drafts with the goodput controller on this synthetic "
                             "step cost (KNEE: forwards of up to that many tokens cost STEP)")
    parser.add_argument("--noise", default=None, type=noise_argument,
                        help="SD,P,FACTOR: each forward's time times exp(N(0, SD)), and FACTOR with probability P "
                             "(seeded: every setting sees the same scatter); needs --cost-ms")
    args = parser.parse_args()
    cost_ms = args.cost_ms
    if args.noise is not None and cost_ms is None:
        parser.error("--noise scatters the synthetic step cost: add --cost-ms")
    try:
        batch_sizes = [int(size) for size in args.batch_sizes.split(",")]
    except ValueError:
        parser.error(f"--batch-sizes {args.batch_sizes!r}: need a comma list of integers")
    if min(batch_sizes) < 1:
        parser.error(f"--batch-sizes {args.batch_sizes}: each at least 1")
    requests = load_requests(Path(args.cells), args.dataset)
    print(f"{args.dataset}: {len(requests)} requests, {sum(len(o) for _, o in requests)} tokens of plain vLLM's output")
    settings = []
    for entry in args.setting:
        label, _, raw = entry.partition("=")
        settings.append((label, FafoConfig.from_user_dict({"method": "fafo", **json.loads(raw or "{}")})))
    trees = any(config.num_candidates > 1 for _, config in settings)
    if trees and cost_ms is not None:
        parser.error("--cost-ms: draft trees (num_candidates > 1) are replayed uncut only")
    if args.oracle and (trees or cost_ms is not None):
        parser.error("--oracle: ranks single drafts, uncut; drop --cost-ms and num_candidates > 1")
    cut = "uncut" if cost_ms is None else f"cut by the controller at {','.join(f'{v:g}' for v in cost_ms)} ms"
    if args.noise is not None:
        cut += f", scattered by {','.join(f'{v:g}' for v in args.noise[:3])}"
    print(f"| setting | batch | tau (drafts {cut}) | draft tokens per forward |"
          + (" simulated tokens/s |" if cost_ms else "")
          + (" branch tokens per forward | accepted off the spine |" if trees else ""))
    print("|---|---|---|---|" + ("---|" if cost_ms else "") + ("---|---|" if trees else ""))
    def row(label: str, batch_size: int, result: dict[str, float]) -> None:
        print(f"| {label} | {batch_size} | {result['tau']:.3f} | {result['draft_tokens_per_forward']:.2f} |"
              + (f" {result['tokens_per_s']:.1f} |" if cost_ms else "")
              + (f" {result.get('branch_tokens_per_forward', 0.0):.2f} | {result.get('accepted_off_spine', 0)} |"
                 if trees else ""))

    if args.vllm_suffix:
        for batch_size in batch_sizes:
            row("vLLM suffix (its own cuts)", batch_size, replay_vllm_suffix(requests, cost_ms, batch_size, args.noise))
    for label, config in settings:
        controller = None if cost_ms is None else new_controller(config)
        prior = prior_table(config)
        for batch_size in batch_sizes:
            row(label, batch_size, replay(config, requests, cost_ms, batch_size, controller,
                                          prior=prior,
                                          noise=args.noise))
            if args.oracle:
                row(f"{label}, best candidate at hand", batch_size, replay(config, requests, batch_size=batch_size,
                                                                           oracle=True, prior=prior))


if __name__ == "__main__":
    main()
