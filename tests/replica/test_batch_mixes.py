"""Any mix of requests in one batch: nothing raises, and every fp32 greedy (or seeded)
request's output equals the same request run alone.

Hypothesis draws batches over every per-request feature the engine samples with:
structured outputs of each kind, ``logit_bias``, ``allowed_token_ids``, ``bad_words``,
logprobs, ``prompt_logprobs``, stop strings, penalties, ``min_tokens``, seeded sampling,
several choices of one prompt (``n`` > 1 runs one engine request per choice, as the
serving layer does), a LoRA adapter, and engines that chunk prefills and preempt. Unseeded
sampled rows ride along as noise: they must not raise either. The example budget is fixed
(derandomized), so ``make test`` runs the same examples every time.

A fault of one request ends that request alone: a row whose sampling raises is ended with
"abort" and the error, the rest of its batch finishes as if it ran alone, and the engine
serves on.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvroute.benchmarks.lora_adapters import save_random_adapter
from kvroute.replica.checkpoint import load_hf_config
from kvroute.replica.llm import LLM
from kvroute.replica.models.arch import ModelArch
from kvroute.replica.sampling_params import SamplingParams
from kvroute.replica.structured_output import StructuredOutput
from tests.replica.helpers import TEXTS, assert_no_leak

BS = 8
SCHEMA = {
    "type": "object",
    "properties": {"tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 2}, "n": {"type": "integer", "minimum": 0, "maximum": 9}},
    "required": ["tags", "n"],
}
STRUCTURED = [
    StructuredOutput("json", SCHEMA),
    StructuredOutput("json_object"),
    StructuredOutput("regex", r"[a-c]{2,6}( [0-9]+)?"),
    StructuredOutput("choice", ["yes", "no", "maybe"]),
    StructuredOutput("grammar", 'root ::= "x" [0-9]+ | "y"'),
]
LONG = " ".join(TEXTS)  # several chunks of a 32-token prefill


@pytest.fixture(scope="module")
def engines(tiny_llama_path, tmp_path_factory):
    """(name -> LLM) for the mixed batches, and one roomy engine that runs each request alone."""
    arch = ModelArch.from_hf_config(load_hf_config(tiny_llama_path))
    adapter = save_random_adapter(tmp_path_factory.mktemp("mix-lora") / "a", arch, rank=4, alpha=8, seed=5)
    common = dict(block_size=BS, dtype="float32", device="cpu", max_model_len=256, enable_lora=True, max_loras=2,
                  lora_modules={"a": str(adapter)})  # fmt: skip
    made = {
        "roomy": LLM(str(tiny_llama_path), num_kv_blocks=512, **common),
        # 32-token chunks and 40 blocks: long prompts are chunked, crowded batches preempt
        "tight": LLM(str(tiny_llama_path), num_kv_blocks=40, max_num_batched_tokens=32, **common),
    }
    return made, LLM(str(tiny_llama_path), num_kv_blocks=512, **common)


@st.composite
def requests(draw):
    """One request: (prompt, params, lora name, whether its output is reproducible)."""
    prompt = draw(st.sampled_from(TEXTS + [LONG]))
    sampled = draw(st.sampled_from(["greedy", "greedy", "seeded", "unseeded"]))
    kw: dict = dict(max_tokens=draw(st.integers(1, 10)), temperature=0.0 if sampled == "greedy" else 0.9)
    if sampled == "seeded":
        kw["seed"] = draw(st.integers(0, 2**31))
    structured = draw(st.none() | st.sampled_from(STRUCTURED))
    if structured is not None:
        kw["structured_output"] = structured
    elif draw(st.booleans()):
        kw["allowed_token_ids"] = tuple(draw(st.lists(st.integers(0, 2000), min_size=1, max_size=40, unique=True)))
    if draw(st.booleans()):
        kw["logit_bias"] = draw(st.dictionaries(st.integers(0, 2000), st.floats(-50, 50), max_size=4))
    if draw(st.booleans()):
        kw["bad_words"] = tuple(draw(st.lists(st.sampled_from(["the", " the", "a", "ing", "x"]), max_size=2)))
    if draw(st.booleans()):
        kw["stop"] = tuple(draw(st.lists(st.sampled_from(["e", " t", ".", "\n"]), max_size=2)))
    kw["logprobs"] = draw(st.none() | st.integers(0, 3))
    kw["prompt_logprobs"] = draw(st.none() | st.integers(0, 2))
    kw["min_tokens"] = draw(st.integers(0, kw["max_tokens"]))
    if draw(st.booleans()):
        kw.update(repetition_penalty=draw(st.floats(0.5, 2.0)), frequency_penalty=draw(st.floats(-1, 1)),
                  presence_penalty=draw(st.floats(-1, 1)))  # fmt: skip
    copies = draw(st.integers(1, 2))  # n > 1: one engine request per choice
    return [(prompt, SamplingParams(**kw), draw(st.sampled_from([None, "a"])), sampled != "unseeded")] * copies


def _same_logprobs(a, b) -> bool:
    if a is None or b is None:
        return a is b
    return len(a) == len(b) and all(
        x is None and y is None or (x.token_id == y.token_id and math.isclose(x.logprob, y.logprob, abs_tol=1e-3)) for x, y in zip(a, b)
    )


@settings(max_examples=30, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(batch=st.lists(requests(), min_size=1, max_size=4).map(lambda groups: [r for g in groups for r in g]),
       engine=st.sampled_from(["roomy", "tight"]))  # fmt: skip
def test_any_batch_mix_equals_each_request_alone(engines, batch, engine):
    made, alone = engines
    llm = made[engine]
    outs = llm.generate([p for p, *_ in batch], [s for _, s, *_ in batch], use_tqdm=False, lora_name=[lo for _, _, lo, _ in batch])
    for (prompt, params, lora, reproducible), out in zip(batch, outs):
        # "abort" only where the request's own fields conflict (min_tokens bans the EOS that
        # is all its grammar allows): never an engine fault, and then alone too
        assert out.finish_reason in ("stop", "length", "abort"), (params, out)
        assert "internal error" not in str(out.stop_reason), (params, out)
        if not reproducible:
            continue
        ref = alone.generate([prompt], [params], use_tqdm=False, lora_name=lora)[0]
        assert (out.token_ids, out.finish_reason, out.stop_reason) == (ref.token_ids, ref.finish_reason, ref.stop_reason), params
        assert out.text == ref.text
        assert _same_logprobs(out.logprobs, ref.logprobs)
        assert _same_logprobs(out.prompt_logprobs, ref.prompt_logprobs)
    assert_no_leak(llm)


def test_a_failing_row_ends_alone_and_the_engine_serves_on(engines):
    made, alone = engines
    llm = made["roomy"]
    params = [SamplingParams(max_tokens=6, temperature=0.0), SamplingParams(max_tokens=6, temperature=0.0, structured_output=STRUCTURED[3])]
    engine = llm.engine
    good = [engine.make_request(f"fault-{i}", llm.tokenizer.encode(TEXTS[i]), p) for i, p in enumerate(params)]
    bad = engine.make_request("fault-bad", llm.tokenizer.encode(TEXTS[2]), SamplingParams(max_tokens=6, temperature=0.0, bad_words=["x"]))
    # past validation: a banned token beyond the vocabulary, so filling this row's mask
    # raises (the whole step's mask with it)
    bad.constraints.bad_words = ((10**9,),)
    for r in [*good, bad]:
        engine.add(r)
    finished = {}
    while engine.has_unfinished():
        for d in engine.step().deltas:
            finished.setdefault(d.request_id, []).append(d)
    last = {rid: ds[-1] for rid, ds in finished.items()}
    assert last["fault-bad"].finish_reason == "abort" and "internal error" in str(last["fault-bad"].stop_reason)
    for i, p in enumerate(params):
        ref = alone.generate([TEXTS[i]], [p], use_tqdm=False)[0]
        assert [t for d in finished[f"fault-{i}"] for t in d.token_ids] == ref.token_ids
    assert_no_leak(llm)
    after = llm.generate([TEXTS[0]], [dataclasses.replace(params[0])], use_tqdm=False)[0]
    assert after.finish_reason == "length" and len(after.token_ids) == 6
