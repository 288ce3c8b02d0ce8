"""The OpenAI API on a real uvicorn server on loopback (the single-engine host), driven
by the official ``openai`` client and raw httpx: shapes, exactness against the offline
engine, streaming, n > 1, logprobs, stops, seeds, prefix-cache hits, metrics, the
router-compatibility endpoints, the bad-input table, auth, body caps, timeouts and
client disconnects (which must free every KV block)."""

from __future__ import annotations

import asyncio
import json

import pytest

httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")

from kvroute.deploy.replica_server import build_replica_server  # noqa: E402
from kvroute.deploy.openai.serving import ServerLimits  # noqa: E402
from kvroute.replica.config import EngineConfig  # noqa: E402
from tests.conftest import wait_until  # noqa: E402
from tests.deploy import hostile  # noqa: E402
from tests.deploy.server import running  # noqa: E402

MODEL = "tiny"
MAX_MODEL_LEN = 512


def _config(path) -> EngineConfig:
    return EngineConfig(
        model=str(path), block_size=8, num_kv_blocks=160, max_model_len=MAX_MODEL_LEN, dtype="float32", max_num_seqs=32
    )


@pytest.fixture(scope="module")
def server(tiny_llama_path):
    app, engine = build_replica_server(_config(tiny_llama_path), ServerLimits(max_n=4, max_prompts=4), MODEL)
    with running(app) as url:
        yield url, engine


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server[0] + "/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server[0], timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def offline(tiny_llama_path):
    """The same engine settings, offline: what the server must reproduce token for token."""
    from kvroute.replica.llm import LLM

    return LLM(str(tiny_llama_path), block_size=8, num_kv_blocks=160, max_model_len=MAX_MODEL_LEN, dtype="float32")


def _idle(engine) -> bool:
    stats = engine.engine.stats()
    return stats.num_running == 0 and stats.num_waiting == 0 and not any(stats.block_ref_counts)


def _greedy(offline, prompt, max_tokens):
    from kvroute.replica.sampling_params import SamplingParams

    ids = offline.tokenizer.encode(prompt) if isinstance(prompt, str) else prompt
    (out,) = offline.generate([ids], SamplingParams(temperature=0.0, max_tokens=max_tokens), use_tqdm=False)
    return out


# ---------------------------------------------------------------------- completions
def test_completion_equals_the_offline_engine(client, offline):
    want = _greedy(offline, "The quick brown fox", 12)
    r = client.completions.create(model=MODEL, prompt="The quick brown fox", max_tokens=12, temperature=0)
    assert r.object == "text_completion" and r.model == MODEL and r.id.startswith("cmpl-")
    (choice,) = r.choices
    assert choice.text == want.text and choice.finish_reason == "length" and choice.index == 0
    assert r.usage.prompt_tokens == len(want.prompt_token_ids)
    assert r.usage.completion_tokens == 12
    assert r.usage.total_tokens == r.usage.prompt_tokens + 12
    assert r.usage.prompt_tokens_details.cached_tokens >= 0


def test_prompt_lists_token_ids_and_n(client, offline):
    ids = offline.tokenizer.encode("Once upon a time")
    r = client.completions.create(model=MODEL, prompt=["Hello world", "Once upon a time"], max_tokens=4, temperature=0, n=2)
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    assert r.choices[0].text == r.choices[1].text == _greedy(offline, "Hello world", 4).text
    assert r.choices[2].text == r.choices[3].text == _greedy(offline, ids, 4).text
    assert r.usage.completion_tokens == 16
    by_ids = client.completions.create(model=MODEL, prompt=ids, max_tokens=4, temperature=0)
    assert by_ids.choices[0].text == r.choices[2].text
    lists = client.completions.create(model=MODEL, prompt=[ids, ids[:2]], max_tokens=4, temperature=0)
    assert lists.choices[0].text == r.choices[2].text and len(lists.choices) == 2


def test_streaming_completion_matches_and_reports_usage(client, http):
    full = client.completions.create(model=MODEL, prompt="A stream of", max_tokens=10, temperature=0)
    chunks = list(
        client.completions.create(
            model=MODEL, prompt="A stream of", max_tokens=10, temperature=0, stream=True, stream_options={"include_usage": True}
        )
    )
    texts = [c.choices[0].text for c in chunks if c.choices]
    assert "".join(texts) == full.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 10
    assert chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens
    with http.stream("POST", "/v1/completions", json={"prompt": "x y", "max_tokens": 3, "stream": True}) as resp:
        assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/event-stream")
        events = [line for line in resp.iter_lines() if line]
    assert events[-1] == "data: [DONE]"
    assert all(json.loads(e[len("data: "):])["object"] == "text_completion" for e in events[:-1])


def test_echo_prepends_the_prompt(client):
    plain = client.completions.create(model=MODEL, prompt="Echo this", max_tokens=4, temperature=0)
    echoed = client.completions.create(model=MODEL, prompt="Echo this", max_tokens=4, temperature=0, echo=True)
    assert echoed.choices[0].text == "Echo this" + plain.choices[0].text
    streamed = client.completions.create(model=MODEL, prompt="Echo this", max_tokens=4, temperature=0, echo=True, stream=True)
    assert "".join(c.choices[0].text for c in streamed) == echoed.choices[0].text


def test_completion_logprobs(client):
    r = client.completions.create(model=MODEL, prompt="Log probs of", max_tokens=5, temperature=0, logprobs=2)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 5
    assert "".join(lp.tokens) == r.choices[0].text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(5)]
    for token, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert value <= 0 and 1 <= len(top) <= 2
        assert max(top.values()) == pytest.approx(value, abs=1e-5)  # greedy: the sampled token is the top one
        assert token in top


def test_stop_strings_and_stop_token_ids(client, offline):
    want = _greedy(offline, "Stop me somewhere", 16)
    text = want.text
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    assert stop.strip(), f"pick a visible stop string from {text!r}"
    r = client.completions.create(model=MODEL, prompt="Stop me somewhere", max_tokens=16, temperature=0, stop=[stop])
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].text == text[: text.index(stop)]
    token = want.token_ids[3]
    r = client.completions.create(
        model=MODEL, prompt="Stop me somewhere", max_tokens=16, temperature=0, extra_body={"stop_token_ids": [token]}
    )
    assert r.choices[0].finish_reason == "stop" and r.usage.completion_tokens == want.token_ids.index(token) + 1


def test_seeded_sampling_is_reproducible(client):
    def sample(seed):
        return client.completions.create(model=MODEL, prompt="Random", max_tokens=16, temperature=1.0, seed=seed)

    a, b, c = sample(123), sample(123), sample(124)
    assert a.choices[0].text == b.choices[0].text
    assert a.choices[0].text != c.choices[0].text
    two = client.completions.create(model=MODEL, prompt="Random", max_tokens=16, temperature=1.0, seed=123, n=2)
    assert two.choices[0].text == a.choices[0].text  # choice i samples with seed + i
    assert two.choices[1].text == c.choices[0].text


def test_repeated_long_prompt_hits_the_prefix_cache(client):
    prompt = "In a distant galaxy, the archive of every star was kept by " * 8
    first = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0)
    second = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0)
    n = first.usage.prompt_tokens
    assert n > 64
    assert second.usage.prompt_tokens_details.cached_tokens == (n - 1) // 8 * 8  # every full block but the last token's
    assert second.choices[0].text == first.choices[0].text


def test_cache_salt_isolates_tenants(client):
    prompt = "A tenant's private preamble that no other tenant may reuse from cache. " * 6

    def cached(salt):
        extra = {} if salt is None else {"cache_salt": salt}
        r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=1, temperature=0, extra_body=extra)
        return r.usage.prompt_tokens_details.cached_tokens

    assert cached("tenant-a") == 0
    assert cached("tenant-b") == 0  # same text, other salt: nothing shared
    assert cached(None) == 0
    assert cached("tenant-a") > 0


# ---------------------------------------------------------------------- chat
def test_chat_completion_and_stream(client, offline):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a color."}]
    ids = offline.apply_chat_template(messages)
    want = _greedy(offline, ids, 8)
    r = client.chat.completions.create(model=MODEL, messages=messages, max_completion_tokens=8, temperature=0)
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-")
    assert r.choices[0].message.role == "assistant" and r.choices[0].message.content == want.text
    assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == 8
    chunks = list(
        client.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=8, temperature=0, stream=True, stream_options={"include_usage": True}
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.total_tokens == len(ids) + 8
    assert all(c.object == "chat.completion.chunk" for c in chunks)


def test_chat_default_max_tokens_fills_the_context(client, offline):
    messages = [{"role": "user", "content": "Go on forever."}]
    ids = offline.apply_chat_template(messages)
    r = client.chat.completions.create(model=MODEL, messages=messages, temperature=0, extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == MAX_MODEL_LEN - len(ids)
    assert r.choices[0].finish_reason == "length"


def test_chat_logprobs_and_n(client):
    r = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=4, temperature=0, logprobs=True, top_logprobs=3, n=2
    )
    assert len(r.choices) == 2
    for choice in r.choices:
        content = choice.logprobs.content
        assert len(content) == 4 and "".join(t.token for t in content) == choice.message.content
        for t in content:
            assert len(t.top_logprobs) == 3 and t.top_logprobs[0].logprob == pytest.approx(t.logprob, abs=1e-5)
            assert bytes(t.bytes).decode() == t.token


# ---------------------------------------------------------------------- other routes
def test_models_health_tokenize(http, offline):
    models = http.get("/v1/models").json()
    assert models["object"] == "list" and models["data"][0]["id"] == MODEL
    health = http.get("/health")
    assert health.status_code == 200 and health.json()["auth"] == "none"  # this server runs without a key
    tok = http.post("/tokenize", json={"prompt": "Hello there"}).json()
    assert tok["tokens"] == offline.tokenizer.encode("Hello there") and tok["count"] == len(tok["tokens"])
    assert http.post("/detokenize", json={"tokens": tok["tokens"]}).json()["prompt"] == "Hello there"
    chat = http.post("/tokenize", json={"messages": [{"role": "user", "content": "Hi"}]}).json()
    assert chat["tokens"] == offline.apply_chat_template([{"role": "user", "content": "Hi"}])


def test_metrics_parse_as_prometheus_text(http, client):
    from prometheus_client.parser import text_string_to_metric_families

    client.completions.create(model=MODEL, prompt="Count me", max_tokens=3, temperature=0)
    text = http.get("/metrics").text
    families = {f.name: f for f in text_string_to_metric_families(text)}
    for name in (
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:kv_cache_usage_perc",
        "vllm:prefix_cache_queries",
        "vllm:prefix_cache_hits",
        "vllm:time_to_first_token_seconds",
        "vllm:inter_token_latency_seconds",
        "vllm:e2e_request_latency_seconds",
        "vllm:num_preemptions",
    ):
        assert name in families, name
    ttft = {s.name: s.value for s in families["vllm:time_to_first_token_seconds"].samples if not s.labels.get("le")}
    assert ttft["vllm:time_to_first_token_seconds_count"] >= 1
    hits = families["vllm:prefix_cache_hits"].samples[0].value
    queries = families["vllm:prefix_cache_queries"].samples[0].value
    assert 0 <= hits <= queries and queries > 0


def test_router_compatibility_endpoints(http):
    info = http.get("/get_model_info").json()
    assert info["is_generation"] is True and info["model_path"]
    server = http.get("/get_server_info").json()
    assert server["block_size"] == 8 and server["served_model_name"] == MODEL and server["num_kv_blocks"] == 160
    load = http.get("/get_load").json()
    assert load["num_reqs"] == load["num_running_reqs"] + load["num_waiting_reqs"]
    assert http.get("/load").json()["server_load"] == load["num_reqs"]


# ---------------------------------------------------------------------- bad input
LONG = list(range(1000, 1000 + MAX_MODEL_LEN))
BAD = [
    # (route, body, status, param)
    ("/v1/completions", {"prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "max_tokens": "ten"}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 5.5}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "temperature": -0.1}, 400, "temperature"),
    ("/v1/completions", {"prompt": "x", "temperature": 2.5}, 400, "temperature"),
    ("/v1/completions", {"prompt": "x", "top_p": 0}, 400, "top_p"),
    ("/v1/completions", {"prompt": "x", "top_p": 1.5}, 400, "top_p"),
    ("/v1/completions", {"prompt": "x", "top_k": -2}, 400, "top_k"),
    ("/v1/completions", {"prompt": "x", "min_p": 1.5}, 400, "min_p"),
    ("/v1/completions", {"prompt": "x", "n": 0}, 400, "n"),
    ("/v1/completions", {"prompt": "x", "n": 5}, 400, "n"),
    ("/v1/completions", {"prompt": "x", "presence_penalty": 3}, 400, "presence_penalty"),
    ("/v1/completions", {"prompt": "x", "frequency_penalty": -2.5}, 400, "frequency_penalty"),
    ("/v1/completions", {"prompt": "x", "repetition_penalty": 0}, 400, "repetition_penalty"),
    ("/v1/completions", {"prompt": "x", "logprobs": 21}, 400, "logprobs"),
    ("/v1/completions", {"prompt": "x", "logprobs": -1}, 400, "logprobs"),
    ("/v1/completions", {"prompt": "x", "min_tokens": 9, "max_tokens": 4}, 400, "min_tokens"),
    ("/v1/completions", {"prompt": "x", "min_tokens": -1}, 400, "min_tokens"),
    ("/v1/completions", {"prompt": "x", "stop": [""]}, 400, "stop"),
    ("/v1/completions", {"prompt": "x", "stop": ["a"] * 17}, 400, "stop"),
    ("/v1/completions", {"prompt": "x", "stop_token_ids": [-1]}, 400, "stop_token_ids"),
    ("/v1/completions", {"prompt": "x", "seed": "abc"}, 400, "seed"),
    ("/v1/completions", {"prompt": "x", "stream": "yes"}, 400, "stream"),
    ("/v1/completions", {"prompt": "x", "suffix": "tail"}, 400, "suffix"),
    ("/v1/completions", {"prompt": ""}, 400, "prompt"),
    ("/v1/completions", {"prompt": []}, 400, "prompt"),
    ("/v1/completions", {"prompt": [1, -5]}, 400, "prompt"),
    ("/v1/completions", {"prompt": [10**9]}, 400, "prompt"),
    ("/v1/completions", {"prompt": ["a", "b", "c", "d", "e"]}, 400, "prompt"),
    ("/v1/completions", {"prompt": {"text": "x"}}, 400, "prompt"),
    ("/v1/completions", {}, 400, "prompt"),
    ("/v1/completions", {"prompt": LONG}, 400, "prompt"),
    ("/v1/completions", {"prompt": LONG[:500], "max_tokens": 20}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "cache_salt": ""}, 400, "cache_salt"),
    ("/v1/chat/completions", {"messages": []}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400, "messages"),
    ("/v1/chat/completions", {"messages": "hello"}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, 400, "top_logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 21, "logprobs": True}, 400, "top_logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 0}, 400, "max_completion_tokens"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x " * 600}]}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 600}, 400, "max_completion_tokens"),
    ("/detokenize", {"tokens": [-3]}, 400, "tokens"),
    ("/tokenize", {}, 400, "prompt"),
]


@pytest.mark.parametrize("route,body,status,param", BAD, ids=[f"{r}:{json.dumps(b)[:40]}" for r, b, _, _ in BAD])
def test_bad_input_gets_a_4xx_in_the_envelope(http, route, body, status, param):
    resp = http.post(route, json=body)
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["type"] == "invalid_request_error" and err["message"]
    assert param in (err["param"] or "") or param in err["message"], err


def test_malformed_json_unknown_model_and_routes(http):
    resp = http.post("/v1/completions", content=b'{"prompt": "x",', headers={"content-type": "application/json"})
    assert resp.status_code == 400 and "JSON" in resp.json()["error"]["message"]
    resp = http.post("/v1/completions", json={"model": "gpt-9", "prompt": "x"})
    assert resp.status_code == 404 and resp.json()["error"]["code"] == "model_not_found"
    assert resp.json()["error"]["param"] == "model"
    resp = http.post("/v1/chat/completions", json={"model": "gpt-9", "messages": [{"role": "user", "content": "x"}]})
    assert resp.status_code == 404
    resp = http.get("/v1/nothing-here")
    assert resp.status_code == 404 and "error" in resp.json()


def test_bad_requests_never_harm_a_good_one(server, http):
    url, engine = server

    async def run():
        async with httpx.AsyncClient(base_url=url, timeout=60) as c:
            good = c.post("/v1/completions", json={"prompt": "Good request", "max_tokens": 12, "temperature": 0})
            bad = [c.post(route, json=body) for route, body, _, _ in BAD[:20]]
            return await asyncio.gather(good, *bad)

    good, *bad = asyncio.run(run())
    assert good.status_code == 200 and good.json()["usage"]["completion_tokens"] == 12
    assert all(400 <= r.status_code < 500 for r in bad)
    wait_until(lambda: _idle(engine), 10, "the engine to be idle with no block held")


def test_oversized_body_gets_413_without_being_read(tiny_llama_path):
    app, _ = build_replica_server(_config(tiny_llama_path), ServerLimits(max_body_bytes=2048), MODEL)
    with running(app) as url, httpx.Client(base_url=url, timeout=30) as c:
        resp = c.post("/v1/completions", json={"prompt": "x" * 5000})
        assert resp.status_code == 413 and resp.json()["error"]["code"] == "request_too_large"

        def chunked():  # no Content-Length: the cap applies to what arrives
            for _ in range(64):
                yield b"x" * 1024

        resp = c.post("/v1/completions", content=chunked(), headers={"content-type": "application/json"})
        assert resp.status_code == 413
        assert c.post("/v1/completions", json={"prompt": "small", "max_tokens": 2}).status_code == 200


def test_api_key(tiny_llama_path, monkeypatch):
    app, _ = build_replica_server(_config(tiny_llama_path), ServerLimits(api_key="s3cret"), MODEL)
    with running(app) as url, httpx.Client(base_url=url, timeout=30) as c:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"}, {"Authorization": "Basic s3cret"}):
            resp = c.post("/v1/completions", json={"prompt": "x", "max_tokens": 2}, headers=headers)
            assert resp.status_code == 401, headers
            assert resp.json()["error"]["type"] == "authentication_error"
        assert c.get("/v1/models").status_code == 401
        assert c.get("/health").status_code == 200  # probes and scrapers need no key
        assert c.get("/health").json()["auth"] == "api_key"
        assert c.get("/metrics").status_code == 200
        good = openai.OpenAI(base_url=url + "/v1", api_key="s3cret", max_retries=0)
        assert good.completions.create(model=MODEL, prompt="x", max_tokens=2).usage.completion_tokens == 2
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=url + "/v1", api_key="nope", max_retries=0).models.list()


def test_timeout_is_408_and_frees_blocks(tiny_llama_path):
    app, engine = build_replica_server(_config(tiny_llama_path), ServerLimits(request_timeout_s=0.3), MODEL)
    body = {"prompt": "Slow", "max_tokens": 400, "ignore_eos": True}
    with running(app) as url, httpx.Client(base_url=url, timeout=30) as c:
        resp = c.post("/v1/completions", json=body)
        assert resp.status_code == 408 and resp.json()["error"]["type"] == "timeout_error"
        with c.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
            events = [line for line in r.iter_lines() if line]
        assert events[-1] == "data: [DONE]" and "request_timeout_s" in events[-2]
        wait_until(lambda: _idle(engine), 10, "the timed-out requests to free their blocks")
        assert engine.metrics.finished == {"abort": 2}  # cut off, not run to their 400 tokens


@pytest.mark.parametrize("stream", [True, False])
def test_client_disconnect_aborts_and_frees_blocks(server, stream):
    url, engine = server
    body = {"prompt": "Never finish " * 20, "max_tokens": 400, "ignore_eos": True, "stream": stream, "n": 2}

    async def leave_early():
        async with httpx.AsyncClient(base_url=url, timeout=60) as c:
            if stream:
                async with c.stream("POST", "/v1/completions", json=body) as resp:
                    assert resp.status_code == 200
                    async for line in resp.aiter_lines():
                        if line.startswith("data: "):
                            break  # one chunk, then hang up
            else:
                with pytest.raises(httpx.ReadTimeout):
                    await c.post("/v1/completions", json=body, timeout=1.0)

    finished_before = dict(engine.metrics.finished)
    asyncio.run(leave_early())
    wait_until(lambda: _idle(engine), 15, "the aborted request to free its blocks")
    finished = engine.metrics.finished
    # Both choices were aborted (not run to their 400 tokens).
    assert finished.get("abort", 0) == finished_before.get("abort", 0) + 2
    assert finished.get("length", 0) == finished_before.get("length", 0)
    stats = engine.engine.stats()
    assert stats.num_free_blocks == stats.num_kv_blocks  # every block back in the free pool (cached ones included)


HOSTILE = hostile.table(vocab_size=49152, max_body_bytes=ServerLimits().max_body_bytes)


@pytest.mark.parametrize("row", HOSTILE, ids=[r.name for r in HOSTILE])
def test_hostile_bodies_get_their_status_in_the_envelope(http, row):
    headers = {} if row.content_type is None else {"content-type": row.content_type}
    resp = http.post(row.route, content=row.body, headers=headers)
    assert resp.status_code in row.statuses, resp.text
    if resp.status_code >= 400:
        err = hostile.check_envelope(resp.status_code, resp.content)
        if row.param is not None:
            assert row.param in (err["param"] or "") or row.param in err["message"], err


def test_a_long_tokenization_does_not_block_the_loop(server, http):
    """A prompt near the body limit takes seconds to tokenize; meanwhile the server
    still answers (tokenization runs off the event loop)."""
    url, _ = server
    big = {"prompt": "lorem ipsum dolor sit amet " * 150_000, "max_tokens": 1}  # ~4 MB, far past the context

    async def run():
        async with httpx.AsyncClient(base_url=url, timeout=120) as c:
            slow = asyncio.ensure_future(c.post("/v1/completions", json=big))
            await asyncio.sleep(0.3)  # the body is in; tokenization has begun
            started = asyncio.get_running_loop().time()
            health = await c.get("/v1/models")
            waited = asyncio.get_running_loop().time() - started
            return await slow, health, waited

    slow, health, waited = asyncio.run(run())
    assert slow.status_code == 400 and slow.json()["error"]["code"] == "context_length_exceeded"
    assert health.status_code == 200
    assert waited < 1.0, waited


def test_an_emulated_replica_is_named_after_its_profile(tiny_llama_path):
    """``serve-replica --emulate PROFILE`` serves the profile's model shape: /v1/models
    names it (the tokenizer's checkpoint stays an alias) and /get_model_info says so."""
    import httpx

    from kvroute.deploy.replica_server import build_replica_server
    from kvroute.replica.config import EngineConfig
    from tests.deploy.server import running

    config = EngineConfig(model=str(tiny_llama_path), block_size=8, num_kv_blocks=64, emulate="gpu_h100_llama3_8b")
    app, _ = build_replica_server(config)
    with running(app) as url:
        assert [m["id"] for m in httpx.get(url + "/v1/models").json()["data"]] == ["emulated-gpu_h100_llama3_8b", str(tiny_llama_path)]
        assert httpx.get(url + "/get_model_info").json()["emulated_profile"] == "gpu_h100_llama3_8b"
        r = httpx.post(url + "/v1/completions", json={"model": str(tiny_llama_path), "prompt": [5, 6, 7], "max_tokens": 2})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2


def test_serving_without_a_key_off_loopback_warns(caplog):
    from kvroute.deploy.openai.api import warn_if_open

    with caplog.at_level("WARNING", logger="kvroute.deploy.openai.api"):
        assert [warn_if_open(None, h) for h in ("127.0.0.1", "::1", "[::1]", "localhost", "127.0.0.2")] == [False] * 5
        assert not caplog.records
        assert warn_if_open(None, "0.0.0.0") and warn_if_open(None, "10.1.2.3") and warn_if_open(None, "node-a")
        assert warn_if_open(None, None)  # the address is unknown: reachable, for all it can tell
        assert not warn_if_open("k", "0.0.0.0")
    assert len(caplog.records) == 4 and "WITHOUT an API key on 0.0.0.0" in caplog.records[0].getMessage()
