"""The runner-up table (Token Recycling): filled from the logits vLLM samples from,
drafted from where the text has nothing, offered as tree branches, kept per tenant."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from vllm_fafo.config import FafoConfig, FafoConfigError
from vllm_fafo.pool import NgramPool
from vllm_fafo.proposer import FafoProposer
from vllm_fafo.runner_up import EMPTY, RunnerUpTable, RunnerUpTables
from vllm_fafo.tree import grow_branches

from .test_proposer import FakeBatch

VOCAB = 32


def test_table_keeps_the_latest_top_tokens_per_token_and_chains_the_top_one():
    table = RunnerUpTable(VOCAB, 3)
    assert table.chain(5, 4) == [] and table.runner_ups(5) == []
    table.update(np.array([5, 7, 5]), np.array([[1, 2, 3], [8, 9, 10], [7, 6, EMPTY]]))
    assert table.successors[5].tolist() == [7, 6, EMPTY]  # a repeated token: its last row wins
    assert table.runner_ups(5) == [6]
    assert table.chain(5, 4) == [7, 8]  # 8 has no prediction: the chain stops
    table.update(np.array([8]), np.array([[5, 1, 2]]))
    assert table.chain(5, 5) == [7, 8, 5, 7, 8]  # cycles are drafts like any other


def test_tables_are_made_per_owner_bounded_and_cleared_in_place():
    tables = RunnerUpTables(VOCAB, 2, max_owners=2)
    a = tables.table_for("a")
    a.update(np.array([1]), np.array([[2, 3]]))
    assert tables.table_for("a") is a and tables.table_for(None) is not a
    tables.table_for("a")
    tables.table_for("b")  # the least recently used owner (None) is dropped
    assert len(tables) == 2 and tables.nbytes == 2 * VOCAB * 2 * 4
    tables.clear()
    assert a.chain(1, 3) == [] and tables.table_for("a") is a
    tables.drop("a")
    assert len(tables) == 1


def make_proposer(**settings) -> FafoProposer:
    """A pool-only proposer with runner-up tables over a VOCAB-token model."""
    config = FafoConfig(**{"num_lanes": 0, "controller": "fixed", "text_source": "pool", "runner_up_tokens": 2,
                           "seed_from_prompt": False, "prior_table": "off", **settings})
    vllm_config = SimpleNamespace(
        speculative_config=SimpleNamespace(num_speculative_tokens=config.num_speculative_tokens),
        additional_config={"fafo": config.to_dict()},
        instance_id="", parallel_config=SimpleNamespace(data_parallel_rank=0),
        model_config=SimpleNamespace(max_model_len=4096, get_vocab_size=lambda: VOCAB),
        scheduler_config=SimpleNamespace(max_num_seqs=8),
    )
    return FafoProposer(vllm_config)


def one_hot_logits(rows: list[list[int]]) -> torch.Tensor:
    """Logits whose top tokens are ``rows[i]``, best first."""
    logits = torch.zeros(len(rows), VOCAB)
    for i, row in enumerate(rows):
        for rank, token in enumerate(row):
            logits[i, token] = 10.0 - rank
    return logits


def step_with_logits(batch: FakeBatch, proposer: FafoProposer, sampled: list[list[int]],
                     inputs: list[list[int]], tops: list[list[list[int]]]) -> list[list[int]]:
    """One step whose forward fed ``inputs[r]`` for request ``r`` and whose logits there
    rank ``tops[r]`` first."""
    return batch.step(proposer, sampled, lambda p: p.take_logits(
        one_hot_logits([top for request in tops for top in request]),
        torch.tensor([token for request in inputs for token in request]),
        np.array([len(request) for request in inputs]), batch.req_ids,
    ))


def test_rows_are_filed_under_their_requests_input_tokens_and_drafted_where_the_pool_has_nothing():
    proposer = make_proposer(num_speculative_tokens=3)
    batch = FakeBatch()
    batch.add("a", [1, 2, 3])
    batch.add("b", [4, 5, 6])
    # the prefill's last positions: after 3 the target ranks 10, 11; after 6: 20, 21
    drafts = step_with_logits(batch, proposer, [[10], [20]], [[3], [6]], [[[10, 11]], [[20, 21]]])
    assert drafts == [[], []]  # nothing known after 10 or 20 yet
    # decode: a fed 10 (-> 12, 13), b fed 20 (-> 10, 14): a's table and b's are one (no salt)
    drafts = step_with_logits(batch, proposer, [[12], [10]], [[10], [20]], [[[12, 13]], [[10, 14]]])
    assert drafts == [[], [12]]  # b's current token 10: its top successor 12, after which nothing
    assert proposer.metrics.proposed_tokens["runner_up"] == 1
    table = proposer._requests["a"].runner_ups
    assert table is proposer._requests["b"].runner_ups
    assert table.successors[[3, 6, 10, 20]].tolist() == [[10, 11], [20, 21], [12, 13], [10, 14]]


def test_verified_drafts_rows_are_filed_and_acceptance_counted():
    proposer = make_proposer(num_speculative_tokens=3)
    batch = FakeBatch()
    batch.add("a", [1, 2, 3])
    step_with_logits(batch, proposer, [[7]], [[3]], [[[7, 8]]])
    step_with_logits(batch, proposer, [[9]], [[7]], [[[9, 1]]])
    # current token 9, nothing after it; feed 9 -> 7: a loop 9 -> 7 -> 9 ... is drafted
    drafts = step_with_logits(batch, proposer, [[7]], [[9]], [[[7, 2]]])
    assert drafts == [[9, 7, 9]]
    # vLLM verified 7, 9, 7, 9 (the current token and the draft): 9 and 7 accepted, then 5
    drafts = step_with_logits(batch, proposer, [[9, 7, 5]], [[7, 9, 7, 9]], [[[9, 1], [7, 2], [5, 6], [4, 3]]])
    assert proposer.metrics.accepted_tokens["runner_up"] == 2
    table = proposer._requests["a"].runner_ups
    assert table.successors[[7, 9]].tolist() == [[5, 6], [4, 3]]  # the later row of a repeated token wins
    assert drafts == [[]]  # nothing after 5


def test_tenants_never_see_each_others_tables_and_sharing_off_keeps_one_per_request():
    proposer = make_proposer()
    batch = FakeBatch()
    batch.add("a", [1, 2, 3], cache_salt="x")
    batch.add("b", [1, 2, 3], cache_salt="y")
    batch.add("c", [4, 5, 6], cache_salt="x")
    step_with_logits(batch, proposer, [[7], [8], [9]], [[3], [3], [6]], [[[7, 1]], [[8, 1]], [[9, 1]]])
    a, b, c = (proposer._requests[r].runner_ups for r in "abc")
    assert a is c and a is not b
    assert a.successors[3].tolist() == [7, 1] and b.successors[3].tolist() == [8, 1]
    assert proposer.metrics_snapshot()["runner_up_tables"] == 2

    private = make_proposer(share_pool=False)
    batch = FakeBatch()
    batch.add("a", [1, 2, 3])
    batch.add("b", [1, 2, 3])
    step_with_logits(batch, private, [[7], [8]], [[3], [3]], [[[7, 1]], [[8, 1]]])
    assert private._requests["a"].runner_ups.successors[3].tolist() == [7, 1]
    assert private._requests["b"].runner_ups.successors[3].tolist() == [8, 1]
    private.remove_requests(["a"])
    assert private.metrics_snapshot()["runner_up_tables"] == 1


def test_rows_that_do_not_add_up_fail_loudly():
    proposer = make_proposer()
    batch = FakeBatch()
    batch.add("a", [1, 2, 3])
    proposer.begin_step((), 0, {}, batch.new_requests)
    with pytest.raises(RuntimeError, match="GPUModelRunner._sample changed"):
        proposer.take_logits(one_hot_logits([[1], [2]]), torch.tensor([3, 4]), np.array([1]), ["a"])


def test_runner_ups_start_branches_at_the_current_token():
    pool = NgramPool(2, 4)
    pool.add([1], (2, 3), "output")
    table = RunnerUpTable(VOCAB, 3)
    table.update(np.array([1, 5, 6]), np.array([[2, 5, 6], [7, 8, 9], [4, 8, 9]]))
    spine = [9, 9, 9]
    branches = grow_branches([pool], [1], spine, max_branches=4, max_tokens=8, runner_ups=table)
    # node 0: the pool's candidate (2, 3), then the runner-ups 5 and 6 of the current token 1,
    # each chained on by top successors (5 -> 7; 6 -> 4), cut to the spine's depth
    assert [(b.node, b.tokens) for b in branches] == [(0, (2, 3)), (0, (5, 7)), (0, (6, 4))]
    without = grow_branches([pool], [1], spine, max_branches=4, max_tokens=8)
    assert [(b.node, b.tokens) for b in without] == [(0, (2, 3))]


def test_runner_up_tokens_is_validated():
    with pytest.raises(FafoConfigError, match=r"runner_up_tokens.*17"):
        FafoConfig.from_user_dict({"method": "fafo", "runner_up_tokens": 17})
    assert FafoConfig.from_user_dict({"method": "fafo", "runner_up_tokens": 4}).runner_up_tokens == 4
