"""Lookahead and Cacheback modes: their pools, tables and configs against
hand-worked examples (Lookahead Sec. 3 / Alg. 1; Cacheback Sec. 3)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from vllm_fafo.config import FafoConfig, FafoConfigError
from vllm_fafo.drafting.frozen_table import load_table
from vllm_fafo.drafting.pool import NgramPool, Origin
from vllm_fafo.lanes.state import LaneState
from vllm_fafo.modes import CacheBackConfig, LookaheadConfig, parse_speculative_config
from vllm_fafo.proposer import FafoProposer
from vllm_fafo.tools.build_frozen_table import build_table, save_table

from .test_proposer import FakeBatch

P = Origin.PROMPT


# Lookahead's pool: key = the one token before the n-gram, at most G per key --------
def lookahead_pool(guesses: int) -> NgramPool:
    config = LookaheadConfig(guesses=guesses).to_fafo()
    return NgramPool(config.max_key_len, config.pool_capacity,
                     min_key_len=config.min_key_len, touch_on_lookup=config.touch_on_lookup)


def test_lookahead_pool_keys_on_the_last_token_only():
    pool = lookahead_pool(guesses=2)
    pool.add([7, 8, 9], (1, 2), Origin.LANE)
    assert pool.keys() == [(9,)]
    assert pool.lookup([5, 9]) == ((1, 2), Origin.LANE)
    assert pool.lookup([9, 5]) is None


def test_lookahead_pool_keeps_g_newest_and_lookups_change_nothing():
    pool = lookahead_pool(guesses=2)
    for ngram in [(1,), (2,), (3,)]:
        pool.add([9], ngram, Origin.LANE)
    assert pool.candidates([9]) == [(2,), (3,)]  # (1,) fell out: G = 2
    assert pool.lookup([9]) == ((3,), Origin.LANE)
    assert pool.candidates([9]) == [(2,), (3,)]
    pool.add([9], (2,), Origin.LANE)  # re-inserted: newest again (LADE's pool)
    assert pool.candidates([9]) == [(3,), (2,)]


def test_lookahead_lanes_are_the_window_diagonals():
    lanes = LaneState([10, 11, 12, 13], num_lanes=3, lane_len=2, max_key_len=1, stagger=True)
    ids, positions = lanes.tail(3, x_pos=100, max_pos=10_000)
    # column-wise: level 0 of lanes 0,1,2, then level 1; lane i starts i later
    assert positions.tolist() == [101, 102, 103, 102, 103, 104]
    assert ids.tolist() == lanes.tokens[:3].T.reshape(-1).tolist()


# Cacheback's tables ---------------------------------------------------------------
def cacheback_pool(**keys) -> NgramPool:
    config = CacheBackConfig(**keys).to_fafo()
    return NgramPool(config.max_key_len, config.pool_capacity, min_key_len=config.min_key_len,
                     max_keys=config.max_keys, touch_on_lookup=config.touch_on_lookup)


def test_cacheback_leaders_are_exactly_ll_tokens():
    pool = cacheback_pool(leader_len=2)
    pool.add([1, 2, 3], (4, 5, 6), P)
    assert pool.keys() == [(2, 3)]
    assert pool.lookup([9, 3]) is None  # no 1-token fallback
    assert pool.lookup([2, 3]) == ((4, 5, 6), P)


def test_cacheback_leader_lru_on_insert_and_query():
    pool = cacheback_pool(leader_capacity=2)
    pool.add([1], (10,), P)
    pool.add([2], (20,), P)
    assert pool.keys() == [(1,), (2,)]
    pool.lookup([1])  # a query refreshes leader 1
    assert pool.keys() == [(2,), (1,)]
    pool.add([3], (30,), P)  # evicts leader 2, the least recently used
    assert pool.keys() == [(1,), (3,)]
    pool.add([1], (11,), P)  # an insert refreshes leader 1
    assert pool.keys() == [(3,), (1,)]


def test_cacheback_follower_recency_only_on_insert():
    pool = cacheback_pool(follower_capacity=2)
    pool.add([1], (10,), P)
    pool.add([1], (11,), P)
    assert pool.lookup([1]) == ((11,), P)
    pool.add([1], (10,), P)  # re-insert: 10 becomes most recent
    assert pool.candidates([1]) == [(11,), (10,)]
    assert pool.lookup([1]) == ((10,), P)
    assert pool.candidates([1]) == [(11,), (10,)]  # the query did not reorder
    pool.add([1], (12,), P)  # FC = 2: evicts 11, the least recently inserted
    assert pool.candidates([1]) == [(10,), (12,)]


def test_frozen_table_build_counts_leaders_and_followers():
    docs = [[1, 2, 3, 1, 2, 4, 1, 2, 3], [5, 1, 2, 3]]
    table = build_table(docs, leader_len=1, follower_len=2, leader_capacity=2, follower_capacity=2)
    # leader 1 appears 4x, leader 2 4x, leader 3 3x: the top two are 1 and 2
    assert dict((tuple(k), v) for k, v in table) == {
        (1,): [[2, 4], [2, 3]],  # (2, 3) 3x is the most frequent: last
        (2,): [[4, 1], [3, 1]],  # (3, 1) 1x, (4, 1) 1x, (3,) incomplete; tie in first-seen order
    }


def test_frozen_table_roundtrip_and_bad_files(tmp_path):
    path = tmp_path / "t.json"
    save_table(path, [([1], [[7, 8], [2, 3]])], 1, 2, "tok")
    pool = load_table(str(path), 1, 2)
    assert pool.lookup([1]) == ((2, 3), Origin.FROZEN)
    with pytest.raises(FafoConfigError, match="has leader_len=1, follower_len=2, but the config has leader_len=1, follower_len=3"):
        load_table(str(path), 1, 3)
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(FafoConfigError, match="is not a vllm-fafo-frozen-table/1 file"):
        load_table(str(tmp_path / "bad.json"), 1, 2)
    with pytest.raises(FafoConfigError, match="cannot be read"):
        load_table(str(tmp_path / "missing.json"), 1, 2)


def make_mode_proposer(config: FafoConfig) -> FafoProposer:
    vllm_config = SimpleNamespace(
        speculative_config=SimpleNamespace(num_speculative_tokens=config.num_speculative_tokens),
        additional_config={"fafo": config.to_dict()},
        instance_id="", parallel_config=SimpleNamespace(data_parallel_rank=0),
        model_config=SimpleNamespace(max_model_len=4096),
        scheduler_config=SimpleNamespace(max_num_seqs=4),
        device_config=SimpleNamespace(device="cpu"),
        cache_config=SimpleNamespace(cache_dtype="fp8", enable_prefix_caching=False),  # not read back
    )
    return FafoProposer(vllm_config)


def test_cacheback_chains_followers_dynamic_before_frozen(tmp_path):
    path = tmp_path / "t.json"
    # frozen: 5 -> (6, 7, 8) and 8 -> (9, 9, 9); also 1 -> (50, 51, 52), which
    # the dynamic table overrides
    save_table(path, [([5], [[6, 7, 8]]), ([8], [[9, 9, 9]]), ([1], [[50, 51, 52]])], 1, 3, "tok")
    config = CacheBackConfig(frozen_table=str(path)).to_fafo()
    proposer = make_mode_proposer(config)
    batch = FakeBatch()
    batch.add("a", [1, 2, 3, 4, 1])
    # dynamic (prompt): 1 -> (2, 3, 4); then 4 -> (1,...)? prompt n-grams of 3 after
    # each leader: 1->(2,3,4), 2->(3,4,1); chain from 1: (2,3,4) then leader 4 misses
    # in the dynamic table and the frozen one -> stop
    drafts = batch.step(proposer, [[5]])
    # last token 5: dynamic misses, frozen gives (6,7,8), then 8 -> (9,9,9): 6 tokens
    assert drafts == [[6, 7, 8, 9, 9, 9]]
    metrics = proposer.metrics.as_dict()
    assert metrics["proposed_tokens"]["frozen"] == 6
    drafts = batch.step(proposer, [[1]])  # the dynamic table knows 1
    assert drafts[0][:3] == [2, 3, 4]
    assert (50, 51, 52) not in proposer._requests["a"].pool.pool.candidates([1])  # frozen stays frozen


def test_lookahead_files_nothing_from_text():
    proposer = make_mode_proposer(LookaheadConfig().to_fafo())
    batch = FakeBatch()
    batch.add("a", [1, 2, 3, 4, 1, 2, 3, 4, 1, 2])
    drafts = batch.step(proposer, [[3]])
    assert drafts == [[]]  # Alg. 1: the pool only takes the lookahead branch's n-grams
    assert len(proposer._requests["a"].pool.pool) == 0


# Configs --------------------------------------------------------------------------
def test_defaults_map_onto_the_shared_machinery():
    la = parse_speculative_config({"method": "lookahead"})
    assert (la.method, la.num_lanes, la.lane_len, la.num_speculative_tokens) == ("lookahead", 15, 4, 4)
    assert (la.max_key_len, la.pool_capacity, la.compression, la.stagger_lanes) == (1, 15, "none", True)
    cb = parse_speculative_config({"method": "cacheback"})
    assert (cb.method, cb.num_lanes, cb.max_key_len, cb.min_key_len) == ("cacheback", 0, 1, 1)
    assert (cb.pool_capacity, cb.max_keys, cb.ngram_len, cb.num_speculative_tokens) == (128, 1 << 20, 3, 6)
    assert parse_speculative_config({"method": "ngram"}) is None
    assert FafoConfig.from_dict(cb.to_dict()) == cb
    assert (la.rank_candidates, cb.rank_candidates, FafoConfig().rank_candidates) == ("recency", "recency", "votes")


@pytest.mark.parametrize(
    "raw, message",
    [
        ({"method": "lookahead", "window": 0}, "'window'\\]=0 is out of range"),
        ({"method": "lookahead", "ngram": 2}, "'ngram'\\]=2 is out of range; allowed: integers in \\[3, 33\\]"),
        ({"method": "lookahead", "num_lanes": 4},
         "unknown key 'num_lanes' for method 'lookahead'; allowed keys: guesses, max_lane_requests, method, "
         "ngram, num_candidates, window"),
        ({"method": "cacheback", "follower_len": "3"}, "'follower_len'\\]='3' must be an integer"),
        ({"method": "cacheback", "window": 3}, "unknown key 'window' for method 'cacheback'"),
        ({"method": "cacheback", "frozen_table": 7}, "'frozen_table'\\]=7 must be a path"),
        ({"method": "cacheback", "frozen_table": "/nonexistent.json"}, "cannot be read as a frozen table"),
    ],
)
def test_bad_mode_keys_name_key_value_and_allowed(raw, message):
    with pytest.raises(FafoConfigError, match=message):
        parse_speculative_config(raw)
