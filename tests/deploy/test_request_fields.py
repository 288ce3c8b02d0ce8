"""The OpenAI request fields beyond the basics, each checked by its effect on a real
single-engine server (uvicorn on loopback, the ``openai`` client and raw httpx):
structured outputs, tools, logits fields, echo with logprobs, truncation, nulls,
unknown fields, and the model card and version routes."""

from __future__ import annotations

import json
import re

import pytest

httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")

from kvroute import __version__  # noqa: E402
from kvroute.deploy.replica_server import build_replica_server  # noqa: E402
from kvroute.deploy.openai.request_fields import ENGINE_REFUSED_FIELDS, NO_EFFECT_FIELDS  # noqa: E402
from kvroute.deploy.openai.serving import ServerLimits  # noqa: E402
from kvroute.deploy.openai.tools.serving import ToolServingConfig  # noqa: E402
from kvroute.replica.config import EngineConfig  # noqa: E402
from tests.deploy.server import running  # noqa: E402

MODEL = "tiny"
MAX_MODEL_LEN = 512
SCHEMA = {"type": "object", "properties": {"color": {"enum": ["red", "blue"]}, "size": {"enum": ["S", "M"]}},
          "required": ["color", "size"], "additionalProperties": False}  # fmt: skip
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]}}, "required": ["city"]}}}  # fmt: skip
SLOW_REGEX = r"[a-z0-9 ]{1,900}x"  # a bounded repeat: seconds to compile against the vocabulary
USER = [{"role": "user", "content": "Pick one."}]


@pytest.fixture(scope="module")
def server(tiny_llama_path):
    config = EngineConfig(model=str(tiny_llama_path), block_size=8, num_kv_blocks=160, max_model_len=MAX_MODEL_LEN,
                          dtype="float32", max_num_seqs=16)  # fmt: skip
    limits = ServerLimits(max_n=4, structured_output_timeout_s=0.5)
    tools = ToolServingConfig.from_flags("chatml_tools", "hermes", enable_auto_tool_choice=True)
    app, engine = build_replica_server(config, limits, MODEL, tool_config=tools)
    with running(app) as url:
        yield url


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server + "/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server, timeout=60) as c:
        yield c


def _complete(http, **body) -> dict:
    resp = http.post("/v1/completions", json={"prompt": "The archive holds", "max_tokens": 6, "temperature": 0, **body})
    assert resp.status_code == 200, resp.text
    return resp.json()


def _error(http, route: str, body: dict) -> dict:
    resp = http.post(route, json=body)
    assert resp.status_code == 400, resp.text
    return resp.json()["error"]


def _token_ids(tok, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False)


# ---------------------------------------------------------------------- structured outputs
def test_json_schema_on_chat_and_guided_json_on_completions_validate(client, http):
    r = client.chat.completions.create(model=MODEL, messages=USER, max_tokens=120, temperature=0.8, seed=3, n=2,
                                       response_format={"type": "json_schema",
                                                        "json_schema": {"name": "pick", "schema": SCHEMA, "strict": True}})  # fmt: skip
    for choice in r.choices:
        jsonschema.validate(json.loads(choice.message.content), SCHEMA)
    text = _complete(http, guided_json=SCHEMA, max_tokens=120)["choices"][0]["text"]
    jsonschema.validate(json.loads(text), SCHEMA)
    obj = client.chat.completions.create(model=MODEL, messages=USER, max_tokens=120, temperature=0,
                                         extra_body={"structured_outputs": {"json_object": True}})  # fmt: skip
    assert isinstance(json.loads(obj.choices[0].message.content), dict)


def test_regex_choice_and_grammar_constrain_the_text(http):
    assert re.fullmatch(r"[0-9]{3}-[a-z]{2}", _complete(http, guided_regex=r"[0-9]{3}-[a-z]{2}", max_tokens=20)["choices"][0]["text"])
    for body in ({"guided_choice": ["yes", "no"]}, {"structured_outputs": {"choice": ["left", "right"]}}):
        choices = body.get("guided_choice") or body["structured_outputs"]["choice"]
        assert _complete(http, **body, temperature=1.0, seed=5, n=3)["choices"][0]["text"] in choices
    grammar = 'root ::= "size:" [0-9] [0-9]?'
    assert re.fullmatch(r"size:[0-9]{1,2}", _complete(http, guided_grammar=grammar, max_tokens=10)["choices"][0]["text"])


def test_bad_specs_are_400s_naming_the_field_before_the_engine(http):
    err = _error(http, "/v1/chat/completions", {"messages": USER, "response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object", "not": {"required": ["a"]}}}}})  # fmt: skip
    assert err["param"].startswith("response_format") and "'not'" in err["message"]
    err = _error(http, "/v1/completions", {"prompt": "x", "structured_outputs": {"regex": "(unclosed"}})
    assert err["param"] == "structured_outputs.regex" and "invalid regex" in err["message"]
    err = _error(http, "/v1/completions", {"prompt": "x", "guided_regex": SLOW_REGEX})
    assert err["param"] == "guided_regex" and "took longer than 0.5 s" in err["message"]


# ---------------------------------------------------------------------- tools
def test_required_and_named_tool_choice_return_valid_calls(client):
    for choice, finish in (("required", "tool_calls"), ({"type": "function", "function": {"name": "get_weather"}}, "stop")):
        r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Weather in Oslo?"}],
                                           tools=[WEATHER], tool_choice=choice, parallel_tool_calls=False,
                                           max_tokens=150, temperature=0)  # fmt: skip
        (call,) = r.choices[0].message.tool_calls
        assert call.function.name == "get_weather" and r.choices[0].finish_reason == finish
        jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])


def test_tools_and_tool_history_reach_the_template(client, http):
    plain = client.chat.completions.create(model=MODEL, messages=USER, max_tokens=1, temperature=0)
    with_tools = client.chat.completions.create(model=MODEL, messages=USER, tools=[WEATHER], tool_choice="auto",
                                                max_tokens=1, temperature=0)  # fmt: skip
    assert with_tools.usage.prompt_tokens > plain.usage.prompt_tokens + 20  # the tool's signature is in the prompt
    history = USER + [
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"},
    ]  # fmt: skip
    after = client.chat.completions.create(model=MODEL, messages=history, tools=[WEATHER], max_tokens=1, temperature=0)
    assert after.usage.prompt_tokens > with_tools.usage.prompt_tokens
    # a forced call is the turn's output; a response_format beside it is still checked (as OpenAI takes both)
    forced = http.post("/v1/chat/completions", json={"messages": USER, "tools": [WEATHER], "tool_choice": "required",
                                                     "parallel_tool_calls": False, "max_tokens": 300, "temperature": 0,
                                                     "response_format": {"type": "json_object"}}).json()  # fmt: skip
    [call] = forced["choices"][0]["message"]["tool_calls"]
    assert call["function"]["name"] == "get_weather" and json.loads(call["function"]["arguments"])["city"] in ("Paris", "Oslo")
    bad_format = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}
    err = _error(http, "/v1/chat/completions", {"messages": USER, "tools": [WEATHER], "tool_choice": "required",
                                                "response_format": bad_format})  # fmt: skip
    assert err["param"].startswith("response_format")
    err = _error(http, "/v1/chat/completions", {"messages": history[:1] + history[2:], "tools": [WEATHER]})
    assert "tool_call_id" in err["param"]


# ---------------------------------------------------------------------- logits fields
def test_logit_bias_forces_a_token(http, smollm2_tokenizer):
    (tid,) = _token_ids(smollm2_tokenizer, " river")
    out = _complete(http, logit_bias={str(tid): 100}, logprobs=1)["choices"][0]
    assert out["logprobs"]["tokens"] == [" river"] * 6
    banned = _complete(http, logit_bias={str(tid): -100}, prompt=[tid] * 4, max_tokens=4, logprobs=1)
    assert " river" not in banned["choices"][0]["logprobs"]["tokens"]


def test_allowed_token_ids_restrict_and_bad_words_are_never_produced(http, smollm2_tokenizer):
    allowed = [_token_ids(smollm2_tokenizer, c)[0] for c in ("a", "b")]
    text = _complete(http, allowed_token_ids=allowed, max_tokens=8, temperature=1.0, seed=1)["choices"][0]["text"]
    assert text and set(text) <= {"a", "b"}
    first = _complete(http, max_tokens=1, logprobs=0)["choices"][0]["logprobs"]["tokens"][0]
    assert first.strip()
    after = _complete(http, bad_words=[first.strip()], max_tokens=6, logprobs=0)["choices"][0]["logprobs"]["tokens"]
    assert first not in after and first.strip() not in after


# ---------------------------------------------------------------------- logprobs and echo
def test_echo_logprobs_with_max_tokens_0_scores_the_prompt(http, smollm2_tokenizer):
    """lm-evaluation-harness' loglikelihood request."""
    prompt = "The quick brown fox jumps"
    n_prompt = len(smollm2_tokenizer.encode(prompt))
    body = _complete(http, prompt=prompt, echo=True, logprobs=1, max_tokens=0)
    (choice,) = body["choices"]
    assert choice["text"] == prompt and body["usage"]["completion_tokens"] == 0
    lp = choice["logprobs"]
    assert len(lp["tokens"]) == n_prompt and lp["token_logprobs"][0] is None
    assert all(x <= 0 for x in lp["token_logprobs"][1:]) and lp["top_logprobs"][0] is None
    one = _complete(http, prompt=prompt, echo=True, logprobs=20, max_tokens=1)["choices"][0]["logprobs"]
    assert len(one["tokens"]) == n_prompt + 1 and len(one["top_logprobs"][-1]) >= 20
    assert one["token_logprobs"][1:n_prompt] == pytest.approx(lp["token_logprobs"][1:], abs=1e-4)


def test_prompt_logprobs_field(http, client):
    body = _complete(http, prompt_logprobs=2)
    assert body["choices"][0]["prompt_logprobs"][0] is None and len(body["choices"][0]["prompt_logprobs"]) > 1
    chat = client.chat.completions.create(model=MODEL, messages=USER, max_tokens=2, extra_body={"prompt_logprobs": 0})
    assert chat.model_extra["prompt_logprobs"][0] is None


# ---------------------------------------------------------------------- prompt fields
def test_truncate_prompt_tokens_keeps_the_last_tokens(http, smollm2_tokenizer):
    ids = list(range(1000, 1040))
    body = _complete(http, prompt=ids, truncate_prompt_tokens=7, echo=True, max_tokens=1)
    assert body["usage"]["prompt_tokens"] == 7
    assert body["choices"][0]["text"].startswith(smollm2_tokenizer.decode(ids[-7:]))
    full = _complete(http, prompt=ids, truncate_prompt_tokens=-1)
    assert full["usage"]["prompt_tokens"] == 40


def test_nulls_mean_defaults_and_top_k_0_is_off(http):
    seeded = {"temperature": 1.0, "seed": 11, "max_tokens": 8}
    want = _complete(http, **seeded)["choices"][0]["text"]
    nulls = dict(top_p=None, top_k=None, min_p=None, n=None, stop=None, user=None, logit_bias=None,
                 response_format=None, stream_options=None, logprobs=None)  # fmt: skip
    assert _complete(http, **seeded, **nulls)["choices"][0]["text"] == want
    assert _complete(http, **seeded, top_k=0)["choices"][0]["text"] == want


def test_unknown_fields_are_400s_and_the_no_effect_list_is_accepted(client, http):
    with pytest.raises(openai.BadRequestError) as exc:
        client.completions.create(model=MODEL, prompt="x", max_tokens=1, extra_body={"frobnicate": 1})
    assert exc.value.body["param"] == "frobnicate" and "unknown field" in exc.value.body["message"]
    err = _error(http, "/v1/chat/completions", {"messages": USER, "stream_options": {"include_usage": True, "extra": 1},
                                                "stream": True})  # fmt: skip
    assert err["param"] == "stream_options.extra"
    samples = {"mm_processor_kwargs": {"num_crops": 4}, "media_io_kwargs": {"video": {"num_frames": 8}}}
    defaults = {k: samples.get(k, v[0][0] if v[0] else "someone") for k, v in NO_EFFECT_FIELDS.items() if k != "metadata"}
    assert _complete(http, **defaults, metadata={"team": "a"})["choices"][0]["text"] == _complete(http)["choices"][0]["text"]
    err = _error(http, "/v1/completions", {"prompt": "x", "use_beam_search": True})
    assert err["param"] == "use_beam_search" and "beam search" in err["message"]


def test_continuous_usage_stats(http):
    body = {"prompt": "Count", "max_tokens": 4, "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}  # fmt: skip
    with http.stream("POST", "/v1/completions", json=body) as resp:
        chunks = [json.loads(line[6:]) for line in resp.iter_lines() if line.startswith("data: {")]
    assert len(chunks) >= 5 and all(c.get("usage") for c in chunks)
    assert [c["usage"]["completion_tokens"] for c in chunks if c["choices"]][-1] == 4


def test_version_and_model_card(http):
    assert http.get("/version").json() == {"version": __version__}
    card = http.get(f"/v1/models/{MODEL}").json()
    assert card["id"] == MODEL and card["object"] == "model" and card["max_model_len"] == MAX_MODEL_LEN
    resp = http.get("/v1/models/gpt-9")
    assert resp.status_code == 404 and resp.json()["error"]["code"] == "model_not_found"


def test_serve_config_checks_the_tool_flags():
    from kvroute.deploy.app_config import parse_args

    base = {"llm_configs": [{"model_loading_config": {"model_id": "m"}}]}
    with pytest.raises(ValueError, match="ingress: .*--enable-auto-tool-choice needs --tool-call-parser"):
        parse_args({**base, "ingress": {"enable_auto_tool_choice": True}})
    with pytest.raises(ValueError, match="ingress: .*unknown parser 'xml'"):
        parse_args({**base, "ingress": {"tool_call_parser": "xml"}})
    ingress = parse_args({**base, "ingress": {"chat_template": "chatml_tools", "tool_call_parser": "hermes",
                                              "enable_auto_tool_choice": True}}).ingress  # fmt: skip
    assert "<tool_call>" in ingress.tool_config().chat_template


# ---------------------------------------------------------------------- vLLM's own fields
def _sse(http, route: str, body: dict) -> list[dict]:
    with http.stream("POST", route, json={**body, "stream": True}) as resp:
        assert resp.status_code == 200
        return [json.loads(line[6:]) for line in resp.iter_lines() if line.startswith("data: {")]


def test_request_id_names_the_answer(client, http):
    chat = client.chat.completions.create(model=MODEL, messages=USER, max_tokens=2, extra_body={"request_id": "trace-7"})
    assert chat.id == "chatcmpl-trace-7"
    assert _complete(http, request_id="job 12/a")["id"] == "cmpl-job 12/a"
    assert {c["id"] for c in _sse(http, "/v1/completions", {"prompt": "x", "max_tokens": 2, "request_id": "s-1"})} == {"cmpl-s-1"}
    for bad in ("", "a\nb", "x" * 257):
        assert _error(http, "/v1/completions", {"prompt": "x", "request_id": bad})["param"] == "request_id"


def test_return_token_ids_whole_and_streamed(http):
    body = {"messages": USER, "max_tokens": 6, "temperature": 0, "return_token_ids": True}
    whole = http.post("/v1/chat/completions", json=body).json()
    prompt = http.post("/tokenize", json={"messages": USER}).json()["tokens"]
    [choice] = whole["choices"]
    assert whole["prompt_token_ids"] == prompt and len(choice["token_ids"]) == whole["usage"]["completion_tokens"] == 6
    assert http.post("/detokenize", json={"tokens": choice["token_ids"]}).json()["prompt"] == choice["message"]["content"]
    chunks = _sse(http, "/v1/chat/completions", body)
    assert chunks[0]["prompt_token_ids"] == prompt
    assert [t for c in chunks for t in c["choices"][0].get("token_ids", [])] == choice["token_ids"]
    done = _complete(http, prompt=["The archive holds", "Two"], return_token_ids=True)
    assert [c["prompt_token_ids"] for c in done["choices"]] == [http.post("/tokenize", json={"prompt": p}).json()["tokens"]
                                                               for p in ("The archive holds", "Two")]  # fmt: skip
    assert all(len(c["token_ids"]) == 6 for c in done["choices"])
    assert "token_ids" not in _complete(http)["choices"][0]


def test_return_tokens_as_token_ids_names_logprob_tokens(http):
    chat = http.post("/v1/chat/completions", json={"messages": USER, "max_tokens": 4, "logprobs": True, "top_logprobs": 2,
                                                   "return_tokens_as_token_ids": True, "return_token_ids": True}).json()  # fmt: skip
    [choice] = chat["choices"]
    assert [e["token"] for e in choice["logprobs"]["content"]] == [f"token_id:{t}" for t in choice["token_ids"]]
    assert all(re.fullmatch(r"token_id:\d+", t["token"]) for e in choice["logprobs"]["content"] for t in e["top_logprobs"])
    done = _complete(http, logprobs=1, return_tokens_as_token_ids=True, return_token_ids=True)["choices"][0]
    assert done["logprobs"]["tokens"] == [f"token_id:{t}" for t in done["token_ids"]]


def test_vllm_fields_the_engine_cannot_honour_are_400s_naming_them(http):
    values = {"chat_template": "{{ messages }}", "structural_tag": "{}", "guided_whitespace_pattern": " ",
              "kv_transfer_params": {"do_remote_prefill": True}, "vllm_xargs": {"k": 1}, "logits_processors": ["m.P"]}  # fmt: skip
    assert set(values) == set(ENGINE_REFUSED_FIELDS)
    for field, value in values.items():
        err = _error(http, "/v1/chat/completions", {"messages": USER, field: value})
        assert err["param"] == field and "not supported" in err["message"], err
    err = _error(http, "/v1/chat/completions", {"messages": USER, "echo": True})
    assert err["param"] == "echo"
    assert _error(http, "/v1/chat/completions", {"messages": USER, "best_of": 2})["param"] == "best_of"
    assert _error(http, "/v1/chat/completions", {"messages": USER, "guided_decoding_backend": "outlines"})["param"] == "guided_decoding_backend"
    ok = http.post("/v1/chat/completions", json={"messages": USER, "max_tokens": 2, "echo": False, "best_of": 1,
                                                 "guided_decoding_backend": "xgrammar", "mm_processor_kwargs": {}})  # fmt: skip
    assert ok.status_code == 200, ok.text


def test_documents_reach_a_template_that_renders_them(http, smollm2_tokenizer):
    from kvroute.deploy.openai.chat_template import ChatRenderer

    err = _error(http, "/v1/chat/completions", {"messages": USER, "documents": [{"title": "a", "text": "b"}]})
    assert err["param"] == "documents" and "does not render documents" in err["message"]
    rag = ("{% for d in documents %}[{{ d.title }}: {{ d.text }}]{% endfor %}"
           "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}")  # fmt: skip
    renderer = ChatRenderer(smollm2_tokenizer, rag)
    assert renderer.uses("documents") and not ChatRenderer(smollm2_tokenizer, "{{ messages }}").uses("documents")
    text = renderer.render(USER, documents=[{"title": "Doc", "text": "body"}], tokenize=False)
    assert text.startswith("[Doc: body]<user>Pick one.")
