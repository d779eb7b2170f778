"""The n-gram pool: candidates keyed by suffixes of 1..K tokens (FAFO Alg. 2-3).

One pool per request, in CPU memory. A candidate is a tuple of up to ``k``
tokens that followed a key somewhere (in the prompt, in the output, or, with
fumble lanes, in a lane's guess). Each key keeps at most ``capacity``
candidates and evicts the least recently used one (FAFO App. F); a lookup
tries the longest suffix first because a longer shared context predicts the
continuation better (FAFO Prop. F.1).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from enum import Enum


class Origin(str, Enum):
    """Where a candidate came from; counted separately in the metrics."""

    PROMPT = "prompt"
    OUTPUT = "output"
    LANE = "lane"


Candidate = tuple[int, ...]


class NgramPool:
    """Suffix-keyed candidate table with a per-key LRU cap."""

    def __init__(self, max_key_len: int, capacity: int) -> None:
        self.max_key_len = max_key_len
        self.capacity = capacity
        self._table: dict[Candidate, OrderedDict[Candidate, Origin]] = {}

    def __len__(self) -> int:
        """Number of keys held."""
        return len(self._table)

    def add(self, context: Sequence[int], candidate: Candidate, origin: Origin) -> None:
        """File ``candidate`` under every suffix of ``context`` of length 1..K.

        ``context`` only needs its last K tokens; callers pass a short slice.
        Re-adding a known candidate refreshes its recency and origin.
        """
        if not candidate:
            return
        longest = min(self.max_key_len, len(context))
        for key_len in range(1, longest + 1):
            key = tuple(context[len(context) - key_len :])
            entries = self._table.get(key)
            if entries is None:
                entries = self._table[key] = OrderedDict()
            elif candidate in entries:
                entries.move_to_end(candidate)
            entries[candidate] = origin
            if len(entries) > self.capacity:
                entries.popitem(last=False)

    def lookup(self, context: Sequence[int]) -> tuple[Candidate, Origin] | None:
        """Most recently used candidate under the longest matching suffix.

        The hit counts as a use: it moves to the recent end of its key.
        """
        longest = min(self.max_key_len, len(context))
        for key_len in range(longest, 0, -1):
            entries = self._table.get(tuple(context[len(context) - key_len :]))
            if entries:
                candidate, origin = next(reversed(entries.items()))
                entries.move_to_end(candidate)
                return candidate, origin
        return None

    def candidates(self, key: Sequence[int]) -> list[Candidate]:
        """Candidates under exactly ``key``, least recently used first."""
        return list(self._table.get(tuple(key), ()))
