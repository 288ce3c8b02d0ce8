"""LoRA adapters in the engine, on the tiny Llama and Qwen2 (fp32, CPU).

Greedy output under an adapter equals that of the base model with the adapter merged
into its weights (``W + scale·B·A``, saved and loaded through the real loader), alone
and in mixed batches (base + two adapters in one step), with prefix caching, chunked
prefill and preemption; an adapter's prefix is never served to another adapter or to
the base; adapters beyond ``max_loras`` take turns (LRU); unloading one in use is
refused; a reused name never sees the old adapter's KV.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from kvroute.benchmarks.lora_adapters import save_merged_model, save_random_adapter
from kvroute.replica.block_hash import HashSpec, hash_blocks, root_hash
from kvroute.replica.llm import LLM
from kvroute.replica.models.arch import ModelArch
from kvroute.replica.checkpoint import load_hf_config
from kvroute.replica.sampling_params import SamplingParams
from tests.replica.helpers import TEXTS, assert_no_leak

BS = 8
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
ENGINE = dict(block_size=BS, max_model_len=256, dtype="float32")


class Fixture:
    """A base model, adapters ``a`` (all modules, r 8) and ``b`` (q/v/down only, r 4,
    rsLoRA-free), their merged models, and greedy references per (adapter, prompt)."""

    def __init__(self, base: Path, tmp: Path) -> None:
        self.base = base
        self.arch = ModelArch.from_hf_config(load_hf_config(base))
        self.adapters = {
            "a": save_random_adapter(tmp / "a", self.arch, rank=8, alpha=16, seed=11),
            "b": save_random_adapter(tmp / "b", self.arch, rank=4, alpha=4, targets=("q_proj", "v_proj", "down_proj"), seed=12),
        }
        self.models = {None: base, **{n: save_merged_model(base, p, tmp / f"merged-{n}") for n, p in self.adapters.items()}}
        tok = LLM(str(base), num_kv_blocks=64, **ENGINE).tokenizer
        self.prompts = [tok.encode(t) for t in TEXTS[:4]]
        self.refs = {}
        for name, path in self.models.items():
            outs = LLM(str(path), num_kv_blocks=256, **ENGINE).generate(self.prompts, GREEDY, use_tqdm=False)
            self.refs[name] = [o.token_ids for o in outs]

    def engine(self, **kw) -> LLM:
        cfg = dict(ENGINE, num_kv_blocks=256, enable_lora=True, max_loras=2, lora_modules={k: str(v) for k, v in self.adapters.items()})
        return LLM(str(self.base), **{**cfg, **kw})


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def fx(request, tmp_path_factory) -> Fixture:
    base = request.getfixturevalue(f"tiny_{request.param}_path")
    return Fixture(base, tmp_path_factory.mktemp(f"lora-{request.param}"))


def test_adapters_change_the_output(fx: Fixture):
    assert fx.refs["a"] != fx.refs[None] and fx.refs["b"] != fx.refs[None] and fx.refs["a"] != fx.refs["b"]


@pytest.mark.parametrize("name", [None, "a", "b"])
def test_each_adapter_alone_equals_its_merged_model(fx: Fixture, name):
    llm = fx.engine()
    outs = llm.generate(fx.prompts, GREEDY, use_tqdm=False, lora_name=name)
    assert [o.token_ids for o in outs] == fx.refs[name]
    assert_no_leak(llm)


def _mixed(fx: Fixture) -> tuple[list[list[int]], list[str | None], list[list[int]]]:
    """Every prompt under the base and both adapters: 12 requests, interleaved."""
    names = [None, "a", "b"]
    prompts, loras, want = [], [], []
    for i, p in enumerate(fx.prompts):
        for k in range(3):
            name = names[(i + k) % 3]
            prompts.append(p)
            loras.append(name)
            want.append(fx.refs[name][i])
    return prompts, loras, want


def test_mixed_batch_equals_merged_models(fx: Fixture):
    llm = fx.engine()
    prompts, loras, want = _mixed(fx)
    outs = llm.generate(prompts, GREEDY, use_tqdm=False, lora_name=loras)
    assert [o.token_ids for o in outs] == want
    stats = llm.engine.stats()
    assert stats.max_batch_size == len(prompts)  # base and both adapters in one step
    assert stats.lora_slot_loads == 2 and stats.num_resident_loras == 2
    assert_no_leak(llm)


def test_mixed_with_chunked_prefill_and_preemption(fx: Fixture):
    """Small budget (chunks of 16 tokens) and a KV cache too small for every request:
    preemptions happen, outputs do not change, prefixes are reused within an adapter."""
    llm = fx.engine(num_kv_blocks=12, max_num_batched_tokens=16)
    prompts, loras, want = _mixed(fx)
    outs = llm.generate(prompts, GREEDY, use_tqdm=False, lora_name=loras)
    assert [o.token_ids for o in outs] == want
    stats = llm.engine.stats()
    assert stats.num_preemptions > 0
    assert_no_leak(llm)


def test_prefix_never_crosses_adapters(fx: Fixture):
    llm = fx.engine()
    prompt = fx.prompts[3]  # 30+ tokens: several full blocks
    full = (len(prompt) - 1) // BS * BS
    cached = []
    for name in [None, "a", "b", "a", None, "b"]:
        (out,) = llm.generate(prompt, GREEDY, use_tqdm=False, lora_name=name)
        cached.append(out.num_cached_tokens)
        assert out.token_ids == fx.refs[name][3]
    assert cached == [0, 0, 0, full, full, full]
    spec = llm.engine.hash_spec
    roots = {root_hash(spec, None, n) for n in (None, "a", "b")} | {root_hash(spec, "a")}
    assert len(roots) == 4  # an adapter is not a salt either
    cached_hashes = set(llm.engine.cached_block_hashes())
    for name in (None, "a", "b"):
        assert set(hash_blocks(spec, prompt, lora_name=name)[: full // BS]) <= cached_hashes


def test_lru_eviction_beyond_max_loras(fx: Fixture, tmp_path):
    c = save_random_adapter(tmp_path / "c", fx.arch, rank=2, seed=13)
    llm = fx.engine(max_loras=2)
    llm.load_lora("c", c)
    lora = llm.engine.lora
    for name in ("a", "b", "c"):
        llm.generate(fx.prompts[0], GREEDY, use_tqdm=False, lora_name=name)
    assert list(lora.resident) == ["b", "c"] and lora.num_slot_loads == 3  # a was least recently used
    (out,) = llm.generate(fx.prompts[0], GREEDY, use_tqdm=False, lora_name="a")
    assert out.token_ids == fx.refs["a"][0]
    assert list(lora.resident) == ["c", "a"] and lora.num_slot_loads == 4
    # Three adapters at once with two slots: they take turns, outputs unchanged.
    outs = llm.generate([fx.prompts[1]] * 3, GREEDY, use_tqdm=False, lora_name=["a", "b", "c"])
    (c_alone,) = llm.generate(fx.prompts[1], GREEDY, use_tqdm=False, lora_name="c")
    assert [o.token_ids for o in outs] == [fx.refs["a"][1], fx.refs["b"][1], c_alone.token_ids]
    assert_no_leak(llm)


def test_one_adapter_per_step_with_max_loras_1(fx: Fixture):
    llm = fx.engine(max_loras=1)
    outs = llm.generate([fx.prompts[0]] * 3, GREEDY, use_tqdm=False, lora_name=["a", None, "b"])
    assert [o.token_ids for o in outs] == [fx.refs["a"][0], fx.refs[None][0], fx.refs["b"][0]]
    assert llm.engine.stats().lora_slot_loads == 2


def test_unknown_adapter_and_unload_in_use(fx: Fixture):
    llm = fx.engine()
    with pytest.raises(ValueError, match="unknown LoRA adapter 'zz'"):
        llm.generate(fx.prompts[0], GREEDY, use_tqdm=False, lora_name="zz")
    eng = llm.engine
    eng.add_request("r1", fx.prompts[0], GREEDY, lora_name="a")
    with pytest.raises(ValueError, match="'a' is in use by 1 request"):
        eng.unload_lora("a")
    while eng.has_unfinished():
        eng.step()
    eng.unload_lora("a")
    assert list(eng.list_loras()) == ["b"]
    with pytest.raises(ValueError, match="unknown LoRA adapter 'a'"):
        eng.add_request("r2", fx.prompts[0], GREEDY, lora_name="a")
    with pytest.raises(ValueError, match="already loaded"):
        llm.load_lora("b", fx.adapters["b"])
    assert_no_leak(llm)


def test_a_reused_name_never_sees_the_old_adapters_kv(fx: Fixture):
    llm = fx.engine()
    prompt = fx.prompts[3]
    llm.generate(prompt, GREEDY, use_tqdm=False, lora_name="a")
    llm.unload_lora("a")
    llm.load_lora("a", fx.adapters["b"])  # another adapter under the old name
    (out,) = llm.generate(prompt, GREEDY, use_tqdm=False, lora_name="a")
    assert out.num_cached_tokens == 0 and out.token_ids == fx.refs["b"][3]


def test_lora_needs_enable_lora(tiny_llama_path):
    llm = LLM(str(tiny_llama_path), num_kv_blocks=32, **ENGINE)
    with pytest.raises(ValueError, match="without enable_lora"):
        llm.generate([1, 2, 3], GREEDY, use_tqdm=False, lora_name="a")
    with pytest.raises(ValueError, match="needs enable_lora"):
        llm.load_lora("a", "/nonexistent")


def test_root_hash_without_adapter_is_unchanged():
    spec = HashSpec(16, 7, "m")
    assert root_hash(spec, "s", None) == root_hash(spec, "s")
    assert root_hash(spec, None, "x") != root_hash(spec, None, "y") != root_hash(spec)
    # the salt cannot imitate an adapter: adapter then salt are framed apart
    assert root_hash(spec, "\x02x\x00") != root_hash(spec, None, "x")


def test_async_engine_loads_serves_and_unloads(fx: Fixture, tmp_path):
    import asyncio

    from kvroute.replica.async_engine import AsyncEngine

    engine = AsyncEngine(fx.engine(lora_modules={}).engine)

    async def collect(name):
        return [t for d in [d async for d in engine.generate(fx.prompts[2], GREEDY, lora_name=name)] for t in d.token_ids]

    async def scenario():
        with pytest.raises(ValueError, match="unknown LoRA adapter 'a'"):
            await collect("a")
        bad = tmp_path / "bad"
        bad.mkdir()
        with pytest.raises(ValueError, match="adapter_config.json: missing"):
            await engine.load_lora("a", str(bad))
        await engine.load_lora("a", str(fx.adapters["a"]))
        await engine.load_lora("b", str(fx.adapters["b"]))
        outs = await asyncio.gather(collect("a"), collect(None), collect("b"))
        assert outs == [fx.refs["a"][2], fx.refs[None][2], fx.refs["b"][2]]
        stream = engine.generate(fx.prompts[2], GREEDY, lora_name="a")
        await stream.__anext__()  # running now
        with pytest.raises(ValueError, match="in use"):
            await engine.unload_lora("a")
        await stream.aclose()  # aborts it: the unload that follows sees it gone
        await engine.unload_lora("a")
        assert list(await engine.list_loras()) == ["b"]

    asyncio.run(scenario())


def test_adapter_root_hash_golden():
    """Pins the adapter's framing (``... model 0x00 0x02 name 0x00 0x01 salt``), which
    every caller that routes must reproduce."""
    import xxhash

    spec = HashSpec(4, 7, "m")
    framed = b"kvroute/root/v1\x00" + b"m\x00" + b"\x02x\x00" + b"\x01salt"
    assert root_hash(spec, "salt", "x") == xxhash.xxh3_128_intdigest(framed, 7) == 0x1BB26DB07C24D8FB48CA48770AEDE126
    assert root_hash(spec, None, "x") == 0xF3A89B2B7335109A6EE88A633D839548
    assert hash_blocks(spec, [1, 2, 3, 4], lora_name="x") == [0xD66634D86319909F20D3F2A636062A27]
