"""Hostile and careless request bodies, as raw bytes, with the statuses each may get.

Shared by the single-engine server's tests and the Serve app's fuzz test. Every body is
sent as it is written here (no client-side JSON encoding), so the table holds what a
JSON library would refuse to produce: unpaired surrogates, NaN, invalid UTF-8, bodies
that are not JSON at all. A row passes when the status is one of its own and every error
comes in OpenAI's envelope; none may be a 500.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Optional

JSON = "application/json"
BAD = frozenset({400})
OK_OR_BAD = frozenset({200, 400})


@dataclass(frozen=True)
class Hostile:
    name: str
    route: str
    body: bytes
    statuses: frozenset[int] = BAD
    content_type: Optional[str] = JSON
    param: Optional[str] = None  # the field the 400 must name, where one is to blame


def _j(obj) -> bytes:
    return json.dumps(obj).encode()  # ensure_ascii: surrogates travel as \ud800 escapes


def _c(**fields) -> bytes:
    return _j({"prompt": "x", "max_tokens": 2, **fields})


def _chat(content, **fields) -> bytes:
    return _j({"messages": [{"role": "user", "content": content}], "max_tokens": 2, **fields})


C, CHAT = "/v1/completions", "/v1/chat/completions"


def table(vocab_size: int, max_body_bytes: int) -> list[Hostile]:
    """The table for a server with this vocabulary and body limit (the limit's row sends
    one byte more than it)."""
    rows = [
        # wrong types
        Hostile("prompt-int", C, _j({"prompt": 5}), param="prompt"),
        Hostile("prompt-bool", C, _j({"prompt": True}), param="prompt"),
        Hostile("prompt-null", C, _j({"prompt": None}), param="prompt"),
        Hostile("prompt-object", C, _j({"prompt": {"text": "x"}}), param="prompt"),
        Hostile("max-tokens-string", C, _c(max_tokens="5"), param="max_tokens"),
        Hostile("n-float", C, _c(n=1.5), param="n"),
        Hostile("temperature-string", C, _c(temperature="hot"), param="temperature"),
        Hostile("stream-int", C, _c(stream=1), param="stream"),
        Hostile("stop-int", C, _c(stop=5), param="stop"),
        Hostile("stop-ints", C, _c(stop=[1, 2]), param="stop"),
        Hostile("logprobs-string", C, _c(logprobs="yes"), param="logprobs"),
        Hostile("messages-object", CHAT, _j({"messages": {"role": "user", "content": "x"}}), param="messages"),
        Hostile("content-int", CHAT, _chat(5), param="messages"),
        Hostile("role-unknown", CHAT, _j({"messages": [{"role": "wizard", "content": "x"}]}), param="messages"),
        Hostile("body-array", C, b"[]"),
        Hostile("body-string", C, b'"hello"'),
        Hostile("body-empty", C, b""),
        Hostile("body-empty-chat", CHAT, b""),
        # NaN, infinities, huge integers
        Hostile("temperature-nan", C, b'{"prompt": "x", "temperature": NaN}', param="temperature"),
        Hostile("top-p-infinity", C, b'{"prompt": "x", "top_p": Infinity}', param="top_p"),
        Hostile("penalty-minus-infinity", C, b'{"prompt": "x", "presence_penalty": -Infinity}', param="presence_penalty"),
        Hostile("max-tokens-1e400", C, b'{"prompt": "x", "max_tokens": 1e400}', param="max_tokens"),
        Hostile("max-tokens-huge", C, _c(max_tokens=10**30), param="max_tokens"),
        Hostile("n-huge", C, _c(n=10**30), param="n"),
        Hostile("seed-2-70", C, _c(seed=2**70), param="seed"),
        Hostile("seed-negative-huge", C, _c(seed=-(2**70)), param="seed"),
        Hostile("top-k-huge", C, _c(top_k=10**20), OK_OR_BAD),
        Hostile("min-tokens-huge", C, _c(min_tokens=10**20), param="min_tokens"),
        Hostile("logprobs-huge", C, _c(logprobs=10**20), param="logprobs"),
        Hostile("chat-top-logprobs-huge", CHAT, _chat("x", logprobs=True, top_logprobs=10**9), param="top_logprobs"),
        # unpaired surrogates, every text field
        Hostile("surrogate-prompt", C, _c(prompt="a\ud800b"), param="prompt"),
        Hostile("surrogate-low-prompt", C, _c(prompt="\udc00"), param="prompt"),
        Hostile("surrogate-reversed-pair", C, _c(prompt="\udc00\ud800"), param="prompt"),
        Hostile("surrogate-prompt-list", C, _c(prompt=["ok", "\ud800"]), param="prompt"),
        Hostile("surrogate-stream", C, _c(prompt="\ud800", stream=True), param="prompt"),
        Hostile("surrogate-stop", C, _c(stop=["\ud800"]), param="stop"),
        Hostile("surrogate-cache-salt", C, _c(cache_salt="\udfff"), param="cache_salt"),
        Hostile("surrogate-model", C, _c(model="\ud800"), param="model"),
        Hostile("surrogate-user", C, _c(user="\ud800"), param="user"),
        Hostile("surrogate-chat", CHAT, _chat("hi \ud800"), param="messages"),
        Hostile("surrogate-chat-part", CHAT, _chat([{"type": "text", "text": "\udc00"}]), param="messages"),
        Hostile("surrogate-chat-stream", CHAT, _chat("\ud800", stream=True, n=2), param="messages"),
        Hostile("surrogate-tokenize", "/tokenize", _j({"prompt": "\ud800"}), param="prompt"),
        Hostile("surrogate-tokenize-messages", "/tokenize", _j({"messages": [{"role": "user", "content": "\ud800"}]}), param="messages"),
        # invalid UTF-8 and JSON that is not
        Hostile("utf8-invalid-byte", C, b'{"prompt": "\xff"}'),
        Hostile("utf8-overlong", C, b'{"prompt": "\xc0\xaf"}'),
        Hostile("utf8-truncated", C, b'{"prompt": "\xe2\x82"}'),
        Hostile("utf16-bom", C, b'\xff\xfe{"prompt": "x"}'),
        Hostile("json-truncated", C, b'{"prompt": "x",'),
        Hostile("json-deeply-nested", C, b'{"prompt": ' + b"[" * 20_000 + b"]" * 20_000 + b"}"),
        Hostile("json-duplicate-keys", C, b'{"prompt": 5, "prompt": "x", "max_tokens": 2}', frozenset({200})),
        # nested prompt lists
        Hostile("prompt-3-deep", C, _c(prompt=[[["a"]]]), param="prompt"),
        Hostile("prompt-ids-nested", C, _c(prompt=[[1, [2]]]), param="prompt"),
        Hostile("prompt-strings-nested", C, _c(prompt=[["a", "b"]]), param="prompt"),
        Hostile("prompt-empty-inner", C, _c(prompt=[[], [1]]), param="prompt"),
        Hostile("prompt-mixed", C, _c(prompt=[1, "a"]), param="prompt"),
        Hostile("prompt-too-many", C, _c(prompt=["a"] * 1000), param="prompt"),
        # out-of-vocabulary and negative ids
        Hostile("ids-vocab", C, _c(prompt=[vocab_size]), param="prompt"),
        Hostile("ids-negative", C, _c(prompt=[-1]), param="prompt"),
        Hostile("ids-huge", C, _c(prompt=[10**30]), param="prompt"),
        Hostile("ids-list-one-bad", C, _c(prompt=[[1, 2], [3, 10**6]]), param="prompt"),
        Hostile("stop-token-ids-vocab", C, _c(stop_token_ids=[vocab_size]), param="stop_token_ids"),
        Hostile("stop-token-ids-negative", C, _c(stop_token_ids=[-5]), param="stop_token_ids"),
        Hostile("detokenize-negative", "/detokenize", _j({"tokens": [-1]}), param="tokens"),
        Hostile("detokenize-vocab", "/detokenize", _j({"tokens": [1, vocab_size]}), param="tokens"),
        # enormous stop lists
        Hostile("stop-10k", C, _c(stop=["a"] * 10_000), param="stop"),
        Hostile("stop-empty-string", C, _c(stop=[""]), param="stop"),
        Hostile("stop-token-ids-8k", C, _c(stop_token_ids=list(range(8_000))), OK_OR_BAD),
        # an unknown field is a 400 naming it (OpenAI's API answers so too); known ones take effect
        Hostile("unknown-field", C, _c(frobnicate={"a": [1, None]}), param="frobnicate"),
        Hostile("unknown-field-chat", CHAT, _chat("x", functions=[{"name": "f"}]), param="functions"),
        Hostile("tools-on-completions", C, _c(tools=[]), param="tools"),
        Hostile("tools-empty", CHAT, _chat("x", tools=[]), param="tools"),
        Hostile("tool-choice-without-tools", CHAT, _chat("x", tool_choice="required"), param="tool_choice"),
        Hostile("tool-choice-bad", CHAT, _chat("x", tool_choice={"type": "function"}), param="tool_choice"),
        Hostile("logit-bias", C, _c(logit_bias={"1": 5}), frozenset({200})),
        Hostile("logit-bias-key", C, _c(logit_bias={"one": 5}), param="logit_bias"),
        Hostile("logit-bias-range", C, _c(logit_bias={"1": 101}), param="logit_bias"),
        Hostile("logit-bias-nan", C, b'{"prompt": "x", "logit_bias": {"1": NaN}}', param="logit_bias"),
        Hostile("logit-bias-vocab", C, _c(logit_bias={str(vocab_size): 1}), param="logit_bias"),
        Hostile("allowed-token-ids-empty", C, _c(allowed_token_ids=[]), param="allowed_token_ids"),
        Hostile("allowed-token-ids-vocab", C, _c(allowed_token_ids=[vocab_size]), param="allowed_token_ids"),
        Hostile("bad-words-blank", C, _c(bad_words=[" "]), param="bad_words"),
        Hostile("prompt-logprobs-huge", C, _c(prompt_logprobs=10**6), param="prompt_logprobs"),
        Hostile("prompt-logprobs-stream", C, _c(prompt_logprobs=1, stream=True), param="prompt_logprobs"),
        Hostile("stream-options-without-stream", C, _c(stream_options={"include_usage": True}), param="stream_options"),
        Hostile("truncate-zero", C, _c(truncate_prompt_tokens=0), param="truncate_prompt_tokens"),
        Hostile("truncate-huge", C, _c(truncate_prompt_tokens=10**9), param="truncate_prompt_tokens"),
        Hostile("beam-search", C, _c(use_beam_search=True), param="use_beam_search"),
        Hostile("store-true", CHAT, _chat("x", store=True), param="store"),
        Hostile("nulls", C, _c(temperature=None, top_p=None, top_k=None, n=None, stop=None, seed=None, user=None), frozenset({200})),
        Hostile("response-format-type", CHAT, _chat("x", response_format={"type": "yaml"}), param="response_format"),
        Hostile("response-format-no-schema", CHAT, _chat("x", response_format={"type": "json_schema"}), param="response_format"),
        Hostile("schema-bad-type", C, _c(guided_json={"type": "banana"}), param="guided_json"),
        Hostile("schema-not-json", C, _c(guided_json="{nope"), param="guided_json"),
        Hostile("regex-invalid", C, _c(guided_regex="(a"), param="guided_regex"),
        Hostile("grammar-invalid", C, _c(guided_grammar="root ::= ("), param="guided_grammar"),
        Hostile("choice-empty", C, _c(guided_choice=[]), param="guided_choice"),
        Hostile("two-structured-outputs", C, _c(guided_regex="a", guided_choice=["a"]), param="guided_regex"),
        Hostile("structured-outputs-key", C, _c(structured_outputs={"whitespace_pattern": " "}), param="structured_outputs"),
        Hostile("chat-template-kwargs-reserved", CHAT, _chat("x", chat_template_kwargs={"tools": []}), param="chat_template_kwargs"),
        # wrong content types
        Hostile("content-type-text", C, _c(), content_type="text/plain"),
        Hostile("content-type-form", C, b"prompt=x&max_tokens=2", content_type="application/x-www-form-urlencoded"),
        Hostile("content-type-none", C, _c(), content_type=None),
        Hostile("content-type-multipart", C, b"--b\r\n\r\nx\r\n--b--\r\n", content_type="multipart/form-data; boundary=b"),
        # over the body limit
        Hostile("body-over-limit", C, _c(prompt="x" * max_body_bytes), frozenset({413})),
    ]
    names = [r.name for r in rows]
    assert len(names) == len(set(names)), "duplicate row names"
    assert all(len(r.body) < max_body_bytes for r in rows if 413 not in r.statuses), "rows must fit the body limit"
    return rows


def check_envelope(status: int, payload: bytes) -> dict:
    """The error object of a 4xx/5xx response, which must be OpenAI's envelope."""
    body = json.loads(payload)
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}, body
    assert isinstance(err["message"], str) and err["message"], body
    assert "Traceback" not in err["message"] and "TypeError" not in err["message"], body
    return err
