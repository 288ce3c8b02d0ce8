"""The Ray Serve app under hostile and generated input, over HTTP on loopback.

Two sources of bodies: the hostile table (tests/deploy/hostile.py: wrong types,
NaN/Infinity/huge integers, surrogates, invalid UTF-8, nested prompt lists, bad ids,
enormous stop lists, bodies over the limit, unknown fields (a 400 naming them), bad
logits fields and structured-output specs, tool fields, wrong content types), and
schemathesis generating valid and invalid requests from the app's own
``/openapi.json`` (bounded and derandomized, so a CI run is repeatable). Whatever
comes in: no 5xx but 503, every error in OpenAI's envelope, no answer later than the
request timeout, and afterwards the service healthy, answering as before, with no
request running and no KV block in use.
"""

from __future__ import annotations

import asyncio
import json
import time

import pytest

ray = pytest.importorskip("ray")
httpx = pytest.importorskip("httpx")
schemathesis = pytest.importorskip("schemathesis")
hypothesis = pytest.importorskip("hypothesis")
from ray import serve  # noqa: E402

from kvroute.cluster.client import KVRouteClient  # noqa: E402
from kvroute.cluster.router_actor import app_router, kill_router_actor, kill_router_actors  # noqa: E402
from kvroute.deploy.app import build_app, parse_args  # noqa: E402
from tests.conftest import wait_until  # noqa: E402
from tests.deploy import hostile  # noqa: E402

MODEL = "tiny-fuzz"
TIMEOUT_S = 20.0
MAX_BODY_BYTES = 64 * 1024
SLACK_S = 10.0  # HTTP and Serve around the request's own timeout
GREEDY = {"prompt": "The rules of the archive are", "max_tokens": 8, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def fuzz_app(ray_cluster, tiny_llama_path):
    name = "kvfuzz"
    args = {
        "app_name": name,
        "llm_configs": [
            {
                "model_loading_config": {"model_id": MODEL, "model_source": str(tiny_llama_path)},
                "engine_kwargs": {"block_size": 8, "num_kv_blocks": 256, "max_model_len": 256, "dtype": "float32"},
                "deployment_config": {"num_replicas": 2, "ray_actor_options": {"num_cpus": 1}},
            }
        ],
        "ingress": {"max_n": 4, "max_prompts": 4, "request_timeout_s": TIMEOUT_S, "max_body_bytes": MAX_BODY_BYTES},
    }
    parsed = parse_args(args)
    serve.run(build_app(parsed), name=name, route_prefix="/fuzz")
    router = app_router(name)
    wait_until(lambda: len(ray.get(router.replicas.remote())) == 2, 60, "both replicas registered")
    url = ray_cluster + "/fuzz"
    before = httpx.post(url + "/v1/completions", json=GREEDY, timeout=60)
    assert before.status_code == 200, before.text
    yield url, router, parsed, before.json()["choices"][0]["text"]
    serve.delete(name)
    kill_router_actors(name)


def _check_response(status: int, content: bytes, content_type: str, elapsed_s: float) -> None:
    assert elapsed_s < TIMEOUT_S + SLACK_S, f"answered after {elapsed_s:.1f} s"
    assert status < 500 or status == 503, (status, content[:500])
    if status >= 400:
        err = hostile.check_envelope(status, content)
        assert err["type"] != "server_error", err
    elif content_type.startswith("text/event-stream"):
        for line in content.decode().splitlines():
            if line.startswith("data: {") and '"error"' in line:
                err = json.loads(line[6:])["error"]
                # A stream may end in an error event (its deadline), never an internal one.
                assert err["type"] != "server_error", err


def test_hostile_table_through_serve(fuzz_app):
    url, _, _, _ = fuzz_app
    rows = hostile.table(vocab_size=49152, max_body_bytes=MAX_BODY_BYTES)

    async def send(c, row):
        headers = {} if row.content_type is None else {"content-type": row.content_type}
        started = time.monotonic()
        resp = await c.post(row.route, content=row.body, headers=headers)
        return row, resp, time.monotonic() - started

    async def run():
        limits = httpx.Limits(max_connections=16)
        async with httpx.AsyncClient(base_url=url, timeout=TIMEOUT_S + 2 * SLACK_S, limits=limits) as c:
            return await asyncio.gather(*(send(c, row) for row in rows))

    failures = []
    for row, resp, elapsed in asyncio.run(run()):
        try:
            assert resp.status_code in row.statuses, (resp.status_code, resp.text[:300])
            _check_response(resp.status_code, resp.content, resp.headers.get("content-type", ""), elapsed)
            if resp.status_code == 400 and row.param is not None:
                err = resp.json()["error"]
                assert row.param in (err["param"] or "") or row.param in err["message"], err
        except AssertionError as exc:
            failures.append(f"{row.name}: {exc}")
    assert not failures, "\n".join(failures)


def test_schemathesis_generated_requests_through_serve(fuzz_app):
    from hypothesis import HealthCheck, given, settings
    from schemathesis import GenerationMode

    url, _, _, _ = fuzz_app
    schema = schemathesis.openapi.from_url(url + "/openapi.json")
    operations = [result.ok() for result in schema.get_all_operations()]
    assert {op.path for op in operations} >= {"/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"}
    seen: dict[int, int] = {}

    for op in operations:
        has_body = op.method.upper() == "POST"  # the GET routes take no input to get wrong
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE) if has_body else (GenerationMode.POSITIVE,):
            examples = 40 if has_body else 3

            @settings(
                max_examples=examples,
                deadline=None,
                database=None,
                derandomize=True,
                suppress_health_check=list(HealthCheck),
            )
            @given(case=op.as_strategy(generation_mode=mode))
            def check(case):
                started = time.monotonic()
                resp = case.call(base_url=url, timeout=TIMEOUT_S + 2 * SLACK_S)
                elapsed = time.monotonic() - started
                seen[resp.status_code] = seen.get(resp.status_code, 0) + 1
                content_type = resp.headers.get("content-type") or [""]  # schemathesis: a list per header
                _check_response(resp.status_code, resp.content, content_type[0], elapsed)

            check()
    assert seen.get(200, 0) > 0 and seen.get(400, 0) > 0, seen  # both valid and invalid bodies were served


def test_service_is_healthy_correct_and_idle_after_the_fuzzing(fuzz_app):
    url, router, parsed, before = fuzz_app
    assert httpx.get(url + "/health", timeout=30).status_code == 200
    after = httpx.post(url + "/v1/completions", json=GREEDY, timeout=60)
    assert after.status_code == 200 and after.json()["choices"][0]["text"] == before
    config = parsed.cluster_config()
    handle = serve.get_deployment_handle(config.deployment_name, app_name=config.app_name)
    client = KVRouteClient(handle, config.hash_spec)

    def idle():
        states = [asyncio.run(client.debug_state(rid, 10.0)) for rid in ray.get(router.replicas.remote())]
        return len(states) == 2 and all(
            s["blocks_in_use"] == 0 and s["num_running"] == 0 and s["num_waiting"] == 0 for s in states
        )

    wait_until(idle, 30, "every replica idle with no KV block in use", interval_s=0.5)
