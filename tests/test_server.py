"""`vllm serve` with the FAFO config answers what plain vLLM answers.

The server runs as a real `vllm serve` process on 127.0.0.1 (engine in its own
process, as users run it; the plugin found through its entry point); the reference
is the session's in-process plain engine, under the same row-invariant settings.
"""

from __future__ import annotations

import json
import subprocess
import time

import pytest
import requests
from prometheus_client.parser import text_string_to_metric_families

from benchmarks.soak import VllmServer, vllm_command

from .engine_utils import greedy

pytestmark = pytest.mark.engine

MAX_TOKENS = 48
PROMPT = "The three primary colors are"
CHAT = [{"role": "user", "content": "Name three uses of a paperclip."}]


class Server(VllmServer):
    """benchmarks/soak.py's `vllm serve` launcher, with request helpers."""

    def __init__(self, model_dir: str, extra_args: list[str], log_path: str):
        super().__init__(model_dir, extra_args, log_path, served_name="smollm2")

    def post(self, path: str, body: dict) -> dict:
        response = requests.post(self.url + path, json=body, timeout=300)
        response.raise_for_status()
        return response.json()

    def stream(self, path: str, body: dict) -> str:
        """Concatenated text of a server-sent-event stream."""
        parts = []
        with requests.post(self.url + path, json={**body, "stream": True},
                           stream=True, timeout=300) as response:
            response.raise_for_status()
            for line in response.iter_lines():
                if not line.startswith(b"data: ") or line == b"data: [DONE]":
                    continue
                choice = json.loads(line[6:])["choices"][0]
                parts.append(choice.get("text") or choice.get("delta", {}).get("content") or "")
        return "".join(parts)


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    fafo = Server(model_dir, ["--speculative-config", json.dumps({"method": "fafo"})],
                  str(tmp_path_factory.mktemp("server") / "fafo.log"))
    try:
        fafo.wait_ready()
        yield fafo
    finally:
        fafo.stop()


def _completion_body() -> dict:
    return {"model": "smollm2", "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0}


def _chat_body() -> dict:
    return {"model": "smollm2", "messages": CHAT, "max_tokens": MAX_TOKENS, "temperature": 0}


def test_completions_same_text(server, plain_llm):
    want = plain_llm.generate([PROMPT], greedy(MAX_TOKENS), use_tqdm=False)[0].outputs[0].text
    have = server.post("/v1/completions", _completion_body())["choices"][0]["text"]
    assert have == want and want
    assert server.stream("/v1/completions", _completion_body()) == want


def test_chat_completions_same_text(server, plain_llm):
    want = plain_llm.chat(CHAT, greedy(MAX_TOKENS), use_tqdm=False)[0].outputs[0].text
    have = server.post("/v1/chat/completions", _chat_body())["choices"][0]["message"]["content"]
    assert have == want and want
    assert server.stream("/v1/chat/completions", _chat_body()) == want


def test_fafo_server_speculates(server):
    metrics = requests.get(server.url + "/metrics", timeout=30).text
    accepted = [
        float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
        if line.startswith("vllm:spec_decode_num_accepted_tokens_total")
    ]
    assert accepted and sum(accepted) > 0


def _samples(server: Server) -> dict[tuple[str, frozenset], float]:
    """The server's /metrics, as (sample name, labels) -> value."""
    text = requests.get(server.url + "/metrics", timeout=30).text
    return {
        (sample.name, frozenset(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(text) for sample in family.samples
    }


def _total(samples: dict, name: str) -> float:
    return sum(value for (sample, _), value in samples.items() if sample == name)


def test_fafo_counters_on_metrics_next_to_vllms(server):
    """FAFO's counters reach the front process's /metrics with vLLM's labels, and its
    accepted tokens by origin add up to vLLM's own accepted-token counter."""
    fafo = server
    fafo.post("/v1/completions", _completion_body())
    deadline = time.time() + 30
    while True:  # the worker publishes about once a second and when it goes idle
        samples = _samples(fafo)
        accepted = _total(samples, "vllm:fafo_accepted_tokens_total")
        if accepted == _total(samples, "vllm:spec_decode_num_accepted_tokens_total") or time.time() > deadline:
            break
        time.sleep(0.5)
    assert accepted == _total(samples, "vllm:spec_decode_num_accepted_tokens_total") > 0
    labels = frozenset({"model_name": "smollm2", "engine": "0"}.items())
    assert samples[("vllm:fafo_propose_calls_total", labels)] > 0
    assert 0 < samples[("vllm:fafo_pool_hits_total", labels)] <= samples[("vllm:fafo_lookups_total", labels)]
    assert samples[("vllm:fafo_requests_tracked", labels)] == 0  # idle again


def test_bad_config_fails_fast_with_its_message(model_dir, tmp_path):
    bad = json.dumps({"method": "fafo", "max_key_len": 0})
    start = time.time()
    result = subprocess.run(
        vllm_command() + ["serve", model_dir, "--speculative-config", bad],
        capture_output=True, text=True, timeout=300,
    )
    assert result.returncode != 0
    assert "speculative_config['max_key_len']=0 is out of range" in result.stdout + result.stderr
    assert time.time() - start < 120
