"""StreamingLLM slots: after writing positions 0..n-1, the region holds the
sinks and the latest window, nothing else."""

import numpy as np
import pytest

from vllm_fafo.compression import StreamingPolicy


def write_all(policy: StreamingPolicy, chunks: list[int]) -> np.ndarray:
    """Write positions in chunks, as prefill chunks and decode steps do."""
    region = np.full(policy.kv_budget, -1)
    start = 0
    for size in chunks:
        positions = np.arange(start, start + size)
        keep = policy.surviving_writes(positions)
        slots = policy.slots(positions[keep])
        assert len(set(slots.tolist())) == len(slots)  # no duplicate targets
        region[slots] = positions[keep]
        start += size
    return region


@pytest.mark.parametrize("sink, budget", [(4, 16), (0, 8), (2, 5)])
@pytest.mark.parametrize("chunks", [[3], [16], [40], [7, 1, 1, 30, 2, 1], [1] * 50])
def test_region_is_sinks_plus_latest_window(sink, budget, chunks):
    policy = StreamingPolicy(sink, budget)
    n = sum(chunks)
    region = write_all(policy, chunks)
    expected = set(range(min(sink, n))) | set(range(max(sink, n - (budget - sink)), n))
    held = {int(p) for p in region if p >= 0}
    assert held == expected
    assert policy.num_valid(n) == len(expected)


def test_bad_sizes_rejected():
    with pytest.raises(ValueError, match="must be >= 0 and < kv_budget"):
        StreamingPolicy(8, 8)
