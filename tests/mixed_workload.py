"""The mixed workload that serves every check of an engine configuration.

Greedy requests of different prompt and output lengths run together (the longest
one runs alone at the end: batch 1), next to a request that ends on EOS, one that
ends on a stop string and one whose prompt nearly fills ``max_model_len``, in one
``generate`` call; seeded sampled requests of a prompt whose next words drafts often
get wrong follow in a second call (:func:`run_mixed` says why). Plain vLLM runs the
workload once per session (the reference); every configuration's engine runs it
once, and each test of the configuration reads the result.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from vllm_fafo.tools.assets import chat_prompt

from .engine_utils import ENGINE_MAX_MODEL_LEN

GREEDY_LENGTHS = (128, 24, 32, 40, 48, 56, 64, 72)
"""Tokens each of the first MT-Bench questions decodes; the first runs alone last."""
NEAR_MAX_MODEL_LEN_TOKENS = 20
"""What the last greedy request's prompt leaves of ``max_model_len``."""
SAMPLED_PATTERN = "The cat sat on the mat. The dog sat on the"
"""An in-context pattern the pool and the lanes propose from, and a next word the model is
unsure of: drafts are proposed and often rejected."""
SAMPLED_PROMPT_TOKENS = 129
"""The sampled prompt: MT-Bench text, then the pattern, one token past vLLM's 128-token CPU
block, so that every sampled request after the first few prefills one token (the
rest is a prefix-cache hit): a sample costs its few decoded tokens, not its prompt."""
SAMPLED_TOKENS = 4
SAMPLED_POSITIONS = (1, 2, 3)
"""Positions the distribution test compares: the first token is sampled from the
prefill's logits, before any draft."""


@dataclasses.dataclass(frozen=True)
class Workload:
    prompts: list[Any]
    params: list[Any]
    labels: list[str]
    """``greedy-<i>``, ``eos``, ``stop``, ``near-max-len``, ``primer`` or ``sample-<i>``."""

    def keep(self, wanted: Callable[[str], bool]) -> Workload:
        """The requests whose label is ``wanted``, in order."""
        rows = [i for i, label in enumerate(self.labels) if wanted(label)]
        return Workload(*([getattr(self, f)[i] for i in rows] for f in ("prompts", "params", "labels")))

    def split(self) -> tuple[Workload, Workload]:
        """(everything but the sampled requests, the sampled requests)."""
        return self.keep(lambda label: not is_sample(label)), self.keep(is_sample)


def is_sample(label: str) -> bool:
    return label.startswith("sample-")


def session_workload(tokenizer, seed0: int, num_samples: int) -> Workload:
    """:func:`mixed_workload` on the suite's prompts (the first 20 MT-Bench questions in
    the chat template, 3 as filler text, 40 HumanEval problems)."""
    from vllm_fafo.tools.assets import load_prompts

    mtbench = [chat_prompt(tokenizer, text) for text in load_prompts("mtbench", 20)]
    return mixed_workload(tokenizer, mtbench, load_prompts("mtbench", 3), load_prompts("humaneval", 40), seed0,
                          num_samples)


def mixed_workload(tokenizer, mtbench: list[str], mtbench_texts: list[str], humaneval: list[str], seed0: int,
                   num_samples: int) -> Workload:
    """The mixed call on ``mtbench`` (chat prompts) and ``humaneval`` (code); ``seed0``
    seeds the ``num_samples`` sampled requests (each engine its own seeds)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    greedy = lambda n, **kw: SamplingParams(temperature=0.0, max_tokens=n, **kw)
    prompts, params, labels = [], [], []

    def add(label, prompt, param):
        labels.append(label), prompts.append(prompt), params.append(param)

    for i, length in enumerate(GREEDY_LENGTHS):
        add(f"greedy-{i}", mtbench[i], greedy(length))
    add("eos", chat_prompt(tokenizer, "Reply with the single word: yes."), greedy(200))
    add("stop", mtbench[1], greedy(200, stop=["\n\n"]))
    code_ids = tokenizer("\n".join(humaneval))["input_ids"][: ENGINE_MAX_MODEL_LEN - NEAR_MAX_MODEL_LEN_TOKENS]
    add("near-max-len", TokensPrompt(prompt_token_ids=code_ids), greedy(100))
    pattern = tokenizer(SAMPLED_PATTERN)["input_ids"]
    filler = tokenizer(" ".join(mtbench_texts))["input_ids"][: SAMPLED_PROMPT_TOKENS - len(pattern)]
    sampled_prompt = TokensPrompt(prompt_token_ids=filler + pattern)
    add("primer", sampled_prompt, greedy(SAMPLED_TOKENS))
    for i in range(num_samples):
        add(f"sample-{i}", sampled_prompt,
            SamplingParams(temperature=0.9, max_tokens=SAMPLED_TOKENS, seed=seed0 + i, detokenize=False))
    return Workload(prompts, params, labels)


@dataclasses.dataclass
class MixedRun:
    """What one engine made of the mixed call, and its counters around it."""

    outputs: dict[str, Any]
    """label -> the request's ``CompletionOutput``."""
    metrics_before: dict | None
    metrics_after: dict | None

    def tokens(self, label: str) -> list[int]:
        return list(self.outputs[label].token_ids)

    @property
    def greedy_labels(self) -> list[str]:
        return [label for label in self.outputs if not is_sample(label)]

    @property
    def samples(self) -> list[list[int]]:
        return [list(o.token_ids) for label, o in self.outputs.items() if is_sample(label)]

    def grew(self, *keys: str) -> Any:
        """A FAFO counter's growth over the call (nested keys: ``grew("accepted_tokens", "lane")``)."""
        before, after = self.metrics_before, self.metrics_after
        for key in keys:
            before, after = before[key], after[key]
        return after - before


def run_mixed(llm, workload: Workload, fafo: bool = True) -> MixedRun:
    """The workload's requests in one ``generate`` call, but for the sampled ones, which
    follow in a second call once the first has put their prompt in the prefix cache
    (``primer``): each then prefills one token. vLLM 0.32.0 on CPU fails a seeded request
    whose prefill is split over two steps (``_bookkeeping_sync`` rewinds its generator
    with ``set_offset``: "CPU Generator does not use offset"), which the tests' 256-token
    steps would otherwise do to some."""
    from vllm_fafo.serving.metrics import collect_metrics

    before = collect_metrics(llm) if fafo else None
    outputs, labels = [], []
    for part in workload.split():
        if part.prompts:
            outputs += llm.generate(part.prompts, part.params, use_tqdm=False)
            labels += part.labels
    after = collect_metrics(llm) if fafo else None
    return MixedRun({label: out.outputs[0] for label, out in zip(labels, outputs)}, before, after)

