"""Fumble lanes: per-request guess streams and their tail layout (pure numpy).

Each request runs ``num_lanes`` lanes of ``lane_len`` tokens. Every step all
active lanes ride behind the real tokens of the batch, column-wise (FAFO
App. E: level 0 of every lane, then level 1, ...), at positions
``x_pos + 1 + level``: each lane is a guess of the text that follows the
current token. The logits of a lane's last token give its next token; the
lane slides forward by one (Lookahead's window, FAFO Sec. 4.2) and its
oldest token moves into a buffer of discarded tokens. The lane's content
after the slide is a finished n-gram, filed in the pool under every suffix
of that buffer up to K tokens (FAFO Alg. 2).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

import numpy as np


class LaneState:
    """The lanes of one request."""

    def __init__(
        self,
        prompt: Sequence[int],
        num_lanes: int,
        lane_len: int,
        max_key_len: int,
        stagger: bool = False,
    ):
        if not prompt:
            raise ValueError("lanes are initialised from the prompt, which is empty")
        self.lane_len = lane_len
        self.stagger = stagger
        # Lookahead initialises its window from prompt tokens; spread the lanes
        # over the prompt so they start from different text.
        prompt_arr = np.asarray(prompt, dtype=np.int64)
        starts = (np.arange(num_lanes) * len(prompt_arr)) // num_lanes
        offsets = (starts[:, None] + np.arange(lane_len)[None, :]) % len(prompt_arr)
        self.tokens = prompt_arr[offsets]  # (num_lanes, lane_len)
        self.discarded = [deque(maxlen=max_key_len) for _ in range(num_lanes)]

    @property
    def num_lanes(self) -> int:
        return self.tokens.shape[0]

    def tail(self, active: int, x_pos: int, max_pos: int) -> tuple[np.ndarray, np.ndarray]:
        """Token ids and positions of the first ``active`` lanes, column-wise.

        Lane i's token at level l sits at ``x_pos + 1 + l``, plus ``i`` when
        staggered: then the lanes are the diagonals of Lookahead's 2D window
        (Lookahead Fig. 2b: the token at window column i + l of step l).
        """
        ids = self.tokens[:active].T.reshape(-1)
        positions = x_pos + 1 + np.repeat(np.arange(self.lane_len), active)
        if self.stagger:
            positions = positions + np.tile(np.arange(active), self.lane_len)
        return ids, np.minimum(positions, max_pos)

    def advance(self, active: int, next_tokens: Sequence[int]) -> list[tuple[list[int], tuple[int, ...]]]:
        """Slide the first ``active`` lanes by one token each.

        Returns (discarded-token context, n-gram) pairs for the pool; a lane
        with nothing discarded yet has no key and files nothing.
        """
        ngrams = []
        for lane in range(active):
            self.discarded[lane].append(int(self.tokens[lane, 0]))
            self.tokens[lane, :-1] = self.tokens[lane, 1:]
            self.tokens[lane, -1] = next_tokens[lane]
            ngrams.append((list(self.discarded[lane]), tuple(int(t) for t in self.tokens[lane])))
        return ngrams


def tail_index(lane: int, level: int, active: int) -> int:
    """Offset of (lane, level) inside a request's column-wise tail."""
    return level * active + lane


def lane_mask(active: int, lane_len: int) -> np.ndarray:
    """Which tail tokens each tail token may attend to: its own lane, at its
    own or an earlier level (FAFO Fig. 4, Lookahead Fig. 2b)."""
    size = active * lane_len
    index = np.arange(size)
    lane, level = index % active, index // active
    return (lane[:, None] == lane[None, :]) & (level[None, :] <= level[:, None])
