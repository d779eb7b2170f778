"""Benchmark matrix: methods x datasets x batch sizes, every method in one run.

Each method runs in its own child process (one engine build per method, a
clean peak-memory figure, no engine left behind), decoding the same prompts
greedily for every dataset and batch size. Every cell is saved as JSON as
soon as it finishes, so an interrupted run resumes where it stopped
(``--force`` redoes cells). The parent then compares each cell with plain
vLLM's (``none``), ``ngram``'s and ``suffix``'s from the same run and writes a summary
JSON, a Markdown table and PNG plots. ``--temperature T`` samples instead (unseeded:
vLLM 0.32.0's CPU runner stops on seeded requests under chunked prefill, see
benchmarks/soak.py); outputs then differ from plain vLLM's by chance and the
identity column reads n/a (tests/test_sampling.py checks the distribution).

    python benchmarks/matrix.py --methods none,ngram,fafo --datasets mtbench \
        --num-prompts 20 --max-tokens 256

``--rounds N`` runs the whole matrix N times, the methods in alternating order, and
reports per-cell medians (``OUT/rounds.md``): methods run one after another, so a
machine whose speed drifts moves one method's cells against another's.

A method is a built-in name (``none``, ``ngram``, ``suffix`` when
arctic-inference is installed, ``fafo``, ``lookahead``, ``cacheback``) or ``LABEL=JSON`` for any
speculative config, e.g. ``'fafo-k8={"method":"fafo","num_speculative_tokens":8}'``. Beside
the speculative config the JSON may carry ``"env"`` (environment variables of that method's
engine process) and ``"engine_args"`` (more ``LLM`` keyword arguments), and ``"method":
"none"`` means no speculative decoding, e.g. plain vLLM on its V1 model runner with whole-step
CUDA graphs: ``'none={"method":"none","env":{"VLLM_USE_V2_MODEL_RUNNER":"0"},
"engine_args":{"compilation_config":{"cudagraph_mode":"FULL"}}}'``.

Figures per cell: tau (decoded tokens / the forwards that gave each request tokens,
counted per request; vLLM's own ratio, ``tau_vllm``, also counts drafts accepted past
``max_tokens`` or EOS and so flatters long drafts),
output tokens/s, wall time per forward step (batch 1), speedup over ``none``,
``ngram`` and ``suffix`` (same run, where they ran),
tail tokens per step (fumble-lane tokens run behind the real ones), peak resident memory of the method's process, and whether the
tokens matched ``none`` token for token. Wall-clock figures depend on the
machine; the summary records which one.

Engines run eager by default (as lanes must); ``--cuda-graphs`` gives the
methods without lanes vLLM's defaults, the fair baseline on a GPU. ``--shape
llama3-8b`` swaps the model for a Llama-3-8B body with random weights
(``load_format="dummy"``): its ms/step prices the same tail layout at a
realistic size, its tau and outputs mean nothing.

``--profile`` runs every cell under cProfile and writes ``OUT/profiles/CELL.txt``:
host milliseconds per engine step spent in the plugin's code (``vllm_fafo``,
its patches) and in the drafter's ``propose``, the heaviest functions, and on
CUDA the call sites that synchronised the GPU (torch's sync debug mode). Those
cells' timings carry the profiler's overhead (``profiled`` in the cell).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import platform
import pstats
import resource
import statistics
import subprocess
import sys
import time
import traceback
import warnings
from collections import Counter
from contextlib import contextmanager
from importlib.util import find_spec
from pathlib import Path

from vllm_fafo.config import FafoConfig
from vllm_fafo.modes import METHODS as FAFO_METHODS
from vllm_fafo.tools.assets import SHAPES

NGRAM_SPEC = {
    "method": "ngram",
    "num_speculative_tokens": 4,
    "prompt_lookup_min": 2,
    "prompt_lookup_max": 4,
}
DEFAULT_NUM_LANES = FafoConfig().num_lanes
DEFAULT_LANE_LEN = FafoConfig().lane_len
BUILTIN_METHODS: dict[str, dict | None] = {
    "none": None,
    "ngram": NGRAM_SPEC,
    "suffix": {"method": "suffix"},  # vLLM's defaults: up to 24 draft tokens, length by match
    "fafo": {"method": "fafo"},
    "lookahead": {"method": "lookahead"},
    "cacheback": {"method": "cacheback"},
}


def engine_steps(llm) -> int:
    """Engine steps so far: the count of vLLM's tokens-per-engine-step histogram."""
    return int(sum(m.count for m in llm.get_metrics() if m.name == "vllm:iteration_tokens_total"))


def generate_counting_forwards(llm, prompts: list[str], params, id_prefix: str) -> tuple[list[list[int]], int]:
    """Decode ``prompts`` together, as ``LLM.generate`` does (one ``LLMEngine.step`` per
    forward), and count, per request, the forwards in which it got new tokens: their
    sum is the denominator of tau, exact at any batch size."""
    engine = llm.llm_engine
    ids = [f"{id_prefix}-{i}" for i in range(len(prompts))]
    for req_id, prompt in zip(ids, prompts):
        engine.add_request(req_id, prompt, params)
    seen = dict.fromkeys(ids, 0)
    token_ids: dict[str, list[int]] = {}
    forwards = 0
    while engine.has_unfinished_requests():
        for output in engine.step():
            produced = len(output.outputs[0].token_ids)
            if produced > seen[output.request_id]:
                seen[output.request_id] = produced
                forwards += 1
            if output.finished:
                token_ids[output.request_id] = list(output.outputs[0].token_ids)
    return [token_ids[req_id] for req_id in ids], forwards


def parse_method(text: str) -> tuple[str, dict | None]:
    """``name`` (built-in) or ``label=JSON`` -> (label, speculative config)."""
    if "=" in text:
        label, spec = text.split("=", 1)
        return label.strip(), json.loads(spec)
    if text not in BUILTIN_METHODS:
        raise SystemExit(
            f"unknown method {text!r}; built-ins: {', '.join(BUILTIN_METHODS)}, "
            "or LABEL=JSON"
        )
    if text == "suffix" and find_spec("arctic_inference") is None:
        raise SystemExit(
            "method 'suffix' (vLLM's suffix decoding) needs the arctic-inference package: "
            "scripts/install_cpu.sh builds it (pip install --no-build-isolation --no-deps "
            "arctic-inference==0.3.0, after nanobind, ninja, cmake and grpcio-tools), "
            "or leave 'suffix' out of --methods")
    return text, BUILTIN_METHODS[text]


def uses_prior_table(method: str) -> bool:
    """Whether a method drafts from the model's prior table: fafo, unless it turns it off
    (Lookahead and Cacheback never do)."""
    spec = parse_method(method)[1] or {}
    return spec.get("method") == "fafo" and spec.get("prior_table", "auto") == "auto"


def engine_settings(config: dict | None) -> tuple[dict | None, dict[str, str], dict]:
    """A method's JSON split into (speculative config or None, env, engine_args)."""
    if config is None:
        return None, {}, {}
    spec = dict(config)
    env, engine_args = spec.pop("env", {}), spec.pop("engine_args", {})
    if spec.get("method") == "none":
        if len(spec) > 1:
            raise SystemExit(f"method 'none' takes no speculative settings, got {sorted(spec)}")
        spec = None
    return spec, {key: str(value) for key, value in env.items()}, engine_args


def cell_path(out: Path, label: str, dataset: str, batch_size: int) -> Path:
    return out / "cells" / f"{label}__{dataset}__b{batch_size}.json"


# Child process: one method, every dataset and batch size ----------------------


def forget_earlier_cells(llm) -> None:
    """Cells reuse one engine but must not learn from each other: the same prompts
    run at every batch size, and an earlier cell's outputs are this cell's answers.
    Clears vLLM's prefix cache and what a method keeps across requests (vLLM
    ``suffix``'s tree of past responses, FAFO's shared pool); cross-request memory
    still works within a cell, across its different prompts."""
    llm.reset_prefix_cache()
    llm.collective_rpc(_forget_past_responses)


def _forget_past_responses(worker) -> int:
    drafter = getattr(worker.model_runner, "drafter", None)
    if hasattr(drafter, "forget_shared_pool"):
        drafter.forget_shared_pool()
    cache = getattr(drafter, "suffix_cache", None)
    if cache is None:
        return 0
    cached = list(cache.cached_requests)
    for req_id in cached:
        cache.evict_cached_response(req_id)
    return len(cached)


@contextmanager
def profiled(enabled: bool, report_path: Path, steps_of):
    """cProfile (and, on CUDA, torch's sync debug mode) around a cell; writes the report.

    ``steps_of()`` returns the engine steps so far, to give per-step figures."""
    if not enabled:
        yield
        return
    import torch

    syncs: Counter[str] = Counter()
    use_cuda = torch.cuda.is_available()

    def note_sync(message, category, filename, lineno, file=None, line=None):
        if "synchronizing" not in str(message):
            return
        frames = [f for f in traceback.extract_stack()[:-1]
                  if "/torch/" not in f.filename and "warnings" not in f.filename]
        site = frames[-1] if frames else None
        syncs[f"{site.filename}:{site.lineno} {site.name}" if site else "?"] += 1

    steps_before = steps_of()
    profiler = cProfile.Profile()
    with warnings.catch_warnings():
        if use_cuda:
            warnings.simplefilter("always")
            warnings.showwarning = note_sync
            torch.cuda.set_sync_debug_mode("warn")
        profiler.enable()
        try:
            yield
        finally:
            profiler.disable()
            if use_cuda:
                torch.cuda.set_sync_debug_mode("default")
    steps = max(1, steps_of() - steps_before)
    report_path.parent.mkdir(parents=True, exist_ok=True)
    report_path.write_text(profile_report(profiler, steps, syncs))


def profile_report(profiler: cProfile.Profile, steps: int, syncs: Counter[str]) -> str:
    """Per engine step: host ms in the plugin's own code (self time of functions in
    ``vllm_fafo`` files, patches included), in drafters' ``propose`` (cumulative), and
    the GPU synchronisation sites; then the top functions, and the plugin's."""
    stats = pstats.Stats(profiler)
    plugin_s = sum(row[2] for (filename, _, _), row in stats.stats.items() if "vllm_fafo" in filename)
    propose_s = sum(row[3] for (filename, _, name), row in stats.stats.items()
                    if name == "propose" and ("spec_decode" in filename or "vllm_fafo" in filename))
    lines = [f"engine steps: {steps}",
             f"host ms per step, total profiled: {1000 * stats.total_tt / steps:.3f}",
             f"host ms per step in vllm_fafo code (self time): {1000 * plugin_s / steps:.3f}",
             f"host ms per step in drafter propose (cumulative): {1000 * propose_s / steps:.3f}",
             f"GPU synchronisations per step: {sum(syncs.values()) / steps:.2f}", ""]
    for site, count in syncs.most_common(20):
        lines.append(f"  {count / steps:6.2f} per step  {site}")
    for title, key, restrictions in (("top by tottime", "tottime", (35,)),
                                     ("top by cumulative", "cumulative", (35,)),
                                     ("vllm_fafo's functions by cumulative", "cumulative", ("vllm_fafo", 30))):
        buffer = io.StringIO()
        pstats.Stats(profiler, stream=buffer).sort_stats(key).print_stats(*restrictions)
        lines += ["", f"== {title}", buffer.getvalue()]
    return "\n".join(lines)


def run_method_cells(args: argparse.Namespace) -> None:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # peak memory is this process's
    label, config = parse_method(args.child)
    spec, env, engine_args = engine_settings(config)
    os.environ.update(env)
    out = Path(args.out)
    todo = [
        (d, b) for d in args.datasets.split(",") for b in _ints(args.batch_sizes)
        if args.force or not cell_path(out, label, d, b).exists()
    ]
    if not todo:
        return  # before importing vLLM: a resumed matrix skips a finished method in seconds
    import torch
    from tqdm import tqdm
    from vllm import LLM, SamplingParams

    from vllm_fafo.serving.metrics import collect_metrics, vllm_spec_counters
    from vllm_fafo.tools.assets import chat_prompt, load_prompts, shaped_model_dir, smollm2_dir
    if args.shape:
        model, load_format = str(shaped_model_dir(args.shape)), "dummy"
    else:
        model, load_format = args.model or str(smollm2_dir()), "auto"
    settings = dict(
        model=model,
        load_format=load_format,
        dtype=args.dtype,
        enforce_eager=not args.cuda_graphs,
        seed=0,
        max_model_len=args.max_model_len,
        hf_overrides=None if args.max_position_embeddings is None else {
            "max_position_embeddings": args.max_position_embeddings},
        disable_log_stats=False,
        kv_cache_memory_bytes=args.kv_cache_mib * 1024 * 1024,
        speculative_config=spec,
    )
    if clash := sorted(settings.keys() & engine_args.keys()):
        raise SystemExit(f"method {label!r}: engine_args {clash} are set by matrix.py's own options")
    llm = LLM(**settings, **engine_args)

    tokenizer = llm.get_tokenizer()
    params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens)
    llm.generate(["Warm-up."], SamplingParams(temperature=0.0, max_tokens=8), use_tqdm=False)
    is_fafo = bool(spec) and spec.get("method") in FAFO_METHODS

    def tail_counters() -> tuple[int, int, int, int]:
        """Lane tokens, draft-tree branch tokens, tokens accepted off the spine, steps."""
        if not is_fafo:
            return 0, 0, 0, 0
        metrics = collect_metrics(llm)
        return (metrics["tail_tokens"], metrics["tree_tokens"], metrics["branch_accepted_tokens"],
                metrics["propose_calls"])
    for dataset, batch_size in todo:
        forget_earlier_cells(llm)
        texts = load_prompts(dataset, args.num_prompts)
        prompts = [chat_prompt(tokenizer, t) for t in texts]
        counters_before = vllm_spec_counters(llm)
        engine_steps_before = engine_steps(llm)
        tail_before, tree_before, branch_before, steps_before = tail_counters()
        token_ids: list[list[int]] = []
        forwards = 0
        report = out / "profiles" / f"{label}__{dataset}__b{batch_size}.txt"
        start = time.perf_counter()
        with profiled(args.profile, report, lambda: engine_steps(llm)), tqdm(
                total=len(prompts), desc=f"{label} {dataset} b{batch_size}", unit="prompt") as bar:
            for i in range(0, len(prompts), batch_size):
                chunk = prompts[i : i + batch_size]
                chunk_ids, chunk_forwards = generate_counting_forwards(
                    llm, chunk, params, id_prefix=f"{dataset}-b{batch_size}-{i}")
                token_ids += chunk_ids
                forwards += chunk_forwards
                bar.update(len(chunk))
        seconds = time.perf_counter() - start
        counters = vllm_spec_counters(llm)
        accepted = counters["num_accepted_tokens"] - counters_before["num_accepted_tokens"]
        drafted = counters["num_draft_tokens"] - counters_before["num_draft_tokens"]
        forward_steps = engine_steps(llm) - engine_steps_before
        tail_after, tree_after, branch_after, steps_after = tail_counters()
        steps = steps_after - steps_before
        tokens = sum(map(len, token_ids))
        cell = {
            "method": label, "dataset": dataset, "batch_size": batch_size,
            "config": config, "prompts": len(prompts), "max_tokens": args.max_tokens,
            "temperature": args.temperature, "profiled": args.profile,
            "enforce_eager": llm.llm_engine.vllm_config.model_config.enforce_eager,
            "tokens": tokens, "accepted": int(accepted),
            # Per request, the forwards that gave it tokens (vLLM's own count, tokens over
            # tokens - accepted, also counts drafts accepted past max_tokens or EOS, and is
            # undefined (None) when those make the accepted drafts outnumber the tokens kept).
            "request_forwards": forwards,
            "tau": tokens / forwards,
            "tau_vllm": tokens / (tokens - accepted) if accepted < tokens else None,
            "seconds": seconds,
            # Engine steps, counted by vLLM (not tokens - accepted: vLLM also counts accepted
            # drafts that ran past max_tokens). At batch 1 each is one request's forward.
            "engine_steps": forward_steps,
            "ms_per_step": 1000 * seconds / forward_steps if batch_size == 1 and forward_steps else None,
            "tokens_per_s": tokens / seconds,
            # Draft tokens vLLM verified per engine step (what a method pays for its tau).
            "draft_tokens_per_step": drafted / forward_steps if forward_steps else 0.0,
            "tail_tokens_per_step": (tail_after - tail_before) / steps if steps else 0.0,
            "tree_tokens_per_step": (tree_after - tree_before) / steps if steps else 0.0,
            "branch_accepted_tokens": branch_after - branch_before,
            "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            # The engine runs in this process (no multiprocessing): its CUDA allocations are ours.
            "peak_gpu_mib": torch.cuda.max_memory_allocated() / 2**20 if torch.cuda.is_available() else None,
            "token_ids": token_ids,
        }
        path = cell_path(out, label, dataset, batch_size)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(cell))


# Parent process: orchestrate, compare, report ----------------------------------


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",")]


def summarize(args: argparse.Namespace, labels: list[str]) -> list[dict]:
    out = Path(args.out)
    rows = []
    for dataset in args.datasets.split(","):
        for batch_size in _ints(args.batch_sizes):
            cells = {
                label: json.loads(cell_path(out, label, dataset, batch_size).read_text())
                for label in labels
            }
            plain, ngram, suffix = cells.get("none"), cells.get("ngram"), cells.get("suffix")
            for cell in cells.values():
                row = {k: v for k, v in cell.items() if k != "token_ids"}
                row["speedup_vs_none"] = (
                    cell["tokens_per_s"] / plain["tokens_per_s"] if plain else None)
                row["speedup_vs_ngram"] = (
                    cell["tokens_per_s"] / ngram["tokens_per_s"] if ngram else None)
                row["speedup_vs_suffix"] = (
                    cell["tokens_per_s"] / suffix["tokens_per_s"] if suffix else None)
                row["identical_to_none"] = (  # sampled outputs differ by chance
                    cell["token_ids"] == plain["token_ids"] if plain and not cell.get("temperature") else None)
                rows.append(row)
    return rows


def markdown_table(rows: list[dict], machine: str) -> str:
    def fmt(value, spec=".2f"):
        return "n/a" if value is None else format(value, spec)

    lines = [
        f"Machine: {machine}. tau is hardware independent; tokens/s and speedups are"
        " this machine's.",
        "",
        "| dataset | batch | method | tau | tokens/s | ms/step | speedup vs none | speedup vs ngram"
        " | speedup vs suffix | draft tok/step | tail tok/step | peak RSS MiB | peak GPU MiB | identical to none |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        same = "n/a" if r["identical_to_none"] is None else ("yes" if r["identical_to_none"] else "NO")
        lines.append(
            f"| {r['dataset']} | {r['batch_size']} | {r['method']} | {r['tau']:.3f} "
            f"| {r['tokens_per_s']:.1f} | {fmt(r.get('ms_per_step'), '.1f')} | {fmt(r['speedup_vs_none'])} "
            f"| {fmt(r['speedup_vs_ngram'])} | {fmt(r.get('speedup_vs_suffix'))} "
            f"| {fmt(r.get('draft_tokens_per_step'), '.1f')} | {r['tail_tokens_per_step']:.1f} "
            f"| {r['peak_rss_mib']:.0f} | {fmt(r.get('peak_gpu_mib'), '.0f')} | {same} |"
        )
    return "\n".join(lines) + "\n"


def _save(fig, path: Path) -> Path:
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot(rows: list[dict], out: Path) -> list[Path]:
    """tau and speedup per dataset and method (batch 1), and against batch size."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    datasets = sorted({r["dataset"] for r in rows})
    methods = list(dict.fromkeys(r["method"] for r in rows))
    smallest_batch = min(r["batch_size"] for r in rows)
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    width = 0.8 / max(1, len(methods))
    for j, (key, title) in enumerate([("tau", "tau (accepted tokens / step)"),
                                      ("speedup_vs_none", "speedup vs plain vLLM")]):
        ax = axes[j]
        for i, method in enumerate(methods):
            values = [
                next((r[key] or 0.0 for r in rows if r["dataset"] == d
                      and r["method"] == method and r["batch_size"] == smallest_batch), 0.0)
                for d in datasets
            ]
            ax.bar([x + i * width for x in range(len(datasets))], values, width, label=method)
        ax.set_xticks([x + width * (len(methods) - 1) / 2 for x in range(len(datasets))])
        ax.set_xticklabels(datasets)
        ax.set_title(f"{title}, batch {smallest_batch}")
    axes[0].legend(fontsize=8)
    written.append(_save(fig, out / "tau_speedup_by_dataset.png"))

    lane_rows = [r for r in rows if (r["config"] or {}).get("method") == "fafo"
                 and r["batch_size"] == smallest_batch]
    lane_counts = {(r["config"] or {}).get("num_lanes", DEFAULT_NUM_LANES) for r in lane_rows}
    if len(lane_counts) > 1:
        fig, axes = plt.subplots(1, 2, figsize=(11, 4))
        for (key, title), ax in zip([("tau", "tau"), ("speedup_vs_none", "speedup vs plain")], axes):
            groups: dict[tuple[str, int], list[tuple[int, float]]] = {}
            for r in lane_rows:
                config = r["config"]
                lanes = config.get("num_lanes", DEFAULT_NUM_LANES)
                lane_len = config.get("lane_len", DEFAULT_LANE_LEN) if lanes else 0
                groups.setdefault((r["dataset"], lane_len), []).append((lanes, r[key] or 0.0))
            for (dataset, lane_len), points in sorted(groups.items()):
                label = f"{dataset}, pool only" if lane_len == 0 else f"{dataset}, lane_len {lane_len}"
                style = "x" if lane_len == 0 else "o-"
                ax.plot(*zip(*sorted(points)), style, label=label)
            ax.set_xlabel("num_lanes")
            ax.set_title(f"{title} against lanes, batch {smallest_batch}")
        axes[0].legend(fontsize=8)
        written.append(_save(fig, out / "tau_speedup_by_lanes.png"))

    batch_sizes = sorted({r["batch_size"] for r in rows})
    if len(batch_sizes) > 1:
        fig, ax = plt.subplots(figsize=(6, 4))
        for method in methods:
            for dataset in datasets:
                points = sorted((r["batch_size"], r["speedup_vs_none"] or 0.0) for r in rows
                                if r["method"] == method and r["dataset"] == dataset)
                ax.plot(*zip(*points), marker="o", label=f"{method} {dataset}")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("batch size")
        ax.set_ylabel("speedup vs plain vLLM")
        ax.legend(fontsize=7)
        written.append(_save(fig, out / "speedup_by_batch_size.png"))
    return written


def run_rounds(args: argparse.Namespace, methods: list[str], labels: list[str], child_args: list[str]) -> None:
    """``--rounds N``: the whole matrix N times (into OUT/round1 ..), the methods in
    alternating order (forward, then backward), and per cell the median over rounds of
    tokens/s and of its ratio to the best other method of the same round. Why: the
    methods run one after another, and a machine whose speed drifts (a CPU shared with
    others) moves one method's cells against another's; alternating the order and
    taking medians cancels a steady drift and damps a passing one."""
    out = Path(args.out)
    per_round: list[list[dict]] = []
    for index in range(args.rounds):
        round_out = out / f"round{index + 1}"
        for method in (methods if index % 2 == 0 else methods[::-1]):
            subprocess.run([sys.executable, __file__, *child_args, "--out", str(round_out), "--child", method],
                           check=True)
        per_round.append(summarize(argparse.Namespace(**{**vars(args), "out": str(round_out)}), labels))
    table = rounds_table(per_round)
    out.mkdir(parents=True, exist_ok=True)
    (out / "rounds.md").write_text(table)
    (out / "rounds.json").write_text(json.dumps({
        "date": time.strftime("%Y-%m-%d"), "machine": machine_description(),
        "args": {k: v for k, v in vars(args).items() if k != "child"},
        "rounds": [[{k: v for k, v in row.items() if k != "token_ids"} for row in rows] for rows in per_round],
    }, indent=1))
    print(table)
    print(f"wrote {out / 'rounds.md'}, {out / 'rounds.json'}")


def rounds_table(per_round: list[list[dict]]) -> str:
    """Per cell: tokens/s of every round, their median, and the median over rounds of
    the ratio to the best other method of that round."""
    lines = ["| dataset | batch | method | tokens/s by round | median tokens/s | median ratio to best other |"
             " identical to none |",
             "|---|---|---|---|---|---|---|"]
    for position, first in enumerate(per_round[0]):
        cells = [rows[position] for rows in per_round]
        ratios = []
        for rows, cell in zip(per_round, cells):
            others = [r["tokens_per_s"] for r in rows if r["dataset"] == cell["dataset"]
                      and r["batch_size"] == cell["batch_size"] and r["method"] != cell["method"]]
            if others:
                ratios.append(cell["tokens_per_s"] / max(others))
        same = {c["identical_to_none"] for c in cells}
        identical = "n/a" if same == {None} else ("yes" if same == {True} else "NO")
        lines.append(
            f"| {first['dataset']} | {first['batch_size']} | {first['method']} | "
            + " / ".join(f"{c['tokens_per_s']:.1f}" for c in cells)
            + f" | {statistics.median(c['tokens_per_s'] for c in cells):.1f} | "
            + (f"{statistics.median(ratios):.2f}" if ratios else "n/a") + f" | {identical} |")
    return "\n".join(lines) + "\n"


def machine_description() -> dict:
    import torch
    import vllm

    return {
        "platform": platform.platform(), "processor": platform.processor(),
        "cpus": os.cpu_count(), "torch": torch.__version__, "vllm": vllm.__version__,
        "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--methods", default="none,ngram,suffix,fafo",
                        help="comma list of built-ins; LABEL=JSON entries via --method")
    parser.add_argument("--method", action="append", default=[],
                        help="extra LABEL=JSON method (repeatable)")
    parser.add_argument("--datasets", default="mtbench")
    parser.add_argument("--batch-sizes", default="1")
    parser.add_argument("--num-prompts", type=int, default=20)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--temperature", type=float, default=0.0,
                        help="0: greedy (outputs checked against plain vLLM's); above 0: unseeded sampling")
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--max-position-embeddings", type=int, default=None,
                        help="override the model's trained positions (hf_overrides), to run a "
                             "max_model_len past them: SmolLM2 has 8192, the long16k prompts need "
                             "--max-model-len 16896 and this at least as large")
    model = parser.add_mutually_exclusive_group()
    model.add_argument("--model", default=None, help="HF folder; default: SmolLM2 built offline")
    model.add_argument("--shape", default=None, choices=sorted(SHAPES),
                       help="a model body with random weights (load_format dummy), "
                            "for step cost only: its tau and outputs mean nothing")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--cuda-graphs", action="store_true",
                        help="let methods without lanes run with vLLM's defaults (CUDA graphs, "
                             "compile) instead of eager; lanes always run eager")
    parser.add_argument("--kv-cache-mib", type=int, default=512)
    parser.add_argument("--out", default="benchmarks/results/latest")
    parser.add_argument("--force", action="store_true", help="redo finished cells")
    parser.add_argument("--rounds", type=int, default=1,
                        help="run the matrix this many times, methods in alternating order, into "
                             "OUT/round1.. and report per-cell medians (OUT/rounds.md)")
    parser.add_argument("--profile", action="store_true",
                        help="run each cell under cProfile (and torch's CUDA sync debug mode) and "
                             "write OUT/profiles/CELL.txt; timings then carry the profiler's overhead")
    parser.add_argument("--summarize-only", action="store_true",
                        help="run nothing: summarize the methods whose cells are all in OUT "
                             "(a matrix cut by a time limit; run it where the cells ran: the "
                             "summary names this machine)")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.temperature < 0:
        parser.error(f"--temperature must be at least 0, got {args.temperature}")
    if args.rounds < 1:
        parser.error(f"--rounds must be at least 1, got {args.rounds}")

    if args.child is not None:
        run_method_cells(args)
        return

    methods = [m for m in args.methods.split(",") if m] + args.method
    labels = [parse_method(m)[0] for m in methods]
    if len(set(labels)) != len(labels):
        raise SystemExit(f"method labels must be unique, got {labels}")
    child_args = [a for a in sys.argv[1:]]
    if args.rounds > 1:
        run_rounds(args, methods, labels, child_args)
        return
    out = Path(args.out)
    if args.summarize_only:
        labels = [label for label in labels if all(
            cell_path(out, label, d, b).exists()
            for d in args.datasets.split(",") for b in _ints(args.batch_sizes))]
        if not labels:
            raise SystemExit(f"--summarize-only: no method has all its cells in {out / 'cells'}")
    else:
        if not args.model and not args.shape and any(uses_prior_table(m) for m in methods):
            from vllm_fafo.tools.assets import smollm2_prior_table

            smollm2_prior_table()  # before the first fafo engine: the set-up does not build it
        for method in methods:
            subprocess.run([sys.executable, __file__, *child_args, "--child", method], check=True)

    rows = summarize(args, labels)
    machine = machine_description()
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True, cwd=Path(__file__).parent).stdout.strip()
    summary = {"date": time.strftime("%Y-%m-%d"), "commit": commit, "machine": machine,
               "args": {k: v for k, v in vars(args).items() if k != "child"}, "rows": rows}
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    table = markdown_table(rows, machine.get("device", "cpu") + f", {machine['cpus']} cpus")
    (out / "summary.md").write_text(table)
    plots = plot(rows, out)
    print(table)
    print(f"wrote {out / 'summary.json'}, {out / 'summary.md'}, "
          + ", ".join(str(p) for p in plots))


if __name__ == "__main__":
    main()
