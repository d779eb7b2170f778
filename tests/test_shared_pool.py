"""The pool shared across requests: lookup order, tenant isolation, memory bound."""

from __future__ import annotations

from vllm_fafo.pool import NgramPool, Origin, alternatives_in, match_pools
from vllm_fafo.shared_pool import TenantPools

from .test_proposer import FakeBatch, make_proposer


def _pools():
    own, shared = NgramPool(max_key_len=3, capacity=4), NgramPool(max_key_len=3, capacity=4)
    return own, shared


def test_longest_key_wins_across_pools_and_own_pool_wins_under_the_same_key():
    own, shared = _pools()
    own.add([2], (10, 11), Origin.OUTPUT)
    shared.add([1, 2], (20, 21), Origin.PROMPT)
    found = match_pools((own, shared), [0, 1, 2])
    assert found.candidate == (20, 21) and found.origin is Origin.SHARED and found.key_len == 2
    own.add([1, 2], (30, 31), Origin.LANE)
    found = match_pools((own, shared), [0, 1, 2])
    assert found.candidate == (30, 31) and found.origin is Origin.LANE and found.key_len == 2
    assert match_pools((own, shared), [5, 6]) is None
    assert match_pools((own,), [0, 1, 2]) == own.match([0, 1, 2])


def test_alternatives_go_key_length_then_pool_then_recency_each_once():
    own, shared = _pools()
    own.add([1, 2], (3, 4), Origin.OUTPUT)
    shared.add([1, 2], (5, 6), Origin.OUTPUT)
    shared.add([1, 2], (3, 4), Origin.OUTPUT)
    own.add([2], (7, 8), Origin.OUTPUT)
    shared.add([2], (9,), Origin.OUTPUT)
    assert list(alternatives_in((own, shared), [1, 2])) == [(3, 4), (5, 6), (7, 8), (9,)]


def test_tenants_are_kept_apart_and_the_least_recent_tenant_is_dropped():
    tenants = TenantPools(2, 4, min_key_len=1, max_keys=100, max_tenants=2, touch_on_lookup=True)
    tenants.pool_for("a").add([1], (2,), Origin.OUTPUT)
    assert tenants.pool_for("b").match([1]) is None
    assert tenants.pool_for(None).match([1]) is None  # unsalted is its own tenant
    assert tenants.num_tenants == 2  # "a" was the least recently used: dropped
    assert tenants.pool_for("a").match([1]) is None


def test_keys_are_bounded_over_all_tenants_by_dropping_the_least_recent():
    tenants = TenantPools(1, 4, min_key_len=1, max_keys=10, max_tenants=8, touch_on_lookup=True)
    for tenant in ("a", "b", "c"):
        pool = tenants.pool_for(tenant)
        for token in range(6):
            pool.add([token], (token + 1,), Origin.OUTPUT)
        tenants.trim()
        assert tenants.num_keys() <= 10
    assert tenants.num_tenants == 1 and tenants.pool_for("c").match([5]) is not None
    assert tenants.pool_for("b").match([5]) is None  # dropped whole, starts afresh


def _announce_and_run(proposer, req_id, prompt, salt, sampled):
    batch = FakeBatch(max_model_len=64)
    batch.add(req_id, prompt, cache_salt=salt)
    drafts = [batch.step(proposer, [tokens]) for tokens in sampled]
    proposer.remove_requests([req_id])
    return drafts


def test_a_later_request_drafts_from_an_earlier_one_of_its_tenant_only():
    proposer = make_proposer(num_speculative_tokens=3, max_key_len=2)
    # "a" writes 7 8 9 10 after 5 6; a later request whose prompt ends in 5 6 can draft it.
    _announce_and_run(proposer, "a", [1, 5, 6], "x", [[7], [8], [9], [10], [11]])
    assert _announce_and_run(proposer, "b", [3, 5], "y", [[6]]) == [[[]]]  # other tenant: nothing
    assert _announce_and_run(proposer, "c", [3, 5], None, [[6]]) == [[[]]]  # unsalted: nothing
    assert _announce_and_run(proposer, "d", [3, 5], "x", [[6]]) == [[[7, 8, 9]]]
    assert proposer.metrics.proposed_tokens["shared"] == 3
    # Sharing off: nothing crosses requests.
    alone = make_proposer(num_speculative_tokens=3, max_key_len=2, share_pool=False)
    _announce_and_run(alone, "a", [1, 5, 6], "x", [[7], [8], [9], [10], [11]])
    assert _announce_and_run(alone, "d", [3, 5], "x", [[6]]) == [[[]]]


def test_shared_pool_memory_stops_growing_over_ten_thousand_requests():
    max_keys = 2000
    # Short requests (8 tokens) file n-grams only with short candidates.
    proposer = make_proposer(shared_pool_keys=max_keys, num_speculative_tokens=4)
    sizes = []
    for i in range(10_000):
        prompt = [(i * 7 + j * 13) % 5003 for j in range(6)]
        _announce_and_run(proposer, f"r{i}", prompt, None, [[i % 5003], [(i + 1) % 5003]])
        if i % 2500 == 2499:
            sizes.append((proposer.shared.num_keys(), proposer.shared.nbytes()))
    assert proposer.num_tracked_requests == 0
    assert all(keys == max_keys for keys, _ in sizes)
    assert max(nbytes for _, nbytes in sizes) <= 1.05 * sizes[0][1]
