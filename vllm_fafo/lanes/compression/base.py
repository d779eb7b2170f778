"""The compression-policy interface: what fills a request's compressed region.

Every request that runs lanes owns one fixed region of ``kv_budget`` slots
per attention layer (FAFO Sec. 4.4, ``B_fixed``), split in three parts::

    [ sink: positions 0..sink-1 | selected: the policy's choice | ring: recent ]

The framework fills the sink and the ring by position alone (planned once per
step on the CPU, shared by every layer); a policy only decides what goes into
the *selected* part, from the tensors a layer sees. StreamingLLM selects
nothing; SnapKV selects prompt tokens once, after prefill; Quest re-selects
pages from the lanes' queries every few steps.

To add a policy: subclass :class:`CompressionPolicy` in a new module, give it
a ``Settings`` dataclass for its own keys (named ``<policy>_<key>`` in the
user's config), and add it to ``POLICIES`` in ``vllm_fafo.lanes.compression``.
Nothing in the runner patches or the attention backend changes.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol

import numpy as np
import torch


class PagedKV(Protocol):
    """Read access to one layer's paged KV cache (the one real KV cache)."""

    def read(self, batch_row: int, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values at ``positions`` of the request in ``batch_row``.

        ``positions`` is (n,) for all heads or (Hk, n) for one set per KV
        head; the result is (n, Hk, D) each, head h taken at its positions.
        """


@dataclass(frozen=True)
class LayerShape:
    """What a policy needs to size its per-layer state once."""

    rows: int  # requests with a region at once
    num_heads: int
    num_kv_heads: int
    head_size: int
    max_model_len: int
    dtype: torch.dtype
    device: torch.device


@dataclass(frozen=True)
class LaneStep:
    """One request in one layer, just before its lanes attend."""

    row: int  # region row
    batch_row: int  # row of the request in vLLM's batch (block table)
    num_final: int  # positions 0..num_final-1 are final (this step's x included)
    lane_query: torch.Tensor  # (T, Hq, D) queries of the request's lane tokens
    scale: float


@dataclass(frozen=True)
class Selection:
    """New content for a row's selected part: ``count`` tokens per KV head."""

    key: torch.Tensor  # (count, Hk, D)
    value: torch.Tensor

    @property
    def count(self) -> int:
        return self.key.shape[0]


@dataclass(frozen=True)
class RegionLayout:
    """Slot arithmetic of the sink and ring parts (pure numpy, CPU side)."""

    sink_tokens: int
    selected_slots: int
    ring_slots: int

    def __post_init__(self) -> None:
        if self.sink_tokens < 0 or self.selected_slots < 0 or self.ring_slots < 1:
            raise ValueError(f"bad region layout {self}")

    @property
    def kv_budget(self) -> int:
        return self.sink_tokens + self.selected_slots + self.ring_slots

    @property
    def ring_start(self) -> int:
        return self.sink_tokens + self.selected_slots

    def slots(self, positions: np.ndarray) -> np.ndarray:
        """Region slot of each absolute position: sink, else its ring slot."""
        positions = np.asarray(positions, dtype=np.int64)
        ring = self.ring_start + (positions - self.sink_tokens) % self.ring_slots
        return np.where(positions < self.sink_tokens, positions, ring)

    def filled_sink_and_ring(self, num_tokens: np.ndarray) -> np.ndarray:
        """(R, kv_budget) bool: the sink and ring slots of R rows holding a token
        once positions 0..num_tokens[r]-1 of row r are written."""
        slot = np.arange(self.kv_budget)
        num_tokens = np.asarray(num_tokens)[:, None]
        ring_end = self.ring_start + self.ring_valid(num_tokens)
        return (slot < self.sink_valid(num_tokens)) | ((slot >= self.ring_start) & (slot < ring_end))

    def sink_valid(self, num_tokens: int | np.ndarray) -> int | np.ndarray:
        return np.minimum(num_tokens, self.sink_tokens)

    def ring_valid(self, num_tokens: int | np.ndarray) -> int | np.ndarray:
        return np.clip(num_tokens - self.sink_tokens, 0, self.ring_slots)

    def oldest_in_ring(self, num_tokens: int) -> int:
        """First position the ring still holds once 0..num_tokens-1 are written."""
        return max(self.sink_tokens, num_tokens - self.ring_slots)

    def surviving_writes(self, positions: np.ndarray) -> np.ndarray:
        """Indices into ``positions`` (ascending) whose write is not overwritten
        later in the same batch: the last write to each slot wins, and doing
        only those keeps the in-place copy free of duplicate targets."""
        slots = self.slots(positions)
        reversed_first = np.unique(slots[::-1], return_index=True)[1]
        return np.sort(len(slots) - 1 - reversed_first)


@dataclass(frozen=True)
class NoSettings:
    """For policies without keys of their own."""

    def validate(self, sink_tokens: int, kv_budget: int, num_speculative_tokens: int) -> None:
        return None


class CompressionPolicy:
    """Base class; the defaults select nothing (the selected part stays empty).

    Layer-side hooks run inside every attention layer's forward, so they get
    tensors and may keep per-layer state (returned by :meth:`new_layer_state`).
    They must be deterministic and must never touch the paged KV cache other
    than reading it: lanes only ever produce guesses, so a policy can change
    tau but never the output.
    """

    name: ClassVar[str]
    Settings: ClassVar[type] = NoSettings
    reads_paged_kv: ClassVar[bool] = False
    """True if the policy reads the paged KV cache (the backend then checks
    its layout once per layer)."""
    attends_full_cache: ClassVar[bool] = False
    """True: lanes see every final token of the paged cache, not the region."""

    def __init__(self, sink_tokens: int, kv_budget: int, settings: Any) -> None:
        self.settings = settings
        self.layout = self.make_layout(sink_tokens, kv_budget, settings)

    def make_layout(self, sink_tokens: int, kv_budget: int, settings: Any) -> RegionLayout:
        return RegionLayout(sink_tokens, 0, kv_budget - sink_tokens)

    # Layer side ---------------------------------------------------------------------
    def new_layer_state(self, shape: LayerShape) -> Any:
        return None

    def reset_row(self, state: Any, row: int) -> None:
        """A new request took region row ``row``."""

    def observe_prefill(self, state: Any, row: int, first_pos: int, query: torch.Tensor) -> None:
        """Queries (n, Hq, D) of a prefill chunk starting at ``first_pos``."""

    def select(self, state: Any, step: LaneStep, kv: PagedKV) -> Selection | None:
        """New selected content for ``step.row``, or None to keep what it has.

        Called every lane step, only for layouts with selected slots."""
        return None


def settings_keys(policy_cls: type[CompressionPolicy]) -> dict[str, str]:
    """User-facing key (``<policy>_<field>``) -> field name of its Settings."""
    return {f"{policy_cls.name}_{f.name}": f.name for f in dataclasses.fields(policy_cls.Settings)}
