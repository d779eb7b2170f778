"""Deep matches on the real engine: a tenant's finished answer drafts for it and for no
other salt, every token identical to plain vLLM's.

The ``lanes`` engine (lanes pinned on, ``controller`` fixed), so both draft sources
run: deep matches (counted under ``deep_match``) and, where they have nothing, the
pool's (lane n-grams)."""

from __future__ import annotations

import uuid

import pytest

from vllm_fafo.serving.metrics import collect_metrics

from .engine_configs import LANES_SPEC
from .engine_utils import greedy, token_ids

pytestmark = pytest.mark.engine


def _accepted(llm) -> dict[str, int]:
    return collect_metrics(llm)["accepted_tokens"]


def test_a_tenants_finished_answer_drafts_for_it_and_for_no_other_salt(lanes_llm, mtbench, plain_run):
    """The same question three times: the first tenant's second run is drafted
    from its first answer, which a new salt's request never sees."""
    prompt, expected = mtbench[0], plain_run.tokens("greedy-0")[:64]
    first, other = f"a-{uuid.uuid4()}", f"b-{uuid.uuid4()}"
    accepted = []
    for salt in (first, other, first):
        before = _accepted(lanes_llm)["deep_match"]
        output = lanes_llm.generate({"prompt": prompt, "cache_salt": salt}, greedy(64), use_tqdm=False)
        assert token_ids(output)[0] == expected
        accepted.append(_accepted(lanes_llm)["deep_match"] - before)
    first_run, other_salt, again = accepted
    k = LANES_SPEC["num_speculative_tokens"]  # at most k of every k + 1 tokens come from a draft
    assert again > 0.9 * k / (k + 1) * len(expected)
    assert other_salt < 0.5 * len(expected)
    assert abs(other_salt - first_run) <= 0.1 * len(expected)  # as little help as a first run


