"""Moving a prefix's KV between two real engines (tiny random Llama, fp32): the importer
hits it and answers exactly as an undisturbed run; every mismatch is refused with nothing
imported; the source's blocks are referenced while copied and freed after; an import that
fails or is cancelled halfway leaves nothing cached; emulated engines move sizes only."""

from __future__ import annotations

import asyncio
import dataclasses
import random
import threading

import pytest

from kvroute.replica.async_engine import AsyncEngine
from kvroute.replica.block_hash import HashSpec
from kvroute.replica.config import EngineConfig
from kvroute.replica.engine import Engine
from kvroute.replica.llm import LLM
from kvroute.replica.profiles import get_profile
from tests.replica.helpers import assert_no_leak, engine_greedy, greedy

BS = 16
NEW = 8


def _llm(path, **kw) -> LLM:
    kw.setdefault("num_kv_blocks", 48)
    return LLM(str(path), dtype=kw.pop("dtype", "float32"), block_size=kw.pop("block_size", BS), **kw)


@pytest.fixture(scope="module")
def prompt() -> list[int]:
    rng = random.Random(5)
    return [rng.randrange(100, 40_000) for _ in range(200)]  # 12 full blocks + 8 tokens


@pytest.fixture(scope="module")
def pair(tiny_llama_path):
    return _llm(tiny_llama_path), _llm(tiny_llama_path)


@pytest.fixture()
def a_b(pair):
    a, b = pair
    for llm in pair:
        assert llm.engine.reset_prefix_cache()
    return a, b


def _cached(llm: LLM, hashes) -> set:
    return set(hashes) & set(llm.engine.cached_block_hashes())


def test_imported_prefix_is_hit_and_answers_as_an_undisturbed_run(a_b, prompt):
    a, b = a_b
    (undisturbed,) = engine_greedy(b, [prompt], NEW)  # B alone, cold
    assert b.engine.reset_prefix_cache()
    out_a = a.generate([prompt], greedy(NEW), use_tqdm=False)[0]
    payload = a.engine.export_blocks(prompt)
    h = payload.header
    assert payload.num_blocks == 12 and h.num_tokens == 192
    assert h.token_ids == tuple(tuple(prompt[i * BS : (i + 1) * BS]) for i in range(12))
    arch = a.engine.arch
    block_bytes = arch.num_layers * 2 * BS * arch.num_kv_heads * arch.head_dim * 4
    layers = 2 * arch.num_layers
    assert payload.kv.shape == (layers, 12, block_bytes // layers) and payload.nbytes == 12 * block_bytes
    assert_no_leak(a)  # released after the copy

    result = b.engine.import_blocks(payload)
    assert (result.blocks, result.tokens, result.imported, result.nbytes) == (12, 192, 12, payload.nbytes)
    assert _cached(b, h.block_hashes) == set(h.block_hashes)
    assert_no_leak(b)  # cached, free, referenced by nobody
    out_b = b.generate([prompt], greedy(NEW), use_tqdm=False)[0]
    assert out_b.num_cached_tokens == 192
    assert tuple(out_b.token_ids) == tuple(out_a.token_ids) == undisturbed
    again = b.engine.import_blocks(payload)  # all present already: nothing written
    assert (again.blocks, again.imported) == (12, 0)
    # by block hashes: the same run, the same bytes
    by_hash = a.engine.export_blocks(block_hashes=list(h.block_hashes))
    assert by_hash.header == h and (by_hash.kv == payload.kv).all()
    m = b.engine.kv_transfer.metrics.report()
    assert m["imports"] == 2 and m["imported_blocks"] == 12 and m["imported_bytes"] == payload.nbytes
    assert_no_leak(a)
    assert_no_leak(b)


def test_source_blocks_are_referenced_while_leased_and_freed_after(a_b, prompt):
    a, _ = a_b
    engine_greedy(a, [prompt], 1)
    xfer = a.engine.kv_transfer
    lease = xfer.lease(prompt, max_blocks=5)
    ids = [blk.block_id for blk in lease.blocks]
    refs = a.engine.stats().block_ref_counts
    assert len(ids) == 5 and [refs[i] for i in ids] == [1] * 5 and sum(refs) == 5
    assert not set(ids) & set(a.engine.kv.pool.free_block_ids())  # no take can evict them
    payload = xfer.copy(lease)
    assert payload.num_blocks == 5
    xfer.release(lease)
    xfer.release(lease)  # once only
    assert_no_leak(a)
    assert a.engine.kv.pool.free_block_ids()[-1] == ids[0]  # released tail first: the head is evicted last


def _tamper(payload, **header_changes):
    return dataclasses.replace(payload, header=dataclasses.replace(payload.header, **header_changes))


def _refused(b: LLM, payload, match: str) -> None:
    before = set(b.engine.cached_block_hashes())
    with pytest.raises(ValueError, match=match):
        b.engine.import_blocks(payload)
    assert set(b.engine.cached_block_hashes()) == before
    assert_no_leak(b)


def test_tampered_or_foreign_payloads_are_refused(a_b, prompt):
    a, b = a_b
    engine_greedy(a, [prompt], 1)
    payload = a.engine.export_blocks(prompt)
    h = payload.header
    tokens = [list(t) for t in h.token_ids]
    tokens[7][3] += 1  # one token of block 7 no longer matches its claimed hash
    _refused(b, _tamper(payload, token_ids=tuple(map(tuple, tokens))), "block 7's hash does not match")
    _refused(b, _tamper(payload, cache_salt="tenant-b"), "block 0's hash does not match")
    ident = h.identity
    other_seed = dataclasses.replace(ident, spec=HashSpec(BS, 99, ident.spec.model_id))
    _refused(b, _tamper(payload, identity=other_seed), "differs from this engine in hash seed")
    _refused(b, _tamper(payload, lora_name="sql"), "LoRA adapter 'sql' is not loaded here")
    _refused(b, dataclasses.replace(payload, kv=payload.kv[:, :-4]), "KV of shape")
    assert b.engine.kv_transfer.metrics.import_refusals == 5
    assert b.engine.import_blocks(payload).imported == 12  # the genuine one still goes in


@pytest.mark.parametrize(
    "engine_kw, match",
    [
        (dict(hash_seed=7), "hash seed"),
        (dict(dtype="bfloat16"), r"dtype \(float32, here bfloat16\)"),
        (dict(block_size=32), r"block size \(16, here 32\)"),
    ],
)
def test_an_engine_of_another_spec_dtype_or_block_size_refuses(a_b, prompt, tiny_llama_path, engine_kw, match):
    a, _ = a_b
    engine_greedy(a, [prompt], 1)
    payload = a.engine.export_blocks(prompt)
    _refused(_llm(tiny_llama_path, **engine_kw), payload, match)


def test_another_model_refuses(a_b, prompt, tiny_qwen2_path):
    a, _ = a_b
    engine_greedy(a, [prompt], 1)
    _refused(_llm(tiny_qwen2_path), a.engine.export_blocks(prompt), "differs from this engine in model")


def test_an_import_failing_halfway_leaves_nothing(a_b, prompt):
    a, b = a_b
    engine_greedy(a, [prompt], 1)
    payload = a.engine.export_blocks(prompt)
    xfer = b.engine.kv_transfer
    targets = []

    def failing(block_ids, kv):  # the copy breaks after the first layer's K and V
        targets[:] = block_ids.tolist()
        xfer._rows()[:2].index_copy_(1, block_ids, kv[:2])
        raise RuntimeError("copy failed")

    xfer._write_rows = failing
    try:
        with pytest.raises(RuntimeError, match="copy failed"):
            b.engine.import_blocks(payload)
    finally:
        del xfer._write_rows
    assert len(targets) == 12 and not _cached(b, payload.header.block_hashes)
    assert_no_leak(b)
    assert sorted(b.engine.kv.pool.free_block_ids()[:12]) == sorted(targets)  # uncached: reused first


async def _until(predicate, timeout_s: float = 10.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not predicate():
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.01)


def test_async_transfer_beside_steps_and_a_cancelled_import(a_b, prompt):
    a, b = a_b
    src, dst = AsyncEngine(a.engine), AsyncEngine(b.engine)
    other = [t + 1 for t in prompt]
    xfer = b.engine.kv_transfer
    real = xfer._write_rows
    gate = threading.Event()
    before = xfer.metrics.imported_blocks

    async def main():
        async for _ in src.generate(prompt, greedy(1)):
            pass
        busy = src.generate(other, greedy(NEW))  # steps run while the export copies
        first = asyncio.ensure_future(busy.__anext__())
        payload = await src.export_blocks(prompt)
        await first
        async for _ in busy:
            pass
        xfer._write_rows = lambda ids, kv: (gate.wait(5), real(ids, kv))
        pool = b.engine.kv.pool
        task = asyncio.ensure_future(dst.import_blocks(payload))
        await _until(lambda: pool.num_free_blocks < pool.num_blocks)  # reserved, the write under way
        task.cancel()  # the caller gives up
        with pytest.raises(asyncio.CancelledError):
            await task
        gate.set()
        await _until(lambda: pool.num_free_blocks == pool.num_blocks)  # the write ends, then the release
        assert not _cached(b, payload.header.block_hashes)
        del xfer._write_rows
        result = await dst.import_blocks(payload)
        assert result.imported == 12
        deltas = [d async for d in dst.generate(prompt, greedy(NEW))]
        return payload, deltas, await dst.metrics_report()

    payload, deltas, report = asyncio.run(main())
    assert deltas[-1].num_cached_tokens == 192
    assert report["kv_transfer"]["imported_blocks"] == before + 12  # the cancelled import counts nothing
    assert_no_leak(a)
    assert_no_leak(b)


def test_import_evicting_into_a_host_tier_keeps_both_prefixes_right(tiny_llama_path, prompt):
    a = _llm(tiny_llama_path)
    b = _llm(tiny_llama_path, num_kv_blocks=16, host_kv_blocks=32)
    other = [t + 3 for t in prompt]
    (expected_other,) = engine_greedy(b, [other], NEW)  # 13 blocks, 12 stay cached
    engine_greedy(a, [prompt], 1)
    payload = a.engine.export_blocks(prompt)
    assert b.engine.import_blocks(payload).imported == 12  # evicts (offloads) other's blocks
    assert len(b.engine.kv.host) >= 8
    outs = b.generate([other, prompt], greedy(NEW), use_tqdm=False)
    assert tuple(outs[0].token_ids) == expected_other and outs[0].num_cached_tokens == 192
    assert outs[1].num_cached_tokens == 192
    assert_no_leak(b)


def test_emulated_engines_move_sizes_and_register_blocks(tiny_llama_path, prompt):
    def emulated() -> Engine:
        return Engine(EngineConfig(model=str(tiny_llama_path), block_size=BS, num_kv_blocks=48,
                                   emulate="gpu_h100_llama3_8b", time_scale=0.01))  # fmt: skip

    a, b = emulated(), emulated()
    a.add_request("r", prompt, greedy(1))
    while a.has_unfinished():
        a.step()
    payload = a.export_blocks(prompt)
    per_token = get_profile("gpu_h100_llama3_8b").kv_bytes_per_token
    assert payload.kv is None and payload.nbytes == 12 * BS * per_token and per_token > 0
    assert b.import_blocks(payload).imported == 12
    b.add_request("s", prompt, greedy(1))
    deltas = []
    while b.has_unfinished():
        deltas += b.step().deltas
    assert deltas[-1].num_cached_tokens == 192
    with pytest.raises(ValueError, match="dtype"):
        _llm(tiny_llama_path).engine.import_blocks(payload)


def test_an_emulated_import_takes_the_profiles_pull_time_and_reports_it(tiny_llama_path, prompt):
    """An emulated import sleeps its profile's pull time for the bytes it writes
    (through the host: half the host copy bandwidth, plus the setup), scaled as a step;
    its pull figures (what a router prices) are the profile's, scaled likewise."""
    def emulated() -> Engine:
        return Engine(EngineConfig(model=str(tiny_llama_path), block_size=BS, num_kv_blocks=48,
                                   emulate="gpu_h100_llama3_8b", time_scale=4.0))  # fmt: skip

    a, b = emulated(), emulated()
    a.add_request("r", prompt, greedy(1))
    while a.has_unfinished():
        a.step()
    slept: list[float] = []
    b.runner._sleep = slept.append  # the one function replaced: record the emulated time instead of waiting it
    profile = get_profile("gpu_h100_llama3_8b")
    payload = a.export_blocks(prompt)
    assert b.import_blocks(payload).imported == 12
    assert slept == [pytest.approx(4.0 * (0.002 + payload.nbytes / (profile.host_copy_bytes_per_s / 2)))]
    assert b.import_blocks(payload).imported == 0 and len(slept) == 1  # all cached already: nothing moves
    per_token, rate, setup = b.kv_transfer.pull_figures()
    assert (per_token, rate, setup) == (profile.kv_bytes_per_token, pytest.approx(25.15e9 / 4), pytest.approx(0.008))
