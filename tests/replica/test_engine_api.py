"""The engine's public API on tiny random models: input validation, abort, stop
conditions, RequestOutput fields, seeded sampling, KV events, cache salts, chat, bf16 and
dtype='auto' under every CPU mode (tests/conftest.py ``cpu_mode``)."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import pytest

from kvroute.kernels import cpu_capability
from kvroute.replica.config import EngineConfig
from kvroute.replica.llm import LLM
from kvroute.replica.request import RequestStatus
from kvroute.replica.sampling_params import SamplingParams
from tests.replica.helpers import TEXTS, assert_no_leak

VOCAB = 49152  # the tiny models use SmolLM2's tokenizer
BS = 8
MAX_LEN = 64
GREEDY_12 = SamplingParams(temperature=0.0, max_tokens=12)


@pytest.fixture(scope="module")
def llm(tiny_llama_path: Path) -> LLM:
    """Shared engine for tests whose assertions do not depend on what ran before."""
    return LLM(str(tiny_llama_path), block_size=BS, num_kv_blocks=128, max_model_len=MAX_LEN, dtype="float32")


@pytest.fixture(scope="module")
def prompt(llm: LLM) -> list[int]:
    return llm.tokenizer.encode(TEXTS[0] + " jumps over the lazy dog")


@pytest.fixture(scope="module")
def greedy_ref(llm: LLM, prompt: list[int]) -> list[int]:
    """The tiny Llama's 12 greedy tokens after ``prompt`` (no EOS among them)."""
    (out,) = llm.generate(prompt, GREEDY_12, use_tqdm=False)
    assert out.finish_reason == "length" and len(out.token_ids) == 12
    assert not set(out.token_ids) & llm.engine.eos_token_ids
    return out.token_ids


def _fresh_tokens(seed: int, n: int) -> list[int]:
    """A prompt no other test uses, so the shared engine's cache holds none of it."""
    rng = random.Random(seed)
    return [rng.randrange(1000, VOCAB) for _ in range(n)]


def _first_new(tokens: list[int], start: int) -> int:
    """The first index >= start whose token does not occur earlier in ``tokens``."""
    for k in range(start, len(tokens)):
        if tokens[k] not in tokens[:k]:
            return k
    raise AssertionError(f"no fresh token in {tokens}")


# --------------------------------------------------------------------------- bad input

SP_CASES = {
    "temperature<0": (dict(temperature=-0.5), r"temperature must be >= 0, got -0\.5"),
    "top_p=0": (dict(top_p=0.0), r"top_p must be in \(0, 1\], got 0\.0"),
    "top_p=1.5": (dict(top_p=1.5), r"top_p must be in \(0, 1\], got 1\.5"),
    "top_k=-2": (dict(top_k=-2), r"top_k must be -1 or 0 \(disabled\) or >= 1, got -2"),
    "max_tokens=0": (dict(max_tokens=0), r"max_tokens must be an integer >= 1, got 0"),
    "min_tokens>max_tokens": (dict(max_tokens=4, min_tokens=5), r"min_tokens must be in \[0, max_tokens=4\], got 5"),
    "n=2": (dict(n=2), r"n must be 1 .*got 2"),
    "logprobs=-1": (dict(logprobs=-1), r"logprobs must be in \[0, 20\], got -1"),
    "logprobs=21": (dict(logprobs=21), r"logprobs must be in \[0, 20\], got 21"),
    "stop_token_ids<0": (dict(stop_token_ids=[-1]), r"stop_token_ids must be >= 0, got \[-1\]"),
}


def test_top_k_zero_means_no_top_k_filter():
    """vLLM's spelling: 0 turns top-k off, as -1 does."""
    assert SamplingParams(top_k=0).top_k == -1 == SamplingParams(top_k=-1).top_k


@pytest.mark.parametrize("case", list(SP_CASES))
def test_bad_sampling_params_are_rejected(case):
    kwargs, msg = SP_CASES[case]
    with pytest.raises(ValueError, match=msg):
        SamplingParams(**kwargs)


def _engine_cases(prompt: list[int]) -> dict:
    """name -> (token_ids, params, message regex) for Engine.add_request."""
    ok = SamplingParams(max_tokens=4)
    return {
        "empty prompt": ([], ok, r"prompt must not be empty \(got 0 tokens\)"),
        "too long for the context": (
            list(range(100, 160)),
            SamplingParams(max_tokens=8),
            r"prompt \(60 tokens\) \+ max_tokens \(8\) = 68 exceeds the model's context length max_model_len=64",
        ),
        "negative token id": (prompt + [-1], ok, rf"prompt token ids must be in \[0, {VOCAB}\); got \[-1\]"),
        "token id == vocab": (prompt + [VOCAB], ok, rf"prompt token ids must be in \[0, {VOCAB}\); got \[{VOCAB}\]"),
        "stop token id == vocab": (
            prompt,
            SamplingParams(stop_token_ids=[5, VOCAB]),
            rf"stop_token_ids must be in \[0, {VOCAB}\); got \[{VOCAB}\]",
        ),
        "params not SamplingParams": (prompt, {"max_tokens": 4}, r"params must be a SamplingParams, got dict"),
    }


@pytest.mark.parametrize("case", list(_engine_cases([])))
def test_bad_requests_are_rejected_and_leave_nothing_behind(case, llm, prompt):
    ids, params, msg = _engine_cases(prompt)[case]
    with pytest.raises(ValueError, match=msg):
        llm.engine.add_request(f"bad-{case}", ids, params)
    assert f"bad-{case}" not in llm.engine.requests
    assert_no_leak(llm)
    # The same through the offline API.
    if isinstance(params, SamplingParams):
        with pytest.raises(ValueError, match=msg):
            llm.generate([ids], params, use_tqdm=False)
        assert_no_leak(llm)


def test_empty_string_and_empty_prompt_list(llm):
    with pytest.raises(ValueError, match=r"prompt must not be empty"):
        llm.generate("", use_tqdm=False)
    with pytest.raises(ValueError, match=r"prompts must not be empty"):
        llm.generate([], use_tqdm=False)
    with pytest.raises(ValueError, match=r"got 2 SamplingParams for 1 prompts"):
        llm.generate(["hi"], [SamplingParams(), SamplingParams()], use_tqdm=False)
    assert_no_leak(llm)


@pytest.mark.parametrize(
    "last, msg",
    [
        (list(range(100, 160)), r"max_model_len=64"),
        ([5, VOCAB], r"prompt token ids must be in \[0, 49152\)"),
        ([], r"prompt must not be empty"),
    ],
)
def test_a_bad_last_prompt_queues_nothing_from_the_list(llm, prompt, last, msg):
    with pytest.raises(ValueError, match=msg):
        llm.generate([prompt, prompt[:3], last], SamplingParams(max_tokens=8), use_tqdm=False)
    assert not llm.engine.requests
    assert_no_leak(llm)
    with pytest.raises(ValueError, match=r"prompts\[2\] must be a string or a list of token ids"):
        llm.generate([prompt, "ok", [1.5]], use_tqdm=False)
    assert_no_leak(llm)
    # The engine is still usable afterwards.
    outs = llm.generate([prompt, prompt[:3]], SamplingParams(max_tokens=2), use_tqdm=False)
    assert [len(o.token_ids) for o in outs] == [2, 2]
    assert_no_leak(llm)


def test_a_request_exactly_as_long_as_the_context_is_fine(llm):
    (out,) = llm.generate([list(range(100, 156))], SamplingParams(max_tokens=8, ignore_eos=True), use_tqdm=False)
    assert (len(out.token_ids), out.finish_reason) == (8, "length")
    assert_no_leak(llm)


def test_duplicate_request_id(llm, prompt):
    llm.engine.add_request("dup", prompt, SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match=r"request_id 'dup' is already in use"):
        llm.engine.add_request("dup", prompt[:2], SamplingParams(max_tokens=2))
    stats = llm.engine.stats()
    assert (stats.num_waiting, stats.num_running) == (1, 0)  # only the first one
    assert llm.engine.abort("dup") is True
    assert_no_leak(llm)


def test_unknown_model_and_non_checkpoint_folder(tmp_path):
    with pytest.raises(ValueError, match=r"model 'no-such-model' is neither an embedded model name \(known: smollm2-135m-instruct\)"):
        LLM("no-such-model")
    with pytest.raises(ValueError, match=r"is not a usable Hugging Face checkpoint folder: config\.json is missing; "
                                         r"no \*\.safetensors weight file; no tokenizer files"):
        LLM(str(tmp_path))


def test_prompt_larger_than_the_whole_kv_cache(tiny_llama_path):
    small = LLM(str(tiny_llama_path), block_size=BS, num_kv_blocks=3, dtype="float32")
    with pytest.raises(ValueError, match=r"prompt \+ max_tokens = 26 tokens needs 4 KV blocks but the cache has only "
                                         r"num_kv_blocks=3 of 8 tokens"):
        small.generate([list(range(100, 124))], SamplingParams(max_tokens=2), use_tqdm=False)
    assert_no_leak(small)
    # Exactly the whole cache is fine.
    (out,) = small.generate([list(range(100, 122))], SamplingParams(max_tokens=2), use_tqdm=False)
    assert len(out.token_ids) == 2
    assert_no_leak(small)


def test_non_chunked_prefill_needs_the_request_in_one_batch(tiny_llama_path):
    llm = LLM(str(tiny_llama_path), block_size=BS, num_kv_blocks=16, max_num_batched_tokens=16,
              enable_chunked_prefill=False, dtype="float32")
    with pytest.raises(ValueError, match=r"prompt \+ max_tokens = 17 exceeds max_num_batched_tokens=16 with chunked "
                                         r"prefill disabled"):
        llm.generate([list(range(100, 113))], SamplingParams(max_tokens=4), use_tqdm=False)
    assert_no_leak(llm)


CONFIG_CASES = {
    "block_size=0": (dict(block_size=0), r"block_size must be a power of two >= 1, got 0"),
    "block_size=3": (dict(block_size=3), r"block_size must be a power of two >= 1, got 3"),
    "max_num_seqs=0": (dict(max_num_seqs=0), r"max_num_seqs must be >= 1, got 0"),
    "dtype=int8": (dict(dtype="int8"), r"dtype must be one of \('auto', 'float32', 'bfloat16', 'float16'\), got 'int8'"),
    "num_kv_blocks=0": (dict(num_kv_blocks=0), r"num_kv_blocks must be >= 1, got 0"),
    "max_num_batched_tokens=0": (dict(max_num_batched_tokens=0), r"max_num_batched_tokens must be >= 1, got 0"),
}


@pytest.mark.parametrize("case", list(CONFIG_CASES))
def test_bad_engine_config(case, tiny_llama_path):
    kwargs, msg = CONFIG_CASES[case]
    with pytest.raises(ValueError, match=msg):
        EngineConfig(model=str(tiny_llama_path), **kwargs)
    with pytest.raises(ValueError, match=msg):
        LLM(str(tiny_llama_path), **kwargs)


def test_engine_level_config_checks(tiny_llama_path):
    with pytest.raises(ValueError, match=r"max_model_len=4096 exceeds the model's max_position_embeddings=2048"):
        LLM(str(tiny_llama_path), max_model_len=4096, num_kv_blocks=4)
    # A page-aligned chunk of fewer tokens than a block would always be 0: nothing could run.
    with pytest.raises(ValueError, match=r"max_num_batched_tokens=4 must be >= block_size=8 with page-aligned chunked"):
        LLM(str(tiny_llama_path), block_size=8, max_num_batched_tokens=4, num_kv_blocks=4)
    # Unaligned chunks of 4 are fine.
    llm = LLM(str(tiny_llama_path), block_size=8, max_num_batched_tokens=4, page_aligned=False, num_kv_blocks=8,
              dtype="float32")
    (out,) = llm.generate([list(range(100, 120))], SamplingParams(max_tokens=3), use_tqdm=False)
    assert len(out.token_ids) == 3
    assert_no_leak(llm)


# --------------------------------------------------------------------------- abort


def test_abort_waiting_prefilling_and_decoding_requests(tiny_llama_path):
    llm = LLM(str(tiny_llama_path), block_size=4, num_kv_blocks=64, max_num_batched_tokens=16, dtype="float32")
    eng = llm.engine
    p = SamplingParams(max_tokens=20, temperature=0.0)
    prompts = {"a": list(range(100, 106)), "b": list(range(200, 206)), "c": list(range(300, 330)),
               "d": list(range(400, 430))}
    for rid, ids in prompts.items():
        eng.add_request(rid, ids, p)
    eng.step()  # a: 6, b: 6, c: 4 (page-aligned chunk of the 4 left)
    eng.step()  # a: 1, b: 1, c: 12; d gets 2 -> 0 after alignment, stays waiting
    reqs = {rid: eng.requests[rid] for rid in prompts}
    assert [(r.status, r.num_computed_tokens, r.num_output_tokens) for r in reqs.values()] == [
        (RequestStatus.RUNNING, 7, 2),
        (RequestStatus.RUNNING, 7, 2),
        (RequestStatus.RUNNING, 16, 0),
        (RequestStatus.WAITING, 0, 0),
    ]
    assert {rid: len(eng.kv.block_ids(rid)) for rid in prompts} == {"a": 2, "b": 2, "c": 4, "d": 0}
    for i, rid in enumerate(["c", "a", "d", "b"]):
        held = len(eng.kv.block_ids(rid))  # no prompt shares a block with another
        free_before = eng.stats().num_free_blocks
        assert eng.abort(rid) is True
        assert eng.abort(rid) is False
        assert reqs[rid].status is RequestStatus.FINISHED and reqs[rid].finish_reason == "abort"
        assert eng.kv.block_ids(rid) == []
        assert eng.stats().num_free_blocks == free_before + held
        if i < 3:
            eng.step()  # the others keep going
    assert not eng.has_unfinished()
    assert_no_leak(llm)
    assert eng.abort("never-existed") is False
    assert eng.step().deltas == []


# --------------------------------------------------------------------------- stop conditions


def test_max_tokens_finishes_with_length(llm, prompt, greedy_ref):
    (out,) = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=5), use_tqdm=False)
    assert out.token_ids == greedy_ref[:5]
    assert (out.finish_reason, out.stop_reason) == ("length", None)


def test_stop_token_ids(llm, prompt, greedy_ref):
    k = _first_new(greedy_ref, 2)
    stop = greedy_ref[k]
    (out,) = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=12, stop_token_ids=[stop]),
                          use_tqdm=False)
    assert out.token_ids == greedy_ref[: k + 1]  # the stop token is included
    assert (out.finish_reason, out.stop_reason) == ("stop", stop)
    # ... but its text is not.
    assert out.text == llm.tokenizer.decode(greedy_ref[:k], skip_special_tokens=True)


def test_min_tokens_suppresses_stop_token_ids(llm, prompt, greedy_ref):
    k = _first_new(greedy_ref, 2)
    stop = greedy_ref[k]
    params = SamplingParams(temperature=0.0, max_tokens=12, min_tokens=k + 2, stop_token_ids=[stop])
    (out,) = llm.generate(prompt, params, use_tqdm=False)
    assert out.token_ids[:k] == greedy_ref[:k]
    assert out.token_ids[k] != stop  # masked: the runner-up is taken instead
    assert stop not in out.token_ids[: k + 2]
    if out.finish_reason == "stop":
        assert out.token_ids[-1] == stop and out.stop_reason == stop and len(out.token_ids) > k + 2
    else:
        assert (out.finish_reason, len(out.token_ids)) == ("length", 12) and stop not in out.token_ids


def test_eos_finishes_unless_ignore_eos(tmp_path, tiny_llama_path, llm, prompt, greedy_ref):
    """A copy of the tiny Llama whose generation_config declares its 5th greedy token an EOS."""
    assert greedy_ref[4] not in greedy_ref[:4]
    eos = greedy_ref[4]
    folder = tmp_path / "tiny-llama-eos"
    shutil.copytree(tiny_llama_path, folder)
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, eos]}))
    eos_llm = LLM(str(folder), block_size=BS, num_kv_blocks=16, dtype="float32")
    assert eos_llm.engine.eos_token_ids == {2, eos}

    (out,) = eos_llm.generate(prompt, GREEDY_12, use_tqdm=False)
    assert out.token_ids == greedy_ref[:5]
    assert (out.finish_reason, out.stop_reason) == ("stop", None)
    assert out.text == eos_llm.tokenizer.decode(greedy_ref[:4], skip_special_tokens=True)

    (out,) = eos_llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True), use_tqdm=False)
    assert out.token_ids == greedy_ref
    assert out.finish_reason == "length"

    (out,) = eos_llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=12, min_tokens=7), use_tqdm=False)
    assert out.token_ids[:4] == greedy_ref[:4] and out.token_ids[4] != eos
    assert eos not in out.token_ids[:7] and len(out.token_ids) >= 7
    assert_no_leak(eos_llm)


def test_stop_strings(llm, prompt, greedy_ref):
    tok = llm.tokenizer
    for k in range(3, len(greedy_ref)):
        piece = tok.decode([greedy_ref[k]]).strip()
        if len(piece) >= 2 and piece not in tok.decode(greedy_ref[:k]):
            break
    else:
        raise AssertionError("no usable stop string in the greedy continuation")
    full = tok.decode(greedy_ref[: k + 1])
    (out,) = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=12, stop=["@@never@@", piece]),
                          use_tqdm=False)
    assert out.token_ids == greedy_ref[: k + 1]
    assert out.text == full[: full.index(piece)]
    assert piece not in out.text
    assert (out.finish_reason, out.stop_reason) == ("stop", piece)


# --------------------------------------------------------------------------- outputs


def test_request_output_fields_and_cached_tokens(llm):
    ids = _fresh_tokens(1, 32)  # 4 full blocks of 8
    params = SamplingParams(temperature=0.0, max_tokens=8)
    (first,) = llm.generate([ids], params, use_tqdm=False)
    assert first.prompt_token_ids == ids and first.num_prompt_tokens == 32
    assert len(first.token_ids) == 8 and first.finish_reason == "length" and first.stop_reason is None
    assert first.text == llm.tokenizer.decode(first.token_ids, skip_special_tokens=True)
    assert first.num_cached_tokens == 0
    assert first.logprobs is None
    (again,) = llm.generate([ids], params, use_tqdm=False)
    # Every prompt block is cached, but the block holding the last token is recomputed.
    assert again.num_cached_tokens == 24
    assert again.num_cached_tokens % BS == 0 and 0 < again.num_cached_tokens < len(ids)
    assert again.token_ids == first.token_ids and again.text == first.text
    (longer,) = llm.generate([ids + [5, 6, 7]], params, use_tqdm=False)
    assert longer.num_cached_tokens == 32
    assert_no_leak(llm)


def test_logprobs(llm, prompt, greedy_ref):
    (out,) = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=6, logprobs=5), use_tqdm=False)
    assert out.token_ids == greedy_ref[:6]
    assert len(out.logprobs) == 6
    for tok, lp in zip(out.token_ids, out.logprobs):
        assert lp.token_id == tok
        assert len(lp.top) == 5
        values = list(lp.top.values())
        assert values == sorted(values, reverse=True) and values[0] <= 0.0
        assert lp.logprob == values[0] and next(iter(lp.top)) == tok  # greedy took the top entry
    (out,) = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=3, logprobs=0), use_tqdm=False)
    assert [lp.top for lp in out.logprobs] == [{}, {}, {}]
    assert [lp.token_id for lp in out.logprobs] == greedy_ref[:3]


# --------------------------------------------------------------------------- seeded sampling


def _seeded(seed: int, max_tokens: int = 16) -> SamplingParams:
    return SamplingParams(temperature=0.8, top_p=0.9, seed=seed, max_tokens=max_tokens)


def _others(llm: LLM, n: int) -> list[list[int]]:
    return [llm.tokenizer.encode(TEXTS[i % len(TEXTS)])[:20] + [11 + i] for i in range(n)]


def test_seeded_sampling_is_reproducible_across_runs_and_batches(llm, prompt):
    alone = llm.generate(prompt, _seeded(1234), use_tqdm=False)[0].token_ids
    assert len(alone) == 16
    assert llm.generate(prompt, _seeded(1234), use_tqdm=False)[0].token_ids == alone
    # The same request in the middle of 10 others (unseeded, drawing from the shared generator).
    others = _others(llm, 10)
    batch = others[:5] + [prompt] + others[5:]
    params = [SamplingParams(temperature=1.0, max_tokens=12)] * 5 + [_seeded(1234)] + \
             [SamplingParams(temperature=1.0, max_tokens=12)] * 5
    outs = llm.generate(batch, params, use_tqdm=False)
    assert outs[5].token_ids == alone
    # Another seed gives another continuation.
    assert llm.generate(prompt, _seeded(4321), use_tqdm=False)[0].token_ids != alone
    assert_no_leak(llm)


def test_seeded_sampling_survives_preemption(tiny_llama_path, llm):
    prompts = [llm.tokenizer.encode(t)[:10] + [20 + i] for i, t in enumerate(TEXTS)] * 2
    params = [_seeded(100 + i, max_tokens=24) for i in range(len(prompts))]
    want = [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    # 10 requests of up to 35 tokens (5 blocks each) over 12 blocks: preemption is certain.
    tight = LLM(str(tiny_llama_path), block_size=BS, num_kv_blocks=12, dtype="float32")
    got = [o.token_ids for o in tight.generate(prompts, params, use_tqdm=False)]
    assert tight.engine.stats().num_preemptions > 0
    assert got == want
    assert_no_leak(tight)


# --------------------------------------------------------------------------- KV events and salts


def test_kv_events_replay_to_the_cached_hash_set(tiny_llama_path):
    llm = LLM(str(tiny_llama_path), block_size=4, num_kv_blocks=24, max_num_batched_tokens=32, dtype="float32")
    eng = llm.engine
    seqs: list[int] = []
    mirror: set[int] = set()
    num_removed = 0
    cleared_seen = False

    def drain() -> dict[str, int]:
        """Step until idle; returns each finished request's num_cached_tokens."""
        nonlocal num_removed, cleared_seen
        cached: dict[str, int] = {}
        while True:
            out = eng.step()
            cached |= {d.request_id: d.num_cached_tokens for d in out.deltas if d.finish_reason}
            ev = out.kv_events
            assert ev.replica_id == "replica-0"
            assert not set(ev.stored) & set(ev.removed)
            seqs.append(ev.seq)
            if ev.cleared:
                mirror.clear()
                cleared_seen = True
            mirror.difference_update(ev.removed)
            mirror.update(ev.stored)
            num_removed += len(ev.removed)
            assert mirror == set(eng.cached_block_hashes())
            if not eng.has_unfinished():
                return cached

    p = SamplingParams(temperature=0.0, max_tokens=6)
    for wave in range(3):
        for i in range(4):
            eng.add_request(f"w{wave}-{i}", _fresh_tokens(100 * wave + i, 14 + i), p)
        drain()
    # The last wave's blocks are the most recently used: they survived the evictions.
    eng.add_request("again", _fresh_tokens(200, 14), p)
    assert drain() == {"again": 12}
    assert num_removed > 0  # 24 blocks could not hold it all: evictions were reported
    assert eng.reset_prefix_cache() is True
    assert drain() == {}  # one empty step that publishes the clear
    assert cleared_seen and mirror == set() == set(eng.cached_block_hashes())
    assert seqs == list(range(1, len(seqs) + 1))
    assert_no_leak(llm)


def test_cache_salt_isolates_tenants(llm):
    ids = _fresh_tokens(2, 33)
    p = SamplingParams(temperature=0.0, max_tokens=2)
    first = llm.generate([ids], p, use_tqdm=False, cache_salt="tenant-a")[0]
    assert first.num_cached_tokens == 0
    assert llm.generate([ids], p, use_tqdm=False, cache_salt="tenant-a")[0].num_cached_tokens == 32
    other = llm.generate([ids], p, use_tqdm=False, cache_salt="tenant-b")[0]
    assert other.num_cached_tokens == 0
    assert other.token_ids == first.token_ids  # the salt changes caching, not results
    assert llm.generate([ids], p, use_tqdm=False)[0].num_cached_tokens == 0  # no salt is its own tenant
    assert llm.generate([ids], p, use_tqdm=False, cache_salt="tenant-b")[0].num_cached_tokens == 32
    assert_no_leak(llm)


# --------------------------------------------------------------------------- chat, properties, dtypes


def test_chat_applies_the_chat_template(llm, tiny_llama_path):
    from transformers import AutoTokenizer

    ref_tok = AutoTokenizer.from_pretrained(str(tiny_llama_path))
    assert llm.model_path == tiny_llama_path.resolve()
    assert llm.tokenizer.encode("Hello, world") == ref_tok.encode("Hello, world")
    assert len(llm.tokenizer) == VOCAB

    conv1 = [{"role": "user", "content": "What is the capital of France?"}]
    conv2 = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    p = SamplingParams(temperature=0.0, max_tokens=3)
    want = [list(ref_tok.apply_chat_template(c, add_generation_prompt=True)["input_ids"]) for c in (conv1, conv2)]
    assert want[0][-4:] == ref_tok.encode("<|im_start|>assistant\n")
    (one,) = llm.chat(conv1, p, use_tqdm=False)
    assert one.prompt_token_ids == want[0] and one.num_prompt_tokens == len(want[0])
    both = llm.chat([conv1, conv2], p, use_tqdm=False)
    assert [o.prompt_token_ids for o in both] == want
    assert both[0].token_ids == one.token_ids
    with pytest.raises(ValueError, match=r"messages\[0\] must be a dict with 'role' and 'content'"):
        llm.chat([{"role": "user"}], p, use_tqdm=False)
    assert_no_leak(llm)


@pytest.mark.usefixtures("cpu_mode")
@pytest.mark.parametrize("fixture", ["tiny_llama_path", "tiny_qwen2_path"])  # untied, tied
def test_bfloat16_runs(fixture, request):
    path = request.getfixturevalue(fixture)
    llm = LLM(str(path), block_size=BS, num_kv_blocks=32, dtype="bfloat16")
    prompts = [llm.tokenizer.encode(t) for t in TEXTS[:3]]
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    for o in outs:
        assert len(o.token_ids) == 8 and o.finish_reason == "length"
        assert all(0 <= t < VOCAB for t in o.token_ids)
        assert o.text == llm.tokenizer.decode(o.token_ids, skip_special_tokens=True)
    assert_no_leak(llm)


def test_auto_dtype_is_bfloat16_only_where_the_cpu_multiplies_it_natively(cpu_mode, tiny_llama_path):
    import torch

    llm = LLM(str(tiny_llama_path), block_size=BS, num_kv_blocks=16, dtype="auto", device="cpu")
    native_bf16 = cpu_capability.current().native_bf16_matmul  # AVX512-BF16 or AMX, unless forced down
    assert llm.engine.runner.dtype == (torch.bfloat16 if native_bf16 else torch.float32)
    assert not (cpu_mode == "avx2" and native_bf16)
    (out,) = llm.generate([[5, 6, 7]], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    assert len(out.token_ids) == 4


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0.0, max_tokens=12),
        SamplingParams(temperature=0.9, top_p=0.95, seed=7, max_tokens=12, frequency_penalty=0.5),
    ],
    ids=["greedy", "seeded"],
)
@pytest.mark.parametrize("split", [1, 5, 11])
def test_resume_output_continues_exactly_like_an_uninterrupted_run(llm, prompt, params, split):
    """A request resumed elsewhere with its tokens so far produces the rest of the
    uninterrupted run: same tokens, same text, same finish, nothing streamed twice."""
    (whole,) = llm.generate(prompt, params, use_tqdm=False)
    head = whole.token_ids[:split]
    engine = llm.engine
    engine.add_request("resumed", prompt, params, resume_output=head)
    deltas = []
    while engine.has_unfinished():
        deltas.extend(d for d in engine.step().deltas if d.request_id == "resumed")
    tail = [t for d in deltas for t in d.token_ids]
    assert tail == whole.token_ids[split:]
    assert deltas[-1].finish_reason == whole.finish_reason
    head_text = llm.tokenizer.decode(head, skip_special_tokens=True)
    assert head_text + "".join(d.text for d in deltas) == whole.text
    assert_no_leak(llm)


def test_bad_resume_output_is_rejected(llm, prompt):
    with pytest.raises(ValueError, match="shorter than max_tokens=3"):
        llm.engine.add_request("r1", prompt, SamplingParams(max_tokens=3), resume_output=[5, 6, 7])
    with pytest.raises(ValueError, match="resume_output token ids"):
        llm.engine.add_request("r2", prompt, SamplingParams(max_tokens=3), resume_output=[VOCAB])
    assert not llm.engine.requests


def test_route_ticket_is_reported_in_the_load_figures(llm, prompt):
    eng = llm.engine
    for bad in (-1, 1.5, "7", True):
        with pytest.raises(ValueError, match="route_ticket must be a non-negative int"):
            eng.add_request("bad", prompt, SamplingParams(max_tokens=2), route_ticket=bad)
    assert not eng.requests
    before = eng.load().route_ticket
    eng.add_request("t1", prompt, SamplingParams(max_tokens=2), route_ticket=before + 10)
    eng.add_request("t0", prompt, SamplingParams(max_tokens=2), route_ticket=before + 5)  # arrived late
    eng.add_request("t-", prompt, SamplingParams(max_tokens=2))  # no ticket (not routed by the router)
    assert eng.load().route_ticket == before + 10  # the highest accepted, whatever the order
    out = eng.step()
    assert out.kv_events.load.route_ticket == before + 10
    while eng.has_unfinished():
        eng.step()
    assert eng.load().route_ticket == before + 10
    assert_no_leak(llm)
