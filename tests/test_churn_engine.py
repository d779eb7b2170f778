"""Requests that come and go the hard ways keep plain vLLM's tokens, and leave no state.

A KV cache too small for the batch makes vLLM preempt requests (their KV is
dropped and recomputed when they resume: the region is refilled by that
prefill, the pool and lanes carry on); more lane requests than region rows
leaves some pool-only; requests aborted between two steps (their drafts
scheduled, staged in the region) and requests finishing mid-draft must not
disturb the others. Lanes are pinned on (``controller: fixed``) so every step
exercises the region.
"""

from __future__ import annotations

import pytest

from vllm_fafo.serving.metrics import collect_metrics

from .engine_configs import LANES_SPEC
from .engine_utils import assert_same_tokens, greedy, make_llm, token_ids

pytestmark = pytest.mark.engine

KV_TOKENS = 1280
"""Tokens the tight engine's KV cache holds: one max_model_len request, not the batch."""
KV_BYTES_PER_TOKEN = 30 * 2 * 3 * 64 * 4
"""SmolLM2-135M: 30 layers x (K, V) x 3 KV heads x 64 dims x fp32."""


@pytest.fixture(scope="session")
def tight_lanes_llm(model_dir):
    """Lanes with 2 region rows and a KV cache that preempts a batch of 8."""
    return make_llm(model_dir, {**LANES_SPEC, "max_lane_requests": 2},
                    kv_cache_memory_bytes=KV_TOKENS * KV_BYTES_PER_TOKEN)


def _preemptions(llm) -> float:
    return sum(m.value for m in llm.get_metrics() if m.name == "vllm:num_preemptions")


def test_preempted_requests_resume_identical_to_plain(plain_llm, tight_lanes_llm, mtbench):
    prompts = mtbench[:8]
    params = [greedy(96 + 8 * i) for i in range(len(prompts))]
    expected = token_ids(plain_llm.generate(prompts, params, use_tqdm=False))
    before = _preemptions(tight_lanes_llm)
    got = token_ids(tight_lanes_llm.generate(prompts, params, use_tqdm=False))
    assert_same_tokens(expected, got)
    assert _preemptions(tight_lanes_llm) > before, "the KV cache was meant to force preemptions"
    metrics = collect_metrics(tight_lanes_llm)
    assert metrics["tail_tokens"] > 0 and metrics["accepted_tokens"]["lane"] > 0
    # vLLM reports the last finished request with the next step: at most it is still held.
    assert metrics["requests_tracked"] <= 1 and metrics["requests_with_region"] <= 1


def test_requests_aborted_between_steps_leave_the_others_identical(plain_llm, lanes_llm, mtbench):
    """Six requests stepped by hand; two are aborted once they have drafts in flight."""
    engine = lanes_llm.llm_engine
    prompts = mtbench[8:14]
    params = [greedy(96 + 8 * i) for i in range(len(prompts))]
    ids = [f"churn-{i}" for i in range(len(prompts))]
    for req_id, prompt, param in zip(ids, prompts, params):
        engine.add_request(req_id, prompt, param)
    aborted = {ids[1], ids[4]}
    finished: dict[str, list[int]] = {}
    steps = 0
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished and output.request_id not in aborted:
                finished[output.request_id] = list(output.outputs[0].token_ids)
        steps += 1
        if steps == 12:
            engine.abort_request(sorted(aborted))
    assert set(finished) == set(ids) - aborted
    kept = [i for i, req_id in enumerate(ids) if req_id not in aborted]
    expected = token_ids(plain_llm.generate([prompts[i] for i in kept], [params[i] for i in kept], use_tqdm=False))
    assert_same_tokens(expected, [finished[ids[i]] for i in kept])
    lanes_llm.generate(mtbench[:1], greedy(2), use_tqdm=False)  # one more step reports the finished ones
    metrics = collect_metrics(lanes_llm)
    assert metrics["requests_tracked"] <= 1 and metrics["requests_with_region"] <= 1
