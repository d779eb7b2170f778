"""FAFO lanes and draft trees on CUDA (FlashAttention wrapped as the CUSTOM backend): GPU only.

Skipped without a CUDA device, so CI (CPU) never runs it; on a GPU machine:
``python -m pytest tests/test_gpu_engine.py``. FlashAttention has no fp32, so both
engines run bf16 with vLLM's batch-invariant mode on (VLLM_BATCH_INVARIANT=1):
a step's extra tail tokens must then change no real token's numerics, and
any differing token is a lane bug, not rounding.
"""

from __future__ import annotations

import pytest
import torch

from vllm_fafo.config import ADDITIONAL_CONFIG_KEY
from vllm_fafo.serving.metrics import collect_metrics

from .engine_utils import (
    assert_concurrent_identical,
    assert_same_tokens,
    chat_prompts,
    generate_one_by_one,
    greedy,
    make_llm,
    token_ids,
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available(),
        reason="needs a CUDA GPU (FlashAttention has no CPU kernel); CI is CPU-only and runs the "
        "same lane code through the CPU engine tests and tests/test_cuda_wrapper.py",
    ),
]

# Two engines live at once (plain and one lane configuration); vLLM refuses to start
# one when free memory is below gpu_memory_utilization x total, so ask for little.
GPU_KWARGS = dict(dtype="bfloat16", kv_cache_memory_bytes=2 * 1024**3, gpu_memory_utilization=0.25)


@pytest.fixture(scope="module")
def batch_invariant():
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("VLLM_BATCH_INVARIANT", "1")
        yield


@pytest.fixture(scope="module")
def gpu_plain_llm(model_dir, batch_invariant):
    return make_llm(model_dir, None, **GPU_KWARGS)


LANE_SPECS = {
    "streaming": {"method": "fafo", "num_lanes": 16, "compression": "streaming", "kv_budget": 64, "sink_tokens": 4,
                  "controller": "fixed"},
    "quest": {"method": "fafo", "num_lanes": 16, "compression": "quest", "kv_budget": 64, "sink_tokens": 4,
              "controller": "fixed"},
    "lookahead": {"method": "lookahead", "window": 6, "ngram": 4, "guesses": 6},  # whole-cache lanes
    "default": {"method": "fafo"},  # on CUDA: pool only, padded 16-token drafts (vllm_fafo/patches/engine_args.py)
    # draft trees: branches through FlashAttention's own kernel (vllm_fafo/attention/cuda.py)
    "tree": {"method": "fafo", "num_lanes": 0, "num_candidates": 4, "controller": "fixed"},
}

# What each configuration must show accepted during the batch-1 run, beyond identity.
def _lane_tokens(metrics: dict) -> int:
    return metrics["accepted_tokens"]["lane"]


def _all_tokens(metrics: dict) -> int:
    return sum(metrics["accepted_tokens"].values())


def _branch_tokens(metrics: dict) -> int:
    return metrics["branch_accepted_tokens"]


ACCEPTED_BY = {"streaming": _lane_tokens, "quest": _lane_tokens, "lookahead": _lane_tokens,
               "default": _all_tokens, "tree": _branch_tokens}


@pytest.fixture(scope="module", params=list(LANE_SPECS))
def gpu_lanes_llm(request, model_dir, batch_invariant):
    llm = make_llm(model_dir, LANE_SPECS[request.param], **GPU_KWARGS)
    llm.fafo_case = request.param
    return llm


@pytest.fixture(scope="module")
def gpu_prompts(gpu_plain_llm):
    from vllm_fafo.tools.assets import load_prompts

    return chat_prompts(gpu_plain_llm, load_prompts("mtbench", 10))


def test_lanes_run_on_the_flash_attention_wrapper(gpu_lanes_llm):
    config = gpu_lanes_llm.llm_engine.vllm_config
    backend = config.attention_config.backend
    if gpu_lanes_llm.fafo_case == "default":  # pool only: vLLM's own backend
        fafo = config.additional_config[ADDITIONAL_CONFIG_KEY]
        assert (fafo["num_lanes"], fafo["pad_drafts"], fafo["num_speculative_tokens"]) == (0, True, 4)
        assert backend is None or backend.name != "CUSTOM"
    else:
        assert backend.name == "CUSTOM"


def test_batch1_identical_to_plain_and_lane_ngrams_accepted(gpu_plain_llm, gpu_lanes_llm, gpu_prompts):
    prompts = gpu_prompts
    expected = token_ids(generate_one_by_one(gpu_plain_llm, prompts, greedy(128)))
    before = collect_metrics(gpu_lanes_llm)
    got = token_ids(generate_one_by_one(gpu_lanes_llm, prompts, greedy(128)))
    assert_same_tokens(expected, got)
    after = collect_metrics(gpu_lanes_llm)
    accepted = ACCEPTED_BY[gpu_lanes_llm.fafo_case]
    assert accepted(after) > accepted(before)


def test_concurrent_requests_identical_to_plain(gpu_plain_llm, gpu_lanes_llm, gpu_prompts):
    assert_concurrent_identical(gpu_plain_llm, gpu_lanes_llm, gpu_prompts[:6], first_len=48)


def _tier_graphs(worker) -> dict[int, list[int]]:
    from vllm_fafo.patches.cudagraph_dispatcher import tier_graph_sizes

    return tier_graph_sizes(worker.model_runner.cudagraph_dispatcher)


def test_padded_tiers_replay_whole_graphs_identical_to_plain(model_dir, gpu_plain_llm, gpu_prompts):
    """``"controller": "goodput"`` on CUDA: padded drafts of one tier per step (0, 4, 8, 16),
    each tier captured as FULL graphs (vllm_fafo.patches.cudagraph_dispatcher); greedy
    tokens identical to plain vLLM's at batch 1 and concurrent."""
    llm = make_llm(model_dir, {"method": "fafo", "controller": "goodput"},
                   **{**GPU_KWARGS, "enforce_eager": False})
    fafo = llm.llm_engine.vllm_config.additional_config[ADDITIONAL_CONFIG_KEY]
    assert (fafo["num_lanes"], fafo["pad_drafts"], fafo["controller"]) == (0, True, "goodput")
    graphs = llm.collective_rpc(_tier_graphs)[0]
    assert sorted(graphs) == [1, 5, 9, 1 + fafo["num_speculative_tokens"]] and all(graphs.values())
    expected = token_ids(generate_one_by_one(gpu_plain_llm, gpu_prompts, greedy(128)))
    assert_same_tokens(expected, token_ids(generate_one_by_one(llm, gpu_prompts, greedy(128))))
    assert_concurrent_identical(gpu_plain_llm, llm, gpu_prompts[:6], first_len=48)
    assert sum(collect_metrics(llm)["padded_request_steps"].values()) > 0
