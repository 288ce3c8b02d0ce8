"""The direct path's routing pieces without a cluster: the decision's header codec (what
a replica accepts from HAProxy, and what it refuses), and the ingress request router's
prompts: for every body kind the API takes, the tokens it hashes are the tokens the
replica's serving code will run (else the directory would match the wrong blocks).
The path end to end, through HAProxy and two replicas, is tests/deploy/test_chaos.py."""

from __future__ import annotations

import asyncio
import base64
import json

import pytest

pytest.importorskip("ray")

from kvroute.deploy.direct_route import ROUTE_HEADER, RouteHeader, current_route, decode_route, encode_route  # noqa: E402
from kvroute.deploy.direct_router import RoutePrompts  # noqa: E402
from kvroute.deploy.openai.messages.api import chat_request  # noqa: E402
from kvroute.deploy.openai.messages.request import parse_request  # noqa: E402
from kvroute.deploy.openai.protocol import ChatCompletionRequest, CompletionRequest  # noqa: E402
from kvroute.deploy.openai.serving import OpenAIServing  # noqa: E402
from kvroute.router.types import RouteDecision  # noqa: E402

MODEL = "tiny"
TOOLS = [{"type": "function", "function": {"name": "lookup", "description": "find a record",
                                           "parameters": {"type": "object", "properties": {"q": {"type": "string"}}}}}]  # fmt: skip


def _header(data: object) -> str:
    return base64.urlsafe_b64encode(json.dumps(data).encode()).decode()


def test_a_decision_survives_the_header_and_anything_else_is_no_decision():
    d = RouteDecision("r1", 48, "prefix", ticket=9, available_tokens=64, fallbacks=("r2",), router_load=0.25,
                      failovers=1, spills=2, pull_from="r3", pull_tokens=32)  # fmt: skip
    value = encode_route(d)
    assert '"' not in value and "," not in value  # HAProxy's Lua reads a header value up to a quote
    back = decode_route(value)
    assert back == RouteDecision("r1", 48, "prefix", ticket=9, available_tokens=64, router_load=0.25, failovers=1,
                                 spills=2, pull_from="r3", pull_tokens=32)  # fmt: skip (fallbacks stay with the router)
    assert decode_route(encode_route(RouteDecision(None, 0, "fallback"))) == RouteDecision(None, 0, "fallback")
    refused = [
        "", "not base64 !", value[:-4], _header([1, 2]), _header({"replica_id": "r1"}),  # a required field missing
        _header({"replica_id": 5, "expected_cached_tokens": 1, "reason": "x"}),  # a wrong type
        _header({"replica_id": "r1", "expected_cached_tokens": True, "reason": "x"}),
        _header({"replica_id": "r1", "expected_cached_tokens": 1, "reason": "x", "evil": 1}),  # an unknown field
        "A" * 5000,
    ]
    assert [decode_route(v) for v in refused] == [None] * len(refused)


def test_the_route_header_is_the_requests_decision_and_only_its():
    seen = []

    async def app(scope, receive, send):
        seen.append(current_route.get())

    wrapped = RouteHeader(app)
    d = RouteDecision("r1", 8, "prefix", ticket=3)

    async def run():
        await wrapped({"type": "http", "headers": [(ROUTE_HEADER.encode(), encode_route(d).encode())]}, None, None)
        await wrapped({"type": "http", "headers": [(b"x-other", b"1")]}, None, None)
        await wrapped({"type": "http", "headers": [(ROUTE_HEADER.encode(), b"garbage")]}, None, None)
        return current_route.get()

    assert asyncio.run(run()) is None
    assert seen == [d, None, None]


@pytest.fixture(scope="module")
def serving(smollm2_tokenizer):
    return OpenAIServing(MODEL, smollm2_tokenizer, 16384, len(smollm2_tokenizer), backend=None,
                         served_model_aliases=("alias",))  # fmt: skip


def _route(serving, body: dict, store=None):
    return asyncio.run(RoutePrompts(serving, store).of(json.dumps(body).encode()))


def test_route_tokens_are_the_tokens_the_replica_runs(serving):
    chat = {"model": MODEL, "messages": [{"role": "system", "content": "Be brief."},
                                         {"role": "user", "content": "Where is the ledger?"}],
            "tools": TOOLS, "cache_salt": "tenant-a", "max_tokens": 5}  # fmt: skip
    prepared = asyncio.run(serving.prepare_chat(ChatCompletionRequest.model_validate(chat), b""))
    assert _route(serving, chat) == (prepared.prompts[0], None, "tenant-a")

    completion = {"model": "alias", "prompt": ["First prompt here", "second"], "max_tokens": 2}
    prepared = asyncio.run(serving.prepare_completion(CompletionRequest.model_validate(completion), b""))
    assert _route(serving, completion) == (prepared.prompts[0], None, None)

    message = {"model": MODEL, "max_tokens": 8, "system": "Be brief.",
               "messages": [{"role": "user", "content": [{"type": "text", "text": "Where is the ledger?"}]}]}  # fmt: skip
    chat_of_message = chat_request(parse_request(json.dumps(message).encode()))
    prepared = asyncio.run(serving.prepare_chat(ChatCompletionRequest.model_validate(chat_of_message), b""))
    assert _route(serving, message) == (prepared.prompts[0], None, None)

    response = {"model": MODEL, "input": "Where is the ledger?", "instructions": "Be brief."}
    plain = {"model": MODEL, "messages": [{"role": "system", "content": "Be brief."},
                                          {"role": "user", "content": "Where is the ledger?"}]}  # fmt: skip
    assert _route(serving, response)[0] == _route(serving, plain)[0]


def test_a_continued_response_routes_on_the_stored_conversation(serving):
    from kvroute.deploy.openai.responses.store import MemoryResponseStore

    store = MemoryResponseStore()
    earlier = [{"type": "message", "role": "user", "content": "Where is the ledger?"},
               {"type": "message", "role": "assistant", "content": "In the vault."}]  # the store's normal form
    asyncio.run(store.put("resp_1", json.dumps({"conversation": earlier})))
    follow_up = {"model": MODEL, "input": "And the key?", "previous_response_id": "resp_1"}
    ids, _, _ = _route(serving, follow_up, store)
    as_chat = {"model": MODEL, "messages": [{"role": "user", "content": "Where is the ledger?"},
                                            {"role": "assistant", "content": "In the vault."},
                                            {"role": "user", "content": "And the key?"}]}  # fmt: skip
    assert ids == _route(serving, as_chat)[0]
    alone, _, _ = _route(serving, {"model": MODEL, "input": "And the key?"}, store)
    # an unknown id: routed on the new input alone (the replica answers the 400)
    assert _route(serving, {**follow_up, "previous_response_id": "resp_gone"}, store)[0] == alone


def test_adapters_and_unreadable_bodies(serving):
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    assert _route(serving, {**body, "model": "sql-lora"})[1] == "sql-lora"
    assert _route(serving, {**body, "model": f"{MODEL}:sql-lora"})[1] == "sql-lora"  # Ray Serve LLM's naming
    assert _route(serving, {**body, "model": "alias"})[1] is None
    for raw in (b"", b"{", b"[1]", b'{"neither": 1}', b'{"messages": "hello"}', b'{"prompt": 5}',
                b'{"messages": [{"role": "user", "content": "hi"}], "surprise": 1}'):  # fmt: skip
        assert asyncio.run(RoutePrompts(serving, None).of(raw)) is None, raw


def test_a_prompt_past_the_horizon_is_read_as_far_as_the_horizon(serving):
    long_text = " ".join(f"entry{i} of the ledger;" for i in range(900))  # ~ 20k characters
    short = RoutePrompts(serving, None, block_size=16, horizon_chars=4000)
    chat = {"model": MODEL, "messages": [{"role": "user", "content": long_text}], "max_tokens": 2}
    exact = asyncio.run(serving.prepare_chat(ChatCompletionRequest.model_validate(chat), b"")).prompts[0]
    head, _, _ = asyncio.run(short.of(json.dumps(chat).encode()))
    assert 500 < len(head) < len(exact) // 3 and head == exact[: len(head)]
    completion = {"model": MODEL, "prompt": long_text, "max_tokens": 2}
    exact = asyncio.run(serving.prepare_completion(CompletionRequest.model_validate(completion), b"")).prompts[0]
    head, _, _ = asyncio.run(short.of(json.dumps(completion).encode()))
    assert 500 < len(head) < len(exact) // 3 and head == exact[: len(head)]
    # keeping the prompt's last tokens moves its head: placed by load, not on a wrong prefix
    assert asyncio.run(short.of(json.dumps({**completion, "truncate_prompt_tokens": 100}).encode()))[0] == []
    # under the horizon nothing changes
    assert asyncio.run(RoutePrompts(serving, None).of(json.dumps(chat).encode()))[0] == asyncio.run(
        serving.prepare_chat(ChatCompletionRequest.model_validate(chat), b"")).prompts[0]
