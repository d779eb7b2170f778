"""The runner-up table on the real engine is filled from the logits vLLM samples from,
under the tokens fed at their positions (tests/engine_configs.py's ``runner-up``: the
pool has no prompt n-grams, so the table drafts early, as spines and as tree branches;
tests/test_engine.py checks its tokens and sampled distribution)."""

from __future__ import annotations

import uuid

import numpy as np
import pytest
import torch

from vllm_fafo.runner_up import EMPTY

from .engine_configs import RUNNER_UP_SPEC
from .engine_utils import greedy

pytestmark = pytest.mark.engine

WIDTH = RUNNER_UP_SPEC["runner_up_tokens"]


def _record_logits(worker) -> None:
    """Spy on what the proposer's take_logits gets: the logits, the input tokens and
    rows it is handed, and what vLLM's persistent batch says each request fed (its
    token at the position of its first logits row, then the drafts vLLM scheduled)."""
    runner = worker.model_runner
    drafter = runner.drafter
    take_logits = drafter.take_logits
    drafter.test_records = records = []

    def spy(logits, input_tokens, rows, req_ids):
        batch = runner.input_batch
        scheduled = np.diff(runner.query_start_loc.np[: len(req_ids) + 1])
        fed = []
        for i, req_id in enumerate(req_ids):
            index = batch.req_id_to_index[req_id]
            drafts = [int(t) for t in drafter.step.scheduled_spec_tokens.get(req_id, ())]
            position = int(batch.num_computed_tokens_cpu[index] + scheduled[i] - 1 - len(drafts))
            fed.append((tuple(runner.requests[req_id].prompt_token_ids), position,
                        [int(batch.token_ids_cpu[index, position]), *drafts]))
        records.append((logits.clone(), input_tokens.clone(), rows.copy(), fed))
        take_logits(logits, input_tokens, rows, req_ids)

    drafter.take_logits = spy


def _take_records(salt: str):
    def take(worker):
        drafter = worker.model_runner.drafter
        records = drafter.test_records
        del drafter.take_logits, drafter.test_records  # the class's method again
        return records, drafter.runner_ups.table_for(salt).successors.copy()
    return take


def test_table_holds_the_top_tokens_of_the_logits_vllm_sampled_from_under_the_tokens_fed(engine, mtbench):
    runner_up_llm = engine("runner-up")
    salt = f"table-{uuid.uuid4()}"
    prompts = mtbench[:3]
    runner_up_llm.collective_rpc(_record_logits)
    outputs = runner_up_llm.generate([{"prompt": p, "cache_salt": salt} for p in prompts], greedy(48),
                                     use_tqdm=False)
    records, table = runner_up_llm.collective_rpc(_take_records(salt))[0]
    texts = {tuple(o.prompt_token_ids): list(o.prompt_token_ids) + list(o.outputs[0].token_ids) for o in outputs}
    reference = np.full_like(table, EMPTY)
    checked = 0
    for logits, input_tokens, rows, fed in records:
        # the rows the proposer was handed are each request's fed tokens, in batch order
        assert rows.tolist() == [len(tokens) for _, _, tokens in fed]
        assert input_tokens.tolist() == [token for _, _, tokens in fed for token in tokens]
        top = torch.topk(logits, WIDTH, dim=-1).indices.numpy()
        first = 0
        for prompt, position, tokens in fed:
            text = texts[prompt]
            if len(prompt) - 1 <= position < len(text) - 1:
                # greedy: the top token after the current token is the text's next token
                assert top[first, 0] == text[position + 1]
                checked += 1
            first += len(tokens)
        for token, row in zip(input_tokens.tolist(), top):
            reference[token] = row
    assert checked >= 3 * 48 // 4  # a draft accepted whole covers several tokens in one row
    np.testing.assert_array_equal(table, reference)
