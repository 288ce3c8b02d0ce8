"""A grammar that starts late (``SamplingParams.structured_output_after``, a reasoning
model's ``</think>``): on the tiny Qwen3, the tokens up to the marker are sampled free,
the rest match the grammar, and a resumed request replays only what follows the marker."""

from __future__ import annotations

import json

import jsonschema
import pytest

from kvroute.replica.llm import LLM
from kvroute.replica.sampling_params import SamplingParams
from kvroute.replica.structured_output import StructuredOutput

SCHEMA = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9},
                                           "ok": {"type": "boolean"}},
          "required": ["n", "ok"], "additionalProperties": False}  # fmt: skip
PROMPT = "Think, then answer in JSON."


@pytest.fixture(scope="module")
def llm(tiny_qwen3_path):
    return LLM(str(tiny_qwen3_path), block_size=16, num_kv_blocks=128, dtype="float32", device="cpu")


def _params(**kw) -> SamplingParams:
    kw.setdefault("max_tokens", 60)
    return SamplingParams(temperature=0.0, structured_output=StructuredOutput("json", SCHEMA), **kw)


def _valid(text: str) -> dict:
    value = json.loads(text)
    jsonschema.validate(value, SCHEMA)
    return value


def _run(engine, rid, ids, params, resume=()) -> tuple[list[int], str, object]:
    engine.add_request(rid, ids, params, resume_output=list(resume))
    tokens, text, last = [], "", None
    while engine.has_unfinished():
        for d in engine.step().deltas:
            tokens += d.token_ids
            text += d.text
            last = d
    return tokens, text, last


def test_the_grammar_starts_after_the_marker(llm):
    marker = llm.tokenizer.encode(" banana", add_special_tokens=False)
    assert len(marker) == 1  # one token: the bias below makes it the first one sampled
    bias = {marker[0]: 100.0}
    late = llm.generate(PROMPT, _params(structured_output_after=tuple(marker), logit_bias=bias), use_tqdm=False)[0]
    assert late.token_ids[0] == marker[0]  # free before the marker: the bias wins
    assert late.finish_reason == "stop"
    _valid(llm.tokenizer.decode(late.token_ids[1:], skip_special_tokens=True))  # the grammar from the token after it
    # from the first token, the grammar masks the marker (no JSON starts with " banana")
    now = llm.generate(PROMPT, _params(logit_bias=bias), use_tqdm=False)[0]
    assert marker[0] not in now.token_ids
    _valid(now.text)


def test_a_resumed_request_replays_after_a_multi_token_marker(llm):
    engine = llm.engine
    tok = llm.tokenizer
    marker = tuple(tok.encode("</think>", add_special_tokens=False))
    assert len(marker) > 1  # SmolLM2's tokenizer spells it in pieces: the sequence is matched whole
    ids = tok.encode(PROMPT)
    reasoning = tok.encode("I think it is", add_special_tokens=False)
    tail, text, last = _run(engine, "after", ids, _params(structured_output_after=marker), reasoning + list(marker))
    assert last.finish_reason == "stop"
    _valid(text)  # the replayed reasoning did not go through the grammar; what follows matches it
    # the marker cut short: the grammar has not started, so free text is no mismatch
    _, _, last = _run(engine, "partial", ids, _params(structured_output_after=marker, max_tokens=len(reasoning) + 4),
                      reasoning + list(marker[:-1]))  # fmt: skip
    assert last.finish_reason == "length"
    # the same tokens with the grammar on from the start are refused on replay
    _, _, last = _run(engine, "strict", ids, _params(), reasoning)
    assert last.finish_reason == "abort" and "does not match" in last.stop_reason


def test_the_marker_ids_are_checked(llm):
    with pytest.raises(ValueError, match="structured_output_after"):
        SamplingParams(structured_output_after=(-1,))
    with pytest.raises(ValueError, match="structured_output_after token ids must be in"):
        llm.engine.make_request("big", [1, 2], _params(structured_output_after=(10**7,)))


def test_the_cpu_mask_writes_nothing_past_a_vocabulary_that_ends_inside_a_word():
    """A tokenizer with added tokens (49154 ids here) ends inside a 32-bit mask word, and
    a row whose grammar has not started allows every id: xgrammar's CPU kernel wrote
    -inf one past the last id, corrupting the heap, until the rows were padded."""
    import torch

    from kvroute.replica.logits_constraints import StepMask, _bits

    vocab = 49154
    base = torch.zeros(1, vocab + 32)  # the logits, then a guard the kernel must not touch
    logits = base[:, :vocab]
    row = _bits(range(vocab), vocab).unsqueeze(0)  # the last word allows ids 49152 and 49153 only
    empty = torch.zeros(0, dtype=torch.long)
    mask = StepMask(row, torch.tensor([0]), empty, empty, torch.zeros(0))
    out = mask.apply(logits, inplace=True)
    assert out.data_ptr() == logits.data_ptr() and torch.isfinite(out).all()
    assert (base[:, vocab:] == 0).all()
    row[0, 0] = 0  # ids 0..31 masked: -inf there, and still nothing past the end
    out = mask.apply(logits, inplace=True)
    assert torch.isinf(out[0, :32]).all() and torch.isfinite(out[0, 32:]).all() and (base[:, vocab:] == 0).all()
