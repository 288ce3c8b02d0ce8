"""Reasoning models end to end: the official ``openai`` client against the
single-engine server on a tiny random Qwen3 whose tokenizer has ``<think>`` and
``</think>`` as added tokens (as Qwen3's has) and a Qwen3-like chat template, under
``--reasoning-parser deepseek_r1`` (the template opens ``<think>``) and ``qwen3`` (it
does not). The random model writes no reasoning of its own, so the tests pick its
tokens: ``allowed_token_ids`` with seeded sampling for free-form splits, a
``logit_bias`` on ``</think>`` where a grammar must start after it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("fastapi")

from kvroute.deploy.openai.reasoning_parsers import REASONING_PARSERS  # noqa: E402
from kvroute.deploy.replica_server import build_replica_server  # noqa: E402
from kvroute.deploy.openai.serving import ServerLimits  # noqa: E402
from kvroute.deploy.openai.tools.serving import ToolServingConfig  # noqa: E402
from kvroute.replica.config import EngineConfig  # noqa: E402
from tests.conftest import _save_tiny  # noqa: E402
from tests.deploy.server import running  # noqa: E402
from tests.deploy.tool_defs import WEATHER  # noqa: E402

MODEL = "thinker"
ASK = [{"role": "user", "content": "What is 2 + 2?"}]
SCHEMA = {"type": "object", "properties": {"answer": {"type": "integer", "minimum": 0, "maximum": 9},
                                           "sure": {"type": "boolean"}},
          "required": ["answer", "sure"], "additionalProperties": False}  # fmt: skip


def chat_template(opens_think: bool, effort: bool) -> str:
    """Qwen3's shape: ChatML, past reasoning from ``reasoning_content``, an empty think
    block with ``enable_thinking`` false; DeepSeek-R1's opens ``<think>`` instead."""
    return (
        ("{%- if reasoning_effort %}<|im_start|>system\nReasoning effort: {{ reasoning_effort }}<|im_end|>\n{% endif %}"
         if effort else "")
        + "{%- if tools %}<|im_start|>system\nTools:{% for t in tools %} {{ t.function.name }}{% endfor %}<|im_end|>\n"
        "{% endif %}"
        "{%- for m in messages %}<|im_start|>{{ m.role }}\n"
        "{%- if m.role == 'assistant' and m.reasoning_content %}<think>{{ m.reasoning_content }}</think>{% endif %}"
        "{{ m.content }}<|im_end|>\n{% endfor %}"
        "{%- if add_generation_prompt %}<|im_start|>assistant\n"
        "{%- if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n"
        + ("{%- else %}<think>\n" if opens_think else "")
        + "{%- endif %}{% endif %}"
    )  # fmt: skip


@pytest.fixture(scope="module")
def think_path(tmp_path_factory: pytest.TempPathFactory, smollm2_path: Path) -> Path:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(smollm2_path))
    tok.add_tokens(["<think>", "</think>"])  # added, not special: the detokenizer keeps them, as Qwen3's
    tok.chat_template = chat_template(False, False)
    return _save_tiny(tmp_path_factory.mktemp("tiny-qwen3-think"), "qwen3", tok, seed=2,
                      rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}, tie_word_embeddings=True)  # fmt: skip


@pytest.fixture(scope="module")
def tok(think_path: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(think_path))


def _serve(path: Path, parser: str, opens_think: bool, effort: bool):
    config = EngineConfig(model=str(path), num_kv_blocks=128, max_model_len=512, dtype="float32", device="cpu")
    tools = ToolServingConfig(chat_template(opens_think, effort), reasoning_parser=parser)
    app, _ = build_replica_server(config, ServerLimits(), MODEL, tool_config=tools)
    return running(app)


@pytest.fixture(scope="module")
def clients(think_path: Path):
    """``{parser name: client}``: deepseek_r1 behind a template that opens <think> and
    takes reasoning_effort; qwen3 behind one that does neither."""
    with _serve(think_path, "deepseek_r1", True, True) as r1, _serve(think_path, "qwen3", False, False) as q3:
        yield {name: openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)
               for name, url in (("deepseek_r1", r1), ("qwen3", q3))}  # fmt: skip


def _ids(tok: Any, *texts: str) -> list[int]:
    ids = [tok.convert_tokens_to_ids(t) if t.startswith("<") else tok.encode(t, add_special_tokens=False)[0] for t in texts]
    assert len(set(ids)) == len(texts)
    return ids


def _streamed(client: Any, **kw: Any) -> tuple[str, str, int]:
    """A streamed answer's joined ``delta.reasoning`` and ``delta.content``, and how many
    chunks carried reasoning."""
    reasoning = content = ""
    sends = 0
    for chunk in client.chat.completions.create(model=MODEL, stream=True, **kw):
        if chunk.choices:
            d = chunk.choices[0].delta
            piece = getattr(d, "reasoning", None) or ""
            reasoning, content, sends = reasoning + piece, content + (d.content or ""), sends + bool(piece)
    return reasoning, content, sends


@pytest.mark.parametrize("name", ["deepseek_r1", "qwen3"])
def test_the_split_equals_the_parser_on_the_raw_text_streamed_and_not(clients, tok, name):
    client = clients[name]
    allowed = _ids(tok, "<think>", "</think>", " yes", " no")
    split_both, switched = 0, False
    bias = (6.0, 2.0)  # (both parsers start inside the reasoning)
    for seed in range(8):
        kw = dict(messages=ASK, max_tokens=10, temperature=1.0, seed=seed,
                  extra_body={"allowed_token_ids": allowed, "logit_bias": {str(allowed[0]): bias[0], str(allowed[1]): bias[1]}})
        raw = client.chat.completions.create(model=MODEL, **{**kw, "extra_body": {**kw["extra_body"],
                                                                                  "separate_reasoning": False}})  # fmt: skip
        text = raw.choices[0].message.content
        assert raw.choices[0].message.reasoning is None  # unsplit: all content
        want_reasoning, want_content = REASONING_PARSERS[name].split(text)
        msg = client.chat.completions.create(model=MODEL, **kw).choices[0].message
        assert (msg.reasoning, msg.content) == (want_reasoning, want_content or None), text
        assert _streamed(client, **kw)[:2] == (want_reasoning or "", want_content), text
        split_both += want_reasoning is not None and bool(want_content)
        if want_reasoning and want_content and not switched:  # the switches, on the first split with reasoning
            switched = True
            hidden = client.chat.completions.create(model=MODEL, **{**kw, "extra_body": {**kw["extra_body"],
                                                                                         "include_reasoning": False}})
            assert (hidden.choices[0].message.reasoning, hidden.choices[0].message.content) == (None, want_content)
            assert _streamed(client, **{**kw, "extra_body": {**kw["extra_body"], "include_reasoning": False}}) == (
                "", want_content, 0)
            assert _streamed(client, **{**kw, "extra_body": {**kw["extra_body"], "stream_reasoning": False}}) == (
                want_reasoning, want_content, 1)  # one piece, once it ends
    assert split_both >= 2 and switched  # some seeds wrote reasoning, then </think>, then content


def test_reasoning_effort_reaches_the_template(clients, tok):
    client = clients["deepseek_r1"]

    def prompt_tokens(**extra: Any) -> int:
        return client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=1, extra_body=extra).usage.prompt_tokens

    base = prompt_tokens()
    for effort in ("low", "medium", "high"):
        line = f"<|im_start|>system\nReasoning effort: {effort}<|im_end|>\n"
        assert prompt_tokens(reasoning_effort=effort) - base == len(tok.encode(line, add_special_tokens=False))
    for extra, client_name in (({"reasoning_effort": "extreme"}, "deepseek_r1"), ({"reasoning_effort": "low"}, "qwen3"),
                               ({"reasoning_effort": "low", "chat_template_kwargs": {"reasoning_effort": "high"}},
                                "deepseek_r1")):  # fmt: skip
        with pytest.raises(openai.BadRequestError) as exc:
            clients[client_name].chat.completions.create(model=MODEL, messages=ASK, max_tokens=1, extra_body=extra)
        assert exc.value.body["param"] == "reasoning_effort", exc.value.body


def test_past_reasoning_in_either_field_reaches_the_template(clients):
    client = clients["deepseek_r1"]

    def prompt_tokens(turn: dict[str, Any]) -> int:
        messages = [*ASK, {"role": "assistant", "content": "4", **turn}, {"role": "user", "content": "Sure?"}]
        return client.chat.completions.create(model=MODEL, messages=messages, max_tokens=1).usage.prompt_tokens

    new, old, none = prompt_tokens({"reasoning": "two and two"}), prompt_tokens({"reasoning_content": "two and two"}), prompt_tokens({})
    assert new == old > none


def _bias_end(tok: Any) -> dict[str, float]:
    return {str(tok.convert_tokens_to_ids("</think>")): 100.0}


def test_json_schema_follows_the_reasoning(clients, tok):
    client = clients["deepseek_r1"]
    fmt = {"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA}}
    kw = dict(messages=ASK, max_tokens=80, temperature=0.0, response_format=fmt, extra_body={"logit_bias": _bias_end(tok)})
    msg = client.chat.completions.create(model=MODEL, **kw).choices[0].message
    # free until </think> (the bias makes it the first token), then the grammar: the JSON
    assert msg.reasoning == ""
    jsonschema.validate(json.loads(msg.content), SCHEMA)
    assert _streamed(client, **kw)[:2] == ("", msg.content)
    # some reasoning first: sampled, with </think> only likely
    found = 0
    for seed in range(6):
        choice = client.chat.completions.create(model=MODEL, **{**kw, "temperature": 1.0, "seed": seed, "max_tokens": 120,
                                                                "extra_body": {"logit_bias": {k: 7.0 for k in _bias_end(tok)}}}
                                                ).choices[0]  # fmt: skip
        if choice.finish_reason == "stop":  # (not cut off by max_tokens)
            jsonschema.validate(json.loads(choice.message.content), SCHEMA)
            found += bool(choice.message.reasoning)
    assert found >= 2
    # qwen3 with enable_thinking false: the prompt closed the reasoning, the grammar runs from the first token
    q3 = clients["qwen3"].chat.completions.create(model=MODEL, messages=ASK, max_tokens=80, temperature=0.0,
                                                  response_format=fmt,
                                                  extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert q3.choices[0].message.reasoning is None
    jsonschema.validate(json.loads(q3.choices[0].message.content), SCHEMA)


def test_a_forced_tool_call_follows_the_reasoning(clients, tok):
    client = clients["deepseek_r1"]
    kw = dict(messages=[{"role": "user", "content": "Weather in Oslo?"}], tools=[WEATHER], temperature=0.0,
              tool_choice={"type": "function", "function": {"name": "get_weather"}}, max_tokens=80,
              extra_body={"logit_bias": _bias_end(tok)})  # fmt: skip
    msg = client.chat.completions.create(model=MODEL, **kw).choices[0].message
    assert msg.reasoning == "" and len(msg.tool_calls) == 1
    call = msg.tool_calls[0]
    assert call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])
    args = ""
    for chunk in client.chat.completions.create(model=MODEL, stream=True, **kw):
        for tc in (chunk.choices[0].delta.tool_calls or []) if chunk.choices else []:
            args += tc.function.arguments or ""
    assert args == call.function.arguments
    with pytest.raises(openai.BadRequestError) as exc:
        client.chat.completions.create(model=MODEL, **{**kw, "extra_body": {"separate_reasoning": False}})
    assert exc.value.body["param"] == "separate_reasoning"


def test_without_a_parser_the_switches_take_only_true(think_path):
    import asyncio

    from kvroute.deploy.openai.errors import APIError
    from kvroute.deploy.openai.protocol import ChatCompletionRequest
    from kvroute.deploy.openai.serving import OpenAIServing
    from kvroute.replica.checkpoint import load_tokenizer

    tokenizer = load_tokenizer(think_path)
    plain = OpenAIServing(MODEL, tokenizer, 512, len(tokenizer), backend=None)
    for field in ("include_reasoning", "separate_reasoning", "stream_reasoning"):
        with pytest.raises(APIError) as exc:
            asyncio.run(plain.prepare_chat(ChatCompletionRequest(messages=ASK, **{field: False}), b""))
        assert exc.value.status == 400 and exc.value.param == field
    prepared = asyncio.run(plain.prepare_chat(ChatCompletionRequest(messages=ASK, response_format={"type": "json_object"}), b""))
    assert prepared.reasoning is None and prepared.params[0].structured_output_after == ()
    r1 = OpenAIServing(MODEL, tokenizer, 512, len(tokenizer), backend=None,
                       tool_config=ToolServingConfig(chat_template(True, False), reasoning_parser="deepseek_r1"))
    prepared = asyncio.run(r1.prepare_chat(ChatCompletionRequest(messages=ASK, response_format={"type": "json_object"}), b""))
    assert prepared.params[0].structured_output_after == (tokenizer.convert_tokens_to_ids("</think>"),)


def test_streamed_token_ids_include_the_markers_the_parser_holds(clients, tok):
    """The <think> a qwen3 output opens with makes no text of its own; its id still
    streams (return_token_ids), so the streamed ids equal the whole answer's."""
    client = clients["qwen3"]
    start = tok.convert_tokens_to_ids("<think>")
    kw = dict(messages=ASK, max_tokens=6, temperature=0.0, extra_body={"logit_bias": {str(start): 100.0},
                                                                       "return_token_ids": True})  # fmt: skip
    whole = client.chat.completions.create(model=MODEL, **kw).choices[0]
    assert whole.token_ids[0] == start
    ids = []
    for chunk in client.chat.completions.create(model=MODEL, stream=True, **kw):
        if chunk.choices:
            ids += getattr(chunk.choices[0], "token_ids", None) or []
    assert ids == whole.token_ids


def test_the_responses_api_returns_reasoning_items_and_replays_them(clients):
    """Under a reasoning parser the Responses API answers with a ``reasoning`` item (the
    reasoning text the chat message carries) before the message, whole and streamed
    alike; a continuation replays it, exactly as the same reasoning item sent as input
    does; ``reasoning.effort`` reaches the template; summaries are refused."""
    client = clients["deepseek_r1"]  # the template opens <think>: the output starts inside the reasoning
    kw: dict[str, Any] = dict(model=MODEL, input=ASK[0]["content"], max_output_tokens=6, temperature=0)
    chat = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=6, temperature=0).choices[0].message
    assert chat.reasoning
    resp = client.responses.create(**kw)
    assert [i.type for i in resp.output] == ["reasoning", "message"]
    assert [p.text for p in resp.output[0].content] == [chat.reasoning]
    events = list(client.responses.create(stream=True, **kw))
    assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == chat.reasoning
    [done] = [e for e in events if e.type == "response.reasoning_text.done"]
    assert done.text == chat.reasoning
    assert [i.type for i in events[-1].response.output] == ["reasoning", "message"]
    follow = dict(model=MODEL, max_output_tokens=2, temperature=0)
    nxt = client.responses.create(previous_response_id=resp.id, input="And 3 + 3?", **follow)
    explicit = client.responses.create(input=[
        {"role": "user", "content": ASK[0]["content"]},
        {"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": chat.reasoning}]},
        {"role": "assistant", "content": chat.content or ""},
        {"role": "user", "content": "And 3 + 3?"}], **follow)  # fmt: skip
    without = client.responses.create(input=[{"role": "user", "content": ASK[0]["content"]},
                                             {"role": "assistant", "content": chat.content or ""},
                                             {"role": "user", "content": "And 3 + 3?"}], **follow)  # fmt: skip
    assert nxt.usage.input_tokens == explicit.usage.input_tokens > without.usage.input_tokens  # the reasoning is in the prompt
    effort = client.responses.create(reasoning={"effort": "high"}, **kw)
    assert effort.reasoning.effort == "high" and effort.usage.input_tokens > resp.usage.input_tokens
    for bad in ({"summary": "auto"}, {"effort": "extreme"}):
        with pytest.raises(openai.BadRequestError):
            client.responses.create(reasoning=bad, **kw)
    with pytest.raises(openai.BadRequestError):
        client.responses.create(**{**kw, "input": [{"type": "reasoning", "summary": [], "encrypted_content": "x"}]})
