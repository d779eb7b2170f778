"""A tenant's shared state in the real engine (its shared pool and the answers deep
matches draft from): tenants by ``cache_salt``, outputs unchanged."""

from __future__ import annotations

import uuid

import pytest

from vllm_fafo.serving.metrics import collect_metrics

from .engine_utils import greedy, token_ids


def _shared_counts(llm) -> tuple[int, int]:
    """Draft tokens proposed from the shared pool, and those accepted from it or from a
    deep match (an earlier answer of the tenant, or the request's own text)."""
    metrics = collect_metrics(llm)
    accepted = metrics["accepted_tokens"]
    return metrics["proposed_tokens"]["shared"], accepted["shared"] + accepted["deep_match"]


@pytest.mark.engine
def test_a_tenant_drafts_from_its_earlier_request_and_no_salt_sees_another(engine, mtbench, plain_run):
    """The same question three times: under a new salt nothing comes from the shared
    pool (the tenant's pool holds only the request's own text, which its own pool
    answers first); under the first request's salt the earlier answer is drafted (deep
    matches find it first, the shared pool where they end)."""
    pool_only_llm = engine("pool-tree")
    prompt, expected = mtbench[0], plain_run.tokens("greedy-0")[:64]
    first, other = f"a-{uuid.uuid4()}", f"b-{uuid.uuid4()}"
    runs = []
    for salt in (first, other, first):
        before = _shared_counts(pool_only_llm)
        output = pool_only_llm.generate({"prompt": prompt, "cache_salt": salt}, greedy(64), use_tqdm=False)
        after = _shared_counts(pool_only_llm)
        runs.append((token_ids(output)[0], after[0] - before[0], after[1] - before[1]))
    assert [tokens for tokens, _, _ in runs] == [expected] * 3
    (_, proposed_first, accepted_first), (_, proposed_other, _), (_, _, accepted_again) = runs
    assert proposed_first == 0 and proposed_other == 0
    assert accepted_again - accepted_first > len(expected) // 2
    assert collect_metrics(pool_only_llm)["shared_pool_tenants"] >= 2
