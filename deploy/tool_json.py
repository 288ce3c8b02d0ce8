"""The incremental machinery every tool-call format shares.

``ObjectScanner`` follows one JSON object as its text arrives, knowing at any moment
which top-level members are complete and where the open one's value started, so a
call's arguments can be streamed as they are written. ``CallStream`` turns one call
object into OpenAI's tool-call deltas (the header with id and name first, then
argument fragments). ``assemble`` folds deltas back into content and calls, as a
client receiving them would. The format parsers build on ``StreamParser``
(tool_stream.py).
"""

from __future__ import annotations

import json
from typing import Any, Optional

from kvroute.deploy.tool_calls import ToolCall, new_call_id

WS = " \t\r\n"


class ObjectScanner:
    """Follows one JSON object from its ``{``: brackets and strings for structure, the
    top-level members' raw spans; ``json.loads`` judges the whole once it closes."""

    def __init__(self) -> None:
        self.parts: list[str] = []  # the text so far, in the pieces it came in (no quadratic copying)
        self.size = 0
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
        base = self.size
        self.parts.append(chunk)
        self.size += len(chunk)
        for n, ch in enumerate(chunk):
            self._step(ch, base + n)
            if self.done or self.error:
                self.parts[-1] = chunk[: n + 1]
                self.size = base + n + 1
                return n + 1
        return len(chunk)

    @property
    def text(self) -> str:
        """All of it (joined once, then kept joined)."""
        if len(self.parts) > 1:
            self.parts = ["".join(self.parts)]
        return self.parts[0] if self.parts else ""

    def tail(self, start: int, end: Optional[int] = None) -> str:
        """``text[start:end]``, read from the newest pieces back."""
        pieces, at = [], self.size
        for part in reversed(self.parts):
            if at <= start:
                break
            pieces.append(part)
            at -= len(part)
        joined = "".join(reversed(pieces))
        return joined[start - at : (None if end is None else end - at)]

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
                        self.open_key = json.loads(self.tail(self.key_start, i + 1))
                    except json.JSONDecodeError:
                        self.error = True
                    self.phase = "colon"
                elif self.depth == 1 and self.phase == "value":
                    self._close_member(i + 1)
            return
        if self.depth > 1:
            self._nested(ch, i)
        elif self.phase == "scalar" and (ch in WS or ch in ",}"):
            self._close_member(i)
            if ch not in WS:
                self._top(ch, i)
        elif ch not in WS:
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
            self.value_start = -1  # until the value's first character
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
        return None if span is None else json.loads(self.tail(*span))

    def start_of(self, key: str) -> Optional[int]:
        """Where the member's value begins (None before it does)."""
        span = self.members.get(key)
        if span is not None:
            return span[0]
        if self.open_key == key and self.phase in ("value", "scalar") and self.value_start >= 0:
            return self.value_start
        return None

    def member_from(self, key: str, offset: int) -> Optional[str]:
        """The member's raw text from ``offset`` characters into its value, as far as it
        has come (to its end once complete); None before it starts."""
        span = self.members.get(key)
        if span is not None:
            return self.tail(span[0] + offset, span[1])
        if self.open_key == key and self.phase in ("value", "scalar") and self.value_start >= 0:
            return self.tail(self.value_start + offset)
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
        self.objects: dict[str, bool] = {}  # whether a member's value is an object

    @property
    def done(self) -> bool:
        return self.scan.done and not self.failed

    def feed(self, text: str) -> tuple[int, list[dict[str, Any]]]:
        used = self.scan.feed(text)
        out: list[dict[str, Any]] = []
        if self.scan.error:
            self.failed = True
            return used, out
        fresh = False
        if self.name is None:
            name = self.given_name if self.given_name is not None else self._member_name()
            fresh = name is not None and self._header_due()
        if fresh:
            self.name = name
            out.append(self._delta({"id": self.id, "type": "function", "function": {"name": name, "arguments": ""}}))
        if self.name is not None:
            out += self._arguments()
        elif self.scan.done:
            self.failed = True  # closed without a usable name
        if self.failed and fresh:
            self.name, out = None, []  # nothing of it was sent
        return used, out

    def _header_due(self) -> bool:
        """Send the header once the call is bound to stand: the arguments have begun as
        an object (what follows can only break the JSON), or the object closed."""
        if self.given_name is not None or self.scan.done:
            return True
        key = self._arg_key()
        return key is not None and self._is_object(key)

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

    def _is_object(self, key: str) -> bool:
        if key not in self.objects:  # decided by the value's first character, once
            start = self.scan.start_of(key)
            if start is None:
                return False
            self.objects[key] = self.scan.tail(start, start + 1) == "{"
        return self.objects[key]

    def _arguments(self) -> list[dict[str, Any]]:
        if self.given_name is not None:
            new: Optional[str] = self.scan.tail(self.sent)
        else:
            key = self._arg_key()
            # a string-encoded or invalid value cannot stream: it is judged when the call closes
            new = self.scan.member_from(key, self.sent) if key and self._is_object(key) else None
        out = []
        if new:
            out.append(self._delta({"function": {"arguments": new}}))
            self.sent += len(new)
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
        if final is None:
            self.failed = True
            return []
        self.arguments = final
        if self.sent:
            return []  # it streamed whole
        self.sent = len(final)
        return [self._delta({"function": {"arguments": final}})]

    def _final_arguments(self, obj: dict[str, Any]) -> Optional[str]:
        if self.given_name is not None:
            return self.scan.text
        key = self._arg_key()
        value = obj.get(key) if key else {}
        if isinstance(value, dict):
            return self.scan.tail(*self.scan.members[key]) if key else "{}"
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
