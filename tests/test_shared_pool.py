"""The pool shared across requests: lookup order and ranking, tenant isolation, memory bound."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from vllm_fafo.drafting.pool import GUESS_VOTES, NgramPool, Origin, PoolArena, alternatives_in, match_pools
from vllm_fafo.drafting.shared_pool import TenantPools

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


def _voting_pools():
    return NgramPool(max_key_len=3, capacity=8, rank="votes"), NgramPool(max_key_len=3, capacity=8, rank="votes")


def test_votes_pick_the_first_token_most_candidates_begin_with():
    own, shared = _voting_pools()
    own.add([1], (5, 6), Origin.PROMPT)
    own.add([1], (5, 7), Origin.OUTPUT)
    own.add([1], (9, 9), Origin.OUTPUT)  # the newest, but 5 has two votes
    assert match_pools((own,), [1]).candidate == (5, 7)  # the newest of the majority
    recency = NgramPool(max_key_len=3, capacity=8)
    for candidate in ((5, 6), (5, 7), (9, 9)):
        recency.add([1], candidate, Origin.OUTPUT)
    assert match_pools((recency,), [1]).candidate == (9, 9)
    # The guess casts GUESS_VOTES: 9 now has 1 + 2 against 5's 2.
    assert match_pools((own,), [1], guess=9).candidate == (9, 9)
    # A text in both pools counts twice; a candidate found in the shared pool is SHARED.
    shared.add([1], (8, 1), Origin.OUTPUT)
    shared.add([1], (8, 2), Origin.OUTPUT)
    shared.add([1], (8, 3), Origin.OUTPUT)
    found = match_pools((own, shared), [1])
    assert (found.candidate, found.origin, found.key_len) == ((8, 3), Origin.SHARED, 1)
    shared.add([1], (5, 7), Origin.OUTPUT)  # 5: two in own, one in shared, against 8's three: own wins the tie
    found = match_pools((own, shared), [1])
    assert (found.candidate, found.origin) == ((5, 7), Origin.OUTPUT)
    # A longer key wins whatever the votes under shorter ones.
    shared.add([4, 1], (3,), Origin.PROMPT)
    assert match_pools((own, shared), [4, 1]) == ((3,), Origin.SHARED, 2)


def _voted_reference(pools, context, guess):
    """Dense reference of the ``votes`` lookup, from the pools' candidate lists."""
    for key_len in range(min(pools[0].max_key_len, len(context)), 0, -1):
        key = context[-key_len:]
        held = [(c, index) for index, pool in enumerate(pools) for c in reversed(pool.candidates(key))]
        if held:
            votes = Counter(c[0] for c, _ in held)
            if guess is not None:
                votes[guess] += GUESS_VOTES
            best = max(range(len(held)), key=lambda i: (votes[held[i][0][0]], -i))
            return held[best][0], held[best][1], key_len
    return None


@pytest.mark.parametrize("seed", range(5))
def test_votes_match_a_dense_reference(seed):
    rng = random.Random(seed)
    own, shared = NgramPool(3, 4, rank="votes"), NgramPool(3, 4, rank="votes")
    for _ in range(300):
        context = [rng.randrange(6) for _ in range(3)]
        candidate = tuple(rng.randrange(5) for _ in range(rng.randrange(1, 4)))
        for pool in (own, shared) if rng.random() < 0.5 else (shared,):
            pool.add(context, candidate, Origin.OUTPUT)
        context = [rng.randrange(6) for _ in range(rng.randrange(1, 4))]
        guess = rng.choice([None, rng.randrange(5)])
        wanted = _voted_reference((own, shared), context, guess)
        found = match_pools((own, shared), context, guess)
        if wanted is None:
            assert found is None
            continue
        candidate, index, key_len = wanted
        assert (found.candidate, found.key_len) == (candidate, key_len)
        assert (found.origin is Origin.SHARED) == (index == 1)
        pool = (own, shared)[index]
        assert pool.candidates(context[-key_len:])[-1] == candidate  # the lookup refreshed the one it drafted


def test_alternatives_go_key_length_then_pool_then_recency_each_once():
    own, shared = _pools()
    own.add([1, 2], (3, 4), Origin.OUTPUT)
    shared.add([1, 2], (5, 6), Origin.OUTPUT)
    shared.add([1, 2], (3, 4), Origin.OUTPUT)
    own.add([2], (7, 8), Origin.OUTPUT)
    shared.add([2], (9,), Origin.OUTPUT)
    assert list(alternatives_in((own, shared), [1, 2])) == [(3, 4), (5, 6), (7, 8), (9,)]


def test_tenants_are_kept_apart_and_the_least_recent_tenant_is_dropped():
    arena = PoolArena(2, 4)
    tenants = TenantPools(arena, max_bytes=100 * arena.bytes_per_key(), max_tenants=2)
    tenants.pool_for("a").add([1], (2,), Origin.OUTPUT)
    assert tenants.pool_for("b").match([1]) is None
    assert tenants.pool_for(None).match([1]) is None  # unsalted is its own tenant
    assert tenants.num_tenants == 2  # "a" was the least recently used: dropped
    assert tenants.pool_for("a").match([1]) is None


def test_each_tenant_is_bounded_in_bytes_and_never_evicts_another():
    arena = PoolArena(1, 4)
    per_key = arena.bytes_per_key()  # a key at its full 4 candidates
    tenants = TenantPools(arena, max_bytes=10 * per_key + per_key // 2, max_tenants=8)
    assert tenants.max_keys == 10
    tenants.pool_for("quiet").add([100], (101,), Origin.OUTPUT)
    busy = tenants.pool_for("busy")
    for token in range(31):
        busy.add([token], (token + 1,), Origin.OUTPUT)
        if 20 <= token < 30:
            assert busy.match([20]) is not None  # used again each step: not moved, still the first filed
    assert len(busy) == 10 and busy.nbytes() <= 10 * per_key + per_key // 2
    assert busy.match([30]) is not None and busy.match([21]) is not None
    assert busy.match([20]) is None  # the first filed went first, though used the step before
    assert tenants.pool_for("quiet").match([100]) is not None  # the busy tenant evicted only its own
    assert tenants.num_tenants == 2 and tenants.nbytes() == 11 * per_key
    with pytest.raises(ValueError, match="one key"):
        TenantPools(arena, max_bytes=per_key - 1, max_tenants=1)


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
    # Short requests (8 tokens) file n-grams only with short candidates.
    proposer = make_proposer(shared_pool_mib=1, num_speculative_tokens=4)
    sizes = []
    for i in range(10_000):
        prompt = [(i * 7 + j * 13) % 5003 for j in range(6)]
        _announce_and_run(proposer, f"r{i}", prompt, None, [[i % 5003], [(i + 1) % 5003]])
        if i % 2500 == 2499:
            sizes.append((proposer.shared.num_keys(), proposer.shared.nbytes(), proposer.index.arena.nbytes()))
    assert proposer.num_tracked_requests == 0
    assert all(keys == proposer.shared.max_keys for keys, _, _ in sizes)
    assert all(charged <= 1 << 20 for _, charged, _ in sizes)
    assert max(allocated for _, _, allocated in sizes) <= 1.05 * sizes[0][2]  # the arena stopped growing
