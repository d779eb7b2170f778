"""Tensor parallelism: every rank must plan the same forward.

Each TP rank runs its own proposer over the same tokens and logits, so pools,
drafts, lanes and draft trees agree as long as every input does. The one input
that differs between ranks is the step's wall time, from which the goodput
controller learns its cost curve and then sizes lanes and drafts; ranks that
sized them differently would run forwards of different token counts. So every
rank's controller learns from TP rank 0's step time.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


class RankZeroStepTime:
    """Sends TP rank 0's step time to every rank of the tensor-parallel group."""

    def __init__(self, cpu_group: dist.ProcessGroup, src_rank: int) -> None:
        self._cpu_group = cpu_group
        self._src_rank = src_rank
        self._buffer = torch.zeros(1, dtype=torch.float64)

    @classmethod
    def for_worker(cls) -> RankZeroStepTime | None:
        """None without tensor parallelism (or outside an engine)."""
        from vllm.distributed.parallel_state import get_tp_group, model_parallel_is_initialized

        if not model_parallel_is_initialized() or get_tp_group().world_size == 1:
            return None
        group = get_tp_group()
        return cls(group.cpu_group, group.ranks[0])

    def share(self, seconds: float) -> float:
        """Rank 0's ``seconds``, on every rank (a collective: every rank calls it each step)."""
        self._buffer[0] = seconds
        dist.broadcast(self._buffer, src=self._src_rank, group=self._cpu_group)
        return float(self._buffer[0])
