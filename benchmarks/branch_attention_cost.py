"""Host time of one step's draft-tree branch attention, all layers, three ways.

Draft-tree branches (vllm_fafo.verification.draft_tree) attend in every layer to the request's
paged KV and their own branch. On CPU they run through vLLM's own attention
kernel (``run_branches_in_kernel``: each branch's keys and values written
over its spine's slots, the kernel called for the branch queries, the
spine's written back; one call per layer for the k-th branch of every
request). This times that per step on synthetic caches shaped like a
model's layers, next to the plugin's written-out attention (the request's
blocks gathered whole, softmax over exactly the keys each branch token sees:
``request_branch_attention``, the dense reference the kernels are tested
against; the CUDA wrapper's branches ran it until FlashAttention's kernel) and
the same attention through ``torch.nn.functional.scaled_dot_product_attention``
with a boolean mask (what the plugin used first), and checks all three agree.

    python benchmarks/branch_attention_cost.py --contexts 300,600,2000
"""

from __future__ import annotations

import argparse
import time
from types import SimpleNamespace

import numpy as np
import torch
import torch.nn.functional as F

from vllm_fafo.attention.branch_attention import kernel_rounds, request_branch_attention, run_branches_in_kernel
from vllm_fafo.attention.cpu import CPUBranchKernel
from vllm_fafo.attention.paged_kv import CPUPagedKV
from vllm_fafo.verification.draft_tree import Branch, BranchPlan, attention_bias, branch_positions, layout_request

SHAPES = {  # query heads, KV heads, head size, layers
    "SmolLM2-135M": (9, 3, 64, 30),
    "Llama-3-8B": (32, 8, 128, 32),
}


def _sdpa(query, key, value, key_tiles, value_tiles, request, scale, bias):
    num_blocks, heads, dim, block_size = key_tiles.shape
    paged_key = key_tiles.permute(1, 0, 3, 2).reshape(heads, num_blocks * block_size, dim)
    paged_value = value_tiles.transpose(0, 1).reshape(heads, num_blocks * block_size, dim)
    keys = torch.cat([paged_key[:, : request.num_paged], key.transpose(0, 1)], dim=1)
    values = torch.cat([paged_value[:, : request.num_paged], value.transpose(0, 1)], dim=1)
    out = F.scaled_dot_product_attention(query.transpose(0, 1), keys, values, attn_mask=bias == 0,
                                         scale=scale, enable_gqa=True)
    return out.transpose(0, 1)


def time_step(shape: str, context: int, branches: list[Branch], block_size: int, repeat: int) -> dict:
    """ms per step of each way, for one request whose current token sits at ``context - 1 -
    its spine``: the batch holds the current token and the spine, then the branch tokens."""
    query_heads, kv_heads, dim, layers = SHAPES[shape]
    gen = torch.Generator().manual_seed(context)
    spine = max(branch.node + len(branch.tokens) for branch in branches)
    x_position = context - 1 - spine
    num_blocks = -(-(context + 64) // block_size)
    cache = torch.randn(num_blocks + 2, kv_heads, block_size, 2 * dim, generator=gen)
    block_table = (torch.randperm(num_blocks + 2, generator=gen)[:num_blocks]).to(torch.int32)[None]
    reader = CPUPagedKV(cache, block_table, "vec")
    request = layout_request("r", 0, 0, x_position, spine + 1, branches)
    bias = torch.from_numpy(attention_bias(request))  # built once per step, read by every layer
    tokens = spine + 1 + request.num_tokens
    query = torch.randn(tokens, query_heads, dim, generator=gen)
    key, value = torch.randn(tokens, kv_heads, dim, generator=gen), torch.randn(tokens, kv_heads, dim, generator=gen)
    reader.write(0, torch.arange(x_position, context), key[: spine + 1], value[: spine + 1])  # as vLLM wrote them
    scale = dim ** -0.5
    rows = request.tokens
    plan = BranchPlan(np.zeros(request.num_tokens, dtype=np.int64), branch_positions(request), (request,))
    kernel = CPUBranchKernel(
        SimpleNamespace(num_heads=query_heads, num_kv_heads=kv_heads, head_size=dim, scale=scale, alibi_slopes=None,
                        sliding_window=-1, logits_soft_cap=0, sinks=None, kv_cache_dtype="auto",
                        attn_type="decoder"),
        SimpleNamespace(isa="vec", _k_scale_float=1.0, _v_scale_float=1.0), cache)

    def written_out(attention) -> torch.Tensor:
        for _ in range(layers):
            key_tiles, value_tiles = reader.read_tiles(0, request.num_paged)
            out = attention(query[rows], key[rows], value[rows], key_tiles, value_tiles, request, scale, bias)
        return out

    def through_kernel() -> torch.Tensor:
        plan.kv_stash.clear()
        output = torch.zeros_like(query)
        rounds = kernel_rounds(plan, block_table, block_size)  # once per step
        for _ in range(layers):
            run_branches_in_kernel(plan, rounds, query, key, value, output, kernel, reader)
        return output[rows]

    ways = {"kernel": through_kernel, "plugin": lambda: written_out(request_branch_attention),
            "sdpa": lambda: written_out(_sdpa)}
    results, outputs = {}, {}
    for name, way in ways.items():
        outputs[name] = way()
        start = time.perf_counter()
        for _ in range(repeat):
            way()
        results[name] = (time.perf_counter() - start) / repeat * 1e3
    torch.testing.assert_close(outputs["plugin"], outputs["sdpa"], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(outputs["kernel"], outputs["plugin"], rtol=1e-4, atol=1e-5)
    return {"shape": shape, "context": context, "branch_tokens": request.num_tokens, **results}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default="SmolLM2-135M", help=f"comma-separated: {', '.join(SHAPES)}")
    parser.add_argument("--contexts", default="300,600,2000")
    parser.add_argument("--branches", default="3,3", help="tokens per branch; branch i hangs off spine node i")
    parser.add_argument("--block-size", type=int, default=128)
    parser.add_argument("--repeat", type=int, default=10)
    args = parser.parse_args()
    branch_lens = [int(n) for n in args.branches.split(",")]
    branches = [Branch(node, tuple(range(1, n + 1))) for node, n in enumerate(branch_lens)]
    print("| shape | context | branch tokens | vLLM kernel ms/step | written out ms/step | torch SDPA ms/step |")
    print("|---|---|---|---|---|---|")
    for shape in args.shapes.split(","):
        if shape not in SHAPES:
            parser.error(f"unknown shape {shape!r}; allowed: {', '.join(SHAPES)}")
        for context in (int(c) for c in args.contexts.split(",")):
            row = time_step(shape, context, branches, args.block_size, args.repeat)
            print(f"| {shape} | {context} | {row['branch_tokens']} | {row['kernel']:.2f} | {row['plugin']:.2f} "
                  f"| {row['sdpa']:.2f} |")


if __name__ == "__main__":
    main()
