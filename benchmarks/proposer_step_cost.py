"""Host time of FafoProposer per step, against batch size and sequence length.

The proposer runs on the host between two forward steps, so its cost per
step must stay flat as the history grows and small per request as the batch
grows. This drives it directly (no engine, no lanes: lanes cost model
compute, measured by benchmarks/matrix.py) with a batch of requests whose
texts repeat themselves the way real text does (spans copied from earlier in
the text between random tokens), so the pool finds drafts and some are
accepted: each step a request's sampled tokens are the text's next tokens,
its draft's matching prefix plus one. Reports microseconds per step (the mean,
which holds the few steps where an array grew, and the median) and per
request-step, and the tau that the drafts would have given. A step is timed
from ``begin_step`` to the end of ``propose`` (the plugin's hooks); the modelled
forward's price is worked out before it, untimed. With no model to
build one from, the prior table (drafted from where the pools miss) holds random
continuations: its lookups cost what a real table's do.

The goodput controller sizes drafts by what steps cost, so the steps here are
timed on a modelled machine (``--cost-ms``, as in replay_pool.py: a forward of
STEP ms, FIRST ms more with a draft, PER ms per further token, optionally
free up to a KNEE of tokens), not on the wall clock: its choices, and so the
host time measured, repeat run to run.

    python benchmarks/proposer_step_cost.py --batch-sizes 1,32
    python benchmarks/proposer_step_cost.py --controller fixed --pad-drafts  # the CUDA defaults
    python benchmarks/proposer_step_cost.py --batch-sizes 1,32 --history 128 --evict-mib 96  # caches cold, as in an engine

``--ngram`` also drives vLLM's ``ngram`` proposer (``NgramProposer``, the matrix's
``ngram`` settings: 4 draft tokens, n-grams of 2 to 4) over the same texts, batch and
cache eviction, each step its drafts' accepted prefix plus one token, and reports its
``propose`` time per step (mean and median), its tau and FAFO's time over it (means, and
medians): the issue's target, measured without an engine's noise. With ``--evict-mib`` 0
the caches stay warm (as on a GPU host, whose forwards leave the processor's caches to
it), with 96 they are cold (as after a CPU forward).

    python benchmarks/proposer_step_cost.py --batch-sizes 1,8,32,128 --history 128,8192 --ngram --evict-mib 96

``--warm-code`` (with ``--evict-mib``) splits a cold step: after each eviction a twin
proposer of the same kind, over other texts, takes its step untimed, so that the code,
the interpreter's and the libraries' state are warm again and only the measured
proposer's own data (its index, its Python objects) is cold; the cold step less this one
is what the code costs cold, this one less the warm step what the data does.

``--set KEY=JSON`` (repeatable) sets one of FAFO's keys over the benchmark's, to see
what a draft source costs per step (``--set share_pool=false --set deep_match=false``).

``--thread-time`` times the steps by the thread's processor time instead of the wall clock:
on a shared virtual machine the wall clock also counts the time other tenants held the
processor (runs of one setting spread by up to 40 % there), processor time does not.

``--gc-pauses`` freezes the heap before the proposer is made, as a vLLM engine
freezes its start-up heap, so that the garbage collector's full collections walk
only what the proposer made since, and reports them: how many ran during the
steps, their pauses, the slowest step, and the objects still tracked after the
steps (docs/results/serving.md "Garbage collector pauses").
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import time
from collections.abc import Callable
from types import SimpleNamespace

import numpy as np
from replay_pool import cost_ms_argument, step_seconds

from vllm_fafo.config import FafoConfig
from vllm_fafo.drafting.index import DraftIndex
from vllm_fafo.drafting.prior_table import DEFAULT_WIDTH, PriorTable
from vllm_fafo.proposer import FafoProposer

CPU_LIKE_COST_MS = (52.0, 3.3, 3.3)
"""A 2-core CPU running SmolLM2 in float32 (replay_pool.py's CPU-like curve)."""


class ModelledClock:
    """A clock that moves only when a modelled forward runs (the proposer's ``clock``)."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


VOCAB = 5000
"""Tokens the texts are made of."""


def repetitive_text(length: int, rng: np.random.Generator, vocab: int = VOCAB, copy_rate: float = 0.5) -> np.ndarray:
    """Tokens where about ``copy_rate`` of the text repeats a span of 4..32 earlier tokens."""
    text = list(rng.integers(0, vocab, size=8))
    while len(text) < length:
        if rng.random() < copy_rate:
            span = int(rng.integers(4, 33))
            start = int(rng.integers(0, max(1, len(text) - span)))
            text += text[start : start + span]
        else:
            text += rng.integers(0, vocab, size=int(rng.integers(1, 9))).tolist()
    return np.asarray(text[:length], dtype=np.int32)


def make_proposer(config: FafoConfig, max_model_len: int) -> FafoProposer:
    return FafoProposer(SimpleNamespace(
        speculative_config=SimpleNamespace(num_speculative_tokens=config.num_speculative_tokens),
        additional_config={"fafo": config.to_dict()},
        instance_id="", parallel_config=SimpleNamespace(data_parallel_rank=0),
        model_config=SimpleNamespace(max_model_len=max_model_len),
    ))


def texts(batch: int, history_len: int, steps: int, num_speculative_tokens: int,
          rng: np.random.Generator) -> np.ndarray:
    """The batch's texts (rows, as vLLM's ``token_ids_cpu``), long enough for ``steps``
    steps that each take up to ``num_speculative_tokens`` + 1 tokens."""
    max_len = history_len + steps * (num_speculative_tokens + 1) + 8
    return np.stack([repetitive_text(max_len, rng) for _ in range(batch)])


def cache_eviction(evict_mib: int) -> Callable[[], None]:
    """A call that writes ``evict_mib`` MiB, one write per cache line (0: none), as a
    forward leaves the caches; run untimed before each step."""
    if not evict_mib:
        return lambda: None
    junk = np.ones((evict_mib << 20) // 8)

    def evict() -> None:
        junk[::8] += 1.0

    return evict


def accepted_tokens(rows: np.ndarray, num_tokens: np.ndarray, drafts: list[list[int]]) -> list[list[int]]:
    """Each request's sampled tokens, the text's next ones: its draft's matching prefix
    plus one (greedy verification); advances ``num_tokens`` by them."""
    sampled = []
    for i, draft in enumerate(drafts):
        truth = rows[i, num_tokens[i] : num_tokens[i] + len(draft) + 1].tolist()
        accepted = 0
        while accepted < len(draft) and draft[accepted] == truth[accepted]:
            accepted += 1
        sampled.append(truth[: accepted + 1])
        num_tokens[i] += accepted + 1
    return sampled


class _DecodingSteps:
    """A proposer's batch of texts (``rows``, each ``history_len`` tokens decoded): each step
    its drafts' accepted prefix plus one token are decoded (:meth:`prepare`, untimed), then
    the proposer drafts (a subclass's ``run``, timed)."""

    drafts: list[list[int]]
    """The proposer's last drafts, one per text (set by the subclass's first step)."""
    sampled: list[list[int]]
    """What each text decoded this step: its drafts' accepted prefix and one token."""

    def __init__(self, rows: np.ndarray, history_len: int) -> None:
        self.rows = rows
        self.num_tokens = np.full(len(rows), history_len, dtype=np.int32)
        self.decoded = 0

    def prepare(self) -> None:
        before = int(self.num_tokens.sum())
        self.sampled = accepted_tokens(self.rows, self.num_tokens, self.drafts)
        self.decoded += int(self.num_tokens.sum()) - before


class _FafoSteps(_DecodingSteps):
    """A FAFO proposer decoding ``batch`` texts on the modelled machine: its prefill, then
    each step the decoded tokens and the modelled forward's price (:meth:`prepare`, the
    benchmark's work), then the plugin's hooks (:meth:`run`)."""

    def __init__(self, config: FafoConfig, batch: int, history_len: int, steps: int, seed: int,
                 cost_ms: tuple[float, ...]) -> None:
        rng = np.random.default_rng(seed)
        super().__init__(texts(batch, history_len, steps, config.num_speculative_tokens, rng), history_len)
        self.proposer = make_proposer(config, self.rows.shape[1])
        # No model here: a prior table of random continuations (a lookup costs the same).
        self.proposer.index = DraftIndex(self.proposer.config, prior=PriorTable(
            rng.integers(0, VOCAB, size=(VOCAB, DEFAULT_WIDTH), dtype=np.int32)))
        self.clock = self.proposer.clock = ModelledClock()
        self.cost_ms, self.batch = cost_ms, batch
        self.req_ids = [f"r{i}" for i in range(batch)]
        # Prefill: each request's last prompt token was sampled; the pool is seeded from the prompt.
        self.proposer.begin_step((), 0, {}, dict.fromkeys(self.req_ids))
        self.proposer.finish_forward(self.req_ids, None)
        self.drafts = self.proposer.propose([[int(row[history_len - 1])] for row in self.rows], self.num_tokens,
                                            self.rows)

    def prepare(self) -> None:
        super().prepare()
        self.spec = {req_id: draft for req_id, draft in zip(self.req_ids, self.drafts)}
        # the modelled forward's tokens and seconds, worked out untimed (the benchmark's, not the proposer's work)
        self.num_drafts = sum(map(len, self.drafts))
        self.forward = step_seconds(self.cost_ms, self.num_drafts, self.batch)

    def run(self) -> None:
        proposer = self.proposer
        proposer.begin_step((), self.batch + self.num_drafts, self.spec, {})
        proposer.finish_forward(self.req_ids, None)
        self.clock.now += self.forward
        self.drafts = proposer.propose(self.sampled, self.num_tokens, self.rows)


class _NgramSteps(_DecodingSteps):
    """vLLM's ``ngram`` proposer (the matrix's settings) decoding ``batch`` texts: its
    ``propose`` each step (:meth:`run`)."""

    def __init__(self, batch: int, history_len: int, steps: int, seed: int) -> None:
        from matrix import NGRAM_SPEC
        from vllm.v1.spec_decode.ngram_proposer import NgramProposer

        self.k = NGRAM_SPEC["num_speculative_tokens"]
        super().__init__(texts(batch, history_len, steps, FafoConfig.num_speculative_tokens,
                               np.random.default_rng(seed)), history_len)
        self.proposer = NgramProposer(SimpleNamespace(
            speculative_config=SimpleNamespace(num_speculative_tokens=self.k,
                                               prompt_lookup_min=NGRAM_SPEC["prompt_lookup_min"],
                                               prompt_lookup_max=NGRAM_SPEC["prompt_lookup_max"]),
            model_config=SimpleNamespace(max_model_len=self.rows.shape[1]),
            scheduler_config=SimpleNamespace(max_num_seqs=max(batch, 1024)),
            parallel_config=SimpleNamespace(tensor_parallel_size=1),
        ))
        self.sampled = [[int(row[history_len - 1])] for row in self.rows]  # the prefill's token
        self.run()

    def run(self) -> None:
        self.drafts = self.proposer.propose(self.k, self.sampled, self.num_tokens, self.rows)


def measure_ngram(batch: int, history_len: int, steps: int, seed: int = 0, evict_mib: int = 0,
                  timer: Callable[[], float] = time.perf_counter, warm_code: bool = False) -> dict:
    """:func:`measure` for vLLM's ``ngram`` proposer (the matrix's settings) over the same
    texts: its ``propose`` per step, and its tau."""
    run = _NgramSteps(batch, history_len, steps, seed)
    twin = _NgramSteps(batch, history_len, steps, seed + 1) if warm_code else None
    times = _timed_steps(run, twin, steps, cache_eviction(evict_mib), timer)
    return {**_step_times(times), "tau": run.decoded / (steps * batch)}


def _timed_steps(run: _DecodingSteps, twin: _DecodingSteps | None, steps: int,
                 evict: Callable[[], None], timer: Callable[[], float]) -> np.ndarray:
    """``run``'s steps, each timed alone after the eviction (and, with a ``twin``, after the
    twin's step: the same code over its own data)."""
    times = np.empty(steps)
    for step in range(steps):
        run.prepare()
        if twin is not None:
            twin.prepare()
        evict()
        if twin is not None:
            twin.run()
        start = timer()
        run.run()
        times[step] = timer() - start
    return times


def _step_times(times: np.ndarray) -> dict:
    """The mean and the median step (us): the mean holds the rare steps where an array
    grew (FAFO's index, vLLM's buffers), the median what a step costs once they stand."""
    return {"us_per_step": times.mean() * 1e6, "median_us_per_step": float(np.median(times)) * 1e6}


def measure(batch: int, history_len: int, steps: int, controller: str, seed: int = 0,
            cost_ms: tuple[float, ...] = CPU_LIKE_COST_MS,
            num_speculative_tokens: int = FafoConfig.num_speculative_tokens, pad_drafts: bool = False,
            gc_pauses: bool = False, evict_mib: int = 0, settings: dict | None = None,
            timer: Callable[[], float] = time.perf_counter, warm_code: bool = False) -> dict:
    """Per-step host time of ``steps`` decoding steps of ``batch`` requests that start
    with ``history_len`` tokens of prompt, their forwards costing ``cost_ms``; with
    ``gc_pauses``, the full garbage collections during the steps too; with ``evict_mib``,
    that many MiB written before each step (untimed), as a forward leaves the caches;
    with ``warm_code``, a twin proposer over other texts then takes its step (untimed), so
    that the code runs warm and only this proposer's own data is cold; ``settings``: more
    of FAFO's keys (``--set``); ``timer``: what the steps are timed by."""
    config = FafoConfig(**{"num_lanes": 0, "controller": controller, "num_speculative_tokens": num_speculative_tokens,
                           "pad_drafts": pad_drafts, "prior_table": "off", **(settings or {})})
    if gc_pauses:
        gc.collect()
        gc.freeze()
    run = _FafoSteps(config, batch, history_len, steps, seed, cost_ms)
    twin = _FafoSteps(config, batch, history_len, steps, seed + 1, cost_ms) if warm_code else None
    collections = _FullCollections() if gc_pauses else None
    times = _timed_steps(run, twin, steps, cache_eviction(evict_mib), timer)
    result = _step_times(times)
    result |= {"us_per_request_step": result["us_per_step"] / batch, "tau": run.decoded / (steps * batch),
               "slowest_step_ms": times.max() * 1e3}
    if collections is not None:
        collections.stop()
        result |= {"full_collections": len(collections.pauses), "longest_pause_ms": max(collections.pauses, default=0.0),
                   "tracked_objects": len(gc.get_objects())}
        del run, twin
        gc.unfreeze()
    return result


class _FullCollections:
    """The pauses (ms) of the garbage collector's full collections while it listens."""

    def __init__(self) -> None:
        self.pauses: list[float] = []
        self._started = 0.0
        gc.callbacks.append(self._on_collection)

    def _on_collection(self, phase: str, info: dict) -> None:
        if info["generation"] != 2:
            return
        if phase == "start":
            self._started = time.perf_counter()
        else:
            self.pauses.append((time.perf_counter() - self._started) * 1e3)

    def stop(self) -> None:
        gc.callbacks.remove(self._on_collection)


def setting_argument(text: str) -> tuple[str, object]:
    """``KEY=JSON`` -> (key, value), for ``--set``."""
    key, sep, value = text.partition("=")
    key = key.strip()
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"{text!r}: expected KEY=JSON, e.g. share_pool=false")
    keys = sorted(field.name for field in dataclasses.fields(FafoConfig))
    if key not in keys:
        raise argparse.ArgumentTypeError(f"{key!r} is not one of FAFO's keys: {', '.join(keys)}")
    try:
        return key, json.loads(value)
    except json.JSONDecodeError as error:
        raise argparse.ArgumentTypeError(f"{text!r}: the value is not JSON ({error})") from None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-sizes", default="1,32", help="comma-separated")
    parser.add_argument("--history", default="128,1024,8192,65536", help="prompt tokens per request, comma-separated")
    parser.add_argument("--steps", type=int, default=500)
    parser.add_argument("--controller", default="goodput", choices=("goodput", "fixed"))
    parser.add_argument("--num-speculative-tokens", type=int, default=FafoConfig.num_speculative_tokens)
    parser.add_argument("--pad-drafts", action="store_true", help="pad_drafts (needs --controller fixed)")
    parser.add_argument("--gc-pauses", action="store_true",
                        help="freeze the heap first (as vLLM does) and report the full garbage collections")
    parser.add_argument("--evict-mib", type=int, default=0,
                        help="write this many MiB before each step, untimed (96: above the L3, as a CPU forward "
                             "leaves the caches; the engine's host time is the cold one, benchmarks/cold_calls.py)")
    parser.add_argument("--warm-code", action="store_true",
                        help="after each eviction, a twin proposer over other texts takes its step, untimed: the "
                             "code, the interpreter and the libraries warm, the measured proposer's own data cold "
                             "(needs --evict-mib)")
    parser.add_argument("--thread-time", action="store_true",
                        help="time FAFO's steps by the thread's processor time, not the wall clock (a shared machine's "
                             "other tenants then do not count)")
    parser.add_argument("--ngram", action="store_true",
                        help="also vLLM's ngram proposer over the same texts, batch and eviction, and FAFO's time over it")
    parser.add_argument("--cost-ms", default=CPU_LIKE_COST_MS, type=cost_ms_argument,
                        help="STEP,FIRST,PER[,KNEE]: the modelled forward the controller sizes drafts for "
                             "(milliseconds; KNEE: tokens a forward takes at STEP's price, as in replay_pool.py)")
    parser.add_argument("--set", action="append", default=[], type=setting_argument, metavar="KEY=JSON",
                        help="one of FAFO's keys (docs/configuration.md) over the benchmark's, e.g. share_pool=false; "
                             "repeatable")
    args = parser.parse_args()
    if args.warm_code and not args.evict_mib:
        parser.error("--warm-code splits a cold step: it needs --evict-mib (96: caches cold, as after a CPU forward)")
    cost_ms = args.cost_ms
    print(f"controller {args.controller}, "
          f"{args.num_speculative_tokens} speculative tokens{', padded' if args.pad_drafts else ''}, "
          f"{args.steps} steps, no lanes (num_lanes 0), forwards modelled at {','.join(f'{v:g}' for v in cost_ms)} ms"
          f"{', timed by the thread processor time' if args.thread_time else ''}"
          f"{f', {args.evict_mib} MiB evicted before each step' if args.evict_mib else ''}"
          f"{', then a twin proposer stepped (code warm, own data cold)' if args.warm_code else ''}")
    settings = dict(args.set)
    if settings:
        print("settings: " + ", ".join(f"{key}={json.dumps(value)}" for key, value in settings.items()))
    options = {"cost_ms": cost_ms, "num_speculative_tokens": args.num_speculative_tokens,
               "pad_drafts": args.pad_drafts, "settings": settings,
               "timer": time.thread_time if args.thread_time else time.perf_counter}
    measure(1, 128, 100, args.controller, **options)  # the process's first steps run slower
    if args.ngram:
        measure_ngram(1, 128, 100)  # its first steps too
    gc_columns = " full collections | longest pause ms | tracked objects after |" if args.gc_pauses else ""
    ngram_columns = (" ngram us per step | ngram median us | ngram tau | fafo / ngram | fafo / ngram, medians |"
                     if args.ngram else "")
    print(f"| batch | history tokens | us per step | median us | us per request-step | tau | slowest step ms |"
          f"{gc_columns}{ngram_columns}")
    print("|---" * (7 + 3 * args.gc_pauses + 5 * args.ngram) + "|")
    for batch in (int(b) for b in args.batch_sizes.split(",")):
        for length in (int(n) for n in args.history.split(",")):
            result = measure(batch, length, args.steps, args.controller, gc_pauses=args.gc_pauses,
                             evict_mib=args.evict_mib, warm_code=args.warm_code, **options)
            gc_cells = (f" {result['full_collections']} | {result['longest_pause_ms']:.1f} | {result['tracked_objects']} |"
                        if args.gc_pauses else "")
            ngram_cells = ""
            if args.ngram:
                ngram = measure_ngram(batch, length, args.steps, evict_mib=args.evict_mib, timer=options["timer"],
                                      warm_code=args.warm_code)
                ngram_cells = (f" {ngram['us_per_step']:.1f} | {ngram['median_us_per_step']:.1f} | {ngram['tau']:.2f} "
                               f"| {result['us_per_step'] / ngram['us_per_step']:.2f} "
                               f"| {result['median_us_per_step'] / ngram['median_us_per_step']:.2f} |")
            print(f"| {batch} | {length} | {result['us_per_step']:.1f} | {result['median_us_per_step']:.1f} "
                  f"| {result['us_per_request_step']:.1f} | {result['tau']:.2f} | {result['slowest_step_ms']:.3f} |"
                  f"{gc_cells}{ngram_cells}")


if __name__ == "__main__":
    main()
