"""Chat templates with tools on the embedded SmolLM2 tokenizer (deploy/openai/chat_template.py and
the shipped chatml_tools template)."""

import json

import pytest

from kvroute.deploy.openai.chat_template import BUILTIN_TEMPLATES, ChatRenderer, load_chat_template
from kvroute.deploy.openai.tools.calls import ToolChatMessage, ToolFields, template_messages
from kvroute.deploy.openai.tools.hermes import HermesParser

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Current weather",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}  # fmt: skip
HISTORY = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Paris and Nice?"},
    {"role": "assistant", "content": "Checking both.", "tool_calls": [
        {"id": "call_a", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
        {"id": "call_b", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Nice"}'}}]},
    {"role": "tool", "tool_call_id": "call_a", "content": "18 C"},
    {"role": "tool", "tool_call_id": "call_b", "content": "21 C"},
]  # fmt: skip


@pytest.fixture(scope="module")
def renderer(smollm2_tokenizer):
    return ChatRenderer(smollm2_tokenizer, load_chat_template("chatml_tools"))


def _conversation(raw):
    return template_messages([ToolChatMessage.model_validate(m) for m in raw])


def test_without_tools_it_renders_what_smollm2s_own_template_does(smollm2_tokenizer, renderer):
    own = ChatRenderer(smollm2_tokenizer)
    for conv in ([{"role": "user", "content": "Hi"}],
                 [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Hi"},
                  {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Again"}]):  # fmt: skip
        assert renderer.render(conv) == own.render(conv)
        assert renderer.render(conv, tokenize=False) == own.render(conv, tokenize=False)


def test_tools_render_in_the_system_turn(smollm2_tokenizer, renderer):
    tools = ToolFields.model_validate({"tools": [WEATHER]}).template_tools()
    text = renderer.render([{"role": "user", "content": "Weather?"}], tools=tools, tokenize=False)
    system = text.split("<|im_end|>")[0]
    listed = system.split("<tools>\n")[1].split("\n</tools>")[0]
    assert json.loads(listed) == WEATHER
    assert text.endswith("<|im_start|>user\nWeather?<|im_end|>\n<|im_start|>assistant\n")
    ids = renderer.render([{"role": "user", "content": "Weather?"}], tools=tools)
    assert ids == smollm2_tokenizer.encode(text, add_special_tokens=False)


def test_history_with_calls_and_results_renders_and_parses_back(renderer):
    text = renderer.render(_conversation(HISTORY), tools=[WEATHER], tokenize=False)
    assistant = text.split("<|im_start|>assistant\n")[1].split("<|im_end|>")[0]
    content, calls = HermesParser.parse(assistant)  # what the model sees is what the parser reads
    assert content == "Checking both."
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Paris"}), ("get_weather", {"city": "Nice"})]
    results = text.split("<|im_end|>\n<|im_start|>user\n")[-1]
    assert results.startswith("<tool_response>\n18 C\n</tool_response>\n<tool_response>\n21 C\n</tool_response><|im_end|>")
    assert text.endswith("<|im_start|>assistant\n")


def test_continue_final_message(renderer):
    conv = [{"role": "user", "content": "Count"}, {"role": "assistant", "content": "One, two,"}]
    text = renderer.render(conv, add_generation_prompt=False, continue_final_message=True, tokenize=False)
    assert text.endswith("<|im_start|>assistant\nOne, two,")


def test_a_template_that_ignores_tools_is_refused(smollm2_tokenizer):
    own = ChatRenderer(smollm2_tokenizer)  # SmolLM2's template renders no tools
    assert not own.renders_tools and not own.renders_tool_calls
    with pytest.raises(ValueError, match="tools: the chat template does not render tools.*--chat-template"):
        own.render([{"role": "user", "content": "Weather?"}], tools=[WEATHER])
    with pytest.raises(ValueError, match="messages: the chat template does not render assistant tool_calls"):
        own.render(_conversation(HISTORY))
    assert own.render([{"role": "user", "content": "Hi"}])  # plain chat still renders


def test_chat_template_kwargs_reach_the_template(smollm2_tokenizer):
    inline = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
              "{% if add_generation_prompt %}<|im_start|>assistant\n{% if not enable_thinking %}<think></think>{% endif %}{% endif %}")  # fmt: skip
    r = ChatRenderer(smollm2_tokenizer, load_chat_template(inline))
    conv = [{"role": "user", "content": "Hi"}]
    assert r.render(conv, chat_template_kwargs={"enable_thinking": False}, tokenize=False).endswith("<think></think>")
    assert r.render(conv, chat_template_kwargs={"enable_thinking": True}, tokenize=False).endswith("assistant\n")
    with pytest.raises(ValueError, match=r"chat_template_kwargs: \['tools'\]"):
        r.render(conv, chat_template_kwargs={"tools": []})
    assert not r.renders_tools
    with pytest.raises(ValueError, match="tools: the chat template does not render tools"):
        r.render(conv, tools=[WEATHER])


def test_template_errors_become_value_errors(smollm2_tokenizer):
    strict = "{% for m in messages %}{% if m.role == 'system' %}{{ raise_exception('no system turns') }}{% endif %}{{ m.content }}{% endfor %}"
    r = ChatRenderer(smollm2_tokenizer, load_chat_template(strict))
    with pytest.raises(ValueError, match="messages: the chat template rejected the conversation: no system turns"):
        r.render([{"role": "system", "content": "x"}])


def test_load_chat_template(tmp_path):
    path = tmp_path / "t.jinja"
    path.write_text("{{ messages[0].content }}")
    assert load_chat_template(str(path)) == "{{ messages[0].content }}"
    assert load_chat_template("chatml_tools") == BUILTIN_TEMPLATES["chatml_tools"].read_text()
    assert load_chat_template("{{ 'inline' }}") == "{{ 'inline' }}"
    with pytest.raises(ValueError, match="--chat-template: 'missing.jinja' is no file"):
        load_chat_template("missing.jinja")
    bad = tmp_path / "bad.jinja"
    bad.write_text("{% for m in messages %}")
    with pytest.raises(ValueError, match="--chat-template .*bad.jinja: not a valid Jinja template"):
        load_chat_template(str(bad))


def test_a_model_without_a_template_is_refused(smollm2_tokenizer):
    import copy

    base = copy.deepcopy(smollm2_tokenizer)
    base.chat_template = None  # as a base model's tokenizer has it
    r = ChatRenderer(base)
    with pytest.raises(ValueError, match="messages: the model has no chat template.*--chat-template"):
        r.render([{"role": "user", "content": "Hi"}])
