"""Host time of one step's draft-tree branch attention, all layers, against torch SDPA.

Draft-tree branches (vllm_fafo.tree) run their own attention in every layer:
the request's blocks gathered whole from vLLM's CPU paged cache, then
softmax over exactly the keys each branch token sees
(``request_branch_attention``). This times that per step on synthetic caches
shaped like a model's layers, next to the same attention through
``torch.nn.functional.scaled_dot_product_attention`` with a boolean mask
(what the plugin used first), and checks they agree.

    python benchmarks/branch_attention_cost.py --contexts 300,600,2000
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from vllm_fafo.attention.branch_attention import request_branch_attention
from vllm_fafo.attention.paged_kv import CPUPagedKV
from vllm_fafo.tree import Branch, layout_request

SHAPES = {  # query heads, KV heads, head size, layers
    "SmolLM2-135M": (9, 3, 64, 30),
    "Llama-3-8B": (32, 8, 128, 32),
}


def _sdpa(query, key, value, key_tiles, value_tiles, request, scale):
    num_blocks, heads, dim, block_size = key_tiles.shape
    paged_key = key_tiles.permute(1, 0, 3, 2).reshape(heads, num_blocks * block_size, dim)
    paged_value = value_tiles.transpose(0, 1).reshape(heads, num_blocks * block_size, dim)
    keys = torch.cat([paged_key[:, : request.num_paged], key.transpose(0, 1)], dim=1)
    values = torch.cat([paged_value[:, : request.num_paged], value.transpose(0, 1)], dim=1)
    out = F.scaled_dot_product_attention(query.transpose(0, 1), keys, values, attn_mask=request.bias == 0,
                                         scale=scale, enable_gqa=True)
    return out.transpose(0, 1)


def time_step(shape: str, context: int, branches: list[Branch], block_size: int, repeat: int) -> dict:
    query_heads, kv_heads, dim, layers = SHAPES[shape]
    gen = torch.Generator().manual_seed(context)
    num_blocks = -(-(context + 64) // block_size)
    cache = torch.randn(num_blocks + 2, kv_heads, block_size, 2 * dim, generator=gen)
    block_table = (torch.randperm(num_blocks + 2, generator=gen)[:num_blocks]).to(torch.int32)[None]
    reader = CPUPagedKV(cache, block_table, "vec")
    request = layout_request("r", 0, 0, context - 1 - max(b.node for b in branches), 0, branches,
                             torch.device("cpu"))
    tokens = request.num_tokens
    query = torch.randn(tokens, query_heads, dim, generator=gen)
    key, value = torch.randn(tokens, kv_heads, dim, generator=gen), torch.randn(tokens, kv_heads, dim, generator=gen)
    scale = dim ** -0.5

    def step(attention) -> torch.Tensor:
        for _ in range(layers):
            key_tiles, value_tiles = reader.read_tiles(0, request.num_paged)
            out = attention(query, key, value, key_tiles, value_tiles, request, scale)
        return out

    results = {}
    for name, attention in (("plugin", request_branch_attention), ("sdpa", _sdpa)):
        step(attention)
        start = time.perf_counter()
        for _ in range(repeat):
            out = step(attention)
        results[name] = (time.perf_counter() - start) / repeat * 1e3
        results[name + "_out"] = out
    torch.testing.assert_close(results.pop("plugin_out"), results.pop("sdpa_out"), rtol=1e-4, atol=1e-5)
    return {"shape": shape, "context": context, "branch_tokens": tokens, **results}


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
    print("| shape | context | branch tokens | plugin ms/step | torch SDPA ms/step |")
    print("|---|---|---|---|---|")
    for shape in args.shapes.split(","):
        if shape not in SHAPES:
            parser.error(f"unknown shape {shape!r}; allowed: {', '.join(SHAPES)}")
        for context in (int(c) for c in args.contexts.split(",")):
            row = time_step(shape, context, branches, args.block_size, args.repeat)
            print(f"| {shape} | {context} | {row['branch_tokens']} | {row['plugin']:.2f} | {row['sdpa']:.2f} |")


if __name__ == "__main__":
    main()
