"""The prior table: lookups, drafting where the pools miss, files, the config key."""

from __future__ import annotations

import logging
import os

import numpy as np
import pytest

from vllm_fafo.config import FafoConfig
from vllm_fafo.drafting.pool import Origin
from vllm_fafo.drafting.prior_table import PriorTable, check_setting, default_path, load_table, resolve, save_table
from vllm_fafo.errors import FafoConfigError
from vllm_fafo.tools.build_prior_table import PRIMER_MESSAGE, answer_prefix

from .test_native_pool import file_and_draft_one, index_for

ROWS = np.array([
    [1, 2, 3],  # 0 -> 1 2 3
    [9, -1, -1],  # 1 -> 9 (the continuation stopped)
    [-1, -1, -1],  # 2 -> nothing
    [4, 4, 4],
], dtype=np.int32)


def test_continuation_stops_at_the_first_missing_token():
    table = PriorTable(ROWS)
    assert table.continuation(0) == (1, 2, 3)
    assert table.continuation(1) == (9,)
    assert table.continuation(2) == ()
    assert table.continuation(4) == () and table.continuation(-1) == ()  # outside the vocabulary
    assert table.lengths.tolist() == [3, 1, 0, 3]  # what the step kernel reads


def _chain(index, target, context, room):
    """The draft chained after ``context`` (nothing filed from it)."""
    return file_and_draft_one(index, target, context, len(context), next_anchor=len(context), room=room)


def test_chain_draft_uses_the_prior_only_where_the_pools_miss():
    index, bare = index_for(PriorTable(ROWS), max_key_len=2, pool_capacity=4), index_for(max_key_len=2, pool_capacity=4)
    pools, bare_pools = index.start("r", None, np.zeros(0)), bare.start("r", None, np.zeros(0))
    for pool in (pools.pool, bare_pools.pool):
        pool.add([5], (0,), Origin.OUTPUT)  # 5 -> 0; nothing under 3 or 9
    # 5: the pool's 0; then 0 misses in the pool -> the prior's 1 2 3; then 3 -> the prior's 4 4 4
    draft, origins, key_len = _chain(index, pools, [8, 5], room=6)
    assert draft == [0, 1, 2, 3, 4, 4]
    assert origins == [Origin.OUTPUT] + [Origin.PRIOR] * 5
    assert key_len == 1  # the first piece's key
    # The pool wins under any key it holds, after a prior piece too.
    pools.pool.add([2, 3], (6,), Origin.OUTPUT)
    draft, origins, _ = _chain(index, pools, [8, 5], room=6)
    assert draft == [0, 1, 2, 3, 6]  # (2, 3) -> 6 from the pool; then neither has anything after 6
    assert origins[-1] is Origin.OUTPUT
    assert _chain(bare, bare_pools, [8, 5], room=6)[0] == [0]  # without the table the chain ends at 0
    # A draft the prior starts reports its key (0: not found in the text), not a later piece's.
    draft, origins, key_len = _chain(index, pools, [8, 0], room=4)
    assert draft == [1, 2, 3, 6] and origins == [Origin.PRIOR] * 3 + [Origin.OUTPUT]
    assert key_len == 0


def test_the_prior_votes_among_the_pools_candidates():
    table = PriorTable(ROWS)
    runs = {}
    for name, prior, rank in (("no guess", None, "votes"), ("votes", table, "votes"), ("recency", table, "recency")):
        index = index_for(prior, max_key_len=2, pool_capacity=4, rank_candidates=rank)
        pools = index.start("r", None, np.zeros(0))
        pools.pool.add([0], (1, 7), Origin.PROMPT)  # the prior's next token after 0 is 1
        pools.pool.add([0], (8, 8), Origin.OUTPUT)  # the newest
        runs[name] = _chain(index, pools, [0], room=2)[0]
    assert runs == {"no guess": [8, 8], "votes": [1, 7], "recency": [8, 8]}  # no guess: a tie, the newest


def test_file_roundtrip_and_errors_name_the_key(tmp_path):
    path = tmp_path / "prior.npz"
    save_table(path, ROWS, "some/model", [7, 8])
    assert load_table(path, vocab_size=4).continuation(0) == (1, 2, 3)
    with pytest.raises(FafoConfigError, match=r"\['prior_table'\].*covers 4 tokens.*vocabulary has 5"):
        load_table(path, vocab_size=5)
    (tmp_path / "junk.npz").write_text("not a table")
    with pytest.raises(FafoConfigError, match=r"\['prior_table'\].*cannot be read as a prior table"):
        load_table(tmp_path / "junk.npz", vocab_size=4)
    np.savez(tmp_path / "other.npz", rows=ROWS, meta=np.asarray('{"format": "something else"}'))
    with pytest.raises(FafoConfigError, match="is not a vllm-fafo-prior-table/1 file"):
        load_table(tmp_path / "other.npz", vocab_size=4)


@pytest.mark.parametrize(("value", "message"), [
    (None, "must be 'auto', 'off' or the path"),
    ("", "must be 'auto', 'off' or the path"),
    ("/nonexistent/prior.npz", "no such file"),
])
def test_config_refuses_bad_values(value, message):
    with pytest.raises(FafoConfigError, match=rf"\['prior_table'\].*{message}"):
        FafoConfig.from_user_dict({"method": "fafo", "prior_table": value})


def test_config_takes_auto_off_and_a_file(tmp_path):
    path = tmp_path / "prior.npz"
    save_table(path, ROWS, "m", [])
    for value in ("auto", "off", str(path)):
        check_setting(value)
        assert FafoConfig.from_user_dict({"method": "fafo", "prior_table": value}).prior_table == value
    assert FafoConfig().prior_table == "auto"


def test_auto_finds_the_table_built_for_the_model(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("VLLM_FAFO_CACHE", str(tmp_path / "cache"))
    model = tmp_path / "model"
    model.mkdir()
    assert resolve("off", str(model), 4) is None
    plugin_logger = logging.getLogger("vllm.vllm_fafo.drafting.prior_table")  # vLLM's tree, which does not propagate
    plugin_logger.addHandler(caplog.handler)
    try:
        assert resolve("auto", str(model), 4) is None
    finally:
        plugin_logger.removeHandler(caplog.handler)
    assert "no prior table for" in caplog.text and "vllm-fafo-prior-table --model" in caplog.text
    save_table(default_path(str(model)), ROWS, str(model), [])
    assert default_path(str(model) + "/") == default_path(str(model))  # one table however the folder is spelled
    assert resolve("auto", str(model) + "/", 4).continuation(3) == (4, 4, 4)
    assert default_path("org/other-model") != default_path(str(model))


def test_answer_prefix_ends_where_the_answer_begins(model_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    whole = answer_prefix(tokenizer)
    assert tokenizer.decode(whole).endswith(f"<|im_start|>user\n{PRIMER_MESSAGE}<|im_end|>\n<|im_start|>assistant\n")
    cut = answer_prefix(tokenizer, block_size=16)
    assert len(cut) == len(whole) // 16 * 16 and cut == whole[len(whole) - len(cut):]
    assert answer_prefix(tokenizer, block_size=len(whole) + 1) == whole  # shorter than a block: whole


def test_the_proposer_drafts_from_the_prior_where_the_pools_miss(tmp_path):
    from types import SimpleNamespace

    from vllm_fafo.proposer import FafoProposer

    from .test_proposer import FakeBatch

    path = tmp_path / "prior.npz"
    rows = np.full((64, 3), -1, np.int32)
    rows[7] = [5, -1, -1]
    save_table(path, rows, "m", [])
    config = FafoConfig(num_lanes=0, controller="fixed", deep_match=False, num_speculative_tokens=4,
                        text_ngram_len=1, prior_table=str(path))
    proposer = FafoProposer(SimpleNamespace(
        speculative_config=SimpleNamespace(num_speculative_tokens=4), additional_config={"fafo": config.to_dict()},
        instance_id="", parallel_config=SimpleNamespace(data_parallel_rank=0),
        model_config=SimpleNamespace(max_model_len=4096, model="m", get_vocab_size=lambda: 64)))
    batch = FakeBatch()
    batch.add("a", [5, 6])
    # Nothing ever followed 7: the prior's 5, then the pool's 5 -> 6 -> 7, then the prior again.
    assert batch.step(proposer, [[7]]) == [[5, 6, 7, 5]]
    assert proposer.metrics.proposed_tokens["prior"] == 2
    batch.add("b", [1, 2])
    assert batch.step(proposer, [[], [3]])[1] == []  # 3: neither the pools nor the prior have anything


@pytest.mark.engine
def test_build_rows_are_the_targets_greedy_continuations(plain_llm, model_dir):
    """vLLM's build against transformers' greedy decoding of the same prompts (float32)."""
    import torch
    from transformers import AutoModelForCausalLM

    from vllm_fafo.tools.build_prior_table import build_rows

    tokens = range(1000, 1006)
    rows, prefix = build_rows(plain_llm, width=3, progress=False, tokens=tokens)
    assert rows.shape == (plain_llm.llm_engine.model_config.get_vocab_size(), 3)
    assert (rows[: tokens.start] == -1).all() and (rows[tokens.stop :] == -1).all()
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.inference_mode():
        for token in tokens:
            ids = torch.tensor([[*prefix, token]])
            expected = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=3, do_sample=False)
            assert list(PriorTable(rows).continuation(token)) == expected[0, ids.shape[1] :].tolist(), token


def test_the_builds_dtype_follows_the_processor(monkeypatch):
    """bfloat16 only where it is computed natively (a GPU, AVX512-BF16, AMX): emulated on an
    AVX2-only CPU, the build had not ended after 20 minutes."""
    import torch

    from vllm_fafo.tools.assets import prior_table_dtype

    for cuda, avx512_bf16, amx, expected in ((False, False, False, "float32"), (False, True, False, "bfloat16"),
                                             (False, False, True, "bfloat16"), (True, False, False, "bfloat16")):
        monkeypatch.setattr(torch.cuda, "is_available", lambda cuda=cuda: cuda)
        monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda flag=avx512_bf16: flag)
        monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda flag=amx: flag)
        assert prior_table_dtype() == expected


def test_the_build_runs_the_engine_in_its_process(tmp_path, monkeypatch):
    """vllm-fafo-prior-table runs vLLM's engine inside its own process, no engine-core
    process (as the tests and benchmarks do): with one, a build never exited."""
    import vllm

    from vllm_fafo.tools import build_prior_table

    seen = {}

    class RecordingLLM:
        def __init__(self, **kwargs):
            seen["multiprocessing"] = os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING")

    monkeypatch.delenv("VLLM_ENABLE_V1_MULTIPROCESSING", raising=False)
    monkeypatch.setattr(vllm, "LLM", RecordingLLM)
    monkeypatch.setattr(build_prior_table, "build_rows", lambda llm, width: (np.zeros((4, width), np.int32), [1]))
    build_prior_table.main(["--model", "m", "--out", str(tmp_path / "table.npz")])
    assert seen["multiprocessing"] == "0"
    assert (tmp_path / "table.npz").exists()
