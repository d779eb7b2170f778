"""Speculative decoding under sampling keeps plain vLLM's distribution.

vLLM 0.32.0's CPU stand-in for the rejection sampler's ``expand_kernel``
never writes its output (vLLM #55005): drafts were scored with logits divided
by uninitialised memory, and sampled text drifted towards the drafts (here a
token of probability 0.003 came out in about half the samples).
``vllm_fafo.patches.cpu_sampling`` replaces it; these tests would fail without, and
so would every sampled-distribution test of tests/test_engine.py.
"""

from __future__ import annotations

import pytest
import torch

from vllm_fafo.patches.cpu_sampling import expand_at_caller_dtype


def dense_expand(values: list, counts: list[int], replace_from, replace_to) -> list:
    return [replace_to if v == replace_from else v
            for v, n in zip(values, counts) for _ in range(n)]


@pytest.mark.parametrize(
    ("dtype", "values", "replace_from", "replace_to"),
    [
        (torch.float32, [0.7, 0.0, 1.3, 0.0], 0, 1),  # temperature: greedy rows become 1
        (torch.float32, [0.9, 0.5, 1.0, 0.25], 0, 0),  # top_p
        (torch.int32, [20, 0, 5, 1], 0, 0),  # top_k
        (torch.int64, [3, 0, 7, 2], 0, 9),
    ],
)
def test_expand_writes_the_callers_buffer_at_its_dtype(dtype, values, replace_from, replace_to):
    counts = [2, 0, 3, 1]
    cu_num_tokens = torch.tensor(counts, dtype=torch.int32).cumsum(0).to(torch.int32)
    output = torch.full((sum(counts),), -7, dtype=dtype)
    expand_at_caller_dtype(output, torch.tensor(values, dtype=dtype), cu_num_tokens,
                           replace_from, replace_to)
    expected = torch.tensor(dense_expand(values, counts, replace_from, replace_to), dtype=dtype)
    assert output.dtype == dtype
    assert torch.equal(output, expected)


@pytest.mark.engine
def test_vllm_expands_temperatures_with_the_patched_kernel(lanes_llm):
    """The kernel vLLM's CPU worker registered is the patched one."""
    from vllm.v1.sample.rejection_sampler import expand_batch_to_tokens

    temperature = torch.tensor([0.7, 0.0, 1.3])
    cu_num_tokens = torch.tensor([2, 2, 5], dtype=torch.int32)
    got = expand_batch_to_tokens(temperature, cu_num_tokens, 5, replace_from=0, replace_to=1)
    assert torch.equal(got, torch.tensor([0.7, 0.7, 1.3, 1.3, 1.3]))
