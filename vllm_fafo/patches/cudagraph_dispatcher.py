"""Whole CUDA graphs for every padded draft length: wraps two methods of vLLM 0.32.0's
``vllm.v1.cudagraph_dispatcher.CudagraphDispatcher``.

vLLM's V1 runner replays one kind of uniform decode batch as FULL graphs:
every request with ``1 + num_speculative_tokens`` tokens. With ``pad_drafts``
under the goodput controller every decode step is a uniform batch of
``1 + t`` tokens per request for the tier ``t`` the controller chose
(:data:`vllm_fafo.control.goodput.DRAFT_TIERS`, 0 included: plain vLLM's
step). For such engines:

1. ``initialize_cudagraph_keys(cudagraph_mode, uniform_decode_query_len)``:
   each tier gets a FULL key of ``b`` requests for every batch size ``b`` vLLM
   captures its own uniform batches at (up to the largest size), added to the
   capture sizes before vLLM's keys are made (so mixed batches padded to them
   find a piecewise graph too), captured by vLLM's own loop
   (``GPUModelRunner._warmup_and_capture``, which the runner patch runs at
   the key's query length).
2. ``_create_padded_batch_descriptor(num_tokens, uniform_decode, has_lora, ...)``:
   a uniform batch is padded to the smallest graph of its query length
   (``uniform_decode_query_len``, which the runner patch sets to the batch's
   own for the dispatch: :func:`uniform_query_len`), and dispatched as a mixed
   batch where none is large enough.

Other engines, and engines without FULL decode graphs, keep vLLM's keys.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from typing import Any

from vllm.config import CUDAGraphMode
from vllm.forward_context import BatchDescriptor
from vllm.v1.cudagraph_dispatcher import CudagraphDispatcher

from vllm_fafo.config import FafoConfig, fafo_settings
from vllm_fafo.control.goodput import draft_tiers
from vllm_fafo.patches.guard import require_signature

TIER_SIZES_ATTRIBUTE = "vllm_fafo_tier_sizes"
"""The dispatcher's attribute: each tier's query length -> the sizes its FULL graphs
are captured at, ascending (empty: vLLM's keys only)."""


def tier_query_lens(vllm_config: Any) -> tuple[int, ...]:
    """Tokens per request of each padded tier's uniform batch, ascending; empty unless
    the engine pads drafts under the goodput controller without lanes."""
    settings = fafo_settings(vllm_config)
    if settings is None:
        return ()
    config = FafoConfig.from_dict(settings)
    if not config.pad_drafts or config.controller != "goodput" or config.num_lanes:
        return ()
    return tuple(1 + tier for tier in draft_tiers(config.num_speculative_tokens).tolist())


def tier_graph_sizes(dispatcher: CudagraphDispatcher) -> dict[int, list[int]]:
    """The tiers' query lengths this dispatcher has FULL graphs for, each with its graphs'
    sizes (empty: none)."""
    return getattr(dispatcher, TIER_SIZES_ATTRIBUTE, {})


@contextlib.contextmanager
def uniform_query_len(runner: Any, query_len: int) -> Iterator[None]:
    """vLLM's runner and dispatcher read one ``uniform_decode_query_len``; within this
    block both read ``query_len``, the batch's own (a dispatch, a capture)."""
    dispatcher = runner.cudagraph_dispatcher
    saved = runner.uniform_decode_query_len, dispatcher.uniform_decode_query_len
    runner.uniform_decode_query_len = dispatcher.uniform_decode_query_len = query_len
    try:
        yield
    finally:
        runner.uniform_decode_query_len, dispatcher.uniform_decode_query_len = saved


def tier_sizes(capture_sizes: list[int], query_len: int, query_lens: tuple[int, ...], max_num_seqs: int,
               max_size: int) -> dict[int, list[int]]:
    """Each tier's graph sizes: ``b * q`` for its query length ``q`` and each batch size
    ``b`` that vLLM's own uniform batches (``query_len`` tokens per request) are captured
    at, up to ``max_size`` tokens and ``max_num_seqs`` requests."""
    batches = sorted({size // query_len for size in capture_sizes if size % query_len == 0 and size >= query_len})
    return {q: [b * q for b in batches if b <= max_num_seqs and b * q <= max_size] for q in query_lens}


def apply() -> None:
    original_initialize = require_signature(
        CudagraphDispatcher, "initialize_cudagraph_keys", ["self", "cudagraph_mode", "uniform_decode_query_len"])
    original_padded = require_signature(
        CudagraphDispatcher, "_create_padded_batch_descriptor",
        ["self", "num_tokens", "uniform_decode", "has_lora", "num_active_loras"])

    @functools.wraps(original_initialize)
    def initialize_cudagraph_keys(self, cudagraph_mode, uniform_decode_query_len=1, *args, **kwargs):
        query_lens = tier_query_lens(self.vllm_config)
        full_decode = (cudagraph_mode != CUDAGraphMode.NONE and cudagraph_mode.decode_mode() == CUDAGraphMode.FULL
                       and cudagraph_mode.separate_routine())
        compilation = self.compilation_config
        sizes = tier_sizes(compilation.cudagraph_capture_sizes, uniform_decode_query_len, query_lens,
                           self.vllm_config.scheduler_config.max_num_seqs,
                           compilation.max_cudagraph_capture_size) if query_lens and full_decode else {}
        setattr(self, TIER_SIZES_ATTRIBUTE, sizes)
        if not sizes:
            return original_initialize(self, cudagraph_mode, uniform_decode_query_len, *args, **kwargs)
        # mixed batches padded to a tier's size find a (piecewise) graph too
        compilation.cudagraph_capture_sizes = sorted(set(compilation.cudagraph_capture_sizes).union(*sizes.values()))
        result = original_initialize(self, cudagraph_mode, uniform_decode_query_len, *args, **kwargs)
        for query_len, tier in sizes.items():
            for size in tier:
                for loras in self._get_lora_cases():
                    self.add_cudagraph_key(CUDAGraphMode.FULL, BatchDescriptor(
                        num_tokens=size, num_reqs=size // query_len, uniform=True, has_lora=loras > 0,
                        num_active_loras=loras))
        return result

    @functools.wraps(original_padded)
    def _create_padded_batch_descriptor(self, num_tokens, uniform_decode, has_lora, num_active_loras=0):
        if not uniform_decode or not tier_graph_sizes(self):
            return original_padded(self, num_tokens, uniform_decode, has_lora, num_active_loras)
        query_len = self.uniform_decode_query_len
        padded = next((size for size in tier_graph_sizes(self).get(query_len, ()) if size >= num_tokens), None)
        if padded is None:  # no graph of this query length holds it: a mixed batch
            return original_padded(self, num_tokens, False, has_lora, num_active_loras)
        return BatchDescriptor(num_tokens=padded, num_reqs=padded // query_len, uniform=True, has_lora=has_lora,
                               num_active_loras=num_active_loras)

    for name, wrapper in (("initialize_cudagraph_keys", initialize_cudagraph_keys),
                          ("_create_padded_batch_descriptor", _create_padded_batch_descriptor)):
        wrapper.vllm_fafo_patch = __name__
        setattr(CudagraphDispatcher, name, wrapper)
