"""The incremental machinery every tool-call format shares.

``ObjectScanner`` follows one JSON object as its text arrives, knowing at any moment
which top-level members are complete and where the open one's value started, so a
call's arguments can be streamed as they are written. ``CallStream`` turns one call
object into OpenAI's tool-call deltas (the header with id and name first, then
argument fragments). ``StreamParser`` is the base of the format parsers: text in,
OpenAI-shaped deltas out; a whole output is parsed by feeding it at once, so a stream
and a full parse can only differ where a stream has already sent what later proves
malformed (see ``StreamParser``).
"""

from __future__ import annotations

import json
from typing import Any, Optional

from kvroute.deploy.tool_calls import ToolCall, new_call_id

_WS = " \t\r\n"


class ObjectScanner:
    """Follows one JSON object from its ``{``: brackets and strings for structure, the
    top-level members' raw spans; ``json.loads`` judges the whole once it closes."""

    def __init__(self) -> None:
        self.text = ""
        self.depth = 0
        self.closers: list[str] = []  # the brackets open below the top level
        self.in_str = False
        self.escape = False
        self.phase = "start"  # start, key, colon, value, scalar, after
        self.key_start = 0
        self.open_key: Optional[str] = None
        self.value_start = 0
        self.members: dict[str, tuple[int, int]] = {}
        self.done = False
        self.error = False

    def feed(self, chunk: str) -> int:
        """Consume characters until the object closes or breaks; returns how many."""
        for n, ch in enumerate(chunk):
            self.text += ch
            self._step(ch, len(self.text) - 1)
            if self.done or self.error:
                return n + 1
        return len(chunk)

    def _step(self, ch: str, i: int) -> None:
        if self.in_str:
            if self.escape:
                self.escape = False
            elif ch == "\\":
                self.escape = True
            elif ch == '"':
                self.in_str = False
                if self.depth == 1 and self.phase == "key":
                    try:
                        self.open_key = json.loads(self.text[self.key_start : i + 1])
                    except json.JSONDecodeError:
                        self.error = True
                    self.phase = "colon"
                elif self.depth == 1 and self.phase == "value":
                    self._close_member(i + 1)
            return
        if self.depth > 1:
            self._nested(ch, i)
        elif self.phase == "scalar" and (ch in _WS or ch in ",}"):
            self._close_member(i)
            if ch not in _WS:
                self._top(ch, i)
        elif ch not in _WS:
            self._top(ch, i)

    def _nested(self, ch: str, i: int) -> None:
        if ch == '"':
            self.in_str = True
        elif ch in "{[":
            self.depth += 1
            self.closers.append("}" if ch == "{" else "]")
        elif ch in "}]":
            if ch != self.closers.pop():
                self.error = True
                return
            self.depth -= 1
            if self.depth == 1:
                self._close_member(i + 1)

    def _top(self, ch: str, i: int) -> None:
        phase = self.phase
        if phase == "start":
            self._expect(ch == "{", "key_or_end")
            self.depth = 1
        elif phase in ("key_or_end", "key") and ch == '"':
            self.in_str, self.key_start, self.phase = True, i, "key"
        elif phase in ("key_or_end", "after") and ch == "}":
            self.depth, self.done = 0, True
        elif phase == "colon":
            self._expect(ch == ":", "value")
        elif phase == "value":
            self.value_start = i
            if ch == '"':
                self.in_str = True
            elif ch in "{[":
                self.depth += 1
                self.closers.append("}" if ch == "{" else "]")
            else:
                self.phase = "scalar"
        elif phase == "after":
            self._expect(ch == ",", "key")
        else:
            self.error = True

    def _expect(self, ok: bool, then: str) -> None:
        if ok:
            self.phase = then
        else:
            self.error = True

    def _close_member(self, end: int) -> None:
        if self.open_key is not None:
            self.members[self.open_key] = (self.value_start, end)
        self.open_key, self.phase = None, "after"

    def value(self, key: str) -> Any:
        """A complete top-level member's value (None while absent or open)."""
        span = self.members.get(key)
        return None if span is None else json.loads(self.text[span[0] : span[1]])

    def raw_prefix(self, key: str) -> Optional[str]:
        """The member's raw text so far (complete or open); None before it starts."""
        span = self.members.get(key)
        if span is not None:
            return self.text[span[0] : span[1]]
        if self.open_key == key and self.phase in ("value", "scalar") and len(self.text) > self.value_start:
            return self.text[self.value_start :]
        return None


class CallStream:
    """One tool call's deltas. The name comes from the object's ``name`` member, or is
    given (then the whole object is the arguments: a forced function's output, Mistral's
    ``name[ARGS]{...}``). Arguments stream as raw text while their value is an object;
    a string-encoded or absent value is sent whole when the call closes."""

    def __init__(self, index: int, id_style: str, arg_keys: tuple[str, ...] = ("arguments", "parameters"),
                 name: Optional[str] = None) -> None:  # fmt: skip
        self.index = index
        self.id = new_call_id(id_style)
        self.arg_keys = arg_keys
        self.given_name = name
        self.name: Optional[str] = None
        self.scan = ObjectScanner()
        self.sent = 0  # characters of arguments sent
        self.arguments = ""
        self.failed = False

    @property
    def done(self) -> bool:
        return self.scan.done and not self.failed

    def feed(self, text: str) -> tuple[int, list[dict[str, Any]]]:
        used = self.scan.feed(text)
        out: list[dict[str, Any]] = []
        if self.scan.error:
            self.failed = True
            return used, out
        if self.name is None:
            name = self.given_name if self.given_name is not None else self._member_name()
            if name is not None:
                self.name = name
                out.append(self._delta({"id": self.id, "type": "function", "function": {"name": name, "arguments": ""}}))
        if self.name is not None:
            out += self._arguments()
        elif self.scan.done:
            self.failed = True  # closed without a usable name
        return used, out

    def _member_name(self) -> Optional[str]:
        try:
            name = self.scan.value("name")
        except json.JSONDecodeError:
            return None
        return name if isinstance(name, str) and name else None

    def _arg_key(self) -> Optional[str]:
        for key in self.arg_keys:
            if key in self.scan.members or self.scan.open_key == key:
                return key
        return None

    def _arguments(self) -> list[dict[str, Any]]:
        if self.given_name is not None:
            raw: Optional[str] = self.scan.text
        else:
            key = self._arg_key()
            raw = self.scan.raw_prefix(key) if key else None
            if raw is not None and not raw.startswith("{"):
                raw = None  # a string-encoded or invalid value: judged when the call closes
        out = []
        if raw is not None and len(raw) > self.sent:
            out.append(self._delta({"function": {"arguments": raw[self.sent :]}}))
            self.sent = len(raw)
            self.arguments = raw
        if self.scan.done:
            out += self._close()
        return out

    def _close(self) -> list[dict[str, Any]]:
        """Check the closed object; send arguments that could not stream."""
        try:
            obj = json.loads(self.scan.text)
        except json.JSONDecodeError:
            obj = None
        final = self._final_arguments(obj) if isinstance(obj, dict) else None
        if final is None or (self.sent and final != self.arguments):
            self.failed = True
            return []
        if self.sent:
            return []
        self.arguments, self.sent = final, len(final)
        return [self._delta({"function": {"arguments": final}})]

    def _final_arguments(self, obj: dict[str, Any]) -> Optional[str]:
        if self.given_name is not None:
            return self.scan.text
        key = self._arg_key()
        value = obj.get(key) if key else {}
        if isinstance(value, dict):
            return self.arguments if self.sent else json.dumps(value, ensure_ascii=False)
        if isinstance(value, str):
            try:
                return value if isinstance(json.loads(value), dict) else None
            except json.JSONDecodeError:
                return None
        return None

    def _delta(self, call: dict[str, Any]) -> dict[str, Any]:
        return {"tool_calls": [{"index": self.index, **call}]}


def assemble(deltas: list[dict[str, Any]]) -> tuple[Optional[str], list[ToolCall]]:
    """Content and calls from a run of deltas (what a client streaming them would have)."""
    content: list[str] = []
    calls: dict[int, dict[str, str]] = {}
    for d in deltas:
        content.append(d.get("content") or "")
        for tc in d.get("tool_calls", ()):
            entry = calls.setdefault(tc["index"], {"id": "", "name": "", "arguments": ""})
            entry["id"] = tc.get("id", entry["id"])
            fn = tc.get("function", {})
            entry["name"] += fn.get("name", "")
            entry["arguments"] += fn.get("arguments", "")
    text = "".join(content)
    return (text or None), [ToolCall(**calls[i]) for i in sorted(calls)]


def _partial_suffix(text: str, marker: str) -> int:
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

    def __init__(self, eager: bool = True) -> None:
        self.eager = eager
        self.buf = ""
        self.mode = self.start_mode
        self.final = False
        self.out: list[dict[str, Any]] = []
        self.pending: list[dict[str, Any]] = []
        self.call: Optional[CallStream] = None
        self.raw = ""  # the call region read so far, restored as content if it proves malformed
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
            text = text.lstrip(_WS)
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
            head = self.buf[:k].rstrip(_WS)
            self._content(head)
            self.raw = self.buf[len(head) : k + len(marker)]
            self.buf = self.buf[k + len(marker) :]
            return True
        if self.final:
            self._content(self.buf)
            self.buf = ""
            return False
        body = self.buf[: len(self.buf) - _partial_suffix(self.buf, marker)]
        head = body.rstrip(_WS)
        self._content(head)
        self.buf = self.buf[len(head) :]
        return False

    def _skip_ws(self) -> bool:
        rest = self.buf.lstrip(_WS)
        self.raw += self.buf[: len(self.buf) - len(rest)]
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
        self.raw += self.buf[:used]
        self.buf = self.buf[used:]
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
        self.pending, self.call, self.raw = [], None, ""
        self.count += 1
        self.after_call = True
        self.mode = then

    def _revert(self) -> None:
        self.pending, self.call = [], None
        raw, self.raw = self.raw, ""
        self._content(raw)
        self.mode = self.revert_mode
