"""The n-gram pool: candidates keyed by suffixes of the text (FAFO Alg. 2-3).

One pool per request, in CPU memory. A candidate is a tuple of tokens that
followed a key somewhere (in the prompt, in the output, or in a lane's
guess). Each key keeps at most ``capacity`` candidates and evicts the least
recently used one (FAFO App. F); a lookup tries the longest suffix first
because a longer shared context predicts the continuation better (FAFO
Prop. F.1).

The same class, configured, is the pool of every method the plugin runs:

- FAFO: keys of 1..K tokens, a lookup refreshes the candidate it returns.
- Lookahead (Sec. 3, Alg. 1): keys of exactly 1 token (the n-gram's first
  token), at most G candidates per key, lookups change nothing.
- Cacheback (Sec. 3.1): keys of exactly LL tokens (leaders) with an LRU cap
  of LC leaders, which both insertion and lookup refresh; at most FC
  followers per leader, refreshed on insertion only.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator, Sequence
from enum import Enum
from typing import NamedTuple


class Origin(str, Enum):
    """Where a candidate came from; counted separately in the metrics."""

    PROMPT = "prompt"
    OUTPUT = "output"
    LANE = "lane"
    FROZEN = "frozen"  # Cacheback's offline table


Candidate = tuple[int, ...]


class Match(NamedTuple):
    """A lookup's answer: the candidate, where it came from, and the length of the
    key it was found under (the goodput controller's evidence for how far to draft)."""

    candidate: Candidate
    origin: Origin
    key_len: int


class NgramPool:
    """Suffix-keyed candidate table with per-key (and optional key) LRU caps."""

    def __init__(
        self,
        max_key_len: int,
        capacity: int,
        *,
        min_key_len: int = 1,
        max_keys: int = 0,
        touch_on_lookup: bool = True,
    ) -> None:
        if not 1 <= min_key_len <= max_key_len:
            raise ValueError(f"need 1 <= min_key_len={min_key_len} <= max_key_len={max_key_len}")
        self.max_key_len = max_key_len
        self.min_key_len = min_key_len
        self.capacity = capacity
        self.max_keys = max_keys  # 0: unbounded
        self.touch_on_lookup = touch_on_lookup
        self._table: OrderedDict[Candidate, OrderedDict[Candidate, Origin]] = OrderedDict()

    def __len__(self) -> int:
        """Number of keys held."""
        return len(self._table)

    def add(self, context: Sequence[int], candidate: Candidate, origin: Origin) -> None:
        """File ``candidate`` under every suffix of ``context`` of length
        ``min_key_len``..``max_key_len``.

        ``context`` only needs its last K tokens; callers pass a short slice.
        Re-adding a known candidate refreshes its recency and origin.
        """
        if not candidate:
            return
        longest = min(self.max_key_len, len(context))
        for key_len in range(self.min_key_len, longest + 1):
            key = tuple(context[len(context) - key_len :])
            entries = self._table.get(key)
            if entries is None:
                entries = self._table[key] = OrderedDict()
                if self.max_keys and len(self._table) > self.max_keys:
                    self._table.popitem(last=False)
            else:
                self._table.move_to_end(key)
                if candidate in entries:
                    entries.move_to_end(candidate)
            entries[candidate] = origin
            if len(entries) > self.capacity:
                entries.popitem(last=False)

    def lookup(self, context: Sequence[int]) -> tuple[Candidate, Origin] | None:
        """Most recently used candidate under the longest matching suffix, and its origin."""
        found = self.match(context)
        return None if found is None else (found.candidate, found.origin)

    def match(self, context: Sequence[int]) -> Match | None:
        """Most recently used candidate under the longest matching suffix.

        The key's recency is refreshed; the candidate's only with
        ``touch_on_lookup``.
        """
        longest = min(self.max_key_len, len(context))
        for key_len in range(longest, self.min_key_len - 1, -1):
            key = tuple(context[len(context) - key_len :])
            entries = self._table.get(key)
            if entries:
                self._table.move_to_end(key)
                candidate, origin = next(reversed(entries.items()))
                if self.touch_on_lookup:
                    entries.move_to_end(candidate)
                return Match(candidate, origin, key_len)
        return None

    def alternatives(self, context: Sequence[int]) -> Iterator[Candidate]:
        """Every candidate under the suffixes of ``context``, longest key first,
        most recently used first under each key, each once; recency untouched
        (the draft tree's branches, :mod:`vllm_fafo.tree`)."""
        seen: set[Candidate] = set()
        longest = min(self.max_key_len, len(context))
        for key_len in range(longest, self.min_key_len - 1, -1):
            entries = self._table.get(tuple(context[len(context) - key_len :]))
            for candidate in reversed(entries or ()):
                if candidate not in seen:
                    seen.add(candidate)
                    yield candidate

    def candidates(self, key: Sequence[int]) -> list[Candidate]:
        """Candidates under exactly ``key``, least recently used first."""
        return list(self._table.get(tuple(key), ()))

    def keys(self) -> list[Candidate]:
        """Keys, least recently used first."""
        return list(self._table)
