"""Pulling a prefix's KV through Ray (``cluster/kv_pull.py``) on the session's local Ray
cluster: a source engine in an actor, the destination engine in this process. A pull
leaves the prefix cached with an undisturbed run's output; a source killed before or
during its export, or one slower than the deadline, gives a fallback with nothing
imported and no block leaked on either side."""

from __future__ import annotations

import asyncio
import random
import time

import pytest

from tests.cluster.conftest import tiny_engine, wait_until

ray = pytest.importorskip("ray")

from kvroute.cluster.kv_pull import export_payload, pull_prefix  # noqa: E402
from kvroute.replica.async_engine import AsyncEngine  # noqa: E402
from kvroute.replica.sampling_params import SamplingParams  # noqa: E402

GREEDY = SamplingParams(temperature=0.0, max_tokens=8)
_RNG = random.Random(3)
PROMPT = [_RNG.randrange(100, 40_000) for _ in range(200)]  # 25 full blocks of 8


class Source:
    """A source replica's engine in its own process (what ``EngineReplica.export_kv`` runs)."""

    def __init__(self, config) -> None:
        self.engine = AsyncEngine.from_config(config)

    async def generate(self, token_ids) -> list[int]:
        return [t async for d in self.engine.generate(token_ids, GREEDY) for t in d.token_ids]

    def slow_exports(self, seconds: float) -> None:
        """Each export's copy takes ``seconds`` longer (one function of the real engine
        replaced; 0 puts the real one back)."""
        xfer = self.engine.engine.kv_transfer
        xfer.__dict__.pop("copy", None)
        if seconds:
            real = xfer.copy
            xfer.copy = lambda lease, on_device=False: (time.sleep(seconds), real(lease, on_device))[1]

    async def export_kv(self, token_ids):
        return await export_payload(self.engine, token_ids)

    async def blocks_in_use(self) -> int:
        return await self.engine.between_steps(lambda: sum(1 for c in self.engine.engine.stats().block_ref_counts if c))


def _start(model) -> "ray.actor.ActorHandle":
    actor = ray.remote(Source).options(num_cpus=0).remote(tiny_engine(model))
    ray.get(actor.generate.remote(PROMPT))  # started, its engine loaded, the prefix cached
    return actor


@pytest.fixture(scope="module")
def source(ray_cluster, tiny_llama_path):
    """A source that lives through the module's tests."""
    actor = _start(tiny_llama_path)
    yield actor
    ray.kill(actor)


@pytest.fixture()
def doomed(ray_cluster, tiny_llama_path):
    """A source a test kills."""
    actor = _start(tiny_llama_path)
    yield actor
    ray.kill(actor)


@pytest.fixture(scope="module")
def dest(tiny_llama_path):
    return AsyncEngine.from_config(tiny_engine(tiny_llama_path))


def _assert_clean(dest: AsyncEngine) -> None:
    stats = dest.engine.stats()
    assert stats.num_running == 0 and stats.num_waiting == 0
    assert set(stats.block_ref_counts) <= {0} and stats.num_free_blocks == stats.num_kv_blocks


def _pull(dest, source, timeout_s: float = 10.0, prompt=PROMPT):
    return pull_prefix(dest, lambda: source.export_kv.remote(prompt), timeout_s)


def test_a_pull_leaves_the_prefix_cached_with_an_undisturbed_output(source, dest):
    assert dest.engine.reset_prefix_cache()
    expected = ray.get(source.generate.remote(PROMPT))  # the same greedy run, now from its cache

    async def main():
        result = await _pull(dest, source)
        deltas = [d async for d in dest.generate(PROMPT, GREEDY)]
        return result, deltas

    result, deltas = asyncio.run(main())
    arch = dest.engine.arch
    assert result.ok and (result.blocks, result.tokens) == (25, 200)
    assert result.nbytes == 25 * arch.num_layers * 2 * 8 * arch.num_kv_heads * arch.head_dim * 4
    assert [t for d in deltas for t in d.token_ids] == expected
    assert deltas[-1].num_cached_tokens == 192  # the block of the prompt's last token is computed again
    m = dest.engine.kv_transfer.metrics
    assert m.pulled_tokens >= 192 and m.pull_s.count >= 1 and m.pull_bytes_per_s > 0
    _assert_clean(dest)
    assert ray.get(source.blocks_in_use.remote()) == 0


def _fallback(dest, source, why: str, kill_after_s: float | None = None, timeout_s: float = 10.0, prompt=PROMPT):
    assert dest.engine.reset_prefix_cache()
    before = dest.engine.kv_transfer.metrics.fallbacks.get(why, 0)

    async def main():
        pull = asyncio.ensure_future(_pull(dest, source, timeout_s, prompt))
        if kill_after_s is not None:
            await asyncio.sleep(kill_after_s)
            ray.kill(source)
        result = await pull
        await asyncio.sleep(0.2)  # anything the pull left behind would settle now
        return result

    result = asyncio.run(main())
    assert result.fallback == why and result.blocks == 0, result
    assert dest.engine.cached_block_hashes() == []
    assert dest.engine.kv_transfer.metrics.fallbacks[why] == before + 1
    _assert_clean(dest)
    return result


def test_a_source_killed_before_the_pull_falls_back(doomed, dest):
    ray.kill(doomed)
    _fallback(dest, doomed, "source_failed")


def test_a_source_killed_while_exporting_falls_back(doomed, dest):
    ray.get(doomed.slow_exports.remote(5.0))
    result = _fallback(dest, doomed, "source_failed", kill_after_s=1.0)
    assert result.seconds < 5.0  # it did not wait for the dead source's copy


def test_a_pull_past_its_deadline_falls_back_and_the_source_releases(source, dest):
    ray.get(source.slow_exports.remote(1.5))
    try:
        _fallback(dest, source, "timeout", timeout_s=0.5)
        wait_until(lambda: ray.get(source.blocks_in_use.remote()) == 0, 10, "the source's export released its blocks")
    finally:
        ray.get(source.slow_exports.remote(0))


def test_a_prefix_the_source_does_not_hold_falls_back(source, dest):
    _fallback(dest, source, "not_cached", prompt=[t + 1 for t in PROMPT])


def test_pulls_and_fallbacks_reach_prometheus(tiny_llama_path):
    """The destination's pulls as ``/metrics`` renders its report: pulled tokens and
    bytes, the pull's seconds, and a fallback counted under its reason."""
    from prometheus_client.parser import text_string_to_metric_families

    from kvroute.deploy.metrics import render_app

    async def run() -> dict:
        src, dst = AsyncEngine.from_config(tiny_engine(tiny_llama_path)), AsyncEngine.from_config(tiny_engine(tiny_llama_path))
        [t async for d in src.generate(PROMPT, GREEDY) for t in d.token_ids]
        ok = await pull_prefix(dst, lambda: export_payload(src, PROMPT))
        cold = await pull_prefix(dst, lambda: export_payload(src, list(range(5000, 5200))))  # never run there
        assert ok.ok and cold.fallback == "not_cached", (ok, cold)
        return await dst.metrics_report()

    report = asyncio.run(run())
    text = render_app("m", {"dst": report}, None, {}).decode()
    samples = {(s.name, s.labels.get("reason")): s.value for f in text_string_to_metric_families(text) for s in f.samples
               if s.name.startswith("kvroute:kv_")}  # fmt: skip
    assert samples[("kvroute:kv_pulls_total", None)] == 1
    assert samples[("kvroute:kv_pulled_tokens_total", None)] == 200 // 8 * 8
    assert samples[("kvroute:kv_pulled_bytes_total", None)] == report["kv_transfer"]["pulled_bytes"] > 0
    assert samples[("kvroute:kv_pull_fallbacks_total", "not_cached")] == 1
    assert samples[("kvroute:kv_pull_seconds_count", None)] == 1 and samples[("kvroute:kv_pull_seconds_sum", None)] > 0
