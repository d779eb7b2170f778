"""A step with draft-tree branches over a paged cache, for the branch-kernel tests of
each backend (tests/test_branch_kernel.py: vLLM's CPU attention;
tests/test_flash_branch_kernel.py: FlashAttention). Imports nothing backend-specific,
so the GPU machine collects the FlashAttention tests without vLLM's CPU kernels."""

from abc import ABC, abstractmethod

import numpy as np
import torch

from vllm_fafo.attention.branch_attention import request_branch_attention
from vllm_fafo.verification.draft_tree import Branch, BranchPlan, attention_bias, branch_positions, layout_request

HQ, HK, D = 9, 3, 64
"""SmolLM2-135M's attention."""
REQUESTS = (  # (tokens before the current one, spine length, branches)
    (300, 4, (Branch(0, (1, 2, 3)), Branch(1, (4, 5)), Branch(0, (6,)))),
    (129, 2, (Branch(1, (7,)),)),
    (700, 5, (Branch(2, (8, 9, 10)), Branch(0, (11, 12, 13, 14, 15)))),
)


class PagedStep(ABC):
    """A step's batch: each request's current token and spine, then every branch
    token in the tail; earlier context and this step's spine written to a paged cache
    with the backend's own write (:meth:`write`), as vLLM has written them when
    attention runs."""

    block_size: int
    block_table: torch.Tensor

    def fill(self, dtype: torch.dtype, device: torch.device, gen: torch.Generator, num_blocks: int,
             blocks_per_request: int) -> None:
        blocks = torch.randperm(num_blocks, generator=gen).to(torch.int32)
        block_table = torch.zeros(len(REQUESTS), blocks_per_request, dtype=torch.int32)
        used = 0
        for row, (x_position, spine, _) in enumerate(REQUESTS):
            needed = -(-(x_position + 1 + spine) // self.block_size)
            block_table[row, :needed] = blocks[used : used + needed]
            used += needed
        self.block_table = block_table.to(device)
        spine_tokens = sum(1 + spine for _, spine, _ in REQUESTS)
        tail_tokens = sum(len(b.tokens) for *_, branches in REQUESTS for b in branches)
        total = spine_tokens + tail_tokens

        def randn(*shape):
            return torch.randn(*shape, generator=gen).to(dtype).to(device)

        self.query, self.key, self.value = randn(total, HQ, D), randn(total, HK, D), randn(total, HK, D)
        requests, x_index, start = [], 0, spine_tokens
        for row, (x_position, spine, branches) in enumerate(REQUESTS):
            self.write(row, torch.arange(x_position), randn(x_position, HK, D), randn(x_position, HK, D))
            rows = slice(x_index, x_index + 1 + spine)
            self.write(row, torch.arange(x_position, x_position + 1 + spine), self.key[rows], self.value[rows])
            request = layout_request(f"r{row}", row, x_index, x_position, start, branches)
            requests.append(request)
            x_index += 1 + spine
            start += request.num_tokens
        self.plan = BranchPlan(np.zeros(tail_tokens, dtype=np.int64),
                               np.concatenate([branch_positions(r) for r in requests]), tuple(requests))

    def slots(self, row: int, positions: torch.Tensor) -> torch.Tensor:
        positions = positions.to(self.block_table.device)
        return (self.block_table[row, positions // self.block_size].long() * self.block_size
                + positions % self.block_size)

    @abstractmethod
    def write(self, row: int, positions: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> None:
        """Store ``key``/``value`` at ``positions`` of request ``row`` with the backend's own write."""

    @abstractmethod
    def verify(self, row: int, node: int, branch_rows: slice) -> torch.Tensor:
        """What the backend's kernel gives the branch tokens in a verification of (the
        current token, spine tokens up to ``node``, then the branch) as the request's spine."""

    def assert_matches_the_dense_reference(self, got: torch.Tensor, reader) -> None:
        for request in self.plan.requests:
            rows = request.tokens
            key_tiles, value_tiles = reader.read_tiles(request.batch_row, request.num_paged)
            want = request_branch_attention(self.query[rows], self.key[rows], self.value[rows], key_tiles,
                                            value_tiles, request, D**-0.5, torch.from_numpy(attention_bias(request)))
            torch.testing.assert_close(got[rows], want, rtol=1e-5, atol=1e-5)

    def assert_each_branch_row_is_its_verification_as_the_spine(self, got: torch.Tensor) -> None:
        compared = 0
        for row, request in enumerate(self.plan.requests):
            for branch, offset in zip(request.branches, request.offsets()):
                rows = slice(request.start + offset, request.start + offset + len(branch.tokens))
                assert torch.equal(got[rows], self.verify(row, branch.node, rows))
                compared += 1
        assert compared == sum(len(branches) for *_, branches in REQUESTS)
