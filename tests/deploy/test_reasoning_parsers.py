"""The reasoning parsers on text: whole outputs split as each format defines, and the
stream, cut at every place (and in random chunkings), joins to the whole split."""

from __future__ import annotations

import random

import pytest

from kvroute.deploy.openai.reasoning import ReasoningPlan, ReasoningServing, template_reads
from kvroute.deploy.openai.reasoning_parsers import REASONING_PARSERS, ReasoningStream, get_reasoning_parser

QWEN3 = REASONING_PARSERS["qwen3"]
R1 = REASONING_PARSERS["deepseek_r1"]

CASES = [
    "<think>\nLet me see.\n</think>\n\nThe answer is 4.",
    "<think>all reasoning, cut off",
    "<think></think>",
    "no think block at all",
    "reasoning the template opened</think>then content",
    "<thi",
    "<think",
    "a </thin b",
    "<think>x</think>y</think>z",
    "",
    "</think>",
    "<think>a</think",
    " <think>leading space</think>c",
    "a<think>b<think>c</think>d<think>e",
    "</thi</think>nk>",
    "r<thi<think>nk>s</think>t",
]


# vLLM 0.32's qwen3 parser engine on the same texts (its extract_reasoning, run once
# under .venv-vllm; test_vllm_reasoning.py compares the two on random texts)
@pytest.mark.parametrize("text,want", [
    ("<think>\nr\n</think>\n\nc", ("\nr\n", "\n\nc")),
    ("<think>cut off", ("cut off", "")),
    ("plain", ("plain", "")),  # no <think> first: still reasoning (a template may open it)
    ("r</think>c", ("r", "c")),
    (" <think>r</think>c", (" r", "c")),
    ("a<think>b</think>c", ("ab", "c")),  # a <think> within the reasoning is dropped
    ("<think><think>a", ("a", "")),
    ("<think>x</think>y</think>z", ("x", "yz")),  # so is a </think> within the content
    ("x</think>y<think>z", ("x", "y<think>z")),
    ("</think>c", (None, "c")),  # an empty reasoning is none
    ("<think></think>", (None, "")),
    ("", (None, "")),
])  # fmt: skip
def test_qwen3_reads_as_vllms_parser_engine(text, want):
    assert QWEN3.split(text) == want


@pytest.mark.parametrize("text,want", [
    ("r</think>c", ("r", "c")),
    ("<think>r</think>c", ("r", "c")),
    ("all reasoning", ("all reasoning", "")),
    ("</think>c", ("", "c")),
    ("a<think>b</think>c", ("a<think>b", "c")),  # only a leading <think> is the model's own opening
])  # fmt: skip
def test_deepseek_r1_starts_inside_the_reasoning(text, want):
    assert R1.split(text) == want


def _streamed(parser, pieces, stream_reasoning=True) -> tuple[str, str, int]:
    s = ReasoningStream(parser, stream_reasoning)
    reasoning = content = ""
    sends = 0
    for p in pieces:
        r, c = s.feed(p)
        reasoning, content, sends = reasoning + r, content + c, sends + bool(r)
    r, c = s.finish()
    return reasoning + r, content + c, sends + bool(r)


def _whole(parser, text) -> tuple[str, str]:
    r, c = parser.split(text)
    return r or "", c


@pytest.mark.parametrize("name", sorted(REASONING_PARSERS))
@pytest.mark.parametrize("text", CASES)
def test_every_two_piece_cut_streams_the_whole_split(name, text):
    parser = REASONING_PARSERS[name]
    for i in range(len(text) + 1):
        for j in range(i, len(text) + 1):
            assert _streamed(parser, [text[:i], text[i:j], text[j:]])[:2] == _whole(parser, text), (text, i, j)


@pytest.mark.parametrize("name", sorted(REASONING_PARSERS))
def test_random_chunkings_and_one_character_deltas(name):
    parser = REASONING_PARSERS[name]
    rng = random.Random(0)
    alphabet = ["<think>", "</think>", "<", "/", "think", ">", "a", " ", "\n", "<thi", "nk>"]
    for _ in range(300):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 12)))
        cuts = sorted(rng.sample(range(len(text) + 1), min(len(text) + 1, rng.randint(0, 6))))
        pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
        assert _streamed(parser, pieces)[:2] == _whole(parser, text), (text, pieces)
        assert _streamed(parser, list(text))[:2] == _whole(parser, text), text


def test_stream_reasoning_false_sends_the_reasoning_once():
    text = "<think>step one, step two</think>done"
    pieces = list(text)
    assert _streamed(QWEN3, pieces)[2] > 1
    reasoning, content, sends = _streamed(QWEN3, pieces, stream_reasoning=False)
    assert (reasoning, content, sends) == ("step one, step two", "done", 1)
    assert _streamed(R1, list("cut off"), stream_reasoning=False) == ("cut off", "", 1)  # at the end


def test_plan_switches():
    text = "<think>r</think>c"
    assert ReasoningPlan(QWEN3).split(text) == ("r", "c")
    assert ReasoningPlan(QWEN3, include=False).split(text) == (None, "c")
    assert ReasoningPlan(QWEN3, separate=False).split(text) == (None, text)
    assert ReasoningPlan(R1, prompt_ended=True).split("x</think>y") == (None, "x</think>y")
    assert ReasoningPlan(QWEN3, separate=False).new_stream() is None
    plan = ReasoningPlan(QWEN3, include=False)
    s = plan.new_stream()
    assert plan.feed(s, "<think>r</thi", False) == ("", "") and plan.feed(s, "nk>c", True) == ("", "c")


def test_unknown_parser_names_the_choices():
    with pytest.raises(ValueError, match=r"--reasoning-parser: unknown parser 'o1'.*deepseek_r1.*qwen3"):
        get_reasoning_parser("o1")


class _Tok:
    """A tokenizer whose markers are single tokens 7 (<think>) and 8 (</think>), and
    ChatML's turn tokens 1 (<|im_start|>) and 2 (<|im_end|>)."""

    all_special_tokens: list[str] = []

    def encode(self, text, add_special_tokens=False):
        return [{"<think>": 7, "</think>": 8, "<|im_start|>": 1, "<|im_end|>": 2}[text]]


@pytest.mark.parametrize("name", sorted(REASONING_PARSERS))
def test_the_prompt_ends_reasoning_when_its_last_marker_closes_it(name):
    serving = ReasoningServing(name, _Tok(), None)
    assert serving.prompt_ended([1, 7, 5, 8, 5, 5])  # Qwen3 enable_thinking false: an empty think block
    assert not serving.prompt_ended([1, 7, 5, 8, 2, 7])  # DeepSeek-R1's template opened a new one
    assert not serving.prompt_ended([1, 2, 3])
    # a past assistant turn's reasoning, then a new turn that opens none: qwen3 reads the
    # new turn only (after its <|im_start|>), deepseek_r1 the whole prompt, as vLLM's do
    assert serving.prompt_ended([1, 7, 5, 8, 4, 2, 1, 6, 2, 1, 3]) is (name == "deepseek_r1")
    assert serving.sampling(ReasoningPlan(QWEN3), "a grammar") == {"structured_output_after": (8,)}
    assert serving.sampling(ReasoningPlan(QWEN3, prompt_ended=True), "a grammar") == {}
    assert serving.sampling(ReasoningPlan(QWEN3), None) == {}


def test_template_reads():
    assert template_reads("{% if reasoning_effort %}x{% endif %}", "reasoning_effort")
    assert not template_reads("{% set reasoning_effort = 1 %}{{ reasoning_effort }}", "reasoning_effort")
    assert not template_reads(None, "reasoning_effort")


def test_the_flag_reaches_serve_replica_serve_and_the_serve_config():
    from kvroute.deploy.app_config import parse_args
    from kvroute.deploy.cli import _tool_ingress_args, build_parser
    from kvroute.deploy.openai.tools.serving import tool_config_from_args

    args = build_parser().parse_args(["serve-replica", "--reasoning-parser", "deepseek_r1"])
    assert tool_config_from_args(args).reasoning_parser == "deepseek_r1"
    args = build_parser().parse_args(["serve", "--reasoning-parser", "qwen3"])
    assert _tool_ingress_args(args)["reasoning_parser"] == "qwen3"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--reasoning-parser", "o1"])
    base = {"llm_configs": [{"model_loading_config": {"model_id": "m"}}]}
    assert parse_args({**base, "ingress": {"reasoning_parser": "qwen3"}}).ingress.tool_config().reasoning_parser == "qwen3"
    with pytest.raises(ValueError, match="ingress: .*unknown parser 'o1'"):
        parse_args({**base, "ingress": {"reasoning_parser": "o1"}})


def test_tool_calls_are_read_from_the_content_after_the_reasoning():
    from kvroute.deploy.openai.tools.calls import ToolFields
    from kvroute.deploy.openai.tools.serving import ToolServingConfig, plan_tools
    from tests.deploy.tool_defs import WEATHER

    tools = plan_tools(ToolServingConfig(tool_call_parser="hermes", enable_auto_tool_choice=True), ToolFields(tools=[WEATHER]))
    call = '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "celsius"}}</tool_call>'
    msg = ReasoningPlan(R1).message(f"I should call it.</think>{call}", tools)
    assert msg["reasoning"] == "I should call it." and msg["content"] is None
    assert [c["function"]["name"] for c in msg["tool_calls"]] == ["get_weather"]
    # a call the model only thinks about is reasoning, not a call
    msg = ReasoningPlan(R1).message(f"maybe {call}?</think>It is sunny.", tools)
    assert "tool_calls" not in msg and msg["content"] == "It is sunny." and call in msg["reasoning"]
