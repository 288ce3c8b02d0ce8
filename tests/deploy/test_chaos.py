"""``kvroute serve`` as the installed script, one start for the module (``served``), on
its default data path (HAProxy straight to the engine replicas, ``deploy/direct_app.py``):
it runs the cluster and answers, routes a repeated prefix to the replica that caches it,
answers a bad body with the API's 400 (not the router's failure), and serves LoRA
adapters with their own prefixes; then chaos through
HTTP: it loses a replica process and then the router actor's process to SIGKILL while
20 greedy streams run. The streams of the killed replica end with an error (on the
direct path a stream's ingress is its replica: the composed path's resume is tested in
tests/cluster and tests/multinode), every other stream completes with the text of an
undisturbed run, routing falls back until the router is back, and the service recovers;
the recovered service then holds the soak benchmark's invariants on a short run
(``kvroute bench soak --url``: this service, so the soak starts none of its own); last,
Ctrl-C stops it cleanly (exit 0)."""

from __future__ import annotations

import asyncio
import functools
import json
import os
import signal
import time
from pathlib import Path

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("ray")

from kvroute.deploy import serve_proxy  # noqa: E402
from tests.conftest import free_port, wait_until  # noqa: E402
from tests.deploy.server import start_cli, stop_cli  # noqa: E402

STREAMS = 20
MAX_TOKENS = 96
KEY = "chaos-key"  # the service runs with an API key: on the direct path each replica checks it
AUTH = {"Authorization": f"Bearer {KEY}"}
ENGINE_ARGS = ["--dtype", "float32", "--block-size", "8", "--num-kv-blocks", "1024", "--max-model-len", "512"]
MAX_BODY_BYTES = 65536  # the soak's over-limit body is a little larger


def _pids(url: str) -> dict[str, list[int]]:
    """Process ids by role, from the service's own /metrics."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(url + "/metrics", timeout=30).text
    out: dict[str, list[int]] = {}
    for fam in text_string_to_metric_families(text):
        if fam.name == "kvroute:process_resident_memory_bytes":
            for s in fam.samples:
                out.setdefault(s.labels["role"], []).append(int(s.labels["pid"]))
    return out


async def _stream(c: httpx.AsyncClient, i: int, progress: list[int]) -> str | None:
    """The stream's text, or None where the connection was cut before it ended."""
    try:
        return await _stream_text(c, i, progress)
    except (httpx.RemoteProtocolError, httpx.ReadError):
        return None


async def _stream_text(c: httpx.AsyncClient, i: int, progress: list[int]) -> str:
    body = {
        "prompt": f"Stream {i} of the chaos run: the archive keeps",  # no shared first block: spread by load
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    text, done = [], False
    async with c.stream("POST", "/v1/completions", json=body) as resp:
        assert resp.status_code == 200, await resp.aread()
        async for line in resp.aiter_lines():
            done = done or line == "data: [DONE]"
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            assert "error" not in event, event
            for choice in event["choices"]:
                text.append(choice["text"])
                progress[i] += 1
    if not done:
        raise httpx.RemoteProtocolError("the stream ended without [DONE]")
    return "".join(text)


async def _run_all(url: str, during=None) -> list[str]:
    progress = [0] * STREAMS
    async with httpx.AsyncClient(base_url=url, headers=AUTH, timeout=300, limits=httpx.Limits(max_connections=STREAMS + 4)) as c:
        tasks = [asyncio.ensure_future(_stream(c, i, progress)) for i in range(STREAMS)]
        if during is not None:
            await during(progress, tasks)
        return await asyncio.gather(*tasks)


@pytest.fixture(scope="module")
def adapters(tiny_llama_path, tmp_path_factory) -> dict[str, Path]:
    """Two tiny random PEFT adapters: ``a`` loaded at start, ``c`` in the dynamic folder."""
    from kvroute.benchmarks.lora_adapters import save_random_adapter
    from kvroute.replica.checkpoint import load_hf_config
    from kvroute.replica.models.arch import ModelArch

    arch = ModelArch.from_hf_config(load_hf_config(tiny_llama_path))
    tmp = tmp_path_factory.mktemp("chaos-lora")
    return {"a": save_random_adapter(tmp / "a", arch, rank=4, seed=41),
            "c": save_random_adapter(tmp / "dynamic" / "c", arch, rank=4, seed=43)}  # fmt: skip


@pytest.fixture(scope="module")
def served(tiny_llama_path, adapters):
    """``kvroute serve`` with 2 replicas on a free port, LoRA on: (process, its output
    lines, url). A test that stops it (the last one) leaves nothing for the teardown to do."""
    port = free_port()
    proc, lines = start_cli(
        ["serve", "--model", str(tiny_llama_path), "--port", str(port), "--replicas", "2", "--api-key", KEY, "--chat-template", "chatml_tools",
         *ENGINE_ARGS, "--enable-lora", "--lora-modules", f"a={adapters['a']}", "--max-loras", "2",
         "--dynamic-lora-path", str(adapters["c"].parent), "--max-body-bytes", str(MAX_BODY_BYTES)],
        "kvroute: ready",
    )
    try:
        yield proc, lines, f"http://127.0.0.1:{port}"
    finally:
        if proc.poll() is None:
            stop_cli(proc, lines)


def test_serve_command_runs_the_cluster(served):
    proc, _, url = served
    assert httpx.get(url + "/health", timeout=30).status_code == 200
    # the default proxy: HAProxy (Ray Serve's high-throughput path) holds the HTTP port
    port = int(url.rsplit(":", 1)[1])
    listeners = {pid for pid in serve_proxy.haproxy_pids(proc.pid) if _listens_on(pid, port)}
    assert listeners, "no HAProxy of this cluster listens on the service's port"
    body = {"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 3}
    r = httpx.post(url + "/v1/chat/completions", json=body, headers=AUTH, timeout=60)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
    r = httpx.post(url + "/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", r.text


def _delivered(url: str) -> float:
    """Cached prompt tokens of requests that arrived with the router's decision (the
    replicas count a request without one as unpredicted, not here)."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(url + "/metrics", headers=AUTH, timeout=30).text
    return sum(s.value for fam in text_string_to_metric_families(text) if fam.name == "kvroute:reuse_tokens"
               for s in fam.samples if s.labels.get("figure") == "delivered")  # fmt: skip


def test_the_router_sends_a_repeated_prefix_to_its_cache_and_bad_bodies_get_the_apis_errors(served):
    _, _, url = served
    delivered_before = _delivered(url)
    prefix = " ".join(f"ledger{i}" for i in range(60))
    cached = []
    for turn in range(4):  # each turn lands where the previous ones cached the prefix
        body = {"messages": [{"role": "user", "content": f"{prefix} turn {turn}"}], "max_tokens": 2}
        r = httpx.post(url + "/v1/chat/completions", json=body, headers=AUTH, timeout=60)
        assert r.status_code == 200, r.text
        cached.append(r.json()["usage"]["prompt_tokens_details"]["cached_tokens"])
    # the first turn may reuse only the template's head that every chat shares (cached by
    # the test before); the turns after it reuse the ledger prefix too
    assert cached[0] < 60 and min(cached[1:]) >= 60 + cached[0], cached
    # the turns reached their replica with the router's decision (HAProxy forwards its
    # header): the replicas count cached tokens delivered under a decision (none arrive
    # without the header, whatever the turns hit)
    wait_until(lambda: _delivered(url) - delivered_before > 0, 30, "the replicas' decision quality")
    # what the router cannot read is placed by load; the replica answers with the API's error
    r = httpx.post(url + "/v1/chat/completions", content=b'{"messages": [', headers={**AUTH, "content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error", r.text
    r = httpx.post(url + "/v1/chat/completions", json={"messages": "hello", "max_tokens": 2}, headers=AUTH, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages", r.text


def test_structured_outputs_and_forced_tool_calls_take_the_direct_path(served):
    """The random tiny model writes what the grammar allows: valid JSON of the schema,
    and a call of the named function whose arguments (an array among them) parse."""
    _, _, url = served
    schema = {"type": "object", "properties": {"ids": {"type": "array", "items": {"type": "integer"}, "maxItems": 3},
                                               "ok": {"type": "boolean"}}, "required": ["ids", "ok"],
              "additionalProperties": False}  # fmt: skip
    body = {"messages": [{"role": "user", "content": "Give JSON"}], "max_tokens": 60, "temperature": 0,
            "response_format": {"type": "json_schema", "json_schema": {"name": "r", "schema": schema}}}  # fmt: skip
    r = httpx.post(url + "/v1/chat/completions", json=body, headers=AUTH, timeout=120)
    assert r.status_code == 200, r.text
    answer = json.loads(r.json()["choices"][0]["message"]["content"])
    assert set(answer) == {"ids", "ok"} and isinstance(answer["ok"], bool), answer
    tools = [{"type": "function", "function": {"name": "tag", "parameters": schema}}]
    body = {"messages": [{"role": "user", "content": "Tag it"}], "max_tokens": 60, "temperature": 0, "tools": tools,
            "tool_choice": {"type": "function", "function": {"name": "tag"}}}  # fmt: skip
    r = httpx.post(url + "/v1/chat/completions", json=body, headers=AUTH, timeout=120)
    assert r.status_code == 200, r.text
    (call,) = r.json()["choices"][0]["message"]["tool_calls"]
    assert call["function"]["name"] == "tag" and set(json.loads(call["function"]["arguments"])) == {"ids", "ok"}


def test_the_openai_client_sends_every_kind_of_request_at_once_through_the_direct_path(served):
    """The real ``openai`` client, one batch in flight together: a plain chat, a
    json_schema chat, a forced tool call and a streamed completion, each answered in its
    shape while the others run beside it on the same replicas."""
    openai = pytest.importorskip("openai")
    _, _, url = served
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0, timeout=120)
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"},  # small: fits max_tokens (whitespace runs are capped)
                                               "tags": {"type": "array", "items": {"enum": ["red", "blue"]}, "maxItems": 2}},
              "required": ["ok", "tags"], "additionalProperties": False}  # fmt: skip
    tools = [{"type": "function", "function": {"name": "tag", "parameters": schema}}]

    async def streamed(model: str) -> str:
        stream = await client.completions.create(model=model, prompt="Once upon", max_tokens=12, temperature=0,
                                                 stream=True, extra_body={"ignore_eos": True})  # fmt: skip
        return "".join([c.choices[0].text async for c in stream if c.choices])

    async def batch() -> list:
        model = (await client.models.list()).data[0].id
        chat = [{"role": "user", "content": "Say something"}]
        return await asyncio.gather(
            client.chat.completions.create(model=model, messages=chat, max_tokens=8, temperature=0,
                                           extra_body={"ignore_eos": True}),
            client.chat.completions.create(model=model, messages=chat, max_tokens=250, temperature=0,
                                           response_format={"type": "json_schema", "json_schema": {"name": "r", "schema": schema}}),
            client.chat.completions.create(model=model, messages=chat, max_tokens=250, temperature=0, tools=tools,
                                           tool_choice={"type": "function", "function": {"name": "tag"}}),
            streamed(model),
        )  # fmt: skip

    plain, structured, forced, text = asyncio.run(batch())
    assert plain.usage.completion_tokens == 8 and plain.choices[0].message.content is not None
    assert set(json.loads(structured.choices[0].message.content)) == {"ok", "tags"}
    (call,) = forced.choices[0].message.tool_calls
    assert call.function.name == "tag" and set(json.loads(call.function.arguments)) == {"ok", "tags"}
    assert forced.choices[0].message.content is None
    assert len(text) > 0


def test_lora_adapters_take_the_direct_path(served, adapters, tiny_llama_path):
    """``model`` names an adapter (loaded at start, or from the dynamic folder on first
    use, also as ``<base>:<adapter>``): its greedy text is the offline engine's with that
    adapter, and its prefix is its own in the router's hashes, so an adapter's repeated
    prompt goes where that adapter cached it."""
    from kvroute.replica.llm import LLM
    from kvroute.replica.sampling_params import SamplingParams

    _, _, url = served
    prompt = "The lighthouse keeper wrote down every ship that passed the northern rocks at dawn"
    llm = LLM(str(tiny_llama_path), block_size=8, num_kv_blocks=64, max_model_len=512, dtype="float32", enable_lora=True,
              max_loras=2)  # fmt: skip
    for name, path in adapters.items():
        llm.load_lora(name, path)
    params = SamplingParams(temperature=0.0, max_tokens=6)
    ids = llm.tokenizer.encode(prompt)
    offline = {name: llm.generate(ids, params, use_tqdm=False, lora_name=name)[0].text for name in (None, "a", "c")}
    assert len(set(offline.values())) == 3, offline
    base = str(tiny_llama_path)

    def complete(model: str, text: str = prompt) -> dict:
        r = httpx.post(url + "/v1/completions", json={"model": model, "prompt": text, "max_tokens": 6, "temperature": 0},
                       headers=AUTH, timeout=60)  # fmt: skip
        assert r.status_code == 200, r.text
        return r.json()

    assert complete("a")["choices"][0]["text"] == offline["a"]
    assert complete("c")["choices"][0]["text"] == offline["c"]  # loaded from the dynamic folder on first use
    assert complete(f"{base}:c")["choices"][0]["text"] == offline["c"]
    assert complete(base)["choices"][0]["text"] == offline[None]
    shared = " ".join(f"tide{i}" for i in range(40))
    cached = {m: [complete(m, f"{shared} {m} turn {t}")["usage"]["prompt_tokens_details"]["cached_tokens"] for t in range(3)]
              for m in ("a", "c")}  # fmt: skip
    assert all(c[0] == 0 and min(c[1:]) >= 40 for c in cached.values()), cached
    r = httpx.post(url + "/v1/completions", json={"model": "nope", "prompt": "hi", "max_tokens": 2}, headers=AUTH, timeout=60)
    assert r.status_code == 404 and "nope" in r.json()["error"]["message"], r.text


def test_streams_survive_sigkill_of_a_replica_and_of_the_router(served):
    proc, _, url = served
    assert proc.poll() is None
    pids = wait_until(
        lambda: (p := _pids(url)) and len(p.get("replica", [])) == 2 and p.get("router") and p,
        60,
        "both replicas and the router in /metrics",
        interval_s=0.5,
    )
    undisturbed = asyncio.run(_run_all(url))
    assert all(len(t) > 0 for t in undisturbed)
    killed: dict[str, float] = {}

    async def chaos(progress, tasks):
        deadline = time.monotonic() + 120
        while min(progress) < 5:  # every stream is mid-flight
            assert time.monotonic() < deadline and not any(t.done() for t in tasks), progress
            await asyncio.sleep(0.02)
        os.kill(pids["replica"][0], signal.SIGKILL)
        killed["replica"] = time.monotonic()
        start = list(progress)
        # every stream still running went on by 10 tokens (the killed replica's are cut at
        # once; the other's must not finish first: then the router's kill would hit no stream)
        while True:
            alive = [i for i, t in enumerate(tasks) if not t.done()]
            if all(progress[i] - start[i] >= 10 for i in alive):
                break
            assert time.monotonic() < deadline, (progress, alive)
            await asyncio.sleep(0.02)
        assert alive, "every stream ended with the killed replica: the router put them all on one"
        os.kill(pids["router"][0], signal.SIGKILL)
        killed["router"] = time.monotonic()

    disturbed = asyncio.run(_run_all(url, chaos))
    assert set(killed) == {"replica", "router"}
    cut = [i for i, text in enumerate(disturbed) if text is None]
    assert 0 < len(cut) < STREAMS, f"cut streams {cut}: the killed replica's should end, the other's go on"
    mismatched = [i for i, (a, b) in enumerate(zip(undisturbed, disturbed)) if b is not None and a != b]
    assert not mismatched, f"streams {mismatched} differ from the undisturbed run"

    # Serve replaces the replica and Ray restarts the router: the service recovers.
    def recovered():
        p = _pids(url)
        replicas = p.get("replica", [])
        return len(replicas) == 2 and pids["replica"][0] not in replicas and p.get("router", [None])[0] != pids["router"][0]

    wait_until(recovered, 120, "a new replica and a restarted router in /metrics", interval_s=1.0)
    r = httpx.post(url + "/v1/completions", json={"prompt": "after the storm", "max_tokens": 4}, headers=AUTH, timeout=60)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4


def test_a_short_soak_holds_its_invariants(served, tmp_path, capsys, monkeypatch):
    """The soak benchmark's invariants on a short run against this service (not its
    speed): every kind sent, no unexpected status, counts that add up, the hostile
    bodies' 4xx, the service idle afterwards, and RSS figures for every process. (How the
    soak starts a service of its own: tests/benchmarks/test_soak.py.)"""
    from kvroute.benchmarks import soak
    from kvroute.benchmarks.cli import main as bench

    class KeyedHttpx:  # the soak's httpx, whose clients send this service's API key
        AsyncClient = functools.partial(httpx.AsyncClient, headers=AUTH)

        def __getattr__(self, name: str):
            return getattr(httpx, name)

    monkeypatch.setattr(soak, "httpx", KeyedHttpx())
    _, _, url = served
    out = tmp_path / "soak.json"
    rc = bench(["soak", "--url", url, "--minutes", "0.1", "--concurrency", "3", "--max-tokens", "8",
                "--max-body-bytes", str(MAX_BODY_BYTES), "--out", str(out)])  # fmt: skip
    result = json.loads(out.read_text())
    assert rc == 0, result["unexpected_examples"]
    assert result["unexpected"] == 0 and result["idle"]["ok"]
    assert set(result["by_kind"]) == set(soak._kinds(8, MAX_BODY_BYTES))  # every kind was sent
    assert sum(result["by_status"].values()) == result["requests"] == sum(result["by_kind"].values())
    assert sum(w["requests"] for w in result["windows"]) == result["requests"]
    assert result["by_status"].get("413", 0) == result["by_kind"]["over_limit"]
    hostile_400 = sum(result["by_kind"][k] for k in ("surrogate", "bad_json", "wrong_type", "oov_ids"))
    assert result["by_status"].get("400", 0) == hostile_400
    roles = {k.split(":")[0] for k in result["windows"][-1]["rss_mib"]}
    assert roles == {"replica", "router", "http"} and len(result["windows"][-1]["kv_usage"]) == 2
    assert set(result["rss_growth_mib"]) == set(result["windows"][0]["rss_mib"])
    assert result["ttft_p99_s"] is not None
    assert "soak: 0.1 min" in capsys.readouterr().out


def test_serve_command_stops_on_ctrl_c(served):
    """After all of the above (a replica and the router killed and replaced, the soak)."""
    proc, lines, _ = served
    haproxies = serve_proxy.haproxy_pids(proc.pid)
    assert haproxies
    output = stop_cli(proc, lines)
    assert proc.returncode == 0, output[-3000:]
    assert "kvroute: stopping" in output
    wait_until(lambda: all(_zombie(p) for p in haproxies), 20, f"the cluster's HAProxy processes {haproxies} to end")


def _zombie(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True
    return stat[stat.rindex(")") + 2] == "Z"


def _listens_on(pid: int, port: int) -> bool:
    """Whether process ``pid`` holds a listening TCP socket on ``port`` (from /proc)."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    for table in ("tcp", "tcp6"):
        for line in Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]:
            f = line.split()
            if f[3] == "0A" and int(f[1].rsplit(":", 1)[1], 16) == port and f[9] in inodes:
                return True
    return False
