"""Issue 31: a long prompt must not stall other requests. Through the Serve application
(2 emulated CPU replicas: every step sleeps the ``cpu_measured`` profile's time for
what it computes, so a 6k-token prefill takes about 10 s without burning the CI's
cores), one long prompt per replica, then short requests alongside them. A request
joins at a step boundary, so it may wait one lone chunk (at most 1 s: 4 step targets)."""

from __future__ import annotations

import asyncio
import time

import pytest

ray = pytest.importorskip("ray")
httpx = pytest.importorskip("httpx")
from ray import serve  # noqa: E402

from kvroute.cluster.router_lookup import app_router, kill_router_actor  # noqa: E402
from kvroute.deploy.app import build_app, parse_args  # noqa: E402
from tests.conftest import end_serve_app, wait_until  # noqa: E402

MODEL = "tiny-emulated"
LONG_TOKENS = 6000  # about 10 s of emulated CPU prefill


@pytest.fixture(scope="module")
def app(ray_cluster, tiny_llama_path):
    name = "kvlong"
    engine = {"emulate": "cpu_measured", "block_size": 16, "num_kv_blocks": 1024, "max_model_len": 8192}
    args = {
        "app_name": name,
        "llm_configs": [{
            "model_loading_config": {"model_id": MODEL, "model_source": str(tiny_llama_path)},
            "engine_kwargs": engine,
            "deployment_config": {"num_replicas": 2, "ray_actor_options": {"num_cpus": 1}},
        }],
    }  # fmt: skip
    serve.run(build_app(parse_args(args)), name=name, route_prefix="/")
    router = app_router(name)
    wait_until(lambda: len(ray.get(router.replicas.remote())) == 2, 60, "both replicas registered")
    yield ray_cluster
    end_serve_app(name)


async def _timed(c: httpx.AsyncClient, body: dict) -> tuple[float, httpx.Response]:
    started = time.monotonic()
    r = await c.post("/v1/completions", json={"model": MODEL, "temperature": 0, **body})
    return time.monotonic() - started, r


def test_short_requests_finish_beside_long_prefills(app):
    """Two long prompts (one per replica: the router counts the first's queue), then
    short requests while both prefill: every short one finishes before either long one,
    each within a small share of the long prefill's time, instead of waiting it out
    (before: every chunk took a step's whole token budget, and a short request was
    admitted only with the long prompt's last chunk)."""

    async def run():
        async with httpx.AsyncClient(base_url=app, timeout=120) as c:
            longs = [
                asyncio.ensure_future(_timed(c, {"prompt": [1000 + (7 * i + j) % 30000 for j in range(LONG_TOKENS)],
                                                 "max_tokens": 1}))
                for i in range(2)
            ]  # fmt: skip
            await asyncio.sleep(1.0)
            shorts = []
            for i in range(6):
                shorts.append(asyncio.ensure_future(_timed(c, {"prompt": f"short {i}", "max_tokens": 4})))
                await asyncio.sleep(0.5)
            short_results = await asyncio.gather(*shorts)
            shorts_done = time.monotonic()
            long_results = await asyncio.gather(*longs)
            return short_results, long_results, shorts_done, time.monotonic()

    short_results, long_results, shorts_done, longs_done = asyncio.run(run())
    assert [r.status_code for _, r in short_results + long_results] == [200] * 8
    assert all(r.json()["usage"]["completion_tokens"] == 4 for _, r in short_results)
    long_s = min(s for s, _ in long_results)
    assert long_s > 6.0, long_s  # the long prefills really were long
    assert shorts_done < longs_done - 1.0, (shorts_done, longs_done)
    assert max(s for s, _ in short_results) < 0.35 * long_s, ([s for s, _ in short_results], long_s)
