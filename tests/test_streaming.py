"""StreamingLLM slots: after writing positions 0..n-1, the region holds the
sinks and the latest window, nothing else."""

import numpy as np
import pytest

from vllm_fafo.lanes.compression import RegionLayout, StreamingPolicy


def write_all(layout: RegionLayout, chunks: list[int]) -> np.ndarray:
    """Write positions in chunks, as prefill chunks and decode steps do."""
    region = np.full(layout.kv_budget, -1)
    start = 0
    for size in chunks:
        positions = np.arange(start, start + size)
        keep = layout.surviving_writes(positions)
        slots = layout.slots(positions[keep])
        assert len(set(slots.tolist())) == len(slots)  # no duplicate targets
        region[slots] = positions[keep]
        start += size
    return region


@pytest.mark.parametrize("sink, budget", [(4, 16), (0, 8), (2, 5)])
@pytest.mark.parametrize("chunks", [[3], [16], [40], [7, 1, 1, 30, 2, 1], [1] * 50])
def test_region_is_sinks_plus_latest_window(sink, budget, chunks):
    layout = StreamingPolicy(sink, budget, StreamingPolicy.Settings()).layout
    n = sum(chunks)
    region = write_all(layout, chunks)
    expected = set(range(min(sink, n))) | set(range(max(sink, n - (budget - sink)), n))
    held = {int(p) for p in region if p >= 0}
    assert held == expected
    assert layout.sink_valid(n) + layout.ring_valid(n) == len(expected)


def test_ring_after_a_selected_part_skips_it():
    layout = RegionLayout(sink_tokens=2, selected_slots=5, ring_slots=4)
    region = write_all(layout, [3, 9])
    assert (region[2:7] == -1).all()  # the policy's part: never written by position
    assert {int(p) for p in region if p >= 0} == {0, 1, 8, 9, 10, 11}


def test_bad_sizes_rejected():
    with pytest.raises(ValueError, match="bad region layout"):
        StreamingPolicy(8, 8, StreamingPolicy.Settings())
