"""Lane state, tail layout and the lane mask against brute-force definitions."""

import numpy as np

from vllm_fafo.drafting.pool import NgramPool, Origin
from vllm_fafo.lanes.state import LaneState, lane_mask, tail_index


def test_lanes_start_from_spread_prompt_windows():
    prompt = list(range(100, 120))
    lanes = LaneState(prompt, num_lanes=4, lane_len=3, max_key_len=2)
    assert lanes.tokens.tolist() == [
        [100, 101, 102], [105, 106, 107], [110, 111, 112], [115, 116, 117]
    ]
    short = LaneState([7, 8], num_lanes=3, lane_len=3, max_key_len=2)
    assert short.tokens.tolist() == [[7, 8, 7], [7, 8, 7], [8, 7, 8]]


def test_tail_is_column_wise_with_positions_after_x():
    lanes = LaneState(list(range(12)), num_lanes=3, lane_len=2, max_key_len=2)
    ids, positions = lanes.tail(active=2, x_pos=50, max_pos=1000)
    # level 0 of lanes 0 and 1, then level 1 of lanes 0 and 1
    assert ids.tolist() == [0, 4, 1, 5]
    assert positions.tolist() == [51, 51, 52, 52]
    assert tail_index(lane=1, level=1, active=2) == 3
    assert lanes.tail(active=2, x_pos=50, max_pos=51)[1].tolist() == [51, 51, 51, 51]


def test_advance_slides_lanes_and_keys_ngrams_by_discarded_tokens():
    lanes = LaneState([1, 2, 3, 4, 5, 6], num_lanes=2, lane_len=3, max_key_len=2)
    assert lanes.tokens.tolist() == [[1, 2, 3], [4, 5, 6]]
    ngrams = lanes.advance(active=1, next_tokens=[9])
    assert lanes.tokens.tolist() == [[2, 3, 9], [4, 5, 6]]  # inactive lane untouched
    assert ngrams == [([1], (2, 3, 9))]
    lanes.advance(active=2, next_tokens=[8, 7])
    ngrams = lanes.advance(active=1, next_tokens=[6])
    assert ngrams == [([2, 3], (9, 8, 6))]  # discarded buffer keeps K=2 tokens
    pool = NgramPool(max_key_len=2, capacity=4)
    for context, ngram in ngrams:
        pool.add(context, ngram, Origin.LANE)
    assert pool.lookup([5, 2, 3]) == ((9, 8, 6), Origin.LANE)
    assert pool.lookup([3]) == ((9, 8, 6), Origin.LANE)


def test_lane_mask_matches_definition():
    for active in (1, 2, 5):
        for lane_len in (1, 3, 4):
            mask = lane_mask(active, lane_len)
            for i in range(active * lane_len):
                for j in range(active * lane_len):
                    same_lane = i % active == j % active
                    not_later = j // active <= i // active
                    assert mask[i, j] == (same_lane and not_later)
            assert np.all(np.diag(mask))
