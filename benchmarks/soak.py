"""Soak a real `vllm serve` under streaming chat traffic with aborts, and check it held.

Starts `vllm serve` on 127.0.0.1 (with a speculative config, or plain), keeps
``--concurrency`` streaming chat requests in flight for ``--seconds`` (prompts
from the bundled MT-Bench questions, mixed lengths, half greedy and half
sampled (temperature 0.8, unseeded unless ``--seeded-sampling``),
``--abort-fraction`` of them closed mid-stream), then stops by
itself. Reports completed / aborted / failed requests, streamed tokens per
second, the server's resident memory over time (API server and engine
processes together), and whether a fixed greedy request gives the same text
before and after the load. Several ``--speculative-config`` values (``none``:
plain vLLM) are soaked one after another, ``--rounds`` times in turn, and compared
in one table: the servers' own memory growth varies by a hundred MiB from run to
run, so a difference between two configs needs them measured in the same run,
more than once. With the plugin on, it also reads the plugin's own
state off ``/metrics`` once the load has drained: no request state, region
row or unfreed request may be left behind, and the shared pool holds no more
keys than its bound; the draft index's arrays (``index_bytes``) are reported
next to the growth. Exits non-zero when a request failed, the text changed,
plugin state was left behind, or memory grew by more than
``--max-rss-growth-kib-per-token`` per streamed token (memory grows with the
work served, plain vLLM's too, so the bound is per token, not absolute).

    python benchmarks/soak.py --concurrency 16 --seconds 60
    python benchmarks/soak.py --speculative-config none --speculative-config '{"method": "fafo"}' \
        --concurrency 32 --seconds 180 --rounds 2
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import socket
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import aiohttp
import psutil
import requests

SERVED_NAME = "soak-model"
FIXED_CHAT = [{"role": "user", "content": "Explain in three sentences why the sky is blue."}]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def vllm_command() -> list[str]:
    exe = os.path.join(os.path.dirname(sys.executable), "vllm")
    return [exe] if os.path.exists(exe) else ["vllm"]


class VllmServer:
    """A `vllm serve` process on a free local port (engine in its own process)."""

    def __init__(self, model: str, extra_args: list[str], log_path: str, served_name: str = SERVED_NAME,
                 max_model_len: int = 1024, kv_cache_mib: int = 256) -> None:
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = dict(os.environ)
        env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
        self.log = open(log_path, "w")
        self.proc = subprocess.Popen(
            vllm_command()
            + ["serve", model, "--host", "127.0.0.1", "--port", str(self.port),
               "--dtype", "float32", "--enforce-eager", "--max-model-len", str(max_model_len),
               "--kv-cache-memory-bytes", str(kv_cache_mib * 1024 * 1024), "--seed", "0",
               "--served-model-name", served_name]
            + extra_args,
            stdout=self.log, stderr=subprocess.STDOUT, env=env,
        )

    def wait_ready(self, timeout: float = 300) -> None:
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}; see {self.log.name}")
            try:
                ready = requests.get(self.url + "/health", timeout=2).status_code == 200
            except requests.RequestException:  # not listening yet
                ready = False
            if ready:
                return
            time.sleep(1)
        raise TimeoutError(f"server not ready after {timeout}s; see {self.log.name}")

    def rss_by_process_mib(self) -> dict[str, float]:
        """Resident memory of the server and every process it started, by process name
        (``vllm`` the API server, ``VLLM::EngineCore`` the engine core, ``VLLM::Worker`` the
        model runner; same names summed)."""
        try:
            root = psutil.Process(self.proc.pid)
            procs = [root, *root.children(recursive=True)]
        except psutil.NoSuchProcess:
            return {}
        rss: dict[str, float] = {}
        for proc in procs:
            try:
                name, used = proc.name(), proc.memory_info().rss / 2**20
            except psutil.NoSuchProcess:
                continue
            rss[name] = rss.get(name, 0.0) + used
        return rss

    def rss_mib(self) -> float:
        """Resident memory of the server and every process it started."""
        return sum(self.rss_by_process_mib().values())

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.log.close()


@dataclass
class LoadResult:
    completed: int = 0
    aborted: int = 0
    failed: int = 0
    tokens: int = 0
    errors: list[str] = field(default_factory=list)


async def _one_request(session: aiohttp.ClientSession, url: str, body: dict, abort_after: int | None,
                       result: LoadResult) -> None:
    """Stream one chat completion; close it after ``abort_after`` chunks if given."""
    chunks, tokens = 0, 0
    try:
        async with session.post(url + "/v1/chat/completions", json=body) as response:
            if response.status != 200:
                raise RuntimeError(f"HTTP {response.status}: {(await response.text())[:200]}")
            async for raw in response.content:
                line = raw.strip()
                if not line.startswith(b"data: ") or line == b"data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    raise RuntimeError(str(event["error"])[:200])
                usage = event.get("usage") or {}
                tokens = usage.get("completion_tokens", tokens)
                chunks += 1
                if abort_after is not None and chunks >= abort_after:
                    response.close()  # the client goes away mid-stream
                    result.aborted += 1
                    result.tokens += tokens
                    return
        result.completed += 1
        result.tokens += tokens
    except Exception as error:  # noqa: BLE001 - every failure is counted and reported
        result.failed += 1
        result.tokens += tokens
        if len(result.errors) < 10:
            result.errors.append(f"{type(error).__name__}: {error}")


async def run_load(url: str, prompts: list[str], concurrency: int, seconds: float, abort_fraction: float,
                   max_tokens: tuple[int, int], seed: int, max_requests: int,
                   seeded: bool) -> tuple[LoadResult, float]:
    """``concurrency`` workers, each sending one request after another until ``seconds``
    have passed or ``max_requests`` were started."""
    result = LoadResult()
    rng = random.Random(seed)
    started = 0
    deadline = time.monotonic() + seconds

    async def worker(session: aiohttp.ClientSession) -> None:
        nonlocal started
        while time.monotonic() < deadline and started < max_requests:
            started += 1
            greedy = rng.random() < 0.5
            body = {
                "model": SERVED_NAME,
                "messages": [{"role": "user", "content": rng.choice(prompts)}],
                "max_tokens": rng.randint(*max_tokens),
                "temperature": 0.0 if greedy else 0.8,
                "stream": True,
                "stream_options": {"include_usage": True, "continuous_usage_stats": True},
            }
            if not greedy and seeded:
                body["seed"] = rng.randrange(1 << 30)
            abort_after = rng.randint(1, 32) if rng.random() < abort_fraction else None
            await _one_request(session, url, body, abort_after, result)

    timeout = aiohttp.ClientTimeout(total=seconds + 600)
    start = time.monotonic()
    async with aiohttp.ClientSession(timeout=timeout) as session:
        await asyncio.gather(*(worker(session) for _ in range(concurrency)))
    return result, time.monotonic() - start


PLUGIN_STATE = ("requests_tracked", "requests_with_region", "requests_started_total", "requests_freed_total",
                "shared_pool_keys", "index_bytes")
"""The plugin's metrics (``vllm:fafo_<name>`` on ``/metrics``) read after the load."""


def plugin_state(url: str) -> dict[str, float]:
    """The plugin's request and pool gauges and counters, summed over engines."""
    from prometheus_client.parser import text_string_to_metric_families

    from vllm_fafo.serving.metrics_export import PREFIX

    response = requests.get(url + "/metrics", timeout=30)
    response.raise_for_status()
    state = dict.fromkeys(PLUGIN_STATE, 0.0)
    for family in text_string_to_metric_families(response.text):
        for sample in family.samples:
            name = sample.name.removeprefix(PREFIX)
            if sample.name.startswith(PREFIX) and name in state:
                state[name] += sample.value
    return state


def shared_key_bound(spec: dict | None) -> int:
    """Keys the shared pools may hold over all tenants under ``spec`` (each tenant's
    ``shared_pool_mib`` in keys, times ``shared_pool_tenants``); 0 where it has none."""
    from vllm_fafo.config import FafoConfig
    from vllm_fafo.drafting.index import DraftIndex

    if not spec or spec.get("method") != "fafo":
        return 0  # lookahead and cacheback keep per-request pools only
    config = FafoConfig.from_user_dict(spec)
    return DraftIndex(config).shared.max_keys * config.shared_pool_tenants if config.share_pool else 0


def state_left_behind(state: dict[str, float], shared_pool_keys: int) -> list[str]:
    """What the plugin still holds after every request ended (empty: nothing)."""
    problems = [f"{name} = {state[name]:g}" for name in ("requests_tracked", "requests_with_region") if state[name]]
    if state["requests_started_total"] != state["requests_freed_total"]:
        problems.append(f"requests started {state['requests_started_total']:g} != "
                        f"freed {state['requests_freed_total']:g}")
    if state["requests_started_total"] == 0:
        problems.append("the plugin tracked no request (its metrics missing from /metrics?)")
    if state["shared_pool_keys"] > shared_pool_keys:
        problems.append(f"shared_pool_keys {state['shared_pool_keys']:g} > bound {shared_pool_keys}")
    return problems


def fixed_greedy_text(url: str) -> str:
    body = {"model": SERVED_NAME, "messages": FIXED_CHAT, "max_tokens": 64, "temperature": 0.0}
    response = requests.post(url + "/v1/chat/completions", json=body, timeout=600)
    response.raise_for_status()
    return response.json()["choices"][0]["message"]["content"]


def soak(args: argparse.Namespace, spec: dict | None, out: Path) -> dict:
    """One server soaked (``spec`` None: plain vLLM); its report, also in ``out``/soak.json."""
    from vllm_fafo.modes import METHODS
    from vllm_fafo.tools.assets import load_prompts, smollm2_dir

    plugin_runs = spec is not None and spec.get("method") in METHODS  # else plain vLLM or a vLLM method

    model = args.model or str(smollm2_dir())
    extra = [] if spec is None else ["--speculative-config", json.dumps(spec)]
    out.mkdir(parents=True, exist_ok=True)
    server = VllmServer(model, extra, str(out / "server.log"), kv_cache_mib=args.kv_cache_mib)
    rss: list[tuple[float, float]] = []
    stop_sampling = threading.Event()
    try:
        server.wait_ready()
        text_before = fixed_greedy_text(server.url)
        start = time.monotonic()

        def sample_rss() -> None:
            while not stop_sampling.is_set():
                rss.append((round(time.monotonic() - start, 1), round(server.rss_mib(), 1)))
                stop_sampling.wait(args.rss_interval)

        sampler = threading.Thread(target=sample_rss, daemon=True)
        rss_before = server.rss_by_process_mib()
        sampler.start()
        load, seconds = asyncio.run(run_load(
            server.url, load_prompts("mtbench"), args.concurrency, args.seconds, args.abort_fraction,
            (args.min_tokens, args.max_tokens), args.seed, args.max_requests, args.seeded_sampling,
        ))
        time.sleep(args.settle_seconds)  # aborted requests drain before the last sample
        stop_sampling.set()
        sampler.join()
        rss_after = server.rss_by_process_mib()
        state = plugin_state(server.url) if plugin_runs else None
        text_after = fixed_greedy_text(server.url)
    finally:
        stop_sampling.set()
        server.stop()
    growth = rss[-1][1] - rss[0][1] if rss else 0.0
    growth_kib_per_token = growth * 1024 / max(1, load.tokens)
    left_behind = [] if state is None else state_left_behind(state, shared_key_bound(spec))
    report = {
        "speculative_config": spec,
        "concurrency": args.concurrency,
        "seeded_sampling": args.seeded_sampling,
        "seconds": round(seconds, 1),
        **asdict(load),
        "tokens_per_s": round(load.tokens / seconds, 2),
        "rss_start_mib": rss[0][1] if rss else None,
        "rss_end_mib": rss[-1][1] if rss else None,
        "rss_peak_mib": max(r for _, r in rss) if rss else None,
        "rss_growth_mib": round(growth, 1),
        "rss_growth_kib_per_token": round(growth_kib_per_token, 1),
        "rss_growth_by_process_mib": {name: round(rss_after.get(name, 0.0) - mib, 1)
                                      for name, mib in rss_before.items()},
        "index_mib": None if state is None else round(state["index_bytes"] / 2**20, 1),
        "plugin_state": state,
        "plugin_state_left_behind": left_behind,
        "same_text_before_and_after": text_before == text_after,
        "rss_over_time": rss,
    }
    report["passed"] = bool(
        load.failed == 0 and report["same_text_before_and_after"] and not left_behind
        and growth_kib_per_token <= args.max_rss_growth_kib_per_token
    )
    (out / "soak.json").write_text(json.dumps(report, indent=1))
    return report


def label(spec: dict | None) -> str:
    return "plain" if spec is None else json.dumps(spec, separators=(",", ":"))


def compare(reports: list[dict]) -> tuple[str, dict[str, float]]:
    """A markdown table of every run, and each config's median growth over plain vLLM's
    (MiB; empty where plain vLLM was not soaked)."""
    lines = ["| config | round | completed / aborted / failed | tokens/s | RSS start MiB | growth MiB "
             "| by process | KiB per token | index MiB | passed |", "|---|---|---|---|---|---|---|---|---|---|"]
    growth: dict[str, list[float]] = {}
    for report in reports:
        name = label(report["speculative_config"])
        growth.setdefault(name, []).append(report["rss_growth_mib"])
        by_process = ", ".join(f"{process} {mib:+.0f}" for process, mib in report["rss_growth_by_process_mib"].items())
        lines.append(f"| `{name}` | {report['round']} | {report['completed']} / {report['aborted']} / "
                     f"{report['failed']} | {report['tokens_per_s']} | {report['rss_start_mib']} | "
                     f"{report['rss_growth_mib']} | {by_process} | {report['rss_growth_kib_per_token']} | "
                     f"{report['index_mib'] if report['index_mib'] is not None else '-'} | {report['passed']} |")
    over_plain = {} if "plain" not in growth else {
        name: round(statistics.median(values) - statistics.median(growth["plain"]), 1)
        for name, values in growth.items() if name != "plain"}
    lines += ["", *(f"`{name}`: median growth {value:+.1f} MiB over plain vLLM's"
                    for name, value in over_plain.items())]
    return "\n".join(lines), over_plain


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="model path (default: the bundled SmolLM2 build)")
    parser.add_argument("--speculative-config", action="append",
                        help="JSON passed to vllm serve --speculative-config, or 'none' for plain vLLM; give it "
                             "more than once to soak each in turn (default: {\"method\": \"fafo\"})")
    parser.add_argument("--rounds", type=int, default=1, help="times every config is soaked, in turn")
    parser.add_argument("--concurrency", type=int, default=16, help="requests kept in flight")
    parser.add_argument("--seconds", type=float, default=60.0, help="how long new requests are sent")
    parser.add_argument("--max-requests", type=int, default=100_000, help="stop sending after this many")
    parser.add_argument("--abort-fraction", type=float, default=0.2, help="share of requests closed mid-stream")
    parser.add_argument("--min-tokens", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--kv-cache-mib", type=int, default=256)
    parser.add_argument("--rss-interval", type=float, default=2.0, help="seconds between memory samples")
    parser.add_argument("--settle-seconds", type=float, default=5.0)
    parser.add_argument("--max-rss-growth-kib-per-token", type=float, default=96.0,
                        help="fail when the server's memory grew by more than this per streamed token "
                             "(plain vLLM 0.32 on CPU grew about 18 KiB per token in a 60 s soak)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the load's own choices")
    parser.add_argument("--seeded-sampling", action="store_true",
                        help="give sampled requests a per-request seed; vLLM 0.32.0 on CPU then stops the "
                             "engine once a seeded request's prefill is chunked (RuntimeError 'CPU Generator "
                             "does not use offset' in GPUModelRunner._bookkeeping_sync, plain vLLM too)")
    parser.add_argument("--out", default="benchmarks/results/soak")
    args = parser.parse_args()
    for name in ("concurrency", "max_requests", "min_tokens", "max_tokens", "rounds"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    if args.min_tokens > args.max_tokens:
        parser.error(f"--min-tokens {args.min_tokens} exceeds --max-tokens {args.max_tokens}")
    if not 0.0 <= args.abort_fraction <= 1.0:
        parser.error(f"--abort-fraction must be in [0, 1], got {args.abort_fraction}")
    specs = []
    for text in args.speculative_config or ['{"method": "fafo"}']:
        try:
            specs.append(None if text == "none" else json.loads(text))
        except json.JSONDecodeError as error:
            parser.error(f"--speculative-config {text!r} is neither 'none' nor JSON: {error}")
    out = Path(args.out)
    reports, run_dirs = [], []
    for round_index in range(args.rounds):
        for i, spec in enumerate(specs):
            run_dirs.append(out / f"round{round_index}-config{i}")
            report = {"round": round_index, **soak(args, spec, run_dirs[-1])}
            reports.append(report)
            print(json.dumps({k: v for k, v in report.items() if k != "rss_over_time"}, indent=1), flush=True)
    table, over_plain = compare(reports)
    (out / "summary.json").write_text(json.dumps(
        {"runs": [str(path) for path in run_dirs], "growth_over_plain_mib": over_plain}, indent=1))
    (out / "summary.md").write_text(table + "\n")
    print(table)
    sys.exit(0 if all(report["passed"] for report in reports) else 1)


if __name__ == "__main__":
    main()
