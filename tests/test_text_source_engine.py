"""The deep-match and suffix-tree text sources on the real engine: tokens identical to
plain vLLM greedy, plain vLLM's distribution under sampling, tenants kept apart.

One engine per source, lanes pinned on (``controller`` fixed), so both draft sources
run: the source's drafts (counted under the origin of the same name) and, where it has
nothing, the pool's (lane n-grams)."""

from __future__ import annotations

import uuid

import pytest

from vllm_fafo.metrics import collect_metrics

from .conftest import BATCH1_PROMPTS
from .engine_utils import (
    assert_concurrent_identical,
    assert_same_tokens,
    generate_one_by_one,
    greedy,
    token_ids,
)
from .test_sampling import assert_same_distribution, sample

pytestmark = pytest.mark.engine


@pytest.fixture(params=["deep_match", "suffix_tree"])
def source(request) -> str:
    return request.param


@pytest.fixture
def source_llm(source, request):
    """The session's engine with ``text_source`` ``source`` (conftest)."""
    return request.getfixturevalue(f"{source}_llm")


def _accepted(llm) -> dict[str, int]:
    return collect_metrics(llm)["accepted_tokens"]


def test_batch1_identical_to_plain_with_source_and_lane_drafts_accepted(source, source_llm, plain_batch1_tokens,
                                                                        mtbench):
    before = _accepted(source_llm)
    got = token_ids(generate_one_by_one(source_llm, mtbench[:BATCH1_PROMPTS], greedy(128)))
    assert_same_tokens(plain_batch1_tokens, got)
    after = _accepted(source_llm)
    assert after[source] > before[source]
    assert after["lane"] > before["lane"]


def test_concurrent_requests_identical_to_plain(plain_llm, source_llm, mtbench):
    assert_concurrent_identical(plain_llm, source_llm, mtbench[:8])


def test_a_tenants_finished_answer_drafts_for_it_and_for_no_other_salt(source, source_llm, mtbench,
                                                                       plain_batch1_tokens):
    """The same question three times: the first tenant's second run is drafted
    from its first answer, which a new salt's request never sees."""
    prompt, expected = mtbench[0], plain_batch1_tokens[0]
    first, other = f"a-{uuid.uuid4()}", f"b-{uuid.uuid4()}"
    accepted = []
    for salt in (first, other, first):
        before = _accepted(source_llm)[source]
        output = source_llm.generate({"prompt": prompt, "cache_salt": salt}, greedy(128), use_tqdm=False)
        assert token_ids(output)[0] == expected
        accepted.append(_accepted(source_llm)[source] - before)
    first_run, other_salt, again = accepted
    assert again > 0.9 * len(expected)
    assert other_salt < 0.5 * len(expected)
    assert abs(other_salt - first_run) <= 0.1 * len(expected)  # as little help as a first run


def test_samples_from_plain_vllms_distribution(source, plain_samples, source_llm):
    """Every draft source on: the text source, lanes, the pool and the prior table."""
    before = _accepted(source_llm)
    got = sample(source_llm, seed0=10_000)
    after = _accepted(source_llm)
    for origin in (source, "prior"):
        assert after[origin] > before[origin], origin  # the rejection sampler's random path ran on its drafts
    assert_same_distribution(plain_samples, got)
