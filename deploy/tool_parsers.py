"""Tool-call parsers for the output formats models are trained on, chosen by name as
vLLM's ``--tool-call-parser`` chooses them.

- ``hermes`` (Qwen2.5, Qwen3, Hermes 2/3 and our ``chatml_tools`` template): content,
  then ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks.
- ``llama3_json`` (Llama 3.1-3.3): the output is ``{"name": ..., "parameters": {...}}``
  objects separated by ``;``, optionally after ``<|python_tag|>``; any other output is
  content.
- ``mistral``: content, then ``[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]``
  or the newer ``[TOOL_CALLS]name[ARGS]{...}``; its ids are 9 letters and digits
  (Mistral's templates reject others), and ``[TOOL_CALLS]`` is a special token, so the
  engine must keep special tokens in the text (``needs_special_tokens``).

Every parser is a ``StreamParser``: ``feed`` a text delta, get OpenAI deltas;
``finish`` at the end; ``Parser.parse(text)`` for a whole output.
"""

from __future__ import annotations

import re
from typing import Optional

from kvroute.deploy.tool_calls import ToolChoice, ToolFields
from kvroute.deploy.tool_json import WS
from kvroute.deploy.tool_stream import StreamParser

_NAME_RUN = re.compile(r"[A-Za-z0-9_-]*")


class HermesParser(StreamParser):
    START, END = "<tool_call>", "</tool_call>"

    def _mode_text(self) -> bool:
        if self._text_until(self.START):
            self.mode = "call"
            return True
        return False

    def _mode_call(self) -> bool:
        return self._read_call("close")

    def _mode_close(self) -> bool:
        self.buf = self.buf.lstrip(WS)
        if self.buf.startswith(self.END):
            self.buf = self.buf[len(self.END) :]
        elif self.END.startswith(self.buf) and not self.final:
            return False  # the closing tag may still be arriving
        self.mode = "text"  # a missing closing tag is tolerated
        return True


class Llama3JsonParser(StreamParser):
    TAG = "<|python_tag|>"
    start_mode = "start"

    def _mode_start(self) -> bool:
        rest = self.buf.lstrip(WS)
        lead = len(self.buf) - len(rest)
        if rest.startswith(self.TAG):
            self.raw, self.buf = [self.buf[: lead + len(self.TAG)]], rest[len(self.TAG) :]
        elif rest.startswith("{"):
            self.raw, self.buf = [self.buf[:lead]], rest
        elif self.TAG.startswith(rest) and not self.final:
            return False
        else:
            self.mode = "text"  # not a call: all of it is content
            return True
        self.mode = "call"
        return True

    def _mode_call(self) -> bool:
        return self._read_call("sep", arg_keys=("parameters", "arguments"))

    def _mode_sep(self) -> bool:
        self.buf = self.buf.lstrip(WS)
        if self.buf.startswith(";"):
            self.raw, self.buf, self.mode = [";"], self.buf[1:], "call"
            return True
        if not self.buf:
            return False
        self.mode = "text"
        return True


class MistralParser(StreamParser):
    MARK, ARGS = "[TOOL_CALLS]", "[ARGS]"
    id_style = "mistral"
    needs_special_tokens = True

    def __init__(self, eager: bool = True, max_calls: Optional[int] = None) -> None:
        super().__init__(eager, max_calls)
        self.call_name = ""

    def _mode_text(self) -> bool:
        if self._text_until(self.MARK):
            self.mode = "open"
            return True
        return False

    def _mode_open(self) -> bool:
        if not self._skip_ws():
            if self.final:
                self._revert()
            return self.final
        if self.buf[0] == "[":
            self.raw.append("[")
            self.buf = self.buf[1:]
            self.mode = "item"
        else:
            self.mode = "item" if self.buf[0] == "{" else "name"
        return True

    def _mode_item(self) -> bool:
        return self._read_call("sep")

    def _mode_sep(self) -> bool:
        self.buf = self.buf.lstrip(WS)
        if self.buf.startswith(","):
            self.raw, self.buf, self.mode = [","], self.buf[1:], "item"
        elif self.buf.startswith("]"):
            self.buf, self.mode = self.buf[1:], "text"
        elif not self.buf:
            return False
        else:
            self.mode = "text"
        return True

    def _mode_name(self) -> bool:
        name = _NAME_RUN.match(self.buf).group(0)
        rest = self.buf[len(name) :]
        if name and rest.startswith(self.ARGS):
            self.raw.append(name + self.ARGS)
            self.buf, self.call_name, self.mode = rest[len(self.ARGS) :], name, "args"
        elif self.ARGS.startswith(rest) and not self.final:
            return False
        else:
            self._revert()
        return True

    def _mode_args(self) -> bool:
        return self._read_call("text", name=self.call_name)


TOOL_PARSERS: dict[str, type[StreamParser]] = {
    "hermes": HermesParser,
    "llama3_json": Llama3JsonParser,
    "mistral": MistralParser,
}


def get_tool_parser(name: str) -> type[StreamParser]:
    """The parser class ``--tool-call-parser NAME`` selects (ValueError naming the choices)."""
    try:
        return TOOL_PARSERS[name]
    except KeyError:
        raise ValueError(f"--tool-call-parser: unknown parser {name!r}; choose one of {sorted(TOOL_PARSERS)}") from None


def resolve_tool_choice(fields: ToolFields, parser: Optional[str], enable_auto: bool) -> ToolChoice:
    """The choice a request gets from what the server's flags allow, as vLLM has it: an
    explicit ``auto`` needs ``--enable-auto-tool-choice`` and a ``--tool-call-parser``
    (ValueError naming tool_choice); left out, it is ``auto`` where that is enabled and
    ``none`` otherwise. ``required`` and a named function are constrained by structured
    outputs and need no parser."""
    if fields.tool_choice == "auto" and not (enable_auto and parser):
        raise ValueError('tool_choice: "auto" needs the server started with --enable-auto-tool-choice and --tool-call-parser')
    if fields.tool_choice is None and fields.tools and not (enable_auto and parser):
        return "none"
    return fields.choice()
