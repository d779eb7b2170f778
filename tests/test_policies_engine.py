"""Quest and SnapKV regions on the real engine: outputs stay plain vLLM's.

The policies read vLLM's CPU paged KV cache to choose what the lanes see;
whatever they choose, verification against the full cache keeps greedy
outputs token-identical. Each test also checks the policy did choose.
"""

from __future__ import annotations

import pytest

from vllm_fafo.attention.cpu import FafoCPUAttentionBackendImpl
from vllm_fafo.metrics import collect_metrics

from .conftest import BATCH1_PROMPTS
from .engine_utils import (
    assert_concurrent_identical,
    assert_same_tokens,
    generate_one_by_one,
    greedy,
    token_ids,
)

pytestmark = pytest.mark.engine


def _selected_tokens(worker) -> int:
    """Selected tokens held in all layers' regions (0: the policy chose nothing)."""
    total = 0
    for module in worker.model_runner.model.modules():
        impl = getattr(module, "impl", None)
        if isinstance(impl, FafoCPUAttentionBackendImpl) and impl.region is not None:
            total += sum(impl.region.selected_count)
    return total


def test_batch1_identical_to_plain(policy_llm, plain_batch1_tokens, mtbench):
    name, llm = policy_llm
    got = token_ids(generate_one_by_one(llm, mtbench[:BATCH1_PROMPTS], greedy(128)))
    assert_same_tokens(plain_batch1_tokens, got)
    assert llm.collective_rpc(_selected_tokens)[0] > 0, f"{name} never selected"
    assert collect_metrics(llm)["accepted_tokens"]["lane"] > 0


def test_concurrent_requests_identical_to_plain(policy_llm, plain_llm, mtbench):
    _, llm = policy_llm
    assert_concurrent_identical(plain_llm, llm, mtbench[8:14])
