"""Per-step cost of each compression policy's selection, per request.

Times ``policy.select`` (and, for ``none``, the full-cache read the lanes
then attend to) in one attention layer on random keys held in a real CPU
paged-KV cache tensor, read through the same reader the engine uses, at
several context lengths, for two model shapes: SmolLM2-135M (9 query / 3
KV heads of 64, 30 layers) and Llama-3-8B (32 / 8 heads of 128, 32 layers).
Reports microseconds per layer and per step (x layers) with the default
lane tail (16 lanes x 6 tokens of queries):

- ``quest`` refresh step (fold new keys + score pages + gather) and the
  other steps (fold only), amortised over ``quest_refresh_steps``;
- ``snapkv``: one-off per request (first lane step), not per step;
- ``none``: the full-context read of every step (Lookahead's lanes).

``streaming`` selects nothing and reads nothing: 0.

    python benchmarks/selection_cost.py
"""

from __future__ import annotations

import argparse
import time

import torch

from vllm_fafo.attention.paged_kv import CPUPagedKV
from vllm_fafo.lanes.compression import QuestPolicy, SnapKVPolicy
from vllm_fafo.lanes.compression.base import LaneStep, LayerShape
from vllm_fafo.lanes.compression.quest import QuestSettings
from vllm_fafo.lanes.compression.snapkv import SnapKVSettings

SHAPES = {  # name: (query heads, kv heads, head size, layers)
    "SmolLM2-135M": (9, 3, 64, 30),
    "Llama-3-8B": (32, 8, 128, 32),
}
BLOCK = 32


def paged_cache(context: int, kv_heads: int, head: int, dtype) -> CPUPagedKV:
    blocks = -(-context // BLOCK) + 1
    cache = torch.randn(blocks, kv_heads, BLOCK, 2 * head, dtype=dtype)
    table = torch.randperm(blocks)[None, : blocks - 1].to(torch.int32)
    return CPUPagedKV(cache, table, "vec")


def time_us(fn, repeat: int) -> float:
    fn()  # warm-up
    start = time.perf_counter()
    for _ in range(repeat):
        fn()
    return (time.perf_counter() - start) / repeat * 1e6


def measure(shape: str, context: int, lane_tokens: int, repeat: int, dtype) -> dict:
    heads, kv_heads, head, layers = SHAPES[shape]
    kv = paged_cache(context, kv_heads, head, dtype)
    layer = LayerShape(1, heads, kv_heads, head, context + 64, dtype, torch.device("cpu"))
    query = torch.randn(lane_tokens, heads, head, dtype=dtype)
    scale = head**-0.5

    quest = QuestPolicy(4, 256, QuestSettings())
    state = quest.new_layer_state(layer)
    step = LaneStep(0, 0, context, query, scale)
    quest.select(state, step, kv)  # folds the prompt once, as the first lane step does

    def quest_refresh():
        state.steps[0] = 0  # (steps - 1) % refresh == 0: a refresh step
        state.folded[0] = context - 2  # two new final tokens this step
        quest.select(state, step, kv)

    def quest_fold_only():
        state.steps[0] = 1
        state.folded[0] = context - 2
        quest.select(state, step, kv)

    snap = SnapKVPolicy(4, 256, SnapKVSettings())
    snap_state = snap.new_layer_state(layer)
    snap.observe_prefill(snap_state, 0, context - 32, torch.randn(32, heads, head, dtype=dtype))

    def snapkv_once():
        snap_state.done[0] = False
        snap.select(snap_state, step, kv)

    positions = torch.arange(context)

    def full_read():  # what the region does for FullCachePolicy, every step
        kv.read(0, positions)

    refresh = QuestSettings().refresh_steps
    q_refresh, q_fold = time_us(quest_refresh, repeat), time_us(quest_fold_only, repeat)
    quest_step = (q_refresh + (refresh - 1) * q_fold) / refresh
    row = {
        "shape": shape, "context": context,
        "quest_refresh_us": q_refresh, "quest_fold_us": q_fold, "quest_step_us": quest_step,
        "snapkv_once_us": time_us(snapkv_once, max(1, repeat // 4)),
        "none_step_us": time_us(full_read, repeat),
        "layers": layers,
    }
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--contexts", default="512,2048,8192")
    parser.add_argument("--shapes", default=",".join(SHAPES))
    parser.add_argument("--lane-tokens", type=int, default=16 * 6)
    parser.add_argument("--repeat", type=int, default=20)
    parser.add_argument("--dtype", default="float32")
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    print(f"per request; torch threads {torch.get_num_threads()}; {args.lane_tokens} lane queries; "
          f"{args.dtype}; microseconds per layer (per step = x layers)")
    print("| shape | context | quest refresh | quest fold-only | quest per step (avg, x layers) "
          "| snapkv once per request (x layers) | none per step (x layers) |")
    print("|---|---|---|---|---|---|---|")
    for shape in args.shapes.split(","):
        for context in (int(c) for c in args.contexts.split(",")):
            r = measure(shape, context, args.lane_tokens, args.repeat, dtype)
            n = r["layers"]
            print(f"| {shape} | {context} | {r['quest_refresh_us']:.0f} | {r['quest_fold_us']:.0f} "
                  f"| {r['quest_step_us']:.0f} ({r['quest_step_us'] * n / 1000:.1f} ms) "
                  f"| {r['snapkv_once_us']:.0f} ({r['snapkv_once_us'] * n / 1000:.1f} ms) "
                  f"| {r['none_step_us']:.0f} ({r['none_step_us'] * n / 1000:.1f} ms) |")


if __name__ == "__main__":
    main()
