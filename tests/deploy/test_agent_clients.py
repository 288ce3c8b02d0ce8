"""The client libraries agents and JSON apps are written with, unmodified, against the
real ``kvroute serve-replica`` (the embedded SmolLM2 in fp32, ``--chat-template
chatml_tools --enable-auto-tool-choice --tool-call-parser hermes``), the one server
test_messages_api and test_responses_api use too (tests/deploy/conftest.py):
langchain-openai, instructor, pydantic-ai, the OpenAI Agents SDK (its
chat-completions model and its default Responses model), the openai SDK's strict
pydantic helpers, anthropic with a ``$defs`` schema, and aiperf's chat and responses runs;
last, langchain once through the Ray Serve application (the session's Ray cluster).

Every schema carries arrays, enums, ``$defs`` (nested pydantic models) and nesting. The
model is tiny, so each test asks for a forced mode (a named or required tool call,
``response_format`` json_schema): the output is valid by construction, and what is
checked is the whole path: the request the library really sends (recorded on the wire),
the server's answer in the shape the library reads (a tool call, not content), and the
library's own parsing into pydantic objects of the right types whose values validate.
Nothing leaves loopback: tracing and telemetry are off, the libraries get the server's
URL.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from enum import Enum
from pathlib import Path
from typing import Annotated, Any, Literal

import pytest

# before the libraries import: nothing phones home
for _var, _value in {"LANGSMITH_TRACING": "false", "LANGCHAIN_TRACING_V2": "false", "OPENAI_AGENTS_DISABLE_TRACING": "1",
                     "HF_HUB_DISABLE_TELEMETRY": "1", "DO_NOT_TRACK": "1"}.items():  # fmt: skip
    os.environ.setdefault(_var, _value)

httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")
pydantic = pytest.importorskip("pydantic")
pytest.importorskip("fastapi")
from pydantic import BaseModel, Field  # noqa: E402

from tests.deploy.conftest import SMOL_MODEL  # noqa: E402

MODEL = SMOL_MODEL
ASK_PERSON = "Ada Lovelace, 36, a mathematician and writer, lives in London, England. High priority."
# room for the whitespace a json_schema grammar lets the model put between tokens (it does, as under vLLM)
MAX_TOKENS = 250
ASK_TRIP = "Plan a train trip: two nights in Paris, then three nights in Rome."


# ---------------------------------------------------------------------- the schemas
class Priority(str, Enum):
    low = "low"
    medium = "medium"
    high = "high"


class Transport(str, Enum):
    train = "train"
    car = "car"
    plane = "plane"


class Address(BaseModel):
    """A postal address."""

    city: str = Field(max_length=12)
    country: str = Field(max_length=12)


class Person(BaseModel):
    """A person and where they live."""

    name: str = Field(max_length=16)
    age: int = Field(ge=0, le=120)
    tags: list[Annotated[str, Field(max_length=10)]] = Field(min_length=1, max_length=2)
    priority: Priority
    home: Address


class Stop(BaseModel):
    """One stop of a trip."""

    city: str = Field(max_length=12)
    nights: int = Field(ge=1, le=14)
    transport: Transport


class Itinerary(BaseModel):
    """A trip: its stops in order."""

    stops: list[Stop] = Field(min_length=1, max_length=2)


def _check_person(p: Any) -> None:
    assert isinstance(p, Person), repr(p)  # instructor answers with a subclass of its own
    assert type(p.home) is Address and type(p.priority) is Priority and type(p.age) is int
    assert 1 <= len(p.tags) <= 2 and all(type(t) is str and len(t) <= 10 for t in p.tags)
    assert Person.model_validate_json(p.model_dump_json()).model_dump() == p.model_dump()


def _check_itinerary(it: Any) -> None:
    assert isinstance(it, Itinerary), repr(it)
    assert 1 <= len(it.stops) <= 2
    for stop in it.stops:
        assert type(stop) is Stop and type(stop.transport) is Transport and 1 <= stop.nights <= 14
    assert Itinerary.model_validate_json(it.model_dump_json()).model_dump() == it.model_dump()


def _has_defs(schema: dict[str, Any]) -> bool:
    """The schema went out with its nested models as ``$defs`` and ``$ref`` (not inlined)."""
    text = json.dumps(schema)
    return "$defs" in schema and '"$ref": "#/$defs/' in text


def _inlined(schema: dict[str, Any]) -> bool:
    """The schema went out with its nested models written in place (langchain's tool
    conversion does that): no ``$ref`` left, an object inside, an enum somewhere."""
    text = json.dumps(schema)
    return "$ref" not in text and '"enum"' in text and text.count('"type": "object"') >= 2


# ---------------------------------------------------------------------- the server and the wire
@pytest.fixture(scope="module")
def server(smol_tools_server):
    """The package's ``kvroute serve-replica`` with the tool flags (tests/deploy/conftest.py)."""
    return smol_tools_server


class Wire:
    """The requests a library sends, read off its own HTTP client (event hooks), so a
    test sees the mode it really used: tools and tool_choice, or response_format."""

    def __init__(self) -> None:
        self.sent: list[tuple[str, dict[str, Any]]] = []

    def _record(self, request: Any) -> None:
        if request.method == "POST":
            self.sent.append((request.url.path, json.loads(request.content)))

    async def _arecord(self, request: Any) -> None:
        self._record(request)

    def http(self) -> Any:
        return httpx.Client(event_hooks={"request": [self._record]}, timeout=120)

    def ahttp(self) -> Any:
        return httpx.AsyncClient(event_hooks={"request": [self._arecord]}, timeout=120)

    def openai(self, server: str) -> Any:
        return openai.OpenAI(base_url=server + "/v1", api_key="unused", max_retries=0, http_client=self.http())

    def aopenai(self, server: str) -> Any:
        return openai.AsyncOpenAI(base_url=server + "/v1", api_key="unused", max_retries=0, http_client=self.ahttp())

    def only(self) -> tuple[str, dict[str, Any]]:
        [(path, body)] = self.sent
        return path, body


@pytest.fixture
def wire() -> Wire:
    return Wire()


def _forced_tool(body: dict[str, Any], name: str) -> dict[str, Any]:
    """The one tool a request forces by name (chat completions' shape); its parameters."""
    assert body["tool_choice"] == {"type": "function", "function": {"name": name}}, body.get("tool_choice")
    [tool] = [t for t in body["tools"] if t["function"]["name"] == name]
    return tool["function"]["parameters"]


# ---------------------------------------------------------------------- the openai SDK's pydantic helpers
def test_openai_sdk_strict_function_tool_and_parse(server, wire):
    """``pydantic_function_tool`` (strict, ``$defs`` kept) forced by name comes back as a
    call the SDK parses into the model; ``parse`` with a ``response_format`` model too."""
    client = wire.openai(server)
    r = client.chat.completions.parse(model=MODEL, messages=[{"role": "user", "content": ASK_PERSON}], temperature=0,
                                      max_tokens=MAX_TOKENS, tools=[openai.pydantic_function_tool(Person)],
                                      tool_choice={"type": "function", "function": {"name": "Person"}})  # fmt: skip
    [call] = r.choices[0].message.tool_calls
    _check_person(call.function.parsed_arguments)
    params = _forced_tool(wire.sent[0][1], "Person")
    assert _has_defs(params) and params["additionalProperties"] is False

    r = client.chat.completions.parse(model=MODEL, messages=[{"role": "user", "content": ASK_TRIP}], temperature=0,
                                      max_tokens=MAX_TOKENS, response_format=Itinerary)  # fmt: skip
    assert r.choices[0].finish_reason == "stop"
    _check_itinerary(r.choices[0].message.parsed)
    assert _has_defs(wire.sent[1][1]["response_format"]["json_schema"]["schema"])


# ---------------------------------------------------------------------- langchain-openai
def _chat_openai(server: str, wire: Wire, **kw: Any) -> Any:
    from langchain_openai import ChatOpenAI

    return ChatOpenAI(model=MODEL, base_url=server + "/v1", api_key="unused", temperature=0, max_tokens=MAX_TOKENS,
                      max_retries=0, http_client=wire.http(), **kw)  # fmt: skip


def _tool_dicts(*models: type[BaseModel]) -> list[dict[str, Any]]:
    """OpenAI tool dicts of pydantic models, their schemas as pydantic writes them."""
    return [{"type": "function", "function": {"name": m.__name__, "description": m.__doc__,
                                              "parameters": m.model_json_schema()}} for m in models]  # fmt: skip


@pytest.mark.parametrize("method", ["function_calling", "json_schema"])
def test_langchain_with_structured_output(server, wire, method):
    pytest.importorskip("langchain_openai")
    llm = _chat_openai(server, wire).with_structured_output(Person, method=method, include_raw=True)
    out = llm.invoke(ASK_PERSON)
    assert out["parsing_error"] is None
    _check_person(out["parsed"])
    path, body = wire.only()
    assert path == "/v1/chat/completions"
    if method == "function_calling":
        assert _inlined(_forced_tool(body, "Person"))  # langchain writes a pydantic model's refs in place
        [call] = out["raw"].tool_calls  # a call, not content the library has to guess at
        assert call["name"] == "Person" and Person.model_validate(call["args"]) == out["parsed"]
    else:
        assert body["response_format"]["type"] == "json_schema" and "tools" not in body
        assert _has_defs(body["response_format"]["json_schema"]["schema"])
        assert Person.model_validate_json(out["raw"].content) == out["parsed"]


def test_langchain_bind_tools_streamed(server, wire):
    """``bind_tools`` with two tools and ``tool_choice`` naming one, streamed: the
    chunks' tool-call pieces add up to one call whose arguments validate. The tools go as
    OpenAI tool dicts, which langchain passes on as they are, ``$defs`` included."""
    pytest.importorskip("langchain_openai")
    llm = _chat_openai(server, wire).bind_tools(_tool_dicts(Person, Itinerary), tool_choice="Itinerary")
    whole = None
    for chunk in llm.stream(ASK_TRIP):
        whole = chunk if whole is None else whole + chunk
    [call] = whole.tool_calls
    assert call["name"] == "Itinerary" and call["id"]
    _check_itinerary(Itinerary.model_validate(call["args"]))
    path, body = wire.only()
    assert body["stream"] is True and _has_defs(_forced_tool(body, "Itinerary"))


# ---------------------------------------------------------------------- instructor
@pytest.mark.parametrize("mode", ["TOOLS", "JSON_SCHEMA"])
def test_instructor(server, wire, mode):
    instructor = pytest.importorskip("instructor")
    client = instructor.from_openai(wire.openai(server), mode=getattr(instructor.Mode, mode))
    # max_retries=0: one request, so a bad answer is an error here, not a silent retry
    it, raw = client.chat.completions.create_with_completion(
        model=MODEL, response_model=Itinerary, max_retries=0, temperature=0, max_tokens=MAX_TOKENS,
        messages=[{"role": "user", "content": ASK_TRIP}])  # fmt: skip
    _check_itinerary(it)
    path, body = wire.only()
    message = raw.choices[0].message
    if mode == "TOOLS":
        assert _has_defs(_forced_tool(body, "Itinerary"))
        [call] = message.tool_calls
        assert message.content is None
        assert Itinerary.model_validate_json(call.function.arguments).model_dump() == it.model_dump()
    else:
        assert body["response_format"]["type"] == "json_schema"
        assert _has_defs(body["response_format"]["json_schema"]["schema"])
        assert Itinerary.model_validate_json(message.content).model_dump() == it.model_dump()


# ---------------------------------------------------------------------- pydantic-ai
@pytest.mark.parametrize("kind", ["tool", "native"])
def test_pydantic_ai_structured_output(server, wire, kind):
    """An Agent with a pydantic ``output_type``: its default tool output (a required call
    of ``final_result``) and ``NativeOutput`` (``response_format`` json_schema)."""
    pytest.importorskip("pydantic_ai")
    from pydantic_ai import Agent, NativeOutput
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider
    from pydantic_ai.settings import ModelSettings

    model = OpenAIChatModel(MODEL, provider=OpenAIProvider(openai_client=wire.aopenai(server)))
    agent = Agent(model, output_type=Person if kind == "tool" else NativeOutput(Person), retries=0,
                  model_settings=ModelSettings(temperature=0, max_tokens=MAX_TOKENS))  # fmt: skip
    result = agent.run_sync(ASK_PERSON)
    _check_person(result.output)
    path, body = wire.only()  # one request: the first answer parsed
    if kind == "tool":
        assert body["tool_choice"] == "required" and [t["function"]["name"] for t in body["tools"]] == ["final_result"]
        assert _has_defs(body["tools"][0]["function"]["parameters"])
    else:
        assert "tools" not in body and _has_defs(body["response_format"]["json_schema"]["schema"])


# ---------------------------------------------------------------------- the OpenAI Agents SDK
def _agents_model(server: str, wire: Wire, kind: str) -> Any:
    agents = pytest.importorskip("agents")
    agents.set_tracing_disabled(True)
    client = wire.aopenai(server)
    if kind == "chat":
        return agents.OpenAIChatCompletionsModel(model=MODEL, openai_client=client)
    return agents.OpenAIResponsesModel(model=MODEL, openai_client=client)


def _plan_trip_tool(asked: list[tuple[list[str], str]]) -> Any:
    import agents

    @agents.function_tool
    def plan_trip(cities: list[str], mode: Literal["train", "car"]) -> str:
        """Book a trip through some cities."""
        asked.append((cities, mode))
        return f"booked {mode} through {', '.join(cities)}"

    return plan_trip


def _forcing(tool: str) -> Any:
    import agents

    return agents.ModelSettings(temperature=0, max_tokens=MAX_TOKENS, tool_choice=tool)


KINDS = [pytest.param("chat", id="chat_completions"), pytest.param("responses", id="responses")]


@pytest.mark.parametrize("kind", KINDS)
def test_agents_sdk_output_type(server, wire, kind):
    """An Agent with a function tool on offer and a pydantic ``output_type``: the SDK's
    strict schema goes out as ``response_format`` (chat) or ``text.format`` (Responses),
    and ``final_output`` is the model, parsed by the SDK."""
    agents = pytest.importorskip("agents")
    asked: list[tuple[list[str], str]] = []
    agent = agents.Agent(name="planner", instructions="Answer with the itinerary.", model=_agents_model(server, wire, kind),
                         tools=[_plan_trip_tool(asked)], output_type=Itinerary,
                         model_settings=agents.ModelSettings(temperature=0, max_tokens=MAX_TOKENS))  # fmt: skip
    result = agents.Runner.run_sync(agent, ASK_TRIP, max_turns=3)
    _check_itinerary(result.final_output)
    path, body = wire.sent[-1]
    if kind == "chat":
        assert path == "/v1/chat/completions" and _has_defs(body["response_format"]["json_schema"]["schema"])
    else:
        assert path == "/v1/responses" and _has_defs(body["text"]["format"]["schema"])
    for cities, mode in asked:  # the model may call the tool first; if it did, the call was valid
        assert all(type(c) is str for c in cities) and mode in ("train", "car")


def test_agents_sdk_chat_completions_forced_function_tool(server, wire):
    """The chat-completions model, a tool forced by name, an array and an enum in its
    arguments: the SDK runs the tool with them (the Responses model's twin is in
    test_responses_api.py)."""
    agents = pytest.importorskip("agents")
    asked: list[tuple[list[str], str]] = []
    agent = agents.Agent(name="planner", model=_agents_model(server, wire, "chat"), tools=[_plan_trip_tool(asked)],
                         tool_use_behavior="stop_on_first_tool",
                         model_settings=_forcing("plan_trip"))  # fmt: skip
    result = agents.Runner.run_sync(agent, ASK_TRIP)
    [(cities, mode)] = asked
    assert cities and all(type(c) is str for c in cities) and mode in ("train", "car")
    assert result.final_output == f"booked {mode} through {', '.join(cities)}"
    path, body = wire.only()
    assert path == "/v1/chat/completions" and _forced_tool(body, "plan_trip")["properties"]["cities"]["type"] == "array"


@pytest.mark.parametrize("kind", KINDS)
def test_agents_sdk_forced_tool_then_output_type(server, wire, kind):
    """The SDK's pattern for "call this tool, then answer in this shape": turn 1 forces the
    tool (the output_type's schema rides along), the SDK resets tool_choice, turn 2
    answers with the model."""
    agents = pytest.importorskip("agents")
    asked: list[tuple[list[str], str]] = []
    agent = agents.Agent(name="planner", model=_agents_model(server, wire, kind), tools=[_plan_trip_tool(asked)],
                         output_type=Itinerary,
                         model_settings=_forcing("plan_trip"))  # fmt: skip
    result = agents.Runner.run_sync(agent, ASK_TRIP, max_turns=3)
    [(cities, mode)] = asked
    assert cities and mode in ("train", "car")
    _check_itinerary(result.final_output)


# ---------------------------------------------------------------------- anthropic
def test_anthropic_forced_tool_with_defs(server):
    """The Messages API's forced tool use with a schema of nested models (``$defs``,
    ``$ref``, an array of objects, an enum): the input validates into the model.
    (test_messages_api.py has the rest of the Messages API.)"""
    anthropic = pytest.importorskip("anthropic")
    client = anthropic.Anthropic(base_url=server, api_key="unused", max_retries=0, timeout=120)
    schema = Itinerary.model_json_schema()
    assert _has_defs(schema)
    m = client.messages.create(model=MODEL, max_tokens=MAX_TOKENS, extra_body={"temperature": 0},
                               messages=[{"role": "user", "content": ASK_TRIP}],
                               tools=[{"name": "itinerary", "description": "Record the trip", "input_schema": schema}],
                               tool_choice={"type": "tool", "name": "itinerary"})  # fmt: skip
    [use] = [b for b in m.content if b.type == "tool_use"]
    assert use.name == "itinerary" and m.stop_reason == "tool_use"
    _check_itinerary(Itinerary.model_validate(use.input))


# ---------------------------------------------------------------------- aiperf
# aiperf pins pandas, pyzmq, rich, pillow, huggingface-hub, prometheus-client, orjson and psutil to older
# minor versions (~=), so it lives in a virtualenv of its own (pyproject.toml says how); AIPERF names its
# script, else one in this interpreter's folder is used
AIPERF = Path(os.environ.get("AIPERF") or Path(sys.executable).parent / "aiperf")


@pytest.mark.parametrize("endpoint", ["chat", "responses"])
def test_aiperf_profile(server, smollm2_path, tmp_path, endpoint):
    """aiperf's streamed chat and responses runs: every request succeeds and the
    figures it exports count the tokens the server streamed."""
    if not AIPERF.exists():
        pytest.skip("no aiperf: python -m venv .venv-aiperf && .venv-aiperf/bin/pip install aiperf==0.13.0, "
                    "then AIPERF=.venv-aiperf/bin/aiperf")
    out = tmp_path / "aiperf"
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")}
    # aiperf's offline mode looks a tokenizer up only in the hub cache, not in a folder; online it takes the
    # folder as a local path, and the hub endpoint is a closed loopback port, so nothing can leave anyway
    env |= {"HF_ENDPOINT": "http://127.0.0.1:9", "HF_HUB_DISABLE_TELEMETRY": "1"}
    cmd = [str(AIPERF), "profile", "--model", MODEL, "--url", server, "--endpoint-type", endpoint, "--streaming",
           "--tokenizer", str(smollm2_path), "--request-count", "4", "--concurrency", "2",
           "--synthetic-input-tokens-mean", "32", "--output-tokens-mean", "8", "--artifact-dir", str(out),
           "--ui-type", "none"]  # fmt: skip
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    figures = json.loads((out / "profile_export_aiperf.json").read_text())
    records = [json.loads(line) for line in (out / "profile_export.jsonl").read_text().splitlines()]
    assert len(records) == 4 and not any(r.get("error") for r in records)
    assert figures["is_complete"] and figures["error_summary"] == [] and figures["completed_request_count"]["avg"] == 4
    assert figures["time_to_first_token"]["avg"] > 0
    streamed = figures["output_sequence_length"]
    assert 0 < streamed["min"] and streamed["max"] <= 8
    if endpoint == "chat":  # the text it streamed, tokenized by aiperf, is as long as the server's usage says
        assert streamed["sum"] == figures["usage_completion_tokens"]["sum"] and figures["osl_mismatch_count"]["avg"] == 0
    # (aiperf 0.13 reads a response's usage from response.completed only; cut at max_output_tokens, the
    # stream ends with response.incomplete, which carries it too, so aiperf has no server counts there)


# ---------------------------------------------------------------------- through the Ray Serve application
def test_langchain_forced_tool_through_the_serve_app(ray_cluster, tiny_llama_path):
    """langchain's ``bind_tools`` with a named ``tool_choice`` (the ``$defs`` tool dicts)
    through the Ray Serve application: the session's Ray cluster, one replica of the tiny
    random Llama behind the ingress with the tool flags, under its own route prefix. The
    tool plan and the call reader run in the ingress here; the grammar alone makes the
    call valid, whatever the weights."""
    pytest.importorskip("langchain_openai")
    from ray import serve

    from kvroute.deploy.app import build_app
    from tests.conftest import end_serve_app

    name = "kvagents"
    args = {"app_name": name, "ingress": {"chat_template": "chatml_tools", "tool_call_parser": "hermes",
                                          "enable_auto_tool_choice": True},
            "llm_configs": [{"model_loading_config": {"model_id": MODEL, "model_source": str(tiny_llama_path)},
                             "engine_kwargs": {"block_size": 16, "num_kv_blocks": 128, "max_model_len": 1024,
                                               "dtype": "float32"},
                             "deployment_config": {"num_replicas": 1, "ray_actor_options": {"num_cpus": 1}}}]}  # fmt: skip
    serve.run(build_app(args), name=name, route_prefix="/agents")
    try:
        wire = Wire()
        llm = _chat_openai(ray_cluster + "/agents", wire).bind_tools(_tool_dicts(Person, Itinerary), tool_choice="Person")
        message = llm.invoke(ASK_PERSON)
        [call] = message.tool_calls
        assert call["name"] == "Person" and not message.invalid_tool_calls
        _check_person(Person.model_validate(call["args"]))
        path, body = wire.only()
        assert path == "/agents/v1/chat/completions" and _has_defs(_forced_tool(body, "Person"))
    finally:
        end_serve_app(name)
