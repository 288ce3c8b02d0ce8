"""The base of the tool-call format parsers: a state machine fed text deltas that
sends OpenAI deltas, content and tool calls, as soon as they are known good."""

from __future__ import annotations

from typing import Any, Optional

from kvroute.deploy.openai.tools.calls import ToolCall
from kvroute.deploy.openai.tools.call_json import WS, CallStream, assemble


def partial_suffix(text: str, marker: str) -> int:
    """Length of the longest end of ``text`` that could begin ``marker``."""
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


class StreamParser:
    """Text in, OpenAI deltas out: ``{"content": ...}`` and ``{"tool_calls": [...]}``.

    Subclasses are state machines: ``mode`` names a ``_mode_<name>`` method that reads
    ``buf`` and returns whether it made progress. Text around calls is content, less the
    whitespace that only separates it from a call. A call region that proves malformed
    goes back out as content, unless (streaming, ``eager``) its header was already sent:
    then the call keeps the arguments sent so far. ``parse`` reads a whole output with
    ``eager=False``, so nothing is sent before it is known good.
    """

    id_style = "openai"
    needs_special_tokens = False  # whether the format's markers are special tokens the detokenizer must keep
    start_mode = "text"
    revert_mode = "text"

    def __init__(self, eager: bool = True, max_calls: Optional[int] = None) -> None:
        self.eager = eager
        self.max_calls = max_calls  # calls past this many are read but dropped (parallel_tool_calls false)
        self.buf = ""
        self.mode = self.start_mode
        self.final = False
        self.out: list[dict[str, Any]] = []
        self.pending: list[dict[str, Any]] = []
        self.call: Optional[CallStream] = None
        self.raw: list[str] = []  # the call region read so far, restored as content if it proves malformed
        self.count = 0
        self.after_call = False

    @classmethod
    def parse(cls, text: str, **kwargs: Any) -> tuple[Optional[str], list[ToolCall]]:
        """A whole output as ``(content, calls)``; content is None when empty."""
        parser = cls(eager=False, **kwargs)
        return assemble(parser.feed(text) + parser.finish())

    @property
    def called(self) -> bool:
        return self.count > 0

    def feed(self, text: str) -> list[dict[str, Any]]:
        self.buf += text
        while getattr(self, "_mode_" + self.mode)():
            pass
        out, self.out = self.out, []
        return out

    def finish(self) -> list[dict[str, Any]]:
        """Everything held back, at the end of the output."""
        self.final = True
        return self.feed("")

    def _mode_text(self) -> bool:  # plain text to the end (formats with no markers after a call)
        self._content(self.buf)
        self.buf = ""
        return False

    def _content(self, text: str) -> None:
        if self.after_call:
            text = text.lstrip(WS)
        if not text:
            return
        self.after_call = False
        if self.out and "content" in self.out[-1]:
            self.out[-1]["content"] += text
        else:
            self.out.append({"content": text})

    def _text_until(self, marker: str) -> bool:
        """Send text up to ``marker`` as content, holding back what could begin it and
        trailing whitespace; True once the marker is consumed."""
        k = self.buf.find(marker)
        if k >= 0:
            head = self.buf[:k].rstrip(WS)
            self._content(head)
            self.raw = [self.buf[len(head) : k + len(marker)]]
            self.buf = self.buf[k + len(marker) :]
            return True
        if self.final:
            self._content(self.buf)
            self.buf = ""
            return False
        body = self.buf[: len(self.buf) - partial_suffix(self.buf, marker)]
        head = body.rstrip(WS)
        self._content(head)
        self.buf = self.buf[len(head) :]
        return False

    def _skip_ws(self) -> bool:
        rest = self.buf.lstrip(WS)
        self.raw.append(self.buf[: len(self.buf) - len(rest)])
        self.buf = rest
        return bool(rest)

    def _read_call(self, then: str, **kwargs: Any) -> bool:
        """Read one call object; on to mode ``then`` once it closes."""
        if self.call is None:
            if not self._skip_ws():
                if self.final:
                    self._revert()
                return self.final
            if self.buf[0] != "{":
                self._revert()
                return True
            self.call = CallStream(self.count, self.id_style, **kwargs)
        used, deltas = self.call.feed(self.buf)
        self.raw.append(self.buf[:used])
        self.buf = self.buf[used:]
        if self.max_calls is None or self.count < self.max_calls:
            (self.out if self.eager else self.pending).extend(deltas)
        if self.call.done:
            self._end_call(then)
        elif self.call.failed or self.final:
            if self.eager and self.call.name is not None:
                self._end_call(then)  # already sent: it stands as sent
            else:
                self._revert()
        else:
            return False
        return True

    def _end_call(self, then: str) -> None:
        self.out += self.pending
        self.pending, self.call, self.raw = [], None, []
        self.count = self.count + 1 if self.max_calls is None else min(self.count + 1, self.max_calls)
        self.after_call = True
        self.mode = then

    def _revert(self) -> None:
        self.pending, self.call = [], None
        raw, self.raw = "".join(self.raw), []
        self._content(raw)
        self.mode = self.revert_mode
