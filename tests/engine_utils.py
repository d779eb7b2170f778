"""Helpers to build in-process vLLM engines the same way in every engine test."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import Any

ENGINE_MAX_MODEL_LEN = 768
MAX_STEP_TOKENS = 256
"""Within these (tokens of a request's context, tokens of one step), vLLM 0.32.0's CPU
attention with its split over the keys off gives a row the same bits in any batch, also
on two threads (tests/test_row_invariance.py): every identity test's reference cannot
move with the batch (tests/row_invariant)."""

ENGINE_KWARGS: dict[str, Any] = dict(
    dtype="float32",
    enforce_eager=True,
    seed=0,
    disable_log_stats=False,
    kv_cache_memory_bytes=512 * 1024 * 1024,
    max_num_batched_tokens=MAX_STEP_TOKENS,
)


def make_llm(model_dir: str, speculative_config: dict | None,
             max_model_len: int = ENGINE_MAX_MODEL_LEN, **overrides):
    from vllm import LLM

    return LLM(
        model=model_dir,
        max_model_len=max_model_len,
        speculative_config=speculative_config,
        **{**ENGINE_KWARGS, **overrides},
    )


def chat_prompts(llm, texts: list[str]) -> list[str]:
    from vllm_fafo.tools.assets import chat_prompt

    tokenizer = llm.get_tokenizer()
    return [chat_prompt(tokenizer, text) for text in texts]


def greedy(max_tokens: int, **kwargs):
    from vllm import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=max_tokens, **kwargs)


def generate_one_by_one(llm, prompts, params) -> list:
    """Batch 1: each prompt decoded alone."""
    return [llm.generate([p], params, use_tqdm=False)[0] for p in prompts]


def token_ids(outputs) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in outputs]


def first_diff(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def assert_same_tokens(expected: list[list[int]], got: list[list[int]]) -> None:
    for i, (want, have) in enumerate(zip(expected, got)):
        assert have == want, f"prompt {i} diverges at token {first_diff(want, have)}"
    assert len(got) == len(expected)


def concurrent_params(num_prompts: int, first_len: int = 40) -> list:
    """Greedy params of different lengths, for prompts submitted at once."""
    return [greedy(first_len + 16 * i) for i in range(num_prompts)]


def assert_concurrent_identical(plain_llm, llm, prompts: list[str], first_len: int = 40) -> None:
    """All prompts submitted at once, with different lengths: same tokens as plain."""
    params = concurrent_params(len(prompts), first_len)
    expected = token_ids(plain_llm.generate(prompts, params, use_tqdm=False))
    got = token_ids(llm.generate(prompts, params, use_tqdm=False))
    assert_same_tokens(expected, got)


@contextlib.contextmanager
def vllm_info_lines() -> Iterator[list[str]]:
    """The messages logged under vLLM's logger tree meanwhile, at INFO as vLLM's
    configure_logging sets it when an engine starts (a test run alone has no engine yet)."""
    messages: list[str] = []
    catcher = logging.Handler(level=logging.INFO)
    catcher.emit = lambda record: messages.append(record.getMessage())
    vllm_logger = logging.getLogger("vllm")
    level = vllm_logger.level
    vllm_logger.addHandler(catcher)
    vllm_logger.setLevel(logging.INFO)
    try:
        yield messages
    finally:
        vllm_logger.removeHandler(catcher)
        vllm_logger.setLevel(level)
