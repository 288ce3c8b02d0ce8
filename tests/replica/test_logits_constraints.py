"""logit_bias, allowed_token_ids and bad_words: the same per-step mask as structured outputs."""

from __future__ import annotations

import pytest
import torch

from kvroute.replica.config import EngineConfig
from kvroute.replica.engine import Engine
from kvroute.replica.llm import LLM
from kvroute.replica.logits_constraints import RequestConstraints, _bits, bad_words_token_ids, step_mask
from kvroute.replica.sampler import Sampler
from kvroute.replica.sampling_params import SampleRequest, SamplingParams
from kvroute.replica.structured_output import StructuredOutput

PROMPT = list(range(300, 340))


@pytest.fixture(scope="module")
def llm(tiny_llama_path):
    return LLM(str(tiny_llama_path), block_size=16, num_kv_blocks=64, dtype="float32", device="cpu")


def _greedy(llm, n=8, **kw):
    return llm.generate(PROMPT, SamplingParams(max_tokens=n, min_tokens=n, temperature=0.0, **kw), use_tqdm=False)[0].token_ids


def test_logit_bias_pushes_and_bans(llm):
    plain = _greedy(llm)
    assert set(_greedy(llm, logit_bias={"777": 100})) == {777}  # JSON keys are strings
    banned = _greedy(llm, logit_bias={plain[0]: -100})
    assert banned[0] != plain[0]


def test_allowed_token_ids_only(llm):
    allowed = [11, 4021, 31000]
    out = _greedy(llm, n=12, allowed_token_ids=allowed)
    assert set(out) <= set(allowed)
    sampled = llm.generate(PROMPT, SamplingParams(max_tokens=12, min_tokens=12, seed=5, allowed_token_ids=allowed), use_tqdm=False)
    assert set(sampled[0].token_ids) <= set(allowed)


def test_bad_words_block_the_greedy_word(llm):
    tok = llm.tokenizer
    plain = _greedy(llm, n=16)
    # a word of the greedy output that is one token with and without its leading space
    word = next(w for w in (tok.decode([t]).strip() for t in plain)
                if w and len(tok.encode(w, add_special_tokens=False)) == len(tok.encode(" " + w, add_special_tokens=False)) == 1)  # fmt: skip
    banned = {tok.encode(w, add_special_tokens=False)[0] for w in (word, " " + word)}
    assert banned & set(plain)
    out = _greedy(llm, n=16, bad_words=[word])
    assert not banned & set(out)


def test_bad_words_block_only_after_their_prefix():
    params = SamplingParams(bad_words=["x"])
    c = RequestConstraints(params, None, None, [(5, 6, 7), (9,)])
    vocab_row = _bits(range(64), 64)
    allowed = lambda out: step_mask([(c, out)], vocab_row).bitmask  # noqa: E731
    from kvroute.kernels.token_bitmask import unpack_bitmask

    after = unpack_bitmask(allowed([1, 5, 6]), 64)[0]
    assert not after[7] and not after[9] and after[6]
    elsewhere = unpack_bitmask(allowed([5, 1]), 64)[0]
    assert elsewhere[7] and not elsewhere[9]


def test_bad_words_tokenized_with_and_without_leading_space(smollm2_tokenizer):
    seqs = bad_words_token_ids(smollm2_tokenizer, ["hello"])
    assert tuple(smollm2_tokenizer.encode("hello", add_special_tokens=False)) in seqs
    assert tuple(smollm2_tokenizer.encode(" hello", add_special_tokens=False)) in seqs
    assert len(seqs) == 2


def test_padded_vocab_ids_are_never_allowed():
    # a model whose logits are wider (70) than its tokenizer's vocabulary (10)
    c = RequestConstraints(SamplingParams(bad_words=["x"]), None, None, [(3,)])
    mask = step_mask([(c, [])], _bits(range(10), 70))
    logits = torch.zeros(1, 70)
    out = mask.apply(logits)
    assert out[0, :10].isfinite().sum() == 9 and out[0, 10:].isinf().all()


def test_mask_and_logprobs_stay_raw():
    logits = torch.randn(2, 40, generator=torch.Generator().manual_seed(0))
    c = RequestConstraints(SamplingParams(allowed_token_ids=[3, 17]), None, _bits([3, 17], 40), [])
    rows = [SampleRequest(SamplingParams(temperature=0.0, logprobs=1, allowed_token_ids=[3, 17]), [1], []),
            SampleRequest(SamplingParams(temperature=0.0), [1], [])]  # fmt: skip
    mask = step_mask([(c, []), (None, [])], _bits(range(40), 40))
    out = Sampler()(logits, rows, mask)
    want = 3 if logits[0, 3] >= logits[0, 17] else 17
    assert out.token_ids == [want, int(logits[1].argmax())]
    assert out.logprobs[0].logprob == pytest.approx(torch.log_softmax(logits[0], 0)[want].item())


@pytest.mark.parametrize("kw,msg", [
    (dict(logit_bias={49152: 1.0}), "logit_bias token ids must be in [0, 49152)"),
    (dict(allowed_token_ids=[1, 60000]), "allowed_token_ids token ids must be in [0, 49152)"),
])  # fmt: skip
def test_out_of_vocab_ids_refused(llm, kw, msg):
    with pytest.raises(ValueError, match=msg.replace("[", r"\[").replace(")", r"\)")):
        llm.engine.make_request("bad", PROMPT, SamplingParams(**kw))


@pytest.mark.parametrize("kw,msg", [
    (dict(logit_bias={1: 100.5}), r"logit_bias\[1\] must be in \[-100, 100\]"),
    (dict(logit_bias={-1: 1}), "logit_bias token ids must be integers >= 0"),
    (dict(allowed_token_ids=[]), "allowed_token_ids must not be empty"),
    (dict(bad_words=[" "]), "bad_words must be non-blank"),
    (dict(structured_output={"type": "object"}), "structured_output must be a StructuredOutput"),
    (dict(top_k=-2), "top_k must be"),
])  # fmt: skip
def test_sampling_params_validation(kw, msg):
    with pytest.raises(ValueError, match=msg):
        SamplingParams(**kw)
    assert SamplingParams(top_k=0).top_k == -1  # 0 means off, as -1


def test_emulated_engine_refuses_constraints(tiny_llama_path):
    engine = Engine(EngineConfig(model=str(tiny_llama_path), block_size=8, emulate="gpu_h100_llama3_8b", num_kv_blocks=64))
    for params in (SamplingParams(structured_output=StructuredOutput("regex", "a+")), SamplingParams(logit_bias={1: 1})):
        with pytest.raises(ValueError, match="the emulated engine has none"):
            engine.make_request("r", [1, 2, 3], params)
    engine.make_request("ok", [1, 2, 3], SamplingParams())
