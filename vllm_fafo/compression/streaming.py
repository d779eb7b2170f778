"""StreamingLLM (Xiao et al., 2024): attention sinks plus a recent window.

The region has ``kv_budget`` slots: the first ``sink_tokens`` hold positions
0..sink-1 for good; the rest form a ring that position p (p >= sink) enters
at slot ``sink + (p - sink) % window``, overwriting the entry that expired.
After positions 0..n-1 are written, the region holds exactly the sinks and
the latest ``window`` positions: StreamingLLM's view.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class StreamingPolicy:
    sink_tokens: int
    kv_budget: int

    def __post_init__(self) -> None:
        if not 0 <= self.sink_tokens < self.kv_budget:
            raise ValueError(
                f"sink_tokens={self.sink_tokens} must be >= 0 and < kv_budget={self.kv_budget}"
            )

    @property
    def window(self) -> int:
        return self.kv_budget - self.sink_tokens

    def slots(self, positions: np.ndarray) -> np.ndarray:
        """Region slot of each absolute position."""
        positions = np.asarray(positions, dtype=np.int64)
        ring = self.sink_tokens + (positions - self.sink_tokens) % self.window
        return np.where(positions < self.sink_tokens, positions, ring)

    def num_valid(self, num_tokens: int) -> int:
        """Filled slots once positions 0..num_tokens-1 are written."""
        return min(num_tokens, self.kv_budget)

    def surviving_writes(self, positions: np.ndarray) -> np.ndarray:
        """Indices into ``positions`` (ascending) whose write is not overwritten
        later in the same batch: the last write to each slot wins, and doing
        only those keeps the in-place copy free of duplicate targets."""
        slots = self.slots(positions)
        reversed_first = np.unique(slots[::-1], return_index=True)[1]
        return np.sort(len(slots) - 1 - reversed_first)
