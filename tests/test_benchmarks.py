"""The benchmark command runs end to end on a tiny matrix, so it cannot rot."""

from __future__ import annotations

import argparse
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

pytestmark = pytest.mark.engine

ROOT = Path(__file__).resolve().parent.parent


def benchmark_script(name: str):
    """``benchmarks/<name>.py`` loaded as a module (the benchmarks are scripts, not a package)."""
    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow  # scripts/check_wheel.sh runs the README's main job in CI
def test_matrix_command_on_a_tiny_matrix(tmp_path, model_dir):
    out = tmp_path / "bench"
    command = [
        sys.executable, str(ROOT / "benchmarks" / "matrix.py"),
        # plain vLLM given as LABEL=JSON, to run a method's engine_args through LLM()
        "--methods", "ngram,fafo", "--method", 'none={"method":"none","engine_args":{"max_num_seqs":8}}',
        "--datasets", "mtbench",
        "--num-prompts", "2", "--max-tokens", "16", "--max-model-len", "1024",
        "--kv-cache-mib", "128", "--out", str(out),
    ]
    subprocess.run(command, check=True, timeout=900, cwd=ROOT)
    summary = json.loads((out / "summary.json").read_text())
    rows = summary["rows"]
    assert {(r["method"], r["dataset"]) for r in rows} == {
        (m, "mtbench") for m in ("none", "ngram", "fafo")
    }
    for row in rows:
        assert row["identical_to_none"] is True
        assert row["tokens"] > 0 and row["tau"] >= 1.0
        # Counted per request: never above vLLM's ratio, which also counts drafts accepted
        # past max_tokens; plain decoding gives exactly one token per forward.
        assert row["tau_vllm"] is None or row["tau"] <= row["tau_vllm"] + 1e-9
        if row["method"] == "none":
            assert row["request_forwards"] == row["tokens"]
    assert (out / "summary.md").read_text().count("| mtbench |") == 3
    assert (out / "tau_speedup_by_dataset.png").stat().st_size > 0

    # Finished cells are skipped on a second run: their files stay untouched.
    cell = out / "cells" / "fafo__mtbench__b1.json"
    stamp = cell.stat().st_mtime_ns
    subprocess.run(command, check=True, timeout=900, cwd=ROOT)
    assert cell.stat().st_mtime_ns == stamp

    # A matrix cut by a time limit: --summarize-only runs nothing, summarizes what finished.
    missing = out / "cells" / "ngram__mtbench__b1.json"
    missing.unlink()
    subprocess.run([*command, "--summarize-only"], check=True, timeout=300, cwd=ROOT)
    assert {r["method"] for r in json.loads((out / "summary.json").read_text())["rows"]} == {"none", "fafo"}
    assert not missing.exists() and cell.stat().st_mtime_ns == stamp


def test_selection_cost_command_runs():
    command = [
        sys.executable, str(ROOT / "benchmarks" / "selection_cost.py"),
        "--contexts", "300", "--shapes", "SmolLM2-135M", "--repeat", "1", "--lane-tokens", "8",
    ]
    result = subprocess.run(command, check=True, timeout=300, cwd=ROOT, capture_output=True, text=True)
    assert "| SmolLM2-135M | 300 |" in result.stdout


def test_branch_attention_cost_command_runs_and_its_three_ways_agree():
    command = [
        sys.executable, str(ROOT / "benchmarks" / "branch_attention_cost.py"),
        "--contexts", "200", "--repeat", "1",
    ]
    result = subprocess.run(command, check=True, timeout=300, cwd=ROOT, capture_output=True, text=True)
    assert "| SmolLM2-135M | 200 | 6 |" in result.stdout


def test_proposer_step_cost_command_runs_and_drafts_are_accepted():
    command = [
        sys.executable, str(ROOT / "benchmarks" / "proposer_step_cost.py"),
        "--batch-sizes", "1,4", "--history", "256", "--steps", "50", "--gc-pauses", "--ngram", "--thread-time",
    ]
    result = subprocess.run(command, check=True, timeout=300, cwd=ROOT, capture_output=True, text=True)
    assert "timed by the thread processor time" in result.stdout.splitlines()[0]
    rows = [line.split("|")[1:-1] for line in result.stdout.splitlines() if line.startswith("| 1 ") or line.startswith("| 4 ")]
    assert [int(row[0]) for row in rows] == [1, 4]
    for row in rows:
        mean, median, per_request, slowest = float(row[2]), float(row[3]), float(row[4]), float(row[6])
        assert 0 < median <= slowest * 1e3 + 1 and 0 < per_request  # the slowest step: ms to 3 decimals
        assert abs(per_request - mean / int(row[0])) < 0.1
        assert float(row[5]) > 1.0  # the repetitive text gives the pool drafts that are accepted
        # --gc-pauses: full collections, their longest pause, tracked objects after
        int(row[7]), float(row[8])  # full collections and their longest pause: numbers in their columns
        assert int(row[9]) < 2000  # the proposer's state is not on the collector's lists (tests/test_gc_tracking.py)
        # --ngram: vLLM's ngram proposer over the same texts: its mean and median, its tau (drafts
        # accepted), FAFO's over it (means, then medians)
        ngram_mean, ngram_median = float(row[10]), float(row[11])
        assert ngram_mean > 0 and ngram_median > 0 and float(row[12]) > 1.0
        assert abs(float(row[13]) - mean / ngram_mean) < 0.01 + 0.01 * float(row[13])
        assert abs(float(row[14]) - median / ngram_median) < 0.01 + 0.01 * float(row[14])


def test_proposer_step_cost_times_steps_on_its_modelled_machine(monkeypatch):
    """The controller learns step costs from the proposer's clock: on the modelled
    machine it drafts the same way every run (caches evicted before each step or not),
    and drafts less where tokens cost more."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    script = benchmark_script("proposer_step_cost")
    runs = [script.measure(4, 256, 60, "goodput", cost_ms=cost) for cost in
            ((52.0, 3.3, 3.3), (52.0, 3.3, 3.3), (10.0, 0.05, 0.05), (10.0, 20.0, 20.0))]
    assert runs[0]["tau"] == runs[1]["tau"]
    assert runs[2]["tau"] > runs[3]["tau"]
    assert script.measure(4, 256, 60, "goodput", cost_ms=(52.0, 3.3, 3.3), evict_mib=1)["tau"] == runs[0]["tau"]


def test_proposer_step_cost_times_steps_by_its_timer_not_the_modelled_clock(monkeypatch):
    """The host time is read off the timer asked for (``--thread-time``, else the wall
    clock), never off the modelled machine's clock the controller learns from: a timer
    that moves one second per reading gives one second per step, for FAFO and ngram."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    script = benchmark_script("proposer_step_cost")
    ticks = iter(range(10**6))
    timer = lambda: float(next(ticks))
    for result in (script.measure(2, 128, 20, "goodput", timer=timer), script.measure_ngram(2, 128, 20, timer=timer)):
        assert result["us_per_step"] == result["median_us_per_step"] == 1e6


def test_proposer_step_costs_median_leaves_out_the_rare_slow_steps(monkeypatch):
    """The mean step holds a slow step (an array grown), the median does not: a timer whose
    readings put one step of twenty at 21 s and the rest at 1 s gives a mean of 2 s, a median of 1."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    script = benchmark_script("proposer_step_cost")
    readings = iter([0.0, 21.0] + [float(t) for t in range(100, 100 + 38)])  # step 1: 21 s, then 19 steps of 1 s
    result = script.measure_ngram(2, 128, 20, timer=lambda: next(readings))
    assert result["us_per_step"] == 2e6 and result["median_us_per_step"] == 1e6


def test_proposer_step_cost_warm_code_steps_a_twin_after_the_eviction_and_outside_the_timer(monkeypatch):
    """``--warm-code``: each step the twin takes its step after the eviction and before the
    timer starts (so only the measured proposer's own data is cold); the twin's texts are its
    own, so the measured drafts, and their tau, are what they are without it; the option
    without an eviction is refused."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    script = benchmark_script("proposer_step_cost")
    calls = []

    class Steps:
        def __init__(self, name):
            self.name = name

        def prepare(self):
            calls.append(f"{self.name}.prepare")

        def run(self):
            calls.append(f"{self.name}.run")

    def timer():
        calls.append("timer")
        return float(len(calls))

    script._timed_steps(Steps("run"), Steps("twin"), 2, lambda: calls.append("evict"), timer)
    assert calls == ["run.prepare", "twin.prepare", "evict", "twin.run", "timer", "run.run", "timer"] * 2
    for measure in (lambda **kw: script.measure(3, 128, 30, "goodput", evict_mib=1, **kw),
                    lambda **kw: script.measure_ngram(3, 128, 30, evict_mib=1, **kw)):
        assert measure(warm_code=True)["tau"] == measure()["tau"] > 1.0
    command = [sys.executable, str(ROOT / "benchmarks" / "proposer_step_cost.py"), "--warm-code"]
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and "--warm-code splits a cold step: it needs --evict-mib" in result.stderr


def test_proposer_step_cost_sets_fafos_keys_and_refuses_unknown_ones(monkeypatch):
    """``--set KEY=JSON`` reaches the proposer's config (here: no deep matches, so other
    drafts are accepted); an unknown key or a value that is not JSON is refused, naming it."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    script = benchmark_script("proposer_step_cost")
    assert script.setting_argument("share_pool=false") == ("share_pool", False)
    for bad, says in (("share_pools=false", "'share_pools' is not one of FAFO's keys"), ("share_pool", "KEY=JSON"),
                      ("share_pool=no", "not JSON")):
        with pytest.raises(argparse.ArgumentTypeError, match=says):
            script.setting_argument(bad)
    default = script.measure(4, 256, 60, "goodput")
    assert script.measure(4, 256, 60, "goodput", settings={})["tau"] == default["tau"]
    assert script.measure(4, 256, 60, "goodput", settings={"deep_match": False})["tau"] != default["tau"]


@pytest.mark.slow  # a benchmark's own path, not the plugin's: benchmarks/matrix.py --shape
def test_matrix_step_cost_on_a_random_weight_shape(tmp_path, model_dir):
    """--shape runs the same tail layout on a model body with dummy weights (the
    Llama-3-8B shape on a GPU); here the tiny body, for the code path. Lanes are
    pinned on: over 32 tokens the goodput controller may never probe them."""
    out = tmp_path / "shape"
    command = [
        sys.executable, str(ROOT / "benchmarks" / "matrix.py"), "--shape", "tiny",
        "--methods", "none", "--method", 'fafo={"method":"fafo","controller":"fixed","num_lanes":16}',
        "--num-prompts", "2", "--max-tokens", "16",
        "--max-model-len", "1024", "--kv-cache-mib", "64", "--out", str(out),
    ]
    subprocess.run(command, check=True, timeout=900, cwd=ROOT)
    rows = json.loads((out / "summary.json").read_text())["rows"]
    assert {r["method"] for r in rows} == {"none", "fafo"}
    for row in rows:
        assert row["ms_per_step"] > 0
    plain = next(r for r in rows if r["method"] == "none")
    assert plain["engine_steps"] == plain["tokens"]  # one token per step, the prefill's included
    assert plain["draft_tokens_per_step"] == 0.0
    fafo = next(r for r in rows if r["method"] == "fafo")
    assert fafo["tail_tokens_per_step"] > 0


def test_projection_combines_tau_and_step_cost(tmp_path):
    def write(name, rows):
        run = tmp_path / name
        run.mkdir()
        (run / "summary.json").write_text(json.dumps({"rows": rows}))
        return run

    tau = write("tau", [
        {"dataset": "mtbench", "method": "none", "batch_size": 1, "tau": 1.0},
        {"dataset": "mtbench", "method": "fafo", "batch_size": 1, "tau": 2.2},
        {"dataset": "mtbench", "method": "ngram", "batch_size": 1, "tau": 1.6},  # no cost cell
        {"dataset": "mtbench", "method": "fafo", "batch_size": 4, "tau": 1.9},  # not batch 1
    ])
    cost = write("cost", [
        {"dataset": "mtbench", "method": "none", "batch_size": 1, "ms_per_step": 10.0},
        {"dataset": "humaneval", "method": "none", "batch_size": 1, "ms_per_step": 12.0},
        {"dataset": "mtbench", "method": "fafo", "batch_size": 1, "ms_per_step": 20.0},
    ])
    command = [sys.executable, str(ROOT / "benchmarks" / "projection.py"),
               "--tau", str(tau), "--cost", str(cost)]
    out = subprocess.run(command, check=True, capture_output=True, text=True, timeout=60).stdout
    assert "**Projection**, not a measurement" in out
    assert "| mtbench | fafo | 2.200 | 20.00 | 1.82x | 1.21x |" in out  # 2.2 * 11 / 20
    assert "| mtbench | none | 1.000 | 11.00 | 1.00x | 1.00x |" in out
    assert "ngram" not in out
    assert (cost / "projection.md").read_text() == out.rstrip("\n") + "\n"


def test_pool_replay_drafts_what_the_text_repeats():
    from vllm_fafo.config import FafoConfig

    module = benchmark_script("replay_pool")
    replay = module.replay

    def config(**keys):
        return FafoConfig.from_user_dict({"method": "fafo", **keys})

    prompt = list(range(100, 140))
    copying = (prompt, prompt[:32])  # the answer quotes the prompt
    fresh = (prompt, list(range(500, 532)))  # nothing in it was seen before
    assert replay(config(), [fresh]) == {"tau": 1.0, "draft_tokens_per_forward": 0.0}
    short = replay(config(num_speculative_tokens=4), [copying])
    long = replay(config(num_speculative_tokens=16), [copying])
    # After the prefill the quote is found under the first token and drafted in full:
    # 31 tokens in ceil(31 / 5) forwards with 4-token drafts, ceil(31 / 17) with 16.
    assert short["tau"] == 32 / (1 + 7) and long["tau"] == 32 / (1 + 2)
    # The shared pool lets a later request draft an earlier one's answer; without it, not.
    first, again = replay(config(), [fresh, fresh]), replay(config(share_pool=False), [fresh, fresh])
    assert first["tau"] > again["tau"] == 1.0
    # With a step cost the goodput controller cuts the drafts (costly ones are dropped once
    # it has seen what they cost), and every forward after the prefill is priced.
    free = replay(config(num_speculative_tokens=16), [copying], cost_ms=(10.0, 0.0, 0.0))
    assert free["tokens_per_s"] == pytest.approx(32 / ((32 / free["tau"] - 1) * 0.010))
    costly = replay(config(num_speculative_tokens=16), [copying] * 3, cost_ms=(10.0, 1000.0, 1000.0))
    assert costly["tau"] < replay(config(num_speculative_tokens=16), [copying] * 3)["tau"]
    # A controller passed in keeps what it learned: run again, it knows drafts cost more
    # than they earn from the first forward on, where a fresh one drafts in full until
    # it has seen a draft's cost.
    warm = module.new_controller(config(num_speculative_tokens=16))
    replay(config(num_speculative_tokens=16), [copying] * 3, cost_ms=(10.0, 1000.0, 1000.0), controller=warm)
    again = replay(config(num_speculative_tokens=16), [copying] * 3, cost_ms=(10.0, 1000.0, 1000.0), controller=warm)
    assert again["tau"] < costly["tau"]
    # Past a knee of 17 tokens the same price; below it tokens are free, so the drafts stay long
    # (cut only where the controller tries sizes below those it saw: it prices them proportionally).
    knee = replay(config(num_speculative_tokens=16), [copying] * 3, cost_ms=(10.0, 1000.0, 1000.0, 17.0))
    assert costly["tau"] < knee["tau"] and costly["draft_tokens_per_forward"] < knee["draft_tokens_per_forward"]
    # Scattered step times (seeded: the same scatter every run) price the same forwards.
    noisy = [replay(config(num_speculative_tokens=16), [copying] * 3, cost_ms=(10.0, 1.0, 1.0),
                    noise=module.StepNoise(0.05, 0.1, 1.5)) for _ in range(2)]
    assert noisy[0] == noisy[1]
    assert noisy[0]["tokens_per_s"] != replay(config(num_speculative_tokens=16), [copying] * 3,
                                              cost_ms=(10.0, 1.0, 1.0))["tokens_per_s"]
    with pytest.raises(ValueError, match="noise scatters the step cost"):
        replay(config(), [copying], noise=module.StepNoise(0.05, 0.0, 1.0))


def test_replay_step_cost_with_a_knee_and_scatter():
    """``--cost-ms STEP,FIRST,PER,KNEE``: forwards of up to KNEE tokens cost STEP, only
    tokens past it are priced, drafts first; ``--noise SD,P,FACTOR`` scatters each time."""
    module = benchmark_script("replay_pool")
    step_seconds = module.step_seconds
    assert step_seconds((10.0, 4.0, 1.0, 8), 3, 2) == pytest.approx(0.010)  # 5 tokens: under the knee
    assert step_seconds((10.0, 4.0, 1.0, 8), 10, 1) == pytest.approx((10.0 + 4.0 + 2.0) / 1000)  # 3 drafts past it
    assert step_seconds((10.0, 4.0, 1.0, 8), 2, 10) == pytest.approx((10.0 + 2.0 + 4.0 + 1.0) / 1000)
    assert step_seconds((10.0, 4.0, 1.0, 1), 3, 2) == step_seconds((10.0, 4.0, 1.0), 3, 2)
    assert module.cost_ms_argument("41,1.2,1.2,8") == (41.0, 1.2, 1.2, 8.0)
    for bad in ("41,1", "41,1,1,8,9", "41,-1,1", "a,b,c", "41,1,1,0", "41,1,1,2.5"):
        with pytest.raises(argparse.ArgumentTypeError):
            module.cost_ms_argument(bad)
    assert noise_samples(module.StepNoise(0.0, 0.0, 1.0)) == [0.04] * 200
    assert noise_samples(module.StepNoise(0.0, 1.0, 1.5)) == pytest.approx([0.06] * 200)
    scattered = noise_samples(module.StepNoise(0.05, 0.0, 1.0))
    assert scattered == noise_samples(module.StepNoise(0.05, 0.0, 1.0))  # seeded
    assert np.std(np.log(scattered)) == pytest.approx(0.05, rel=0.2)
    paused = np.array(noise_samples(module.StepNoise(0.0, 0.25, 2.0)))
    assert set(paused.round(6)) == {0.04, 0.08} and 0.1 < np.mean(paused > 0.05) < 0.4
    assert module.noise_argument("0.05,0.02,1.5") == module.StepNoise(0.05, 0.02, 1.5)
    for bad in ("0.05,0.02", "-0.1,0,1", "0.1,2,1", "0.1,0.5,0.5"):
        with pytest.raises(argparse.ArgumentTypeError):
            module.noise_argument(bad)


def noise_samples(noise) -> list[float]:
    sample = noise.sampler()
    return [sample(0.04) for _ in range(200)]


def test_pool_replay_of_draft_trees_and_the_oracle_take_the_candidate_the_text_follows():
    from vllm_fafo.config import FafoConfig

    module = benchmark_script("replay_pool")

    def config(**keys):  # candidates as long as a draft (text_ngram_len 0): whole 16-token branches
        return FafoConfig(deep_match=False, share_pool=False, text_ngram_len=0, **keys)

    # (1, 2) was followed first by `older`, then by `newer`; the answer takes `older` again.
    older, newer = list(range(10, 26)), list(range(40, 56))
    request = ([1, 2, *older, 3, 1, 2, *newer, 4, 1], [2, *older, 5])
    # Spine only: the newest candidate is rejected at its first token, the next forward
    # finds `older`'s rest under (2, 10): 18 tokens in 3 forwards (the prefill's included).
    assert module.replay(config(), [request]) == {"tau": 6.0, "draft_tokens_per_forward": 32 / 3}
    # With a branch: `older` rides off node 0 and is accepted whole with the spine's
    # rejection, then the target's 5: 2 forwards.
    tree = module.replay(config(num_candidates=2), [request])
    assert tree["tau"] == 9.0 and tree["accepted_off_spine"] == 16 and tree["branch_tokens_per_forward"] == 8.0
    with pytest.raises(ValueError, match="uncut"):
        module.replay(config(num_candidates=2), [request], cost_ms=(10.0, 1.0, 1.0))
    # The best candidate at hand as the draft (a perfect ranking): `older` at once, 2 forwards.
    assert module.replay(config(), [request], oracle=True) == {"tau": 9.0, "draft_tokens_per_forward": 16 / 2}
    with pytest.raises(ValueError, match="oracle"):
        module.replay(config(num_candidates=2), [request], oracle=True)


def test_pool_replay_drafts_an_earlier_answer_and_not_with_sharing_off():
    from vllm_fafo.config import FafoConfig

    module = benchmark_script("replay_pool")

    def replay(*requests, **keys):
        return module.replay(FafoConfig.from_user_dict({"method": "fafo", **keys}), list(requests))

    prompt = list(range(100, 140))
    fresh = (prompt, list(range(500, 532)))
    assert replay(fresh, fresh)["tau"] > replay(fresh, fresh, share_pool=False)["tau"] == 1.0


def test_vllm_suffix_replay_drafts_what_was_seen_no_longer_than_the_match():
    module = benchmark_script("replay_pool")
    replay = module.replay_vllm_suffix

    prompt = list(range(100, 140))
    copying = (prompt, prompt[:32])
    fresh = (prompt, list(range(500, 532)))
    assert replay([fresh]) == {"tau": 1.0, "draft_tokens_per_forward": 0.0}
    quoted = replay([copying])  # drafted as matched: 1 token after 1 matched token, 2 after 2, ...
    assert 1.0 < quoted["tau"] < 32 / 3
    # vLLM keeps earlier answers: the second request drafts the first one's
    assert replay([fresh, fresh])["tau"] > 1.0
    # priced like the settings' replay: every forward after the prefill, here 31 without drafts
    assert replay([fresh], cost_ms=(10.0, 1.0, 1.0))["tokens_per_s"] == pytest.approx(32 / 0.31)


def _matrix_module():
    return benchmark_script("matrix")


def test_rounds_table_takes_medians_of_rates_and_of_ratios_within_each_round():
    def row(method, rate):
        return {"dataset": "mtbench", "batch_size": 1, "method": method, "tokens_per_s": rate,
                "identical_to_none": True}

    # The machine slows down over the rounds; fafo against the best other is 1.1, 0.5, 1.2.
    rounds = [[row("none", 100.0), row("fafo", 110.0)],
              [row("none", 200.0), row("fafo", 100.0)],
              [row("none", 50.0), row("fafo", 60.0)]]
    table = _matrix_module().rounds_table(rounds)
    assert "| mtbench | 1 | fafo | 110.0 / 100.0 / 60.0 | 100.0 | 1.10 | yes |" in table
    assert "| mtbench | 1 | none | 100.0 / 200.0 / 50.0 | 100.0 | 0.91 | yes |" in table


def test_profile_report_counts_the_plugin_s_own_time_per_step(tmp_path):
    """``--profile``: host time in vllm_fafo code and in ``propose`` per engine step."""
    import numpy as np

    from vllm_fafo.drafting.pool import NgramPool, Origin

    matrix = _matrix_module()
    pool = NgramPool(max_key_len=4, capacity=4)
    report = tmp_path / "profiles" / "cell.txt"
    with matrix.profiled(True, report, steps_of=iter([10, 20]).__next__):
        for start in range(2000):
            pool.add(np.arange(start, start + 4).tolist(), (start + 4,), Origin.OUTPUT)
        sum(range(10**6))  # time outside the plugin
    text = report.read_text()
    assert text.startswith("engine steps: 10\n")
    plugin_ms = float(text.split("in vllm_fafo code (self time): ")[1].split("\n")[0])
    total_ms = float(text.split("total profiled: ")[1].split("\n")[0])
    assert 0 < plugin_ms < total_ms
    assert "drafter propose (cumulative): 0.000" in text
    assert "pool.py" in text.split("== vllm_fafo's functions by cumulative")[1]


def test_a_method_can_set_its_engine_s_environment_and_arguments():
    matrix = _matrix_module()
    label, config = matrix.parse_method(
        'none-v1={"method":"none","env":{"VLLM_USE_V2_MODEL_RUNNER":0},'
        '"engine_args":{"compilation_config":{"cudagraph_mode":"FULL"}}}')
    assert label == "none-v1"
    assert matrix.engine_settings(config) == (
        None, {"VLLM_USE_V2_MODEL_RUNNER": "0"}, {"compilation_config": {"cudagraph_mode": "FULL"}})
    assert matrix.engine_settings({"method": "fafo", "num_lanes": 0}) == ({"method": "fafo", "num_lanes": 0}, {}, {})
    assert matrix.engine_settings(None) == (None, {}, {})
    with pytest.raises(SystemExit, match="method 'none' takes no speculative settings"):
        matrix.engine_settings({"method": "none", "num_speculative_tokens": 4})


def test_matrix_rounds_alternate_the_method_order(tmp_path, monkeypatch):
    """``--rounds 2`` runs the methods forward, then backward, each round into its own
    folder, and reports every cell once per round. The engines are stood in for by a
    child that writes its cell (the tiny matrix above runs real ones)."""
    matrix = benchmark_script("matrix")
    out = tmp_path / "bench"
    args = argparse.Namespace(
        methods="none,fafo", method=[], datasets="humaneval", batch_sizes="1", out=str(out), rounds=2)
    order, real_run = [], subprocess.run

    def child(command, *rest, **options):
        if "--child" not in command:  # not a method's engine (the machine's description)
            return real_run(command, *rest, **options)
        label, round_out = command[-1], Path(command[command.index("--out") + 1])
        order.append((round_out.name, label))
        path = matrix.cell_path(round_out, label, "humaneval", 1)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"method": label, "dataset": "humaneval", "batch_size": 1, "temperature": 0.0,
                                    "tokens_per_s": 10.0 + len(order), "token_ids": [[1, 2]]}))

    monkeypatch.setattr(matrix.subprocess, "run", child)
    matrix.run_rounds(args, ["none", "fafo"], ["none", "fafo"], [])
    assert order == [("round1", "none"), ("round1", "fafo"), ("round2", "fafo"), ("round2", "none")]
    table = (out / "rounds.md").read_text()
    assert table.count("| humaneval | 1 |") == 2
    # fafo against none: 12 / 11 in round 1, 13 / 14 in round 2; the median ratio 1.0097
    assert "| humaneval | 1 | fafo | 12.0 / 13.0 | 12.5 | 1.01 | yes |" in table


def test_batch_replay_runs_requests_together_and_batch_1_is_one_after_another():
    """``batch_size`` B: B requests decode together (a new one starts when one ends),
    so a later request cannot draft from an earlier one's finished answer, only from
    what is decoded so far; every request's tokens are counted once either way."""
    module = benchmark_script("replay_pool")
    import numpy as np

    from vllm_fafo.config import FafoConfig

    rng = np.random.default_rng(5)
    answer = rng.integers(100, 5000, size=64).tolist()
    twins = [(rng.integers(100, 5000, size=12).tolist(), answer) for _ in range(2)]
    events = []
    for event, running in module.scheduled(twins * 2, batch_size=2):
        events.append((event, [r.req_id for r in running] if event == "step" else running.req_id))
        for request in running if event == "step" else ():
            request.done = len(request.output)  # the whole answer in one forward
    assert events[:3] == [("start", "0"), ("start", "1"), ("step", ["0", "1"])]
    assert [e for e in events if e[0] == "start"] == [("start", str(i)) for i in range(4)]
    assert sum(e[0] == "finish" for e in events) == 4
    config = FafoConfig(deep_match=False, num_lanes=0)
    one_after_another = module.replay(config, twins)
    together = module.replay(config, twins, batch_size=2)
    assert one_after_another == module.replay(config, twins, batch_size=1)
    # the second twin copies the first one's finished answer one after another; together both start blind
    assert one_after_another["tau"] > together["tau"] >= 1.0
    suffix_together = module.replay_vllm_suffix(twins, batch_size=2)
    assert module.replay_vllm_suffix(twins)["tau"] > suffix_together["tau"] >= 1.0
    assert module.step_seconds((10.0, 4.0, 1.0), 3, 2) == pytest.approx((10.0 + 1.0 + 4.0 + 2.0) / 1000)


def test_cpu_attention_row_invariance_calls_vllm_s_kernel_on_the_cache_it_made():
    """The harness's kernel call is attention over the request's keys (dense softmax
    reference, float32, keys read back with the plugin's own paged-cache reader), so
    its bitwise verdicts compare real attention outputs."""
    import torch

    from vllm_fafo.attention.paged_kv import CPUPagedKV, PagedKVLayoutError

    bench = benchmark_script("cpu_attention_row_invariance")
    torch.manual_seed(0)
    attention = bench.PagedAttention(torch.float32, split_kv=False)
    seq_len, num_rows = 300, 4
    blocks = bench.blocks_for(1, seq_len)
    try:
        reader = CPUPagedKV(attention.kv_cache, torch.tensor([blocks], dtype=torch.int32), attention.isa)
    except PagedKVLayoutError as error:  # an AMX machine: the same skip the plugin's readers make
        pytest.skip(f"no dense reference: {error}")
    keys, values = reader.read(0, torch.arange(seq_len))  # (tokens, KV heads, D)
    rows = torch.randn(num_rows, bench.NUM_HEADS, bench.HEAD_DIM)
    got = attention([(blocks, seq_len, rows)])[0]
    group = bench.NUM_HEADS // bench.NUM_KV_HEADS
    for i in range(num_rows):
        seen = seq_len - num_rows + i + 1
        for head in range(bench.NUM_HEADS):
            k, v = keys[:seen, head // group], values[:seen, head // group]
            weights = torch.softmax(rows[i, head] @ k.T * bench.HEAD_DIM**-0.5, dim=-1)
            torch.testing.assert_close(got[i, head], weights @ v, atol=1e-5, rtol=1e-5)


def test_cpu_attention_row_invariance_command_runs():
    command = [sys.executable, str(ROOT / "benchmarks" / "cpu_attention_row_invariance.py"),
               "--dtype", "bfloat16", "--split-kv", "off"]
    result = subprocess.run(command, check=True, timeout=300, cwd=ROOT, capture_output=True, text=True)
    assert "| 300 | 9 |" in result.stdout and "arrangements differ" in result.stdout


def test_soak_table_gives_each_config_s_median_growth_over_plain_vllm_s():
    def report(spec, round_index, growth):
        return {"speculative_config": spec, "round": round_index, "completed": 10, "aborted": 2, "failed": 0,
                "tokens_per_s": 50.0, "rss_start_mib": 3000.0, "rss_growth_mib": growth,
                "rss_growth_by_process_mib": {"vllm": 1.0, "VLLM::Worker": growth - 1.0},
                "rss_growth_kib_per_token": 10.0, "index_mib": None if spec is None else 11.4, "passed": True}

    fafo = {"method": "fafo"}
    reports = [report(None, 0, 250.0), report(fafo, 0, 460.0), report(None, 1, 270.0), report(fafo, 1, 300.0),
               report(None, 2, 100.0), report(fafo, 2, 400.0)]
    from benchmarks.soak import compare

    table, over_plain = compare(reports)
    assert over_plain == {'{"method":"fafo"}': 150.0}  # medians 400 and 250, not the rounds' own differences
    assert '| `{"method":"fafo"}` | 1 | 10 / 2 / 0 | 50.0 | 3000.0 | 300.0 | vllm +1, VLLM::Worker +299 | 10.0 | 11.4 |' \
        in table
    assert compare(reports[1::2])[1] == {}  # no plain run: nothing to compare


def test_host_time_parts_say_what_propose_spends_outside_them(monkeypatch):
    """``host_time.py --parts``: each part's median per call, and propose's own time per step
    (propose less the parts called once per step; a part called otherwise is not subtracted)."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))  # host_time imports matrix, as a script does
    host_time = benchmark_script("host_time")
    parts = {"FafoProposer.propose": [10e-6, 20e-6, 30e-6], "DraftIndex.draft_batch": [4e-6, 5e-6, 6e-6],
             "RequestTable.settle": [1e-6, 1e-6, 1e-6], "GoodputController.choose_tier": [],
             "DraftJudge.add": [1e-6, 9e-6]}
    rows = host_time.parts_rows("fafo", 8, parts)
    assert rows == [
        "| fafo | 8 | DraftIndex.draft_batch | 5 |",
        "| fafo | 8 | RequestTable.settle | 1 |",
        "| fafo | 8 | DraftJudge.add (2 calls in 3 steps) | 5 |",
        "| fafo | 8 | FafoProposer.propose | 20 |",
        "| fafo | 8 | propose outside the parts above | 14 |",
    ]
    planning = {"FumbleLanes.plan_step": [3e-6, 5e-6, 4e-6], "GoodputController.choose_lanes": [2e-6],
                "FumbleLanes._active_lanes": []}
    assert host_time.planning_rows("fafo", 8, 3, planning) == [
        "| fafo | 8 | FumbleLanes.plan_step (3 calls in 3 steps) | 4 |",
        "| fafo | 8 | GoodputController.choose_lanes (1 calls in 3 steps) | 2 |",
    ]
    for module, cls_name, name in (*host_time.PARTS, *host_time.PLANNING_PARTS):  # a renamed method fails here
        assert callable(getattr(getattr(importlib.import_module(module), cls_name), name)), (cls_name, name)
    proposer, runner_patch = (importlib.import_module(m) for m in ("vllm_fafo.proposer", "vllm_fafo.patches.gpu_model_runner"))
    assert all(callable(getattr(proposer.FafoProposer, name)) for name in host_time.HOOKS)
    assert all(callable(getattr(runner_patch, name)) for name in host_time.PATCH_WORK)


def test_host_time_serves_as_on_a_gpu_where_asked(monkeypatch):
    """``host_time.py --dtype bfloat16 --cuda-graphs``: the engines run in that dtype with
    vLLM's defaults (not eager), and every child engine is given the options."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    host_time = benchmark_script("host_time")
    assert host_time.engine_arguments("float32", False)["enforce_eager"] is True
    gpu = host_time.engine_arguments("bfloat16", True)
    assert (gpu["dtype"], gpu["enforce_eager"]) == ("bfloat16", False)
    children = []
    monkeypatch.setattr(host_time, "run_rounds", lambda argv, methods, rounds: children.append((argv, methods)))
    monkeypatch.setattr(sys, "argv", ["host_time.py", "--methods", "fafo,ngram", "--dtype", "bfloat16",
                                      "--cuda-graphs"])
    host_time.main()
    argv, methods = children[0]
    assert methods == ["fafo", "ngram"] and argv[-3:] == ["--dtype", "bfloat16", "--cuda-graphs"]


def test_host_time_rounds_show_each_round_and_the_ratio_by_round(monkeypatch):
    """``host_time.py --rounds``: each method's medians round by round, and the first method's
    ratio to each other one taken within a round (a round missing a cell is left out of it)."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    host_time = benchmark_script("host_time")
    cell = lambda n, label, batch, us: {"round": n, "label": label, "batch": batch, "all_us": us}
    results = [cell(0, "fafo", 8, 200.0), cell(0, "ngram", 8, 250.0), cell(0, "fafo", 32, 330.0),
               cell(0, "ngram", 32, 300.0), cell(1, "fafo", 8, 220.0), cell(1, "ngram", 8, 200.0),
               cell(1, "fafo", 32, 300.0), cell(2, "fafo", 8, 210.0), cell(2, "ngram", 8, 300.0)]
    assert host_time.rounds_rows(results) == [
        "| method | batch | all, us per step, by round | median |",
        "|---|---|---|---|",
        "| fafo | 8 | 200, 220, 210 | 210 |",
        "| ngram | 8 | 250, 200, 300 | 250 |",
        "| fafo | 32 | 330, 300 | 315 |",
        "| ngram | 32 | 300 | 300 |",
        "",
        "| ratio | batch | by round | median |",
        "|---|---|---|---|",
        "| fafo / ngram | 8 | 0.80, 1.10, 0.70 | 0.80 |",
        "| fafo / ngram | 32 | 1.10 | 1.10 |",
    ]


def test_cold_calls_times_each_call_warm_and_cold(monkeypatch):
    """``cold_calls.py``: a row per call, warm and cold times in us, the kernels' arguments
    as many as named (a kernel taking 8 arrays reads the first)."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))  # cold_calls imports proposer_step_cost, as a script does
    cold_calls = benchmark_script("cold_calls")
    assert cold_calls.kernel_taking(8)(*(np.full(2, i) for i in range(8))) == 0
    rows = cold_calls.call_rows(evict_mib=1, calls=3)
    assert [row.split(" | ")[0] for row in rows] == [
        "| Python function", "| numpy call (np.minimum of two 8-element arrays)", "| numba kernel taking 1 array",
        "| numba kernel taking 8 arrays", "| numba kernel taking 32 arrays", "| numba kernel taking 64 arrays",
        "| numba kernel taking a structref of 64 arrays"]
    assert all(float(cell) > 0 for row in rows for cell in row.strip(" |").split(" | ")[1:])
    # the step kernel beside a trivial kernel taking its arguments (as many as it takes: a
    # changed signature fails here), called directly and through the dispatcher
    rows = cold_calls.step_kernel_rows(evict_mib=1, steps=4)
    assert [row.split(" | ")[0] for row in rows] == [
        f"| {name}, batch {batch}" for batch in (1, 32) for name in (
            "step kernel", "a trivial kernel taking its arguments", "the same through numba's dispatcher")]
    assert all(float(row.strip(" |").split(" | ")[2]) > 0 for row in rows)
