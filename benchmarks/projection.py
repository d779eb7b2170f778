"""Projected speedup at a realistic model size, labelled as a projection.

tau depends on the proposals (measured on real text with the small real
model); the cost of a step with the tail depends on the model size (measured
with ``matrix.py --shape llama3-8b``, random weights, same tail layout). At
batch 1:

    projected speedup(method) = tau(method) * ms_per_step(none) / ms_per_step(method)

    python benchmarks/projection.py --tau benchmarks/results/gpu_smollm2 \
        --cost benchmarks/results/gpu_llama3_8b_shape

It is not a measurement: the big model's own proposals would differ.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def batch1_rows(run_dir: Path) -> list[dict]:
    rows = json.loads((run_dir / "summary.json").read_text())["rows"]
    return [r for r in rows if r["batch_size"] == 1]


def project(tau_rows: list[dict], cost_rows: list[dict]) -> list[dict]:
    """One row per (dataset, method) with a tau and a step cost for both it and ``none``."""
    cost = {}
    for r in cost_rows:  # ms/step does not depend on the text: average over datasets
        cost.setdefault(r["method"], []).append(r["ms_per_step"])
    cost = {method: sum(values) / len(values) for method, values in cost.items()}
    if "none" not in cost:
        raise SystemExit("the cost run has no 'none' cell: run it with --methods none,...")
    out = []
    for r in tau_rows:
        if r["method"] not in cost:
            continue
        ratio = cost["none"] / cost[r["method"]]
        out.append({
            "dataset": r["dataset"], "method": r["method"], "tau": r["tau"],
            "ms_per_step": cost[r["method"]], "step_cost_ratio": 1 / ratio,
            "projected_speedup": r["tau"] * ratio,
        })
    return out


def markdown(rows: list[dict], tau_dir: Path, cost_dir: Path) -> str:
    lines = [
        f"**Projection**, not a measurement: tau from `{tau_dir}`, step cost from "
        f"`{cost_dir}` (batch 1).",
        "",
        "| dataset | method | tau | ms/step (big body) | step cost vs none | projected speedup |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['dataset']} | {r['method']} | {r['tau']:.3f} | {r['ms_per_step']:.2f} "
            f"| {r['step_cost_ratio']:.2f}x | {r['projected_speedup']:.2f}x |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tau", type=Path, required=True, help="matrix.py output on real text")
    parser.add_argument("--cost", type=Path, required=True, help="matrix.py --shape output")
    args = parser.parse_args()
    text = markdown(project(batch1_rows(args.tau), batch1_rows(args.cost)), args.tau, args.cost)
    (args.cost / "projection.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
