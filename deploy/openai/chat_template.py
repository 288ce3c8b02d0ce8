"""Chat templates: the one ``--chat-template`` names (a file, inline Jinja, or a template
shipped here) or the tokenizer's own, rendered with tools and ``chat_template_kwargs``.

A template that ignores ``tools`` would silently serve a model that never learns of
them, so ``ChatRenderer`` probes the template once (a conversation with a tool and a
call whose names are unlikely anywhere else) and refuses requests it cannot render.
"""

from __future__ import annotations

from functools import cached_property
from pathlib import Path
from typing import Any, Optional, Union

from jinja2 import TemplateError

TEMPLATES_DIR = Path(__file__).resolve().parent / "templates"
BUILTIN_TEMPLATES = {"chatml_tools": TEMPLATES_DIR / "chatml_tools.jinja"}

# Arguments ChatRenderer.render sets itself; chat_template_kwargs may not override them.
_RESERVED = frozenset({"conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
                       "continue_final_message", "tokenize", "return_dict", "return_tensors", "tokenizer_kwargs"})  # fmt: skip

_PROBE_NAME = "kvroute_probe_fn_q7x"
_PROBE_TOOL = {"type": "function", "function": {"name": _PROBE_NAME, "description": "probe",
                                                "parameters": {"type": "object", "properties": {}}}}  # fmt: skip
# The call id is 9 letters and digits: Mistral's templates reject any other shape.
_PROBE_CALL = [
    {"role": "user", "content": "probe"},
    {"role": "assistant", "content": "", "tool_calls": [
        {"id": "probe0001", "type": "function", "function": {"name": _PROBE_NAME, "arguments": {}}}]},
    {"role": "tool", "tool_call_id": "probe0001", "name": _PROBE_NAME, "content": "probe"},
]  # fmt: skip


def load_chat_template(value: str) -> str:
    """``--chat-template VALUE``: a file's text, a shipped template's name
    (``chatml_tools``), or the template itself when VALUE holds Jinja (as vLLM takes it)."""
    path = Path(value).expanduser()
    try:
        is_file = path.is_file()
    except OSError:  # the template's text itself, too long for a file name
        is_file = False
    if is_file:
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise ValueError(f"--chat-template: cannot read {path}: {exc}") from None
    elif value in BUILTIN_TEMPLATES:
        text = BUILTIN_TEMPLATES[value].read_text(encoding="utf-8")
    elif "{{" in value or "{%" in value:
        text = value
    else:
        raise ValueError(f"--chat-template: {value!r} is no file, no Jinja and none of the shipped templates "
                         f"{sorted(BUILTIN_TEMPLATES)}")  # fmt: skip
    _check_syntax(text, value)
    return text


def _check_syntax(text: str, origin: str) -> None:
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    try:
        ImmutableSandboxedEnvironment().parse(text)
    except TemplateError as exc:
        raise ValueError(f"--chat-template {origin}: not a valid Jinja template: {exc}") from None


class ChatRenderer:
    """Renders conversations for one tokenizer with one template (the given one, else
    the tokenizer's), checking that what a request needs rendered is rendered."""

    def __init__(self, tokenizer: Any, template: Optional[str] = None) -> None:
        self.tokenizer = tokenizer
        self.template = template or getattr(tokenizer, "chat_template", None) or None
        if isinstance(self.template, dict):  # a tokenizer with named templates: the default one
            self.template = self.template.get("default")

    @cached_property
    def renders_tools(self) -> bool:
        """Whether the template shows the model the tools it is given."""
        return self._probe([{"role": "user", "content": "probe"}], [_PROBE_TOOL])

    @cached_property
    def renders_tool_calls(self) -> bool:
        """Whether the template shows assistant turns' tool calls (and tool results)."""
        return self._probe(_PROBE_CALL, [_PROBE_TOOL] if self.renders_tools else None, need_tools=False)

    def _probe(self, messages: list[dict[str, Any]], tools: Optional[list[dict[str, Any]]], need_tools: bool = True) -> bool:
        try:
            text = self._apply(messages, tools, True, False, {}, tokenize=False)
            without = self._apply([{"role": "user", "content": "probe"}], tools, True, False, {}, tokenize=False)
        except (TemplateError, TypeError, ValueError):
            return False
        return _PROBE_NAME in text if need_tools else text.count(_PROBE_NAME) > without.count(_PROBE_NAME)

    def check(self, messages: list[dict[str, Any]], tools: Optional[list[dict[str, Any]]]) -> None:
        """ValueError naming the field when the template cannot render the request."""
        if self.template is None:
            raise ValueError("messages: the model has no chat template; start the server with --chat-template FILE")
        if tools and not self.renders_tools:
            raise ValueError("tools: the chat template does not render tools; start the server with a template that "
                             "does (--chat-template FILE, e.g. --chat-template chatml_tools for ChatML models)")  # fmt: skip
        if any(m.get("tool_calls") or m.get("role") == "tool" for m in messages) and not self.renders_tool_calls:
            raise ValueError("messages: the chat template does not render assistant tool_calls and tool messages; "
                             "start the server with a template that does (--chat-template FILE)")  # fmt: skip

    def uses(self, variable: str) -> bool:
        """Whether the template reads ``variable`` (a name its Jinja source refers to)."""
        if self.template is None:
            return False
        from jinja2 import meta
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        return variable in meta.find_undeclared_variables(ImmutableSandboxedEnvironment().parse(self.template))

    def render(
        self,
        messages: list[dict[str, Any]],
        tools: Optional[list[dict[str, Any]]] = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template_kwargs: Optional[dict[str, Any]] = None,
        tokenize: bool = True,
        documents: Optional[list[dict[str, str]]] = None,
    ) -> Union[str, list[int]]:
        """The prompt's token ids (or text): ``messages`` as ``template_messages`` gives
        them, ``tools`` as ``ToolFields.template_tools`` gives them, and
        ``chat_template_kwargs`` as extra template variables (e.g. ``enable_thinking``)."""
        kwargs = dict(chat_template_kwargs or {})
        clash = sorted(set(kwargs) & _RESERVED)
        if clash:
            raise ValueError(f"chat_template_kwargs: {clash} are set by the request itself, not by template variables")
        if documents is not None:  # vLLM's RAG documents, a variable of templates that render them
            kwargs["documents"] = documents
        self.check(messages, tools)
        try:
            return self._apply(messages, tools, add_generation_prompt, continue_final_message, kwargs, tokenize)
        except TemplateError as exc:  # the template's own checks (roles, order) or a bad expression
            raise ValueError(f"messages: the chat template rejected the conversation: {exc}") from None

    def _apply(self, messages: list[dict[str, Any]], tools: Optional[list[dict[str, Any]]], add_generation_prompt: bool,
               continue_final_message: bool, kwargs: dict[str, Any], tokenize: bool) -> Union[str, list[int]]:  # fmt: skip
        out = self.tokenizer.apply_chat_template(
            messages,
            tools=tools,
            chat_template=self.template,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            tokenize=tokenize,
            return_dict=False,
            **kwargs,
        )
        if not tokenize:
            return out
        if isinstance(out, dict) or hasattr(out, "input_ids"):
            out = out["input_ids"]
        return list(out)
