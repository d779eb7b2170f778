"""Whether vLLM's CPU attention kernel gives one query row the same bits whatever batch it runs in.

A draft-tree branch is exact only if the target's logits at its tokens are the
ones a spine verification of the same tokens would give. On CPU the plugin runs
branch queries through vLLM's own kernel (docs/results/draft-trees.md), but in
another arrangement than a verification: alone or beside other requests'
branches. That is exact if the kernel's output for a query row depends only
on that row's query and keys, not on the rows and requests around it. This calls ``ops.cpu_attention_with_kv_cache``
(vLLM 0.32.0) on a random paged cache for one request of ``q`` query rows
(a verification step), then for the same rows

- beside other requests of other lengths (a batch),
- each row as a request of its own (a decode step, or a branch token),
- split into two requests, the later rows on their own (a branch beside its spine),

and reports whether each output equals the first bit for bit.

    python benchmarks/cpu_attention_row_invariance.py --dtype bfloat16 --split-kv on
    python benchmarks/cpu_attention_row_invariance.py --dtype float32 --split-kv off
"""

from __future__ import annotations

import argparse

import torch
from vllm import _custom_ops as ops
from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 9, 3, 64, 128
"""SmolLM2-135M's attention, vLLM's CPU block size."""
NUM_BLOCKS = 64
CASES = ((300, 9), (600, 17), (1500, 5), (129, 3), (2000, 17))
"""(tokens in the request's cache, query rows at its end)."""

Request = tuple[list[int], int, torch.Tensor]
"""Block ids, tokens in the cache (the last query row's position + 1), query rows."""


def enable_amx_tiles() -> None:
    """Ask Linux for this process's AMX tile state, which vLLM's AMX attention kernel
    uses and does not ask for: in the engine oneDNN's bfloat16 matrix products ask
    first, here the kernel runs first and dies of an illegal instruction without it."""
    if not torch._C._cpu._init_amx():
        raise RuntimeError("CPU attention ISA 'amx', but Linux refused this process the AMX tile state")


class PagedAttention:
    """vLLM's CPU attention over one random paged cache."""

    def __init__(self, dtype: torch.dtype, split_kv: bool) -> None:
        self.dtype, self.split_kv = dtype, split_kv
        self.isa = _get_attn_isa(dtype, BLOCK_SIZE, HEAD_DIM)
        if self.isa == "amx":
            enable_amx_tiles()
        self.kv_cache = torch.randn(NUM_BLOCKS, NUM_KV_HEADS, BLOCK_SIZE, 2 * HEAD_DIM, dtype=dtype)
        """vLLM's CPU cache shape; split into keys and values as its forward does."""
        halves = self.kv_cache.view(NUM_BLOCKS, NUM_KV_HEADS, 2 * BLOCK_SIZE, HEAD_DIM)
        self.key_cache, self.value_cache = halves.chunk(2, dim=2)

    def __call__(self, requests: list[Request]) -> list[torch.Tensor]:
        """Each request's output rows, from one kernel call over all of them."""
        query = torch.cat([rows for *_, rows in requests])
        query_start_loc = torch.tensor([0] + [len(rows) for *_, rows in requests]).cumsum(0).to(torch.int32)
        seq_lens = torch.tensor([seq_len for _, seq_len, _ in requests], dtype=torch.int32)
        block_table = torch.zeros(len(requests), max(len(blocks) for blocks, *_ in requests), dtype=torch.int32)
        for row, (blocks, *_) in enumerate(requests):
            block_table[row, : len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
        scheduler_metadata = ops.cpu_attn_get_scheduler_metadata(
            num_reqs=len(requests), num_heads=NUM_HEADS, num_kv_heads=NUM_KV_HEADS, head_dim=HEAD_DIM,
            seq_lens=seq_lens, dtype=self.dtype, query_start_loc=query_start_loc, causal=True,
            sliding_window_size=-1, isa=self.isa, enable_kv_split=self.split_kv, dynamic_causal=None,
            kv_cache_dtype="auto",
        )
        output = torch.empty_like(query)
        ops.cpu_attention_with_kv_cache(
            query=query, key_cache=self.key_cache, value_cache=self.value_cache, output=output,
            query_start_loc=query_start_loc, seq_lens=seq_lens, scale=HEAD_DIM**-0.5, causal=True,
            alibi_slopes=None, sliding_window=-1, block_table=block_table, softcap=0.0,
            scheduler_metadata=scheduler_metadata, s_aux=None, dynamic_causal=None,
            k_scale=1.0, v_scale=1.0, kv_cache_dtype="auto",
        )
        return list(output.split([len(rows) for *_, rows in requests]))


def blocks_for(first_block: int, tokens: int) -> list[int]:
    return list(range(first_block, first_block + (tokens + BLOCK_SIZE - 1) // BLOCK_SIZE))


def compare(attention: PagedAttention, seq_len: int, num_rows: int) -> dict[str, float | None]:
    """Max abs difference to the verification call of each rearrangement (None: bitwise equal)."""
    blocks = blocks_for(1, seq_len)
    rows = torch.randn(num_rows, NUM_HEADS, HEAD_DIM, dtype=attention.dtype)
    verified = attention([(blocks, seq_len, rows)])[0]
    others = [(blocks_for(40, n), n, torch.randn(k, NUM_HEADS, HEAD_DIM, dtype=attention.dtype))
              for n, k in ((700, 1), (90, 40), (2500, 6))]
    first = seq_len - num_rows + 1  # tokens the first query row sees
    tail = num_rows // 2
    arranged = {
        "in a batch": attention([others[0], (blocks, seq_len, rows), others[1], others[2]])[1],
        "each row alone": torch.cat([attention([(blocks, first + i, rows[i : i + 1])])[0] for i in range(num_rows)]),
        "split in two": torch.cat(attention([(blocks, seq_len - tail, rows[: num_rows - tail]),
                                             (blocks, seq_len, rows[num_rows - tail :])])),
    }
    return {name: None if torch.equal(out, verified) else (out.float() - verified.float()).abs().max().item()
            for name, out in arranged.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    parser.add_argument("--split-kv", default="on", choices=("on", "off"),
                        help="the kernel's split over the keys (vLLM's VLLM_CPU_ATTN_SPLIT_KV, on by default)")
    args = parser.parse_args()
    torch.manual_seed(0)
    attention = PagedAttention(getattr(torch, args.dtype), args.split_kv == "on")
    print(f"CPU attention ISA {attention.isa}, {args.dtype}, split over keys {args.split_kv}")
    print("| tokens | query rows | in a batch | each row alone | split in two |")
    print("|---|---|---|---|---|")
    differing = 0
    for seq_len, num_rows in CASES:
        diffs = compare(attention, seq_len, num_rows)
        differing += sum(diff is not None for diff in diffs.values())
        cells = " | ".join("equal" if diff is None else f"differs ({diff:.2g})" for diff in diffs.values())
        print(f"| {seq_len} | {num_rows} | {cells} |")
    print(f"{differing} of {3 * len(CASES)} arrangements differ from the verification call bit for bit")


if __name__ == "__main__":
    main()
