"""The Ray Serve application end to end: ``build_app`` on a real local Ray cluster,
requests through Serve's HTTP proxy on loopback with the official ``openai`` client.

The module's application (``app``: 2 replicas, the tool flags, the fuzzing limits) also
takes hostile and generated input, last: the hostile table (tests/deploy/hostile.py:
wrong types, NaN/Infinity/huge integers, surrogates, invalid UTF-8, nested prompt lists,
bad ids, enormous stop lists, bodies over the limit, unknown fields (a 400 naming them),
bad logits fields and structured-output specs, tool fields, wrong content types), and
schemathesis generating valid and invalid requests from the app's own ``/openapi.json``
(bounded and derandomized, so a CI run is repeatable). Whatever comes in: no 5xx but 503,
every error in OpenAI's envelope, no answer later than the request timeout, and
afterwards the service healthy, answering as before (the greedy text it gave when it
came up), with no request running and no KV block in use.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time

import pytest

ray = pytest.importorskip("ray")
httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")
from ray import serve  # noqa: E402

from kvroute.cluster.client import KVRouteClient  # noqa: E402
from kvroute.cluster.router_lookup import app_router, kill_router_actor  # noqa: E402
from kvroute.deploy.app import build_app, parse_args  # noqa: E402
from tests.conftest import end_serve_app, wait_until  # noqa: E402
from tests.deploy import hostile  # noqa: E402

MODEL = "tiny-served"
TOOL_FLAGS = {"chat_template": "chatml_tools", "tool_call_parser": "hermes", "enable_auto_tool_choice": True}
TIMEOUT_S = 20.0
MAX_BODY_BYTES = 64 * 1024
SLACK_S = 10.0  # HTTP and Serve around the request's own timeout
# what the fuzzing (at the end of the module) may ask for at most
FUZZ_LIMITS = {"max_n": 4, "max_prompts": 4, "request_timeout_s": TIMEOUT_S, "max_body_bytes": MAX_BODY_BYTES}
GREEDY = {"prompt": "The rules of the archive are", "max_tokens": 8, "temperature": 0, "ignore_eos": True}


def _args(model_path, app_name: str, **deployment) -> dict:
    return {
        "app_name": app_name,
        "llm_configs": [
            {
                "model_loading_config": {"model_id": MODEL, "model_source": str(model_path)},
                "engine_kwargs": {"block_size": 8, "num_kv_blocks": 256, "max_model_len": 512, "dtype": "float32"},
                "deployment_config": {"num_replicas": 2, "ray_actor_options": {"num_cpus": 1}, **deployment},
            }
        ],
    }


@pytest.fixture(scope="module")
def app(ray_cluster, tiny_llama_path):
    name = "kvhttp"
    parsed = parse_args({**_args(tiny_llama_path, name), "ingress": {**TOOL_FLAGS, **FUZZ_LIMITS}})
    serve.run(build_app(parsed), name=name, route_prefix="/")
    router = app_router(name)
    wait_until(lambda: len(ray.get(router.replicas.remote())) == 2, 60, "both replicas registered")
    before = httpx.post(ray_cluster + "/v1/completions", json=GREEDY, timeout=60)
    assert before.status_code == 200, before.text
    yield ray_cluster, router, parsed, before.json()["choices"][0]["text"]
    end_serve_app(name)


def _states(router, cluster_config) -> dict[str, dict]:
    handle = serve.get_deployment_handle(cluster_config.deployment_name, app_name=cluster_config.app_name)
    client = KVRouteClient(handle, cluster_config.hash_spec)
    return {rid: asyncio.run(client.debug_state(rid, 10.0)) for rid in ray.get(router.replicas.remote())}


def test_completions_chat_and_prefix_hits_through_serve(app):
    url, router, _, _ = app
    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=60)
    r = client.completions.create(model=MODEL, prompt="Hello through Serve", max_tokens=6, temperature=0)
    assert r.usage.completion_tokens == 6 and r.choices[0].finish_reason == "length"
    chunks = list(client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=5, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert sum(1 for c in chunks if c.choices and c.choices[0].delta.content) >= 1
    prompt = "A long shared system prompt about the rules of the archive, " * 6
    first = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0)
    time.sleep(0.5)  # the holder's KV events reach the router
    second = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0)
    n = first.usage.prompt_tokens
    assert second.usage.prompt_tokens_details.cached_tokens == (n - 1) // 8 * 8  # routed to the holder
    models = httpx.get(url + "/v1/models").json()
    assert [m["id"] for m in models["data"]][0] == MODEL
    assert httpx.get(url + "/health").status_code == 200


def test_metrics_cover_every_replica_and_the_router(app):
    from prometheus_client.parser import text_string_to_metric_families

    url, router, _, _ = app
    replicas = set(ray.get(router.replicas.remote()))

    def families():
        text = httpx.get(url + "/metrics", timeout=30).text
        fams = {f.name: f for f in text_string_to_metric_families(text)}
        seen = {s.labels["replica"] for s in fams["vllm:num_requests_running"].samples}
        hits = sum(s.value for s in fams["vllm:prefix_cache_hits"].samples)
        # requests routed to each replica that its load reports do not count yet: none,
        # once the replicas have reported after the earlier requests
        in_flight = {s.labels["replica"]: s.value for s in fams["kvroute:router_in_flight"].samples}
        return fams if seen == replicas and hits > 0 and in_flight == dict.fromkeys(replicas, 0.0) else None

    # Replicas report about once a second: wait for reports that include the earlier hits.
    fams = wait_until(families, 15, "a metrics report from every replica, with the cache hits, nothing in flight", interval_s=0.5)
    for name in ("vllm:kv_cache_usage_perc", "vllm:prefix_cache_hits", "vllm:time_to_first_token_seconds",
                 "vllm:inter_token_latency_seconds", "vllm:e2e_request_latency_seconds", "vllm:num_preemptions"):
        assert name in fams
    reasons = {s.labels["reason"] for s in fams["kvroute:routing_decisions"].samples}
    assert "prefix" in reasons
    assert fams["kvroute:router_replicas"].samples[0].value == 2
    assert fams["kvroute:directory_blocks"].samples[0].value > 0
    value = {f: fams[f].samples[0].value for f in ("kvroute:predicted_cached_tokens", "kvroute:actual_cached_tokens",
                                                    "kvroute:routed_requests", "kvroute:router_fallbacks")}
    assert value["kvroute:routed_requests"] >= 4 and value["kvroute:router_fallbacks"] == 0
    # the one router's CPU use (what the ingresses spill by), a real figure of its process
    (cpu,) = fams["kvroute:router_cpu_cores"].samples
    assert cpu.labels["router"] == "0" and 0.0 <= cpu.value < 2.0
    assert fams["kvroute:router_spills"].samples[0].value == 0
    assert value["kvroute:predicted_cached_tokens"] > 0
    assert value["kvroute:actual_cached_tokens"] == value["kvroute:predicted_cached_tokens"]
    reuse = {s.labels["figure"]: s.value for s in fams["kvroute:reuse_tokens"].samples if s.name.endswith("_total")}
    assert reuse["captured"] == value["kvroute:predicted_cached_tokens"] and reuse["delivered"] == reuse["captured"]
    assert reuse["offered"] > reuse["available"] >= reuse["captured"] > 0
    procs = fams["kvroute:process_resident_memory_bytes"].samples
    assert {s.labels["role"] for s in procs} == {"replica", "router", "http"}
    assert {s.labels["replica"] for s in procs if s.labels["role"] == "replica"} == replicas
    assert len({s.labels["pid"] for s in procs}) == 4 and all(s.value > 10 * 2**20 for s in procs)


def test_replica_side_errors_are_400_and_unknown_model_404(app):
    url, _, _, _ = app
    resp = httpx.post(url + "/v1/completions", json={"prompt": "x", "max_tokens": 2, "stop_token_ids": [10**6]}, timeout=30)
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["message"].startswith("stop_token_ids must be in [0, ")  # the engine's own words
    resp = httpx.post(url + "/v1/completions", json={"model": "other", "prompt": "x"}, timeout=30)
    assert resp.status_code == 404


def test_health_is_503_until_a_replica_registers(ray_cluster, tiny_llama_path):
    """The ingress' readiness is the router actor's: 503 in the envelope while it knows
    no replica (all starting, or all lost), 200 once one registered."""
    from kvroute.cluster.config import ClusterConfig
    from kvroute.cluster.router_actor import get_or_create_router_actor
    from kvroute.deploy.openai.api import build_api
    from kvroute.deploy.backends.cluster import ClusterBackend
    from kvroute.deploy.openai.serving import OpenAIServing
    from kvroute.replica.config import EngineConfig
    from kvroute.replica.checkpoint import load_tokenizer
    from tests.deploy.server import running

    config = ClusterConfig(engine=EngineConfig(model=str(tiny_llama_path)), app_name="kvhealth")
    router = get_or_create_router_actor(config)
    try:
        tokenizer = load_tokenizer(tiny_llama_path)
        serving = OpenAIServing(MODEL, tokenizer, 512, 49152, ClusterBackend(None, [router], tokenizer, None))

        async def no_metrics():
            return b"", "text/plain"

        with running(build_api(serving, no_metrics)) as url:
            resp = httpx.get(url + "/health", timeout=30)
            assert resp.status_code == 503 and resp.json()["error"]["type"] == "service_unavailable_error"
            assert resp.headers["Retry-After"] == "1"
            ray.get(router.register.remote("r1", config.hash_spec, 16, [], 0))
            assert httpx.get(url + "/health", timeout=30).status_code == 200
            ray.get(router.remove_replica.remote("r1"))
            assert httpx.get(url + "/health", timeout=30).status_code == 503
            # a replica hashing with another seed is refused, and /health names it
            other = dataclasses.replace(config.hash_spec, seed=config.hash_spec.seed + 1)
            with pytest.raises(ValueError, match="hashes blocks with"):
                ray.get(router.register.remote("r2", other, 16, [], 0))
            body = httpx.get(url + "/health", timeout=30).json()
            assert "r2" in body["refused_replicas"] and "hash_seed" in body["refused_replicas"]["r2"]
    finally:
        kill_router_actor(config.router_actor_name)


def test_client_disconnect_frees_blocks_on_the_replica(app):
    url, router, parsed, _ = app
    config = parsed.cluster_config()

    async def leave_early():
        async with httpx.AsyncClient(base_url=url, timeout=60) as c:
            body = {"prompt": "Keep going " * 10, "max_tokens": 400, "ignore_eos": True, "stream": True}
            async with c.stream("POST", "/v1/completions", json=body) as resp:
                assert resp.status_code == 200
                async for line in resp.aiter_lines():
                    if line.startswith("data: "):
                        break

    asyncio.run(leave_early())

    def idle():
        states = _states(router, config)
        return all(s["blocks_in_use"] == 0 and s["num_running"] == 0 and s["num_waiting"] == 0 for s in states.values())

    wait_until(idle, 20, "every replica idle with no block in use", interval_s=0.3)


def test_overload_is_429_with_retry_after_and_api_key_applies(ray_cluster, tiny_llama_path):
    name = "kvhttp-small"
    args = _args(tiny_llama_path, name, num_replicas=1, max_ongoing_requests=1, max_queued_requests=1)
    args["ingress"] = {"api_key": "k3y", "request_timeout_s": 60}
    serve.run(build_app(args), name=name, route_prefix="/small")
    try:
        url = ray_cluster + "/small"
        assert httpx.post(url + "/v1/completions", json={"prompt": "x"}).status_code == 401
        headers = {"Authorization": "Bearer k3y"}
        body = {"prompt": "Busy " * 10, "max_tokens": 60, "ignore_eos": True}
        # The queue holds one request; multi-request bodies (n > 1, prompt lists,
        # streamed or not) join the burst: each is served whole or refused at once.
        bodies = [body] * 8 + [{**body, "n": 2}, {**body, "prompt": ["Busy", "Idle"], "stream": True}] * 2

        async def timed(c, b):
            started = time.monotonic()
            resp = await c.post("/v1/completions", json=b)
            return resp, time.monotonic() - started

        async def burst():
            async with httpx.AsyncClient(base_url=url, timeout=120, headers=headers) as c:
                return await asyncio.gather(*(timed(c, b) for b in bodies))

        results = asyncio.run(burst())
        codes = sorted(r.status_code for r, _ in results)
        assert set(codes) <= {200, 429} and codes.count(200) >= 1 and codes.count(429) >= 4, codes
        assert max(s for _, s in results) < 60  # nobody waited past request_timeout_s
        rejected = next(r for r, _ in results if r.status_code == 429)
        assert int(rejected.headers["Retry-After"]) >= 1
        assert rejected.json()["error"]["type"] == "rate_limit_error"
        for (r, _), b in zip(results, bodies):
            if r.status_code == 200 and not b.get("stream"):
                assert r.json()["usage"]["completion_tokens"] == 60 * b.get("n", 1)
            elif r.status_code == 200:
                assert r.text.count('"finish_reason":"length"') == 2 and "error" not in r.text
        after = httpx.post(url + "/v1/completions", json={"prompt": "x", "max_tokens": 2}, headers=headers, timeout=60)
        assert after.status_code == 200
    finally:
        end_serve_app(name)


def test_rays_prefix_cache_affinity_router_swaps_in(ray_cluster, tiny_llama_path):
    """`--router prefix_affinity_ray`: Ray's own PrefixCacheAffinityRouter routes the
    same application (it matches on the prompt text the client attaches)."""
    from kvroute.deploy.app_config import router_choice

    name = "kvhttp-ray-router"
    route = router_choice("prefix_affinity_ray")
    args = _args(tiny_llama_path, name, request_router_config={"request_router_class": route["request_router_class"]})
    serve.run(build_app(args), name=name, route_prefix="/rayrouter")
    try:
        client = openai.OpenAI(base_url=ray_cluster + "/rayrouter/v1", api_key="none", max_retries=0, timeout=60)
        prompt = "Shared instructions for the affinity router to match on. " * 6
        outs = [client.completions.create(model=MODEL, prompt=prompt, max_tokens=3, temperature=0) for _ in range(3)]
        assert all(o.usage.completion_tokens == 3 for o in outs)
        assert len({o.choices[0].text for o in outs}) == 1
    finally:
        end_serve_app(name)


def _texts_by_index(resp_json) -> list[str]:
    return [c["text"] for c in sorted(resp_json["choices"], key=lambda c: c["index"])]


def _stream_texts(c, route: str, body: dict) -> list[str]:
    texts: dict[int, str] = {}
    with c.stream("POST", route, json={**body, "stream": True}) as resp:
        assert resp.status_code == 200, resp.read()
        for line in resp.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            assert "error" not in event, event
            for ch in event["choices"]:
                piece = ch["text"] if "text" in ch else ch["delta"].get("content", "")
                texts[ch["index"]] = texts.get(ch["index"], "") + (piece or "")
    return [texts[i] for i in sorted(texts)]


def test_every_multi_request_body_is_served_through_serve(app):
    """n > 1, prompt lists (text and token ids), streaming and chat n > 1: each choice and
    each list entry is its own request to Serve, and each equals the lone request."""
    url, router, parsed, _ = app
    body = {"max_tokens": 5, "temperature": 0, "ignore_eos": True}
    chat = {"messages": [{"role": "user", "content": "Name a color."}], **body}
    with httpx.Client(base_url=url, timeout=60) as c:
        alone = {p: _texts_by_index(c.post("/v1/completions", json={**body, "prompt": p}).json())[0] for p in ("hello", "world")}
        ids = [c.post("/tokenize", json={"prompt": p}).json()["tokens"] for p in ("hello", "world")]
        chat_alone = c.post("/v1/chat/completions", json=chat).json()["choices"][0]["message"]["content"]

        started = time.monotonic()
        r = c.post("/v1/completions", json={**body, "prompt": "hello", "n": 3})
        assert r.status_code == 200, r.text
        assert _texts_by_index(r.json()) == [alone["hello"]] * 3
        r = c.post("/v1/completions", json={**body, "prompt": ["hello", "world"], "n": 2})
        assert _texts_by_index(r.json()) == [alone["hello"]] * 2 + [alone["world"]] * 2
        assert r.json()["usage"]["completion_tokens"] == 20
        r = c.post("/v1/completions", json={**body, "prompt": ids})
        assert _texts_by_index(r.json()) == [alone["hello"], alone["world"]]
        assert _stream_texts(c, "/v1/completions", {**body, "prompt": ["hello", "world"], "n": 2}) == (
            [alone["hello"]] * 2 + [alone["world"]] * 2
        )
        r = c.post("/v1/chat/completions", json={**chat, "n": 2})
        assert [ch["message"]["content"] for ch in r.json()["choices"]] == [chat_alone] * 2
        assert _stream_texts(c, "/v1/chat/completions", {**chat, "n": 2}) == [chat_alone] * 2
        assert time.monotonic() - started < 45  # was: 300 s per request, then 503

    def idle():
        states = _states(router, parsed.cluster_config())
        return all(s["blocks_in_use"] == 0 and s["num_running"] == 0 for s in states.values())

    wait_until(idle, 20, "every replica idle with no block in use", interval_s=0.3)


def test_multi_request_bodies_do_not_hold_up_other_clients(app):
    """Five long n=2 / prompt-list requests in flight, then a short one-prompt request:
    it is served at once, and the long ones all finish."""
    url, _, _, _ = app
    long = {"max_tokens": 60, "ignore_eos": True, "temperature": 0}

    async def run():
        async with httpx.AsyncClient(base_url=url, timeout=120) as c:
            heavy = [
                asyncio.ensure_future(c.post("/v1/completions", json={**long, "prompt": f"long {i}", "n": 2}))
                for i in range(3)
            ] + [
                asyncio.ensure_future(c.post("/v1/completions", json={**long, "prompt": [f"a {i}", f"b {i}"], "stream": True}))
                for i in range(2)
            ]
            await asyncio.sleep(1.0)
            started = time.monotonic()
            short = await c.post("/v1/completions", json={"prompt": "quick", "max_tokens": 2})
            short_s = time.monotonic() - started
            return short, short_s, await asyncio.gather(*heavy)

    short, short_s, heavy = asyncio.run(run())
    assert short.status_code == 200 and short.json()["usage"]["completion_tokens"] == 2
    assert short_s < 20, short_s  # was: 37 s and more
    assert [r.status_code for r in heavy] == [200] * 5
    assert all(r.json()["usage"]["completion_tokens"] == 120 for r in heavy[:3])


def test_tools_json_schema_and_prompt_logprobs_through_serve(app):
    """What the answers carry survives the replicas' path: forced tool calls (whole and
    streamed), a JSON-schema answer, and the prompt logprobs the replica's first delta
    brings (also as echo's logprobs)."""
    import jsonschema

    url, _, _, _ = app
    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=60)
    tz = {"type": "object", "properties": {"tz": {"enum": ["UTC", "CET"]}}, "required": ["tz"]}
    tools = [{"type": "function", "function": {"name": "get_time", "parameters": tz}}]
    ask = [{"role": "user", "content": "What time is it?"}]
    # seeded: the random model may pad the JSON with whitespace (the grammar allows it) past max_tokens
    kw = dict(model=MODEL, messages=ask, max_tokens=200, seed=1)
    r = client.chat.completions.create(tools=tools, tool_choice="required", parallel_tool_calls=False, n=2, **kw)
    for choice in r.choices:
        [call] = choice.message.tool_calls
        assert choice.finish_reason == "tool_calls" and call.function.name == "get_time"
        jsonschema.validate(json.loads(call.function.arguments), tz)
    named = {"type": "function", "function": {"name": "get_time"}}
    chunks = list(client.chat.completions.create(tools=tools, tool_choice=named, stream=True, **kw))
    deltas = [tc for c in chunks for tc in (c.choices[0].delta.tool_calls or ())]
    assert deltas[0].function.name == "get_time" and chunks[-1].choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads("".join(d.function.arguments or "" for d in deltas)), tz)
    doc = client.chat.completions.create(response_format={"type": "json_schema", "json_schema": {"name": "t", "schema": tz}},
                                         **kw)  # fmt: skip
    jsonschema.validate(json.loads(doc.choices[0].message.content), tz)
    ids = httpx.post(url + "/tokenize", json={"prompt": "prompt logprobs through serve"}).json()["tokens"]
    c = client.completions.create(model=MODEL, prompt=ids, max_tokens=1, extra_body={"prompt_logprobs": 1})
    plp = c.choices[0].model_extra["prompt_logprobs"]
    assert plp[0] is None and [int(next(iter(p))) for p in plp[1:]] == ids[1:]
    echo = client.completions.create(model=MODEL, prompt=ids, max_tokens=0, echo=True, logprobs=1)
    lp = echo.choices[0].logprobs
    assert lp.token_logprobs[0] is None and len(lp.tokens) == len(ids) and echo.usage.completion_tokens == 0
    assert lp.token_logprobs[1:] == pytest.approx([next(iter(p.values()))["logprob"] for p in plp[1:]], abs=1e-4)


# The Messages API with the anthropic client, on this module's app (collected here, after the above).
from tests.deploy.serve_app_messages import (  # noqa: E402,F401
    test_messages_through_serve_answer_as_the_chat_path_and_hit_the_cache,
    test_messages_tool_loop_through_serve,
)


# Hostile and generated input, last: the module's app after all of the above.


def _check_response(status: int, content: bytes, content_type: str, elapsed_s: float) -> None:
    assert elapsed_s < TIMEOUT_S + SLACK_S, f"answered after {elapsed_s:.1f} s"
    assert status < 500 or status == 503, (status, content[:500])
    if status >= 400:
        err = hostile.check_envelope(status, content)
        assert err["type"] != "server_error", err
    elif content_type.startswith("text/event-stream"):
        for line in content.decode().splitlines():
            if not line.startswith("data: {"):
                continue
            event = json.loads(line[6:])
            # chat/completions put an error object at the top; the Responses API sends {"type": "error", ...}
            err = event.get("error") if isinstance(event.get("error"), dict) else None
            if event.get("type") == "error":
                err = event
            # A stream may end in an error event (its deadline), never an internal one.
            if err is not None:
                assert err.get("type") != "server_error" and err.get("code") != "server_error", err


def test_hostile_table_through_serve(app):
    url, _, _, _ = app
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


def test_schemathesis_generated_requests_through_serve(app):
    schemathesis = pytest.importorskip("schemathesis")
    pytest.importorskip("hypothesis")
    from hypothesis import HealthCheck, given, settings
    from schemathesis import GenerationMode

    url, _, _, _ = app
    schema = schemathesis.openapi.from_url(url + "/openapi.json")
    operations = [result.ok() for result in schema.get_all_operations()]
    assert {op.path for op in operations} >= {"/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"}
    seen: dict[int, int] = {}

    for op in operations:
        has_body = op.method.upper() == "POST"  # the GET routes take no input to get wrong
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE) if has_body else (GenerationMode.POSITIVE,):
            examples = 20 if has_body else 3

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


def test_service_is_healthy_correct_and_idle_after_the_fuzzing(app):
    url, router, parsed, before = app
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
