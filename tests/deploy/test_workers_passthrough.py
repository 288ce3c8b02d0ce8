"""``kvroute serve --workers``' data path without Ray: the HTTP layer over a
``WorkersBackend`` (a fake pool and router, the worker an ``httpx.MockTransport``).
One forwarding hop: one rank call and one HTTP request per client request, sent
straight to the worker. A streamed answer passes through as the worker's bytes: the
chunks the backend yields are the worker's chunks (same boundaries, events cut
mid-JSON included), and the client reads exactly the bytes the worker sent."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")

from kvroute.deploy.backends.workers import WorkersBackend  # noqa: E402
from kvroute.deploy.openai.api import build_api  # noqa: E402
from kvroute.deploy.openai.serving import OpenAIServing  # noqa: E402
from kvroute.replica.block_hash import HashSpec  # noqa: E402
from kvroute.router.types import RouteDecision  # noqa: E402

MODEL, WORKER_MODEL, URL = "m", "served-by-worker", "http://worker-a:8000"
# a worker's SSE as it might arrive: one event cut mid-JSON across chunks, spacing and
# escapes a parser would normalise, its usage chunk last
CHUNKS = [
    b'data: {"id":"chatcmpl-1","object":"chat.completion.chunk","choices":[{"index":0,"delta":{"role":"assistant"}}]}\n\n',
    b'data: {"id":"chatcmpl-1", "choices":[{"index":0,"delta":{"content":"caf\\u00e9',
    b' \\ud83d\\ude00"}}]}\n\ndata: {"id":"chatcmpl-1","choices":[{"index":0,"delta":{"content":"!"},"finish_reason":"length"}]}\n\n',
    b'data: {"id":"chatcmpl-1","choices":[],"usage":{"prompt_tokens":9,"completion_tokens":2,"total_tokens":11,'
    b'"prompt_tokens_details":{"cached_tokens":0}}}\n\n',
    b"data: [DONE]\n\n",
]


class _Remote:
    def __init__(self, fn) -> None:
        self.fn = fn

    def remote(self, *args: Any):
        async def call():
            return self.fn(*args)

        return call()


class _Pool:
    def __init__(self) -> None:
        self.up_workers = _Remote(lambda: {"a": (URL, WORKER_MODEL, {})})
        self.mark_down = _Remote(lambda wid, reason: pytest.fail(f"worker {wid} marked down: {reason}"))


class _Router:
    def __init__(self) -> None:
        self.calls: list[tuple] = []
        self.rank = _Remote(self._rank)

    def _rank(self, hashes, num_tokens, candidates, lora_name) -> RouteDecision:
        self.calls.append((len(hashes), num_tokens, candidates))
        return RouteDecision("a", 0, "load")


@pytest.fixture
def parts(smollm2_tokenizer):
    seen: list[httpx.Request] = []

    async def worker(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        body = json.loads(request.content)
        if body.get("stream"):
            async def sse():
                for chunk in CHUNKS:
                    yield chunk

            return httpx.Response(200, headers={"content-type": "text/event-stream"}, content=sse())
        return httpx.Response(200, json={"id": "chatcmpl-2", "object": "chat.completion", "model": body["model"],
                                         "choices": [], "usage": {"prompt_tokens": 9, "completion_tokens": 0}})  # fmt: skip

    router = _Router()
    backend = WorkersBackend(_Pool(), [router], HashSpec(block_size=4, seed=1, model_id=MODEL), 30.0)
    backend.client = httpx.AsyncClient(transport=httpx.MockTransport(worker))
    serving = OpenAIServing(MODEL, smollm2_tokenizer, 2048, 49152, backend)
    return serving, backend, router, seen


CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Say hi, one word, to the worker please"}],
        "max_tokens": 2}  # fmt: skip


def test_a_streamed_chat_yields_the_workers_chunks_unchanged_after_one_hop(parts):
    serving, backend, router, seen = parts
    from kvroute.deploy.openai.protocol import ChatCompletionRequest

    body = json.dumps({**CHAT, "stream": True}).encode()

    async def go() -> list[bytes]:
        answer = await serving.chat(ChatCompletionRequest.model_validate_json(body), body)
        return [chunk async for chunk in answer]

    assert asyncio.run(go()) == CHUNKS  # the same chunks, cut where the worker cut them
    assert len(seen) == 1 and len(router.calls) == 1  # one rank, one forwarded request
    (req,) = seen
    assert str(req.url) == URL + "/v1/chat/completions"
    assert json.loads(req.content) == {**json.loads(body), "model": WORKER_MODEL}  # the body as sent, model renamed


def test_the_client_reads_exactly_the_bytes_the_worker_sent(parts):
    serving, backend, router, seen = parts
    app = build_api(serving, lambda: None)

    async def go() -> tuple[httpx.Response, httpx.Response]:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://ingress") as client:
            streamed = await client.post("/v1/chat/completions", json={**CHAT, "stream": True})
            whole = await client.post("/v1/chat/completions", json=CHAT)
            return streamed, whole

    streamed, whole = asyncio.run(go())
    assert streamed.status_code == 200 and streamed.headers["content-type"].startswith("text/event-stream")
    assert streamed.content == b"".join(CHUNKS)
    assert whole.status_code == 200 and whole.json()["id"] == "chatcmpl-2"
    assert len(seen) == 2 and len(router.calls) == 2  # one hop each
    assert all(str(r.url) == URL + "/v1/chat/completions" for r in seen)
