"""Per-step cost of FafoProposer.propose against sequence length.

The proposer files only the n-grams that this step's accepted tokens
completed and looks up K suffixes, so its cost per step must stay flat as
the history grows. This drives it directly (no engine) with a fake batch of
one request whose history is random tokens, and reports microseconds per
step at several lengths.

    python benchmarks/proposer_step_cost.py
"""

from __future__ import annotations

import argparse
import time
from types import SimpleNamespace

import numpy as np

from vllm_fafo.config import FafoConfig
from vllm_fafo.proposer import FafoProposer


def step_cost_us(history_len: int, steps: int, accepted_per_step: int, seed: int = 0) -> float:
    config = FafoConfig(num_lanes=0)  # the pool's own cost; lanes cost model compute
    max_len = history_len + steps * (accepted_per_step + 1) + 8
    proposer = FafoProposer(SimpleNamespace(
        speculative_config=SimpleNamespace(num_speculative_tokens=config.num_speculative_tokens),
        additional_config={"fafo": config.to_dict()},
        model_config=SimpleNamespace(max_model_len=max_len),
    ))
    rng = np.random.default_rng(seed)
    row = rng.integers(0, 1000, size=(1, max_len)).astype(np.int32)
    num_tokens = np.array([history_len], dtype=np.int32)
    proposer.begin_step((), 0, {})
    proposer.finish_forward(["r"], None)
    proposer.propose([[int(row[0, history_len - 1])]], num_tokens, row)  # prefill seeding
    start = time.perf_counter()
    for _ in range(steps):
        sampled = [0] * (accepted_per_step + 1)
        num_tokens[0] += len(sampled)
        proposer.begin_step((), 0, {})
        proposer.finish_forward(["r"], None)
        proposer.propose([sampled], num_tokens, row)
    return (time.perf_counter() - start) / steps * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--accepted", type=int, default=2)
    args = parser.parse_args()
    print("| history tokens | us per step |")
    print("|---|---|")
    for length in (128, 1024, 8192, 65536):
        print(f"| {length} | {step_cost_us(length, args.steps, args.accepted):.1f} |")


if __name__ == "__main__":
    main()
