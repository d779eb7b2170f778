"""Cost of lane attention in one layer: one call per request vs one batched call.

Times, on random tensors of the engine's shapes, the lanes of R requests
attending to their region rows (``kv_budget`` slots, all filled) and their
own lanes: ``lane_attention`` once per request (what the wrapper did before,
and still does for the ``none`` policy) against ``batched_lane_attention``
(one SDPA call for all requests). Microseconds per layer, on this machine's
device (CUDA when present, synchronised, else CPU).

    python benchmarks/lane_attention_cost.py
"""

from __future__ import annotations

import argparse
import time

import torch

from vllm_fafo.attention.lane_attention import batched_lane_attention, lane_attention

SHAPES = {  # name: (query heads, kv heads, head size)
    "SmolLM2-135M": (9, 3, 64),
    "Llama-3-8B": (32, 8, 128),
}


def timed(fn, repeat: int, device: torch.device) -> float:
    fn()  # warm-up
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(repeat):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - start) / repeat * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", default="1,4,8,16")
    parser.add_argument("--shapes", default=",".join(SHAPES))
    parser.add_argument("--kv-budget", type=int, default=256)
    parser.add_argument("--lanes", type=int, default=16)
    parser.add_argument("--lane-len", type=int, default=6)
    parser.add_argument("--repeat", type=int, default=20)
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    n = args.lanes * args.lane_len
    print(f"device {device}, {dtype}, kv_budget {args.kv_budget}, {args.lanes} lanes x {args.lane_len}")
    print("| shape | requests | per-request calls (us/layer) | batched (us/layer) | ratio |")
    print("|---|---|---|---|---|")
    for name in args.shapes.split(","):
        hq, hk, d = SHAPES[name]
        for rows in (int(r) for r in args.requests.split(",")):
            make = lambda *shape: torch.randn(*shape, device=device, dtype=dtype)
            q, k, v = make(rows * n, hq, d), make(rows * n, hk, d), make(rows * n, hk, d)
            rk, rv = make(rows, args.kv_budget, hk, d), make(rows, args.kv_budget, hk, d)
            valid = torch.ones(rows, args.kv_budget, dtype=torch.bool, device=device)
            scale = d**-0.5

            def per_request():
                for r in range(rows):
                    t = slice(r * n, (r + 1) * n)
                    lane_attention(q[t], k[t], v[t], rk[r], rv[r], args.lanes, args.lane_len, scale)

            def batched():
                batched_lane_attention(q, k, v, rk, rv, valid, args.lanes, args.lane_len, scale)

            loop_us = timed(per_request, args.repeat, device)
            batch_us = timed(batched, args.repeat, device)
            print(f"| {name} | {rows} | {loop_us:.0f} | {batch_us:.0f} | {loop_us / batch_us:.2f}x |")


if __name__ == "__main__":
    main()
