"""A tenant's pool, shared by its requests: lookup order and ranking by tag, tenant
isolation, the memory bound and the running requests' keys."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from vllm_fafo.drafting.pool import (
    GUESS_VOTES,
    OWN_VOTES,
    NgramPool,
    Origin,
    PoolArena,
    RequestPool,
    alternatives_in,
    file_in,
    match_in,
)
from vllm_fafo.drafting.shared_pool import TenantPools

from .test_proposer import FakeBatch, make_proposer


def _tenant(capacity: int = 4, **settings) -> tuple[RequestPool, RequestPool]:
    """Two requests of one tenant's pool, as (``me``, another)."""
    pool = NgramPool(max_key_len=3, capacity=capacity, **settings)
    return RequestPool(pool, pool.arena.new_tag()), RequestPool(pool, pool.arena.new_tag())


def test_longest_key_wins_and_the_asker_s_own_candidate_wins_under_the_same_key():
    me, other = _tenant()
    file_in(me, [2], (10, 11), Origin.OUTPUT)
    file_in(other, [1, 2], (20, 21), Origin.PROMPT)
    found = match_in(me, [0, 1, 2])
    assert found.candidate == (20, 21) and found.origin is Origin.SHARED and found.key_len == 2
    assert match_in(other, [0, 1, 2]).origin is Origin.PROMPT  # the other request's own
    file_in(me, [1, 2], (30, 31), Origin.LANE)
    file_in(other, [1, 2], (40, 41), Origin.OUTPUT)  # newer, but not mine
    found = match_in(me, [0, 1, 2])
    assert found.candidate == (30, 31) and found.origin is Origin.LANE and found.key_len == 2
    assert match_in(me, [5, 6]) is None
    assert match_in(RequestPool(me.pool, -1), [0, 1, 2]) == me.pool.match([0, 1, 2])  # -1: all its own


def test_votes_pick_the_first_token_most_candidates_begin_with():
    plain = NgramPool(max_key_len=3, capacity=16, rank="votes")
    plain.add([1], (5, 6), Origin.PROMPT)
    plain.add([1], (5, 7), Origin.OUTPUT)
    plain.add([1], (9, 9), Origin.OUTPUT)  # the newest, but 5 has two votes
    assert plain.match([1]).candidate == (5, 7)  # the newest of the majority
    recency = NgramPool(max_key_len=3, capacity=16)
    for candidate in ((5, 6), (5, 7), (9, 9)):
        recency.add([1], candidate, Origin.OUTPUT)
    assert recency.match([1]).candidate == (9, 9)
    # The guess casts GUESS_VOTES: 9 now has 1 + 2 against 5's 2.
    assert match_in(RequestPool(plain, -1), [1], guess=9).candidate == (9, 9)
    # In a tenant's pool the asker's own candidates cast OWN_VOTES, others' one each;
    # one another request filed is SHARED.
    me, other = _tenant(capacity=16, rank="votes")
    file_in(me, [1], (5, 6), Origin.PROMPT)
    file_in(me, [1], (5, 7), Origin.OUTPUT)
    for token in range(2 * OWN_VOTES - 1):
        file_in(other, [1], (8, token), Origin.OUTPUT)
    assert match_in(me, [1]) == ((5, 7), Origin.OUTPUT, 1)  # 6 votes against 5
    file_in(other, [1], (8, 99), Origin.OUTPUT)
    assert match_in(me, [1]) == ((5, 7), Origin.OUTPUT, 1)  # 6 against 6: its own wins the tie
    file_in(other, [1], (8, 100), Origin.OUTPUT)
    assert match_in(me, [1]) == ((8, 100), Origin.SHARED, 1)  # 6 against 7
    assert match_in(other, [1]).candidate == (8, 100)  # for the other, 8 has 21 votes
    # A longer key wins whatever the votes under shorter ones.
    file_in(other, [4, 1], (3,), Origin.PROMPT)
    assert match_in(me, [4, 1]) == ((3,), Origin.SHARED, 2)


def _voted_reference(filings, context, me, guess):
    """Dense reference of the ``votes`` lookup in a pool that evicts nothing and is not
    touched by lookups: ``filings`` are every (key, candidate, tag) filed, in order."""
    for key_len in range(min(3, len(context)), 0, -1):
        key = tuple(context[-key_len:])
        last = {}  # candidate -> (its last filing's order, tag)
        for order, (filed_key, candidate, tag) in enumerate(filings):
            if filed_key[-key_len:] == key and len(filed_key) >= key_len:
                last[candidate] = (order, tag)
        if last:
            own = {c: me < 0 or tag == me for c, (_, tag) in last.items()}
            votes = Counter()
            for candidate in last:
                votes[candidate[0]] += OWN_VOTES if own[candidate] and me >= 0 else 1
            if guess is not None:
                votes[guess] += GUESS_VOTES
            best = max(last, key=lambda c: (votes[c[0]], own[c], last[c][0]))
            return best, own[best], key_len
    return None


@pytest.mark.parametrize("seed", range(5))
def test_votes_match_a_dense_reference(seed):
    rng = random.Random(seed)
    pool = NgramPool(3, 256, rank="votes", touch_on_lookup=False)  # nothing evicted, lookups change nothing
    tags = [-1, pool.arena.new_tag(), pool.arena.new_tag(), pool.arena.new_tag()]
    filings = []
    for _ in range(300):
        context = [rng.randrange(6) for _ in range(3)]
        candidate = tuple(rng.randrange(5) for _ in range(rng.randrange(1, 4)))
        tag = rng.choice(tags[1:])
        file_in(RequestPool(pool, tag), context, candidate, Origin.OUTPUT)
        filings.append((tuple(context), candidate, tag))
        context = [rng.randrange(6) for _ in range(rng.randrange(1, 4))]
        guess = rng.choice([None, rng.randrange(5)])
        me = rng.choice(tags)
        wanted = _voted_reference(filings, context, me, guess)
        found = match_in(RequestPool(pool, me), context, guess)
        if wanted is None:
            assert found is None
            continue
        candidate, own, key_len = wanted
        assert (found.candidate, found.key_len) == (candidate, key_len)
        assert (found.origin is Origin.SHARED) == (not own)


def test_alternatives_go_key_length_then_the_asker_s_own_then_recency_each_once():
    me, other = _tenant()
    file_in(me, [1, 2], (3, 4), Origin.OUTPUT)
    file_in(other, [1, 2], (5, 6), Origin.OUTPUT)
    file_in(me, [2], (7, 8), Origin.OUTPUT)
    file_in(other, [2], (9,), Origin.OUTPUT)
    file_in(other, [2], (3, 4), Origin.OUTPUT)  # under [1, 2] already
    assert list(alternatives_in(me, [1, 2])) == [(3, 4), (5, 6), (7, 8), (9,)]
    assert list(alternatives_in(other, [1, 2])) == [(5, 6), (3, 4), (9,), (7, 8)]


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
    # the bound, and the last request's keys, filed while it ran (evicted by the next filing)
    one_request = (8 - proposer.config.ngram_len) * proposer.config.max_key_len
    per_key = proposer.index.arena.bytes_per_key()
    assert all(proposer.shared.max_keys < keys <= proposer.shared.max_keys + one_request for keys, _, _ in sizes)
    assert all(charged <= (1 << 20) + one_request * per_key for _, charged, _ in sizes)
    assert max(allocated for _, _, allocated in sizes) <= 1.05 * sizes[0][2]  # the arena stopped growing


def test_a_running_request_keeps_its_keys_past_its_tenant_s_bound():
    """The keys a running request filed are held on top of its tenant's bound: a prompt
    larger than the bound drafts from its own start; once it stops they count."""
    proposer = make_proposer(shared_pool_mib=1, num_speculative_tokens=4, max_key_len=2)
    bound = proposer.shared.max_keys
    prompt = list(range(1000, 1000 + 3 * bound // 2)) + [1000, 1001]  # distinct, then its start again
    batch = FakeBatch()
    batch.add("long", prompt)
    drafts = batch.step(proposer, [[1002]])
    assert drafts == [[1003, 1004, 1005, 1006]]  # the prompt's start, filed first
    assert proposer.shared.num_keys() > bound
    proposer.remove_requests(["long"])
    _announce_and_run(proposer, "next", [7, 8, 9], None, [[10], [11]])
    assert bound < proposer.shared.num_keys() <= bound + 2 * 2  # its keys count against the bound now ("next"'s
    # two anchors of two keys each were held on top while it ran)
