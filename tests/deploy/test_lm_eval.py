"""lm-evaluation-harness as a client: ``lm_eval --model local-completions`` against the
single-engine server, on tasks the test writes (a JSONL each, no hub download). Its
loglikelihoods (``echo`` + ``logprobs`` + ``max_tokens: 1``, the harness's own request)
equal the prompt logprobs the offline engine computes for the same tokens, and its
greedy generations equal the offline engine's."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvroute.deploy.replica_server import build_replica_server
from kvroute.deploy.openai.serving import ServerLimits
from kvroute.replica.config import EngineConfig
from kvroute.replica.llm import LLM
from kvroute.replica.sampling_params import SamplingParams
from tests.deploy.server import running

MODEL = "tiny-llama"
QUESTIONS = [
    ("The capital of France is", [" Paris", " Berlin", " a city by the sea"], 0),
    ("Two plus two equals", [" four", " five"], 0),
    ("def add(a, b):\n    return", [" a + b", " a - b", " None"], 0),
]
PROMPTS = ["The quick brown fox", "Once upon a time", "1, 2, 3,"]


def _write_tasks(folder: Path) -> None:
    mc = folder / "mc.jsonl"
    mc.write_text("".join(json.dumps({"question": q, "choices": c, "answer": a}) + "\n" for q, c, a in QUESTIONS))
    gen = folder / "gen.jsonl"
    gen.write_text("".join(json.dumps({"question": p, "answer": "x"}) + "\n" for p in PROMPTS))
    (folder / "kvroute_mc.yaml").write_text(
        f"task: kvroute_mc\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {mc}\n"
        "test_split: test\noutput_type: multiple_choice\ndoc_to_text: '{{question}}'\n"
        "doc_to_choice: '{{choices}}'\ndoc_to_target: '{{answer}}'\nmetric_list:\n  - metric: acc\n"
    )
    (folder / "kvroute_gen.yaml").write_text(
        f"task: kvroute_gen\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {gen}\n"
        "test_split: test\noutput_type: generate_until\ndoc_to_text: '{{question}}'\ndoc_to_target: '{{answer}}'\n"
        "generation_kwargs:\n  until: ['\\n']\n  max_gen_toks: 8\n  do_sample: false\n"
        "metric_list:\n  - metric: exact_match\n"
    )


def _samples(out: Path, task: str) -> list[dict]:
    files = sorted(out.rglob(f"samples_{task}_*.jsonl"))
    assert files, f"lm_eval wrote no samples for {task}: {list(out.rglob('*'))}"
    return [json.loads(line) for line in files[-1].read_text().splitlines()]


@pytest.fixture(scope="module")
def harness_run(tiny_llama_path, tmp_path_factory):
    folder = tmp_path_factory.mktemp("lm-eval")
    _write_tasks(folder)
    config = EngineConfig(model=str(tiny_llama_path), dtype="float32", block_size=16, num_kv_blocks=256)
    app, _engine = build_replica_server(config, ServerLimits(), MODEL)
    with running(app) as url:
        args = [
            sys.executable, "-m", "lm_eval", "--model", "local-completions",
            "--model_args", f"model={MODEL},base_url={url}/v1/completions,tokenizer_backend=huggingface,"
            f"tokenizer={tiny_llama_path},num_concurrent=1,max_retries=1,tokenized_requests=True",
            "--tasks", "kvroute_mc,kvroute_gen", "--include_path", str(folder),
            "--log_samples", "--output_path", str(folder / "out"),
        ]  # fmt: skip
        env = os.environ | {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
        proc = subprocess.run(args, capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return folder / "out"


@pytest.fixture(scope="module")
def offline(tiny_llama_path):
    return LLM(str(tiny_llama_path), dtype="float32", block_size=16, num_kv_blocks=256)


def _pair(tok, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """The harness's split of a context and its continuation into tokens."""
    spaces = len(context) - len(context.rstrip())
    if spaces:
        continuation, context = context[-spaces:] + continuation, context[:-spaces]
    whole = tok(context + continuation, add_special_tokens=False).input_ids
    ctx = tok(context, add_special_tokens=False).input_ids
    return ctx, whole[len(ctx) :]


def test_loglikelihoods_equal_the_engines_prompt_logprobs(harness_run, offline):
    samples = _samples(harness_run, "kvroute_mc")
    assert len(samples) == len(QUESTIONS)
    for s in samples:
        pairs = [(a["arg_0"], a["arg_1"]) for a in s["arguments"].values()]
        for (context, choice), resp in zip(pairs, s["resps"]):
            ctx, cont = _pair(offline.tokenizer, context, choice)
            out = offline.generate([ctx + cont], SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=1),
                                   use_tqdm=False)[0]  # fmt: skip
            want = sum(lp.logprob for lp in out.prompt_logprobs[len(ctx) :])
            got = float(resp[0][0])
            assert math.isclose(got, want, abs_tol=1e-3), (context, choice, got, want)


def test_generations_equal_the_offline_engine(harness_run, offline):
    samples = _samples(harness_run, "kvroute_gen")
    assert len(samples) == len(PROMPTS)
    for s in samples:
        prompt = s["doc"]["question"]
        ids = offline.tokenizer(prompt, add_special_tokens=False).input_ids
        want = offline.generate([ids], SamplingParams(max_tokens=8, temperature=0.0, stop=["\n"], seed=1234),
                                use_tqdm=False)[0].text  # fmt: skip
        got = s["resps"][0][0]
        assert got == want, (prompt, got, want)
