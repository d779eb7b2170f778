"""Whole CUDA graphs for every padded draft length (vllm_fafo.patches.cudagraph_dispatcher),
on vLLM's own ``CudagraphDispatcher`` and ``CompilationConfig``: which graphs it would
capture and where each batch is dispatched. No GPU: capture and replay themselves are
``tests/test_gpu_engine.py``'s."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from vllm.config import CompilationConfig, CompilationMode, CUDAGraphMode
from vllm.v1.cudagraph_dispatcher import CudagraphDispatcher

from vllm_fafo.config import FafoConfig
from vllm_fafo.patches import apply_all
from vllm_fafo.patches.cudagraph_dispatcher import tier_graph_sizes, tier_query_lens, tier_sizes, uniform_query_len

MAX_NUM_SEQS = 64
VLLM_SIZES = [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64, 128, 256, 512]
"""Capture sizes as vLLM 0.32.0 would list them for 64 sequences (before its spec-decode rounding)."""
VLLM_BATCHES = (1, 2, 3, 4, 8, 16)
"""The batches of 17-token requests vLLM captures after rounding those sizes up to multiples of 17."""
LARGEST = 17 * 16
"""The largest size left (vLLM drops sizes that round past 512)."""


def dispatcher_for(spec: dict | None, num_speculative_tokens: int = 16,
                   mode: CUDAGraphMode = CUDAGraphMode.FULL_AND_PIECEWISE) -> CudagraphDispatcher:
    """A dispatcher with its keys, set up as vLLM's GPU runner does
    (``_check_and_update_cudagraph_mode``)."""
    apply_all()
    compilation = CompilationConfig(
        mode=CompilationMode.VLLM_COMPILE, cudagraph_mode=mode, cudagraph_capture_sizes=list(VLLM_SIZES),
        max_cudagraph_capture_size=VLLM_SIZES[-1], splitting_ops=list(CompilationConfig._attention_ops))
    query_len = 1 + num_speculative_tokens
    compilation.adjust_cudagraph_sizes_for_spec_decode(query_len)
    additional = {} if spec is None else {"fafo": FafoConfig.from_user_dict(spec).to_dict()}
    vllm_config = SimpleNamespace(compilation_config=compilation, num_speculative_tokens=num_speculative_tokens,
                                  scheduler_config=SimpleNamespace(max_num_seqs=MAX_NUM_SEQS), lora_config=None,
                                  additional_config=additional)
    dispatcher = CudagraphDispatcher(vllm_config)
    dispatcher.initialize_cudagraph_keys(mode, query_len)
    return dispatcher


TIERED = {"method": "fafo", "num_lanes": 0, "controller": "goodput", "pad_drafts": True}


def full_keys(dispatcher: CudagraphDispatcher) -> set[tuple[int, int]]:
    return {(key.num_tokens, key.num_reqs) for key in dispatcher.cudagraph_keys[CUDAGraphMode.FULL] if key.uniform}


def test_only_padded_drafts_under_the_goodput_controller_without_lanes_have_tiers():
    assert tier_query_lens(SimpleNamespace(additional_config={"fafo": FafoConfig.from_user_dict(TIERED).to_dict()})) \
        == (1, 5, 9, 17)
    for spec in ({**TIERED, "controller": "fixed"}, {**TIERED, "pad_drafts": False}, {**TIERED, "num_lanes": 4},
                 None):
        settings = {} if spec is None else {"fafo": FafoConfig.from_user_dict(spec).to_dict()}
        assert tier_query_lens(SimpleNamespace(additional_config=settings)) == ()


def test_other_engines_keep_vllms_own_keys():
    """The fixed controller's padded drafts (the CUDA default) and engines of other
    methods: exactly the keys vLLM makes, one FULL graph per size of 17-token requests."""
    for spec in ({**TIERED, "controller": "fixed"}, None):
        dispatcher = dispatcher_for(spec)
        assert tier_graph_sizes(dispatcher) == {}
        assert full_keys(dispatcher) == {(17 * b, b) for b in VLLM_BATCHES}
    assert tier_graph_sizes(dispatcher_for(TIERED, mode=CUDAGraphMode.PIECEWISE)) == {}  # no FULL decode graphs


def test_every_tier_has_a_full_graph_at_every_batch_size_vllm_captures():
    dispatcher = dispatcher_for(TIERED)
    assert tier_graph_sizes(dispatcher) == {q: [q * b for b in VLLM_BATCHES] for q in (1, 5, 9, 17)}
    # vLLM's own (17-token batches) and as many of each other tier: no more
    assert full_keys(dispatcher) == {(q * b, b) for q in (1, 5, 9, 17) for b in VLLM_BATCHES}
    sizes = dispatcher.compilation_config.cudagraph_capture_sizes
    assert sizes == sorted({q * b for q in (1, 5, 9, 17) for b in VLLM_BATCHES})
    piecewise = {key.num_tokens for key in dispatcher.cudagraph_keys[CUDAGraphMode.PIECEWISE]}
    assert piecewise == set(sizes)  # mixed batches padded to any of them find a graph


@pytest.mark.parametrize("query_len", [1, 5, 9, 17])
def test_a_uniform_batch_of_any_tier_replays_its_tiers_smallest_graph_that_holds_it(query_len):
    dispatcher = dispatcher_for(TIERED)
    runner = SimpleNamespace(cudagraph_dispatcher=dispatcher, uniform_decode_query_len=17)
    for requests in range(1, MAX_NUM_SEQS + 1):
        num_tokens = requests * query_len
        with uniform_query_len(runner, query_len):
            mode, key = dispatcher.dispatch(num_tokens, uniform_decode=True)
        holding = [b for b in VLLM_BATCHES if b >= requests]
        if holding:
            assert mode == CUDAGraphMode.FULL and key.uniform
            assert (key.num_tokens, key.num_reqs) == (holding[0] * query_len, holding[0])
        else:  # more requests than the largest graph of this tier holds: a mixed batch's graph, or none
            assert mode != CUDAGraphMode.FULL
    assert (runner.uniform_decode_query_len, dispatcher.uniform_decode_query_len) == (17, 17)  # restored


def test_mixed_batches_dispatch_as_before():
    tiered, plain = dispatcher_for(TIERED), dispatcher_for(None)
    for num_tokens in (3, 17, 100, LARGEST - 1):
        mode, key = tiered.dispatch(num_tokens, uniform_decode=False)
        assert mode == CUDAGraphMode.PIECEWISE and not key.uniform and key.num_tokens >= num_tokens
        assert key.num_tokens <= plain.dispatch(num_tokens, uniform_decode=False)[1].num_tokens


def test_tier_sizes_are_vllms_batch_sizes_at_each_query_length():
    assert tier_sizes([17, 34, 68], 17, (1, 5, 17), max_num_seqs=64, max_size=68) == {
        1: [1, 2, 4], 5: [5, 10, 20], 17: [17, 34, 68]}
    assert tier_sizes([17, 34, 68], 17, (1, 5, 17), max_num_seqs=2, max_size=30) == {1: [1, 2], 5: [5, 10], 17: [17]}
