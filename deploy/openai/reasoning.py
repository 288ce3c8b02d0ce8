"""Reasoning models on the chat path: the request fields, the server's reasoning
settings, and per request a ``ReasoningPlan`` that reads each choice's text back as
``reasoning`` and content (``deploy/openai/reasoning_parsers.py`` holds the parsers).

Per request, ``ReasoningServing`` (built once per server from ``--reasoning-parser``):

- ``with_effort``: ``reasoning_effort`` reaches the chat template as the variable of
  that name, as vLLM passes it; a template that never reads it is a 400 naming the
  field (the model would silently reason as it always does).
- ``plan``: with a parser, how the answer splits; without one, ``include_reasoning``,
  ``separate_reasoning`` and ``stream_reasoning`` take only ``true``, as before.
  A prompt whose last think marker is ``</think>`` (Qwen3 with ``enable_thinking``
  false) has ended the reasoning: the output is all content, as vLLM reads it (under
  qwen3, the last marker of the turn the output starts: after ChatML's last turn token).
- ``sampling``: with a structured output (``response_format``, a forced tool call) the
  engine applies the grammar only once the output has written ``</think>``
  (``SamplingParams.structured_output_after``), so the model reasons freely and the
  JSON follows, as vLLM does with a reasoning parser. The marker is matched as token
  ids: the one added token of Qwen3 and DeepSeek-R1, or the tokenizer's own spelling
  of ``</think>`` where it has no such token.

The answer carries ``message.reasoning`` (vLLM 0.32's name; it renamed
``reasoning_content``) and streams ``delta.reasoning``; ``include_reasoning`` false drops
it from the answer (the content stays what follows it). SGLang's ``separate_reasoning``
false leaves the text unsplit, all content; its ``stream_reasoning`` false sends the
reasoning in one delta once it ends.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Any, Literal, Optional, Sequence

from pydantic import BaseModel, StrictBool

from kvroute.deploy.openai.errors import bad_request
from kvroute.deploy.openai.reasoning_parsers import THINK_END, THINK_START, ReasoningParser, ReasoningStream, get_reasoning_parser

__all__ = ["ReasoningFields", "ReasoningPlan", "ReasoningServing", "template_reads"]

_SWITCHES = ("include_reasoning", "separate_reasoning", "stream_reasoning")


class ReasoningFields(BaseModel):
    """The chat request's reasoning fields: vLLM's ``include_reasoning`` and
    ``reasoning_effort``, SGLang's ``separate_reasoning`` and ``stream_reasoning``.
    Listed before the no-effect fields in the request's bases, so these definitions
    replace theirs on /v1/chat/completions."""

    include_reasoning: StrictBool = True
    separate_reasoning: StrictBool = True
    stream_reasoning: StrictBool = True
    reasoning_effort: Optional[Literal["low", "medium", "high"]] = None


def template_reads(template: Optional[str], variable: str) -> bool:
    """Whether the Jinja ``template`` refers to ``variable`` (a name it does not set)."""
    if not template:
        return False
    from jinja2 import meta
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    return variable in meta.find_undeclared_variables(ImmutableSandboxedEnvironment().parse(template))


def _last(rev: list[int], marker: Sequence[int]) -> int:
    """Where ``marker``'s last occurrence ends, counted from the end of the reversed ids
    ``rev`` (smaller: later in the prompt); -1 when it does not occur."""
    want = list(reversed(marker))
    pos = 0
    while True:
        try:
            pos = rev.index(want[0], pos)
        except ValueError:
            return -1
        if rev[pos : pos + len(want)] == want:
            return pos
        pos += 1


@dataclass(frozen=True)
class ReasoningPlan:
    """One request's reasoning handling. ``prompt_ended``: the prompt closed the
    reasoning, so the output is all content; ``separate`` false: the text stays unsplit."""

    parser: type[ReasoningParser]
    include: bool = True
    separate: bool = True
    stream: bool = True
    prompt_ended: bool = False

    @property
    def active(self) -> bool:
        """Whether the output is read for reasoning at all."""
        return self.separate and not self.prompt_ended

    def split(self, text: str) -> tuple[Optional[str], str]:
        """A whole choice's ``(reasoning, content)``; reasoning None when there is none
        or ``include_reasoning`` is false."""
        if not self.active:
            return None, text
        reasoning, content = self.parser.split(text)
        return (reasoning if self.include else None), content

    def new_stream(self) -> Optional[ReasoningStream]:
        """A fresh stream reader for one choice; None: the text is all content."""
        return ReasoningStream(self.parser, self.stream) if self.active else None

    def feed(self, stream: Optional[ReasoningStream], text: str, final: bool) -> tuple[str, str]:
        """One delta's ``(reasoning, content)`` through ``stream`` (reasoning "" where it
        is not included)."""
        if stream is None:
            return "", text
        reasoning, content = stream.feed(text)
        if final:
            more = stream.finish()
            reasoning, content = reasoning + more[0], content + more[1]
        return (reasoning if self.include else ""), content

    def message(self, text: str, tools: Any) -> dict[str, Any]:
        """A whole choice as an assistant ``message``: the content (read for tool calls
        by ``tools``, a ``ToolPlan``, when given; null when empty) and ``reasoning``."""
        reasoning, content = self.split(text)
        out = tools.message(content) if tools is not None else {"role": "assistant", "content": content or None}
        out["reasoning"] = reasoning
        return out


class ReasoningServing:
    """The server's reasoning settings: ``parser_name`` (``--reasoning-parser``, None
    for none), the tokenizer the markers are found in, the chat template."""

    def __init__(self, parser_name: Optional[str], tokenizer: Any, template: Optional[str]) -> None:
        self.parser = get_reasoning_parser(parser_name) if parser_name else None
        self.template = template
        self.end_ids: tuple[int, ...] = ()
        self.start_ids: tuple[int, ...] = ()
        self.turn_ids: frozenset[int] = frozenset()
        if self.parser is not None:  # (a server without a parser never looks for the markers)
            self.end_ids = tuple(tokenizer.encode(THINK_END, add_special_tokens=False))
            self.start_ids = tuple(tokenizer.encode(THINK_START, add_special_tokens=False))
            turns = (tokenizer.encode(m, add_special_tokens=False) for m in self.parser.turn_markers)
            self.turn_ids = frozenset(ids[0] for ids in turns if len(ids) == 1)  # (single tokens only, as vLLM's)
        special = set(getattr(tokenizer, "all_special_tokens", ()) or ())
        # a marker the detokenizer would skip must be kept in the text the parser reads
        self.keep_special_tokens = self.parser is not None and bool({THINK_START, THINK_END} & special)

    @cached_property
    def template_takes_effort(self) -> bool:
        return template_reads(self.template, "reasoning_effort")

    def with_effort(self, req: Any) -> Any:
        """``req`` with its ``reasoning_effort`` among the template variables (400
        naming the field when the template does not read it, or when
        ``chat_template_kwargs`` sets it to another value)."""
        effort = req.reasoning_effort
        if effort is None:
            return req
        if not self.template_takes_effort:
            raise bad_request("reasoning_effort: the model's chat template does not take reasoning_effort",
                              param="reasoning_effort")  # fmt: skip
        kwargs = dict(req.chat_template_kwargs or {})
        if kwargs.get("reasoning_effort", effort) != effort:
            raise bad_request(f"reasoning_effort: {effort!r} disagrees with chat_template_kwargs.reasoning_effort "
                              f"{kwargs['reasoning_effort']!r}", param="reasoning_effort")  # fmt: skip
        kwargs["reasoning_effort"] = effort
        return req.model_copy(update={"chat_template_kwargs": kwargs})

    def plan(self, req: Any, prompt_ids: Sequence[int], forced: bool) -> Optional[ReasoningPlan]:
        """The request's plan (None without a parser); 400 naming the field for a switch
        that needs a parser, or ``separate_reasoning`` false with a forced tool call
        (the call is read from the content after the reasoning)."""
        if self.parser is None:
            for name in _SWITCHES:
                if getattr(req, name) is False:
                    raise bad_request(f"{name}: only true is supported on a server without a reasoning parser "
                                      "(start it with --reasoning-parser)", param=name)  # fmt: skip
            return None
        if forced and not req.separate_reasoning:
            raise bad_request(f"separate_reasoning: false cannot be combined with tool_choice {req.choice_label()}, "
                              "whose call follows the reasoning", param="separate_reasoning")  # fmt: skip
        return ReasoningPlan(self.parser, req.include_reasoning, req.separate_reasoning, req.stream_reasoning,
                             self.prompt_ended(prompt_ids))  # fmt: skip

    def prompt_ended(self, ids: Sequence[int]) -> bool:
        """Whether the prompt's last think marker is ``</think>`` (vLLM's test): the
        template closed the reasoning (an empty think block) before the output starts.
        Under qwen3 only the markers after the last ChatML turn token count, so a past
        turn's reasoning does not end the new one's (as vLLM's qwen3 reads the prompt)."""
        if not self.end_ids:
            return False
        rev = list(ids)[::-1]
        if self.turn_ids:
            rev = rev[: next((i for i, t in enumerate(rev) if t in self.turn_ids), len(rev))]
        end = _last(rev, self.end_ids)
        if end < 0:
            return False
        start = _last(rev, self.start_ids) if self.start_ids else -1
        return start < 0 or end < start

    def sampling(self, plan: Optional[ReasoningPlan], structured: Any) -> dict[str, Any]:
        """The ``SamplingParams`` fields of a request: a structured output starts after
        ``</think>`` unless the prompt already ended the reasoning."""
        if plan is None or structured is None or plan.prompt_ended or not self.end_ids:
            return {}
        return {"structured_output_after": self.end_ids}
