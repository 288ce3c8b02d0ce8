"""The Responses API (``/v1/responses``) end to end with the official ``openai`` client:
the single-engine ``kvroute serve-replica`` on the embedded SmolLM2 with the tool flags
(``chatml_tools``, auto tool choice, the hermes parser; the package's ``smol_tools_server``), then once through the Ray Serve application with
two ingresses in front of one fleet. Also the response store's bounds, on its own, and
the OpenAI Agents SDK's default (Responses) model when the package is installed.

What a Responses request answers is checked against the same conversation sent to
``/v1/chat/completions`` (greedy, so the texts must be equal): that is what the
translation promises.
"""

from __future__ import annotations

import json
from typing import Any, Literal

import pytest

httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")
pydantic = pytest.importorskip("pydantic")
pytest.importorskip("fastapi")

from kvroute.cluster.response_store_actor import BoundedStore, StoreBounds  # noqa: E402
from tests.deploy.conftest import SMOL_MODEL  # noqa: E402

MODEL = SMOL_MODEL
GREEDY: dict[str, Any] = {"temperature": 0, "max_output_tokens": 24}
TRIP = {
    "type": "function", "name": "plan_trip", "description": "Plan a trip through some cities",
    "parameters": {"type": "object", "additionalProperties": False, "required": ["cities", "mode"], "properties": {
        "cities": {"type": "array", "items": {"type": "string", "maxLength": 12}, "minItems": 1, "maxItems": 3},
        "mode": {"type": "string", "enum": ["train", "car"]}}},
}  # fmt: skip
WEATHER = {
    "type": "function", "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "required": ["city", "unit"], "properties": {
        "city": {"type": "string", "maxLength": 20}, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}}},
}  # fmt: skip


@pytest.fixture(scope="module")
def server(smol_tools_server):
    """The package's ``kvroute serve-replica`` with the tool flags (tests/deploy/conftest.py)."""
    return smol_tools_server


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server + "/v1", api_key="unused", max_retries=0, timeout=120)


def _chat_text(client, messages: list[dict[str, Any]], max_tokens: int = 24) -> str:
    r = client.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=max_tokens)
    return r.choices[0].message.content


def _events(stream) -> list[Any]:
    events = list(stream)
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert [e.type for e in events[:2]] == ["response.created", "response.in_progress"]
    return events


# ---------------------------------------------------------------------- text
def test_plain_input_and_instructions_answer_as_the_chat_path(client):
    r = client.responses.create(model=MODEL, input="Name a fruit.", **GREEDY)
    assert r.id.startswith("resp_") and r.object == "response" and r.model == MODEL
    assert r.status in ("completed", "incomplete")
    [item] = r.output
    assert item.type == "message" and item.role == "assistant" and item.content[0].type == "output_text"
    assert r.output_text == _chat_text(client, [{"role": "user", "content": "Name a fruit."}])
    u = r.usage
    assert u.input_tokens > 0 and u.output_tokens > 0 and u.total_tokens == u.input_tokens + u.output_tokens

    told = client.responses.create(model=MODEL, instructions="Answer in French.", input="Name a fruit.", **GREEDY)
    assert told.instructions == "Answer in French." and told.temperature == 0
    expected = _chat_text(client, [{"role": "system", "content": "Answer in French."},
                                   {"role": "user", "content": "Name a fruit."}])  # fmt: skip
    assert told.output_text == expected and told.usage.input_tokens != u.input_tokens

    # input items: typed content parts and an earlier assistant turn
    items = [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Hi, I am Ada."}]},
             {"role": "assistant", "content": [{"type": "output_text", "text": "Hello Ada!", "annotations": []}]},
             {"role": "user", "content": "What is my name?"}]  # fmt: skip
    r = client.responses.create(model=MODEL, input=items, **GREEDY)
    assert r.output_text == _chat_text(client, [{"role": "user", "content": "Hi, I am Ada."},
                                                {"role": "assistant", "content": "Hello Ada!"},
                                                {"role": "user", "content": "What is my name?"}])  # fmt: skip


def test_max_output_tokens_makes_it_incomplete(client):
    r = client.responses.create(model=MODEL, input="Tell me a long story about a dragon.", temperature=0, max_output_tokens=3)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.usage.output_tokens == 3 and r.output[0].status == "incomplete"


def test_streamed_text_equals_the_greedy_text(client):
    kw: dict[str, Any] = {"temperature": 0, "max_output_tokens": 100}  # room to finish: the stream helper wants response.completed
    whole = client.responses.create(model=MODEL, input="Write one sentence about the sea.", **kw)
    events = _events(client.responses.create(model=MODEL, input="Write one sentence about the sea.", stream=True,
                                             **kw))  # fmt: skip
    kinds = [e.type for e in events]
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    assert len(deltas) > 1 and "".join(d.delta for d in deltas) == whole.output_text
    assert kinds[2:4] == ["response.output_item.added", "response.content_part.added"]
    assert kinds[-4:-1] == ["response.output_text.done", "response.content_part.done", "response.output_item.done"]
    assert whole.status == "completed" and kinds[-1] == "response.completed"
    done = next(e for e in events if e.type == "response.output_text.done")
    final = events[-1].response
    assert done.text == whole.output_text == final.output_text and final.id == events[0].response.id
    assert {d.item_id for d in deltas} == {final.output[0].id}
    assert final.usage.output_tokens == whole.usage.output_tokens
    # the SDK's stream helper assembles the same response
    with client.responses.stream(model=MODEL, input="Write one sentence about the sea.", **kw) as stream:
        text = "".join(e.delta for e in stream if e.type == "response.output_text.delta")
        assert text == stream.get_final_response().output_text == whole.output_text


# ---------------------------------------------------------------------- structured output
def test_json_schema_text_format_validates(client):
    schema = {"type": "object", "additionalProperties": False, "required": ["name", "colors"], "properties": {
        "name": {"type": "string", "maxLength": 16},
        "colors": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "minItems": 1, "maxItems": 3}}}  # fmt: skip
    fmt = {"format": {"type": "json_schema", "name": "fruit", "schema": schema, "strict": True}}
    r = client.responses.create(model=MODEL, input="Describe an apple as JSON.", text=fmt, temperature=0,
                                max_output_tokens=80)  # fmt: skip
    assert r.status == "completed" and r.text.format.type == "json_schema"
    jsonschema.validate(json.loads(r.output_text), schema)

    class Fruit(pydantic.BaseModel):
        name: str
        color: Literal["red", "green", "yellow"]

    parsed = client.responses.parse(model=MODEL, input="Describe a banana.", text_format=Fruit, temperature=0,
                                    max_output_tokens=60)  # fmt: skip
    assert isinstance(parsed.output_parsed, Fruit)
    # json_object: any object (the model rambles inside it; that it is held to an object shows from its start)
    obj = client.responses.create(model=MODEL, input="Tell me about cats.", temperature=0, max_output_tokens=16,
                                  text={"format": {"type": "json_object"}})  # fmt: skip
    assert obj.text.format.type == "json_object" and obj.output_text.lstrip().startswith("{")


# ---------------------------------------------------------------------- function calls
@pytest.mark.parametrize("tool_choice", [{"type": "function", "name": "plan_trip"}, "required"])
def test_forced_call_with_array_and_enum_is_a_function_call_item(client, tool_choice):
    kw: dict[str, Any] = dict(model=MODEL, input="Plan a train trip to Paris and Rome.", tools=[TRIP, WEATHER],
                              tool_choice=tool_choice, parallel_tool_calls=False, temperature=0, max_output_tokens=120)  # fmt: skip
    r = client.responses.create(**kw)
    [call] = r.output
    assert call.type == "function_call" and call.name == "plan_trip" and call.call_id.startswith("call_")
    assert call.id.startswith("fc_") and r.status == "completed"
    jsonschema.validate(json.loads(call.arguments), TRIP["parameters"])
    assert r.tools[0].name == "plan_trip" and r.parallel_tool_calls is False

    events = _events(client.responses.create(stream=True, **kw))
    fragments = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    done = next(e for e in events if e.type == "response.function_call_arguments.done")
    [item] = events[-1].response.output
    assert "".join(fragments) == done.arguments == item.arguments == call.arguments
    assert item.type == "function_call" and item.name == "plan_trip" and events[-1].type == "response.completed"


def test_tool_loop_with_function_call_output(client):
    ask = "What's the weather in Paris?"
    first = client.responses.create(model=MODEL, input=ask, tools=[WEATHER], tool_choice="required",
                                    parallel_tool_calls=False, temperature=0, max_output_tokens=80)  # fmt: skip
    [call] = first.output
    args = json.loads(call.arguments)
    jsonschema.validate(args, WEATHER["parameters"])
    result = json.dumps({"city": args["city"], "temperature": 18, "unit": args["unit"]})
    answer = {"type": "function_call_output", "call_id": call.call_id, "output": result}
    # continued from the stored response ...
    cont = client.responses.create(model=MODEL, previous_response_id=first.id, input=[answer], tools=[WEATHER],
                                   tool_choice="none", temperature=0, max_output_tokens=40)  # fmt: skip
    # ... and with the whole conversation sent again, the output items replayed as they came
    replay = [{"role": "user", "content": ask}, call.model_dump(exclude_none=True), answer]
    again = client.responses.create(model=MODEL, input=replay, tools=[WEATHER], tool_choice="none", temperature=0,
                                    max_output_tokens=40, store=False)  # fmt: skip
    expected = client.chat.completions.create(model=MODEL, temperature=0, max_tokens=40, tool_choice="none",
        tools=[{"type": "function", "function": {k: v for k, v in WEATHER.items() if k != "type"}}],
        messages=[{"role": "user", "content": ask},
                  {"role": "assistant", "content": None, "tool_calls": [{"id": call.call_id, "type": "function",
                   "function": {"name": call.name, "arguments": call.arguments}}]},
                  {"role": "tool", "tool_call_id": call.call_id, "content": result}])  # fmt: skip
    text = expected.choices[0].message.content
    assert text and "<tool_call>" not in text
    assert cont.output_text == again.output_text == text
    assert [o.type for o in cont.output] == ["message"] and cont.previous_response_id == first.id


# ---------------------------------------------------------------------- stored responses
def test_previous_response_id_continues_on_the_cached_prefix(server, client):
    first = client.responses.create(model=MODEL, instructions="You are terse.", input="My cat is called Tom.", **GREEDY)
    second = client.responses.create(model=MODEL, instructions="You are terse.", previous_response_id=first.id,
                                     input="What is my cat called?", **GREEDY)  # fmt: skip
    conversation = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "My cat is called Tom."},
                    {"role": "assistant", "content": first.output_text},
                    {"role": "user", "content": "What is my cat called?"}]  # fmt: skip
    assert second.output_text == _chat_text(client, conversation)
    assert second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens
    # the continuation's prompt starts with the first one's, whose blocks the engine kept
    assert 0 < second.usage.input_tokens_details.cached_tokens <= first.usage.input_tokens + first.usage.output_tokens
    # instructions are not carried over: without them the prompt is the conversation alone
    third = client.responses.create(model=MODEL, previous_response_id=second.id, input="Thanks.", **GREEDY)
    tokens = httpx.post(server + "/tokenize", json={
        "model": MODEL, "messages": conversation[1:] + [{"role": "assistant", "content": second.output_text},
                                                         {"role": "user", "content": "Thanks."}]}).json()  # fmt: skip
    assert third.usage.input_tokens == tokens["count"]


def test_get_and_delete(client):
    r = client.responses.create(model=MODEL, input="Say yes.", metadata={"ticket": "42"}, user="ada", **GREEDY)
    got = client.responses.retrieve(r.id)
    assert got.id == r.id and got.output_text == r.output_text and got.metadata == {"ticket": "42"}
    assert got.usage == r.usage and got.user == "ada" and got.store is True
    client.responses.delete(r.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.delete(r.id)
    with pytest.raises(openai.BadRequestError) as err:
        client.responses.create(model=MODEL, previous_response_id=r.id, input="And?", **GREEDY)
    assert err.value.body["code"] == "previous_response_not_found" and err.value.body["param"] == "previous_response_id"


def test_store_false_is_not_retrievable(client):
    r = client.responses.create(model=MODEL, input="Say no.", store=False, **GREEDY)
    assert r.store is False
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r.id)
    streamed = _events(client.responses.create(model=MODEL, input="Say no.", store=False, stream=True, **GREEDY))
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(streamed[-1].response.id)
    kept = _events(client.responses.create(model=MODEL, input="Say no.", stream=True, **GREEDY))[-1].response
    assert client.responses.retrieve(kept.id).output_text == kept.output_text == r.output_text


# ---------------------------------------------------------------------- input items
def test_input_items_are_the_conversation_up_to_the_output(client):
    """``input_items.list``: the items a response was generated from, newest first by
    default; a continuation's are the previous conversation (its output included) and
    its own input; the client's auto-paging walks them by ``after``."""
    first = client.responses.create(model=MODEL, instructions="You are terse.", input="My cat is called Tom.", **GREEDY)
    page = client.responses.input_items.list(first.id)
    [item] = page.data
    assert item.type == "message" and item.role == "user" and item.status == "completed"
    assert [(p.type, p.text) for p in item.content] == [("input_text", "My cat is called Tom.")]
    assert page.first_id == page.last_id == item.id and page.has_more is False and page.object == "list"

    second = client.responses.create(model=MODEL, previous_response_id=first.id, input="What is my cat called?", **GREEDY)
    asc = client.responses.input_items.list(second.id, order="asc").data
    assert [(i.type, i.role) for i in asc] == [("message", "user"), ("message", "assistant"), ("message", "user")]
    assert asc[1].content[0].type == "output_text" and asc[1].content[0].text == first.output_text
    assert asc[2].content[0].text == "What is my cat called?"
    desc = client.responses.input_items.list(second.id)
    assert [i.id for i in desc.data] == [i.id for i in reversed(asc)] and len(set(i.id for i in asc)) == 3
    one = client.responses.input_items.list(second.id, limit=1, order="asc")
    assert [i.id for i in one.data] == [asc[0].id] and one.has_more is True
    assert [i.id for i in one] == [i.id for i in asc]  # paged by after=<last id>, one item a page
    after = client.responses.input_items.list(second.id, after=asc[1].id, order="desc")
    assert [i.id for i in after.data] == [asc[0].id] and after.has_more is False


def test_input_items_carry_function_calls_and_outputs(client):
    call = {"type": "function_call", "call_id": "call_7", "name": "get_weather",
            "arguments": json.dumps({"city": "Paris", "unit": "celsius"})}  # fmt: skip
    output = {"type": "function_call_output", "call_id": "call_7", "output": '{"temperature": 18}'}
    r = client.responses.create(model=MODEL, input=[{"role": "user", "content": "Weather in Paris?"}, call, output],
                                tools=[WEATHER], tool_choice="none", **GREEDY)  # fmt: skip
    items = client.responses.input_items.list(r.id, order="asc").data
    assert [i.type for i in items] == ["message", "function_call", "function_call_output"]
    assert (items[1].call_id, items[1].name, items[1].arguments) == ("call_7", "get_weather", call["arguments"])
    assert (items[2].call_id, items[2].output) == ("call_7", output["output"])


@pytest.mark.parametrize("query,param", [
    ({"limit": "0"}, "limit"), ({"limit": "101"}, "limit"), ({"limit": "ten"}, "limit"), ({"order": "newest"}, "order"),
    ({"after": "msg_nope"}, "after"), ({"before": "x"}, "before"), ({"include": "message.output_text.logprobs"}, "include"),
])  # fmt: skip
def test_input_items_bad_query_is_a_400_naming_it(client, server, query, param):
    r = client.responses.create(model=MODEL, input="Say yes.", **GREEDY)
    got = httpx.get(f"{server}/v1/responses/{r.id}/input_items", params=query, timeout=30)
    assert got.status_code == 400, got.text
    error = got.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error" and param in error["message"]


def test_input_items_of_an_unknown_or_unstored_response_are_a_404(client):
    unstored = client.responses.create(model=MODEL, input="Say no.", store=False, **GREEDY)
    for rid in ("resp_nope", unstored.id):
        with pytest.raises(openai.NotFoundError):
            client.responses.input_items.list(rid)


BAD = [
    ({"input": "hi", "frequency_penalty": 1}, "frequency_penalty"),
    ({"input": [{"role": "robot", "content": "hi"}]}, "input[0].role"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x"}]}]}, "input[0].content[0].type"),
    ({"input": [{"type": "web_search_call", "id": "x"}]}, "input[0].type"),
    ({"input": [{"type": "function_call_output", "call_id": "call_1", "output": "{}"}]}, "input[0].call_id"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "[1]"}]}, "input[0].arguments"),
    ({"input": "hi", "tools": [TRIP], "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice"),
    ({"input": "hi", "tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"input": "hi", "text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format.schema"),
    ({"input": "hi", "text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "nonsense"}}}}, "text.format.schema"),
    ({"input": "hi", "max_output_tokens": 5000}, "max_output_tokens"),
    ({"input": "hi", "temperature": 3}, "temperature"),
    ({"input": "hi", "include": ["message.output_text.logprobs"]}, "include"),
    ({"input": "hi", "truncation": "auto"}, "truncation"),
    ({"input": "hi", "previous_response_id": "resp_unknown"}, "previous_response_id"),
    ({"input": "hi", "model": "gpt-4o"}, "model"),
    ({"input": []}, "input"),
]


@pytest.mark.parametrize("body,param", BAD, ids=[p for _, p in BAD])
def test_bad_requests_are_4xx_naming_the_field(server, body, param):
    r = httpx.post(server + "/v1/responses", json=body, timeout=60)
    assert 400 <= r.status_code < 500, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error", error
    assert r.status_code == (404 if param == "model" else 400)


@pytest.mark.parametrize("arguments,message", [
    ("{oops", "input[0].arguments: not valid JSON (Expecting property name enclosed in double quotes)"),
    ("[1]", "input[0].arguments: must encode a JSON object, got list"),
])
def test_a_replayed_calls_arguments_must_be_an_object(arguments, message):
    """The same object check as a chat assistant's ``tool_calls`` (``json_object``),
    with the item's path in front instead of ``function.arguments``."""
    from kvroute.deploy.openai.responses.request import _item

    with pytest.raises(ValueError) as exc:
        _item(0, {"type": "function_call", "call_id": "c", "name": "f", "arguments": arguments})
    assert str(exc.value) == message


def test_a_client_that_leaves_mid_stream_aborts_its_request(server):
    from tests.conftest import wait_until

    body = {"model": MODEL, "input": "Tell me a very long story about a dragon.", "stream": True, "temperature": 0,
            "max_output_tokens": 500}  # fmt: skip
    with httpx.stream("POST", server + "/v1/responses", json=body, timeout=60) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("event: response.output_text.delta"):
                assert httpx.get(server + "/get_load").json()["num_reqs"] == 1  # still generating
                break  # leaving the iterator drops the connection
    wait_until(lambda: httpx.get(server + "/get_load").json()["num_reqs"] == 0, 20, "the engine request to be aborted")


def _events_of(pieces: list[bytes]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The Responses events ``response_events`` makes of chat SSE bytes arriving in
    ``pieces``, and what it handed over to be stored."""
    import asyncio

    from kvroute.deploy.openai.responses.request import ResponsesRequest
    from kvroute.deploy.openai.responses.stream import response_events

    async def run() -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        async def feed():
            for piece in pieces:
                yield piece

        stored: list[dict[str, Any]] = []

        async def finished(response: dict[str, Any]) -> None:
            stored.append(response)

        frames = [e async for e in response_events(ResponsesRequest(input="x"), "resp_x", MODEL, 0, feed(), finished)]
        return [json.loads(f.split(b"\ndata: ", 1)[1]) for f in frames], stored

    return asyncio.run(run())


def test_events_from_the_chat_streams_bytes_cut_anywhere_and_an_error_frame(server):
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "Name a fruit."}], "stream": True, "temperature": 0,
            "max_tokens": 12, "stream_options": {"include_usage": True}}  # fmt: skip
    raw = httpx.post(server + "/v1/chat/completions", json=chat, timeout=60).content
    events, stored = _events_of([raw])
    text = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    assert text and events[-1]["response"]["output"][0]["content"][0]["text"] == text
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    chat_usage = json.loads(raw.split(b"data: ")[-2])["usage"]  # the chunk before [DONE]
    assert stored == [events[-1]["response"]] and stored[0]["usage"]["output_tokens"] == chat_usage["completion_tokens"]

    def shape(evs: list[dict[str, Any]]) -> list[tuple[str, str]]:
        return [(e["type"], e.get("delta", "")) for e in evs]

    for data in (raw, raw.replace(b"\n", b"\r\n")):
        for size in (1, 7, 100):
            assert shape(_events_of([data[i : i + size] for i in range(0, len(data), size)])[0]) == shape(events)
    # the chat stream fails after it started: the open item ends, then error and response.failed; nothing stored
    cut = raw[: raw.index(b"data: ", len(raw) // 2)]
    error = {"error": {"message": "the service is overloaded", "type": "rate_limit_error", "param": None, "code": "overloaded"}}
    failed, stored = _events_of([cut, b"data: " + json.dumps(error).encode() + b"\n\n", b"data: [DONE]\n\n"])
    assert [e["type"] for e in failed[-3:]] == ["response.output_item.done", "error", "response.failed"]
    assert failed[-2]["code"] == "overloaded" and failed[-1]["response"]["status"] == "failed"
    assert failed[-1]["response"]["error"]["message"] == "the service is overloaded" and stored == []


def test_unknown_ids_and_bodies_that_are_not_json(server):
    assert httpx.get(server + "/v1/responses/resp_nope").status_code == 404
    assert httpx.delete(server + "/v1/responses/resp_nope").json()["error"]["param"] == "response_id"
    r = httpx.post(server + "/v1/responses", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]


# ---------------------------------------------------------------------- the store's bounds
def test_bounded_store_evicts_by_count_bytes_and_age():
    now = [0.0]
    store = BoundedStore(StoreBounds(max_entries=3, max_bytes=100, ttl_s=10), clock=lambda: now[0])
    for key in "abc":
        assert store.put(key, "x" * 20)
    store.get("a")  # "a" is now the most recently used: "b" goes first
    store.put("d", "x" * 20)
    assert [store.get(k) is not None for k in "abcd"] == [True, False, True, True]
    store.put("e", "y" * 50)  # 20 * 3 + 50 > 100: the two least recently used go
    assert store.stats()["bytes"] <= 100 and store.get("e") == "y" * 50
    assert store.put("big", "z" * 101) is False and store.get("big") is None
    now[0] = 11.0
    assert store.get("e") is None and store.stats()["expired"] == 1
    assert store.delete("d") is False  # expired too
    store.put("f", "ok")
    assert store.delete("f") is True and store.delete("f") is False


# ---------------------------------------------------------------------- the OpenAI Agents SDK
def test_agents_sdk_default_responses_model(server):
    agents = pytest.importorskip("agents")
    agents.set_tracing_disabled(True)
    client = openai.AsyncOpenAI(base_url=server + "/v1", api_key="unused", max_retries=0, timeout=120)
    model = agents.OpenAIResponsesModel(model=MODEL, openai_client=client)
    settings = agents.ModelSettings(temperature=0, max_tokens=24)
    plain = agents.Runner.run_sync(agents.Agent(name="plain", instructions="Be brief.", model=model, model_settings=settings),
                                   "Name a color.")  # fmt: skip
    assert isinstance(plain.final_output, str) and plain.final_output

    asked: list[tuple[list[str], str]] = []

    @agents.function_tool
    def plan_trip(cities: list[str], mode: Literal["train", "car"]) -> str:
        """Plan a trip through some cities."""
        asked.append((cities, mode))
        return f"booked {mode} through {', '.join(cities)}"

    tool_settings = agents.ModelSettings(temperature=0, max_tokens=120, tool_choice="plan_trip")
    agent = agents.Agent(name="planner", model=model, model_settings=tool_settings, tools=[plan_trip],
                         tool_use_behavior="stop_on_first_tool")  # fmt: skip
    result = agents.Runner.run_sync(agent, "Plan a train trip to Paris and Rome.")
    [(cities, mode)] = asked
    assert cities and mode in ("train", "car") and result.final_output == f"booked {mode} through {', '.join(cities)}"


# ---------------------------------------------------------------------- through the Serve application
def test_any_ingress_of_the_serve_app_retrieves_and_continues_a_response(ray_cluster, tiny_llama_path):
    """Two ingresses (the application's, and one more at ``/b`` in front of the same
    fleet of 4 replicas, as the multi-ingress benchmark runs them) share the
    application's response store: a response stored through one is read, continued and
    deleted through the other. Every continuation goes to the replica that holds its
    conversation's KV: conversations that start apart spread over the replicas, and each
    turn, sent through the other ingress than the one before, finds at least the
    previous prompt's full blocks cached."""
    from ray import serve

    from kvroute.cluster.response_store_actor import kill_response_store
    from kvroute.cluster.router_lookup import app_router
    from kvroute.deploy.app import build_app, compose_ingress_app
    from tests.conftest import end_serve_app, wait_until

    ray = pytest.importorskip("ray")
    name, model, block = "kvresponses", "tiny-served", 8
    args = {"app_name": name, "llm_configs": [{
        "model_loading_config": {"model_id": model, "model_source": str(tiny_llama_path)},
        "engine_kwargs": {"block_size": block, "num_kv_blocks": 256, "max_model_len": 512, "dtype": "float32",
                          "hash_seed": 11},
        "deployment_config": {"num_replicas": 4, "ray_actor_options": {"num_cpus": 1}}}]}  # fmt: skip
    serve.run(build_app(args), name=name, route_prefix="/")
    serve.run(compose_ingress_app(args, name), name=f"{name}-b", route_prefix="/b")
    try:
        router = app_router(name)
        wait_until(lambda: len(ray.get(router.replicas.remote())) == 4, 120, "the 4 replicas registered")
        ingresses = [openai.OpenAI(base_url=ray_cluster + prefix, api_key="none", max_retries=0, timeout=60)
                     for prefix in ("/v1", "/b/v1")]  # fmt: skip
        one, two = ingresses
        topics = ["the archive", "a lighthouse", "the winter market", "an old ferry", "the orchard", "a glass tower",
                  "the salt road", "a quiet library"]  # fmt: skip
        # each conversation's own instructions (a continuation sends them again): its first block is its own,
        # where the template's default system prompt would give every conversation the same first blocks
        instructions = [f"{t.title()} keeper, answer briefly." for t in topics]
        last = [one.responses.create(model=model, instructions=ins, input=f"Tell me about {t}, its rules and its keepers.",
                                     temperature=0, max_output_tokens=6) for t, ins in zip(topics, instructions)]  # fmt: skip
        assert two.responses.retrieve(last[0].id).output_text == last[0].output_text
        hits = turns = 0
        for turn in range(1, 3):
            for i, previous in enumerate(last):
                nxt = ingresses[turn % 2].responses.create(model=model, instructions=instructions[i],
                                                           previous_response_id=previous.id, input=f"And then, part {turn}?",
                                                           temperature=0, max_output_tokens=6)  # fmt: skip
                assert nxt.usage.input_tokens > previous.usage.input_tokens + previous.usage.output_tokens
                turns += 1
                hits += nxt.usage.input_tokens_details.cached_tokens >= previous.usage.input_tokens // block * block
                last[i] = nxt
        assert hits / turns >= 0.99, f"continuation hit rate {hits}/{turns}"
        holders = [rid for rid in ray.get(router.replicas.remote()) if ray.get(router.directory.remote(rid))]
        assert len(holders) >= 2  # the conversations did spread: the hits are the router's doing
        assert one.responses.retrieve(last[0].id).previous_response_id is not None
        two.responses.delete(last[0].id)
        with pytest.raises(openai.NotFoundError):
            one.responses.retrieve(last[0].id)
    finally:
        end_serve_app(f"{name}-b")
        end_serve_app(name)
        kill_response_store(name)
