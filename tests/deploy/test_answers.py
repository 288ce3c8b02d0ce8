"""What the answers carry, shaped from real ToolPlans and TokenDelta streams (no engine,
no HTTP): tool calls in chat bodies and streams, vLLM's prompt_logprobs, completions
echo with logprobs in lm-evaluation-harness's shape, echo with max_tokens 0, and
continuous usage stats."""

from __future__ import annotations

import asyncio
import json
import math
from typing import Any, Optional

import pytest

from kvroute.deploy.openai.answers.logprobs import TokenText, prompt_logprobs
from kvroute.deploy.openai.fanout import Choice
from kvroute.deploy.openai.protocol import PreparedRequest
from kvroute.deploy.openai.answers.bodies import body
from kvroute.deploy.openai.answers.chunks import chunks
from kvroute.deploy.openai.tools.calls import ToolFields
from kvroute.deploy.openai.tools.call_json import assemble
from kvroute.deploy.openai.tools.serving import ToolServingConfig, plan_tools
from kvroute.replica.outputs import RequestId, TokenDelta, TokenLogprob
from kvroute.replica.sampling_params import SamplingParams

TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"tz": {"enum": ["UTC", "CET"]}}, "required": ["tz"]}}}  # fmt: skip
AUTO = ToolServingConfig(tool_call_parser="hermes", enable_auto_tool_choice=True)
CALL_TEXT = 'On it.\n<tool_call>\n{"name": "get_time", "arguments": {"tz": "CET"}}\n</tool_call>'


@pytest.fixture(scope="module")
def text_of(smollm2_tokenizer):
    return TokenText(smollm2_tokenizer)


def _request(chat: bool, prompts: list[list[int]], n: int = 1, **fields: Any) -> PreparedRequest:
    base = dict(chat=chat, request_id="chatcmpl-1" if chat else "cmpl-1", model="m", prompts=prompts,
                params=[SamplingParams(max_tokens=16)] * n, lora_name=None, cache_salt=None, stream=False,
                include_usage=False, logprobs=None, echo=[""] * len(prompts), body=b"{}")  # fmt: skip
    return PreparedRequest(**(base | fields))


def _lp(token_id: int, logprob: float, top: dict[int, float]) -> TokenLogprob:
    return TokenLogprob(token_id, logprob, top)


def _prompt_lps(prompt: list[int]) -> list[Optional[TokenLogprob]]:
    """One record per prompt token after the first; the token is the top one at even
    positions, and outside the top at odd ones."""
    out: list[Optional[TokenLogprob]] = [None]
    for i, t in enumerate(prompt[1:], 1):
        other = (t + 1) % 1000
        top = {t: -0.5, other: -1.5} if i % 2 == 0 else {other: -0.25, other + 1: -2.0}
        out.append(_lp(t, -0.5 if i % 2 == 0 else -float(i), top))
    return out


def _deltas(tokenizer, text: str, prompt: list[int], finish: str = "stop", logprobs: bool = False,
            with_prompt_lps: bool = False) -> list[TokenDelta]:  # fmt: skip
    """``text`` as an engine streams it: one token per delta, the prompt's logprobs with
    the first, the finish reason with the last."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    out = []
    for k, tok in enumerate(ids):
        last = k == len(ids) - 1
        piece = tokenizer.decode(ids[: k + 1])[len(tokenizer.decode(ids[:k])) :]
        lps = [_lp(tok, -0.1 * (k + 1), {tok: -0.1 * (k + 1)})] if logprobs else None
        out.append(TokenDelta(RequestId("r"), [tok], piece, lps, finish if last else None, len(prompt), 0, None,
                              prompt_logprobs=_prompt_lps(prompt) if with_prompt_lps and k == 0 else None))  # fmt: skip
    return out


async def _stream(per_choice: dict[int, list[TokenDelta]], n: int):
    """The merged stream ``fanout.run_choices`` makes: each delta absorbed into its
    choice, the choices' deltas interleaved."""
    choices = {i: Choice(index=i, prompt_index=i // n) for i in per_choice}
    longest = max(len(ds) for ds in per_choice.values())
    for k in range(longest):
        for i, ds in per_choice.items():
            if k < len(ds):
                choices[i].absorb(ds[k])
                yield choices[i], ds[k]


def _finished(per_choice: dict[int, list[TokenDelta]], n: int) -> list[Choice]:
    async def run():
        seen = {}
        async for c, _ in _stream(per_choice, n):
            seen[c.index] = c
        return [seen[i] for i in sorted(seen)]

    return asyncio.run(run())


def _chunks(req: PreparedRequest, per_choice: dict[int, list[TokenDelta]], text_of) -> list[dict[str, Any]]:
    async def run():
        return [json.loads(json.dumps(c)) async for c in chunks(req, _stream(per_choice, len(req.params)), text_of)]

    return asyncio.run(run())


# ---------------------------------------------------------------------- tool calls
def test_chat_body_reads_tool_calls_with_the_plan(smollm2_tokenizer, text_of):
    prompt = smollm2_tokenizer.encode("hi")
    plan = plan_tools(AUTO, ToolFields.model_validate({"tools": [TIME]}))
    per_choice = {0: _deltas(smollm2_tokenizer, CALL_TEXT, prompt), 1: _deltas(smollm2_tokenizer, "It is noon.", prompt)}
    out = body(_request(True, [prompt], n=2, tools=plan), _finished(per_choice, 2), text_of)
    called, plain = out["choices"]
    assert called["message"]["content"] == "On it." and called["finish_reason"] == "tool_calls"
    [call] = called["message"]["tool_calls"]
    assert call["type"] == "function" and call["id"].startswith("call_")
    assert call["function"]["name"] == "get_time" and json.loads(call["function"]["arguments"]) == {"tz": "CET"}
    assert plain["message"] == {"role": "assistant", "content": "It is noon."} and plain["finish_reason"] == "stop"
    untooled = body(_request(True, [prompt], n=2), _finished(per_choice, 2), text_of)
    assert untooled["choices"][0]["message"] == {"role": "assistant", "content": CALL_TEXT}


def test_forced_named_call_finishes_with_stop(smollm2_tokenizer, text_of):
    prompt = smollm2_tokenizer.encode("hi")
    plan = plan_tools(ToolServingConfig(), ToolFields.model_validate(
        {"tools": [TIME], "tool_choice": {"type": "function", "function": {"name": "get_time"}}}))  # fmt: skip
    deltas = _deltas(smollm2_tokenizer, '{"tz": "UTC"}', prompt)
    out = body(_request(True, [prompt], tools=plan), _finished({0: deltas}, 1), text_of)
    [choice] = out["choices"]
    assert choice["message"]["content"] is None and choice["finish_reason"] == "stop"  # OpenAI: a named call stops
    assert [c["function"]["name"] for c in choice["message"]["tool_calls"]] == ["get_time"]


def test_streamed_tool_calls_assemble_to_the_whole_answer(smollm2_tokenizer, text_of):
    prompt = smollm2_tokenizer.encode("hi")
    plan = plan_tools(AUTO, ToolFields.model_validate({"tools": [TIME]}))
    per_choice = {0: _deltas(smollm2_tokenizer, CALL_TEXT, prompt, logprobs=True),
                  1: _deltas(smollm2_tokenizer, "It is noon.", prompt, logprobs=True)}  # fmt: skip
    req = _request(True, [prompt], n=2, tools=plan, stream=True, logprobs=0)
    got = _chunks(req, per_choice, text_of)
    assert [c["choices"][0]["delta"] for c in got[:2]] == [{"role": "assistant", "content": ""}] * 2
    for i, text in ((0, CALL_TEXT), (1, "It is noon.")):
        mine = [c["choices"][0] for c in got[2:] if c["choices"][0]["index"] == i]
        assert [m["finish_reason"] for m in mine][-1] == ("tool_calls" if i == 0 else "stop")
        assert all(m["finish_reason"] is None for m in mine[:-1])
        assert sum(len(m["logprobs"]["content"]) for m in mine if m["logprobs"]) == len(per_choice[i])
        content, calls = assemble([m["delta"] for m in mine])
        want = plan.message(text)
        assert content == want["content"]
        assert [(c.name, json.loads(c.arguments)) for c in calls] == [
            (c["function"]["name"], json.loads(c["function"]["arguments"])) for c in want.get("tool_calls", [])]
    header = [d for c in got for d in c["choices"][0]["delta"].get("tool_calls", []) if "id" in d]
    assert len(header) == 1 and header[0]["type"] == "function" and header[0]["function"]["name"] == "get_time"


def test_forced_required_stream_sends_only_calls(smollm2_tokenizer, text_of):
    prompt = smollm2_tokenizer.encode("hi")
    plan = plan_tools(ToolServingConfig(), ToolFields.model_validate({"tools": [TIME], "tool_choice": "required"}))
    text = '[{"name": "get_time", "parameters": {"tz": "UTC"}}]'
    got = _chunks(_request(True, [prompt], tools=plan, stream=True), {0: _deltas(smollm2_tokenizer, text, prompt)}, text_of)
    deltas = [c["choices"][0]["delta"] for c in got[1:]]
    content, calls = assemble(deltas)
    assert content is None and [(c.name, json.loads(c.arguments)) for c in calls] == [("get_time", {"tz": "UTC"})]
    assert got[-1]["choices"][0]["finish_reason"] == "tool_calls"


# ---------------------------------------------------------------------- prompt logprobs
def test_prompt_logprobs_shape(smollm2_tokenizer, text_of):
    prompt = smollm2_tokenizer.encode("The quick brown fox")
    lps = _prompt_lps(prompt)
    lps[2] = _lp(prompt[2], -math.inf, {7: -0.1})
    out = json.loads(json.dumps(prompt_logprobs(prompt, lps, text_of)))
    assert len(out) == len(prompt) and out[0] is None
    for i, (t, position) in enumerate(zip(prompt[1:], out[1:]), 1):
        first_key = next(iter(position))
        assert first_key == str(t)  # the prompt's token first
        assert position[first_key]["decoded_token"] == text_of(t)
        if i == 2:
            assert position[first_key] == {"logprob": -9999.0, "rank": None, "decoded_token": text_of(t)}
        elif i % 2 == 0:
            assert position[first_key]["rank"] == 1 and len(position) == 2
        else:
            assert position[first_key]["rank"] is None and len(position) == 3
            assert [v["rank"] for v in list(position.values())[1:]] == [1, 2]


def test_prompt_logprobs_take_the_engines_rank(smollm2_tokenizer, text_of):
    prompt = smollm2_tokenizer.encode("ranked tokens")
    lps = [None] + [TokenLogprob(t, -3.0, {7: -0.1}, rank=40 + i) for i, t in enumerate(prompt[1:])]
    out = prompt_logprobs(prompt, lps, text_of)
    assert [p[t]["rank"] for t, p in zip(prompt[1:], out[1:])] == [40 + i for i in range(len(prompt) - 1)]
    assert all(p[7]["rank"] == 1 for p in out[1:])


def test_prompt_logprobs_on_completion_choices_and_once_on_chat(smollm2_tokenizer, text_of):
    prompts = [smollm2_tokenizer.encode("One two three"), smollm2_tokenizer.encode("Four five")]
    per_choice = {i: _deltas(smollm2_tokenizer, " six", prompts[i], with_prompt_lps=True) for i in range(2)}
    out = body(_request(False, prompts, prompt_logprobs=1), _finished(per_choice, 1), text_of)
    for p, choice in enumerate(out["choices"]):
        assert choice["prompt_logprobs"] == prompt_logprobs(prompts[p], _prompt_lps(prompts[p]), text_of)
        assert choice["logprobs"] is None
    plain = body(_request(False, prompts), _finished(per_choice, 1), text_of)
    assert all("prompt_logprobs" not in c for c in plain["choices"])
    chat = body(_request(True, prompts[:1], prompt_logprobs=1), _finished({0: per_choice[0]}, 1), text_of)
    assert chat["prompt_logprobs"] == prompt_logprobs(prompts[0], _prompt_lps(prompts[0]), text_of)
    assert "prompt_logprobs" not in chat["choices"][0]


def test_a_resumed_choice_keeps_its_first_prompt_logprobs(smollm2_tokenizer):
    prompt = smollm2_tokenizer.encode("a b c")
    first, again = _deltas(smollm2_tokenizer, " d", prompt, with_prompt_lps=True)[0], _prompt_lps(prompt + [5])
    choice = Choice(index=0, prompt_index=0)
    choice.absorb(first)
    choice.absorb(TokenDelta(RequestId("r"), [9], "x", None, "stop", len(prompt) + 1, 0, prompt_logprobs=again))
    assert choice.prompt_logprobs == _prompt_lps(prompt)


# ---------------------------------------------------------------------- echo with logprobs
def _lm_eval_loglikelihood(choice: dict[str, Any], ctxlen: int) -> tuple[float, bool]:
    """What lm-evaluation-harness's local-completions reads from an echo answer."""
    token_lps = choice["logprobs"]["token_logprobs"][ctxlen:-1]
    tops = choice["logprobs"]["top_logprobs"][ctxlen:-1]
    return sum(token_lps), all(t == max(top.values()) for t, top in zip(token_lps, tops))


def test_echo_logprobs_start_with_the_prompt(smollm2_tokenizer, text_of):
    prompt = smollm2_tokenizer.encode("Paris is the capital of France")
    echo = smollm2_tokenizer.decode(prompt)
    deltas = _deltas(smollm2_tokenizer, ".", prompt, finish="length", logprobs=True, with_prompt_lps=True)
    req = _request(False, [prompt], logprobs=1, echo=[echo], echo_logprobs=True)
    [choice] = body(req, _finished({0: deltas}, 1), text_of)["choices"]
    lp = choice["logprobs"]
    assert choice["text"] == echo + "."
    assert lp["tokens"] == [text_of(t) for t in prompt] + ["."]
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    lps = _prompt_lps(prompt)
    assert lp["token_logprobs"][1:-1] == [x.logprob for x in lps[1:]]
    assert lp["text_offset"] == [sum(len(t) for t in lp["tokens"][:i]) for i in range(len(lp["tokens"]))]
    for token, value, top in zip(lp["tokens"][1:], lp["token_logprobs"][1:], lp["top_logprobs"][1:]):
        assert next(iter(top.items())) == (token, value)  # the token itself leads its top
    ctxlen = 3
    total, greedy = _lm_eval_loglikelihood(choice, ctxlen)
    assert total == pytest.approx(sum(x.logprob for x in lps[ctxlen:]))
    assert greedy is False  # odd positions are not the top token
    last = len(prompt) - 1  # a one-token continuation: greedy where the prompt token is the top one
    assert _lm_eval_loglikelihood(choice, last) == (lps[last].logprob, last % 2 == 0)


def test_echo_only_answers_the_prompt(smollm2_tokenizer, text_of):
    prompt = smollm2_tokenizer.encode("Scored, not continued")
    echo = smollm2_tokenizer.decode(prompt)
    deltas = _deltas(smollm2_tokenizer, "!", prompt, finish="stop", logprobs=True, with_prompt_lps=True)
    req = _request(False, [prompt], logprobs=1, echo=[echo], echo_logprobs=True, echo_only=True)
    out = body(req, _finished({0: deltas}, 1), text_of)
    [choice] = out["choices"]
    assert choice["text"] == echo and choice["finish_reason"] == "length" and choice["stop_reason"] is None
    assert choice["logprobs"]["tokens"] == [text_of(t) for t in prompt]
    assert out["usage"]["completion_tokens"] == 0 and out["usage"]["total_tokens"] == len(prompt)
    streamed = _chunks(req.__class__(**(req.__dict__ | {"stream": True, "include_usage": True})), {0: deltas}, text_of)
    [only, last] = streamed
    assert only["choices"][0]["text"] == echo and only["choices"][0]["finish_reason"] == "length"
    assert only["choices"][0]["logprobs"] == choice["logprobs"]
    assert last["choices"] == [] and last["usage"]["completion_tokens"] == 0


def test_streamed_echo_logprobs_equal_the_body(smollm2_tokenizer, text_of):
    prompt = smollm2_tokenizer.encode("Count: one two")
    echo = smollm2_tokenizer.decode(prompt)
    deltas = _deltas(smollm2_tokenizer, " three four", prompt, finish="length", logprobs=True, with_prompt_lps=True)
    req = _request(False, [prompt], logprobs=1, echo=[echo], echo_logprobs=True)
    [whole] = body(req, _finished({0: deltas}, 1), text_of)["choices"]
    got = _chunks(req.__class__(**(req.__dict__ | {"stream": True})), {0: deltas}, text_of)
    assert len(got) == len(deltas) and got[0]["choices"][0]["text"].startswith(echo)
    assert "".join(c["choices"][0]["text"] for c in got) == whole["text"]
    for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
        assert [x for c in got for x in c["choices"][0]["logprobs"][key]] == whole["logprobs"][key]


# ---------------------------------------------------------------------- continuous usage
@pytest.mark.parametrize("chat", [False, True])
def test_continuous_usage_counts_as_it_goes(smollm2_tokenizer, text_of, chat):
    prompt = smollm2_tokenizer.encode("Usage as it goes")
    per_choice = {i: _deltas(smollm2_tokenizer, " one two three", prompt, finish="length") for i in range(2)}
    req = _request(chat, [prompt], n=2, stream=True, include_usage=True, continuous_usage=True)
    got = _chunks(req, per_choice, text_of)
    *streamed, final = got
    assert final["choices"] == [] and final["usage"]["completion_tokens"] == 2 * len(per_choice[0])
    count = {0: 0, 1: 0}
    for c in streamed:
        i = c["choices"][0]["index"]
        if not (chat and c["choices"][0]["delta"].get("role")):
            count[i] += 1
        assert c["usage"] == {"prompt_tokens": len(prompt), "completion_tokens": count[i],
                              "total_tokens": len(prompt) + count[i]}  # fmt: skip
    plain = _chunks(req.__class__(**(req.__dict__ | {"continuous_usage": False})), per_choice, text_of)
    assert all("usage" not in c for c in plain[:-1]) and plain[-1]["usage"] == final["usage"]
