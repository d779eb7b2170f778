"""The target's runner-up tokens, recycled as a draft source (Token Recycling).

Every verification forward already computes the target's logits after the
current token and after every draft token; most of those predictions are
thrown away. Token Recycling (Luo et al., 2024) keeps the top few next tokens
of every such position in a table keyed by the token they follow (its
"adjacency matrix"), the newest prediction overwriting older ones, and drafts
from it at no extra forward tokens. Here the table serves where the text has
no candidate (the pool's keys and the deep matches all miss): the draft is the
chain of top-1 successors of the current token; and with a draft tree the
current token's other runner-ups start branches.

A table is ``vocab_size x width`` int32 (49,152 x 4 for SmolLM2: 768 KiB),
one per tenant (vLLM's ``cache_salt``; the predictions after a token carry
what the text around it said), or one per request with ``share_pool`` false;
:class:`RunnerUpTables` bounds how many exist.
"""

from __future__ import annotations

from collections import OrderedDict

import numpy as np

EMPTY = -1
"""A table slot no prediction filled yet."""


class RunnerUpTable:
    """The target's latest top-``width`` next tokens after each token id."""

    def __init__(self, vocab_size: int, width: int) -> None:
        if vocab_size < 1 or width < 1:
            raise ValueError(f"need vocab_size={vocab_size} >= 1 and width={width} >= 1")
        self.successors = np.full((vocab_size, width), EMPTY, dtype=np.int32)

    def update(self, tokens: np.ndarray, top_next: np.ndarray) -> None:
        """File ``top_next[i]`` (best first) as what follows ``tokens[i]``; where a
        token repeats, its last row wins (the latest position in the batch's order)."""
        self.successors[tokens] = top_next

    def chain(self, token: int, length: int) -> list[int]:
        """Up to ``length`` tokens, each the top successor of the one before,
        starting after ``token``; shorter where the table has no prediction."""
        successors = self.successors
        draft: list[int] = []
        for _ in range(length):
            token = int(successors[token, 0])
            if token == EMPTY:
                break
            draft.append(token)
        return draft

    def runner_ups(self, token: int) -> list[int]:
        """The successors of ``token`` after the top one, best first."""
        return [int(t) for t in self.successors[token, 1:] if t != EMPTY]

    @property
    def nbytes(self) -> int:
        return self.successors.nbytes


class RunnerUpTables:
    """One :class:`RunnerUpTable` per owner (a tenant, or a request with sharing off),
    at most ``max_owners`` of them: the least recently used one is dropped."""

    def __init__(self, vocab_size: int, width: int, max_owners: int) -> None:
        if max_owners < 1:
            raise ValueError(f"need max_owners={max_owners} >= 1")
        self.vocab_size = vocab_size
        self.width = width
        self.max_owners = max_owners
        self._tables: OrderedDict[str | None, RunnerUpTable] = OrderedDict()

    def table_for(self, owner: str | None) -> RunnerUpTable:
        """The owner's table (made on first use), refreshed as most recently used."""
        table = self._tables.get(owner)
        if table is None:
            table = self._tables[owner] = RunnerUpTable(self.vocab_size, self.width)
            while len(self._tables) > self.max_owners:
                self._tables.popitem(last=False)
        else:
            self._tables.move_to_end(owner)
        return table

    def drop(self, owner: str | None) -> None:
        self._tables.pop(owner, None)

    def clear(self) -> None:
        """Forget every prediction, in place (running requests hold their tables)."""
        for table in self._tables.values():
            table.successors.fill(EMPTY)

    def __len__(self) -> int:
        return len(self._tables)

    @property
    def nbytes(self) -> int:
        return sum(table.nbytes for table in self._tables.values())
