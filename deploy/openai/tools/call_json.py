"""The incremental machinery every tool-call format shares.

``CallStream`` follows one call object as its text arrives and turns it into OpenAI's
tool-call deltas (the header with id and name first, then argument fragments). Its
meaning is read by jiter, pydantic's JSON parser, in its partial mode (as vLLM reads calls
with partial-json-parser): a prefix of a JSON object parses into the members complete so
far, strings cut short included. Only where the object ends is found by hand, with a
bracket and string counter (``Brackets``), so the text after it stays with the format.
Arguments stream as the serialization of what has parsed, holding back what may still
change (an open string's closing quote, a number's last digits, closing brackets), so
the fragments always join into the final ``arguments``. ``assemble`` folds deltas back
into content and calls, as a client receiving them would.
"""

from __future__ import annotations

import json
from typing import Any, Optional

import jiter

from kvroute.deploy.openai.tools.calls import ToolCall, new_call_id

WS = " \t\r\n"
_NUMBER_TAIL = "+-.eE0123456789"
# Small objects are parsed again on every delta; past this size, once they have grown by
# an eighth, so a long argument costs linear time (its fragments come in larger pieces).
_REPARSE_ALWAYS = 4096


class Brackets:
    """Where a JSON value that starts with ``{`` ends: nesting depth and string state,
    nothing else (the value's meaning is jiter's)."""

    def __init__(self) -> None:
        self.depth = 0
        self.in_str = False
        self.escape = False

    def feed(self, chunk: str) -> tuple[Optional[int], str]:
        """The offset in ``chunk`` just past the closing bracket (None while open), and the
        chunk up to there with control characters inside strings escaped: a grammar's
        string rule may let a model write them raw, which strict JSON refuses."""
        raw: list[int] = []  # where a raw control character sits inside a string
        end: Optional[int] = None
        for i, ch in enumerate(chunk):
            if self.in_str:
                if self.escape:
                    self.escape = False
                elif ch == "\\":
                    self.escape = True
                elif ch == '"':
                    self.in_str = False
                elif ch < " ":
                    raw.append(i)
            elif ch == '"':
                self.in_str = True
            elif ch in "{[":
                self.depth += 1
            elif ch in "}]":
                self.depth -= 1
                if self.depth == 0:
                    end = i + 1
                    break
        text = chunk if end is None else chunk[:end]
        for i in reversed(raw):
            text = f"{text[:i]}\\u{ord(text[i]):04x}{text[i + 1:]}"
        return end, text


def _parse(text: str, partial: bool) -> Any:
    """jiter's reading of ``text`` (a prefix of it when ``partial``); ValueError when it is
    no JSON (NaN and infinities included) or nests too deep."""
    return jiter.from_json(text.encode(), partial_mode="trailing-strings" if partial else False, allow_inf_nan=False)


def _dumps(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)


class CallStream:
    """One tool call's deltas. The name comes from the object's ``name`` member, or is
    given (then the whole object is the arguments: a forced function's output, Mistral's
    ``name[ARGS]{...}``). Arguments stream while their value is an object; a
    string-encoded value is sent whole when the call closes."""

    def __init__(self, index: int, id_style: str, arg_keys: tuple[str, ...] = ("arguments", "parameters"),
                 name: Optional[str] = None) -> None:  # fmt: skip
        self.index = index
        self.id = new_call_id(id_style)
        self.arg_keys = arg_keys
        self.given_name = name
        self.name: Optional[str] = None
        self.brackets = Brackets()
        self.parts: list[str] = []  # the object's text in the pieces it came in
        self.size = 0
        self.parsed_at = -1  # the size at the last partial parse
        self.closed = False
        self.failed = False
        self.sent = ""  # the arguments sent so far
        self.arguments = ""

    @property
    def done(self) -> bool:
        return self.closed and not self.failed

    def text(self) -> str:
        if len(self.parts) > 1:
            self.parts = ["".join(self.parts)]
        return self.parts[0] if self.parts else ""

    def feed(self, chunk: str) -> tuple[int, list[dict[str, Any]]]:
        """Read ``chunk`` up to the object's end; returns how much of it was used and
        the deltas now known good."""
        end, text = self.brackets.feed(chunk)
        used = len(chunk) if end is None else end
        self.parts.append(text)
        self.size += len(text)
        if end is not None:
            self.closed = True
            return used, self._close()
        if not self._due():
            return used, []
        self.parsed_at = self.size
        try:
            obj = _parse(self.text(), partial=True)
        except ValueError:
            self.failed = True
            return used, []
        return used, self._progress(obj) if isinstance(obj, dict) else []

    def _due(self) -> bool:
        grown = self.size - self.parsed_at
        return grown > 0 and (self.size <= _REPARSE_ALWAYS or self.name is None or grown * 8 >= self.size)

    def _args_of(self, obj: dict[str, Any]) -> tuple[Optional[str], Any]:
        if self.given_name is not None:
            return None, obj
        for key in self.arg_keys:
            if key in obj:
                return key, obj[key]
        return None, None

    def _progress(self, obj: dict[str, Any]) -> list[dict[str, Any]]:
        """The header once the call is bound to stand (named, its arguments begun as an
        object: what follows can only break the JSON), then the arguments' stable part."""
        out: list[dict[str, Any]] = []
        _, args = self._args_of(obj)
        if self.name is None:
            name = self.given_name if self.given_name is not None else self._complete_name(obj)
            if name is None or not isinstance(args, dict):
                return out
            self.name = name
            out.append(self._delta({"id": self.id, "type": "function", "function": {"name": name, "arguments": ""}}))
        if isinstance(args, dict):
            out += self._send(self._stable(_dumps(args)))
        return out

    def _complete_name(self, obj: dict[str, Any]) -> Optional[str]:
        """The ``name`` member once its string has closed (a partial parse shows it cut)."""
        name = obj.get("name")
        if not isinstance(name, str) or not name:
            return None
        if self.brackets.in_str and obj and next(reversed(obj)) == "name":
            return None  # the open string may be the name itself
        return name

    def _stable(self, serialized: str) -> str:
        """What of ``serialized`` (the arguments parsed so far) no later text can change."""
        stable = serialized.rstrip("]}")
        if self.brackets.in_str:
            stable = stable[:-1] if stable.endswith('"') else stable
        elif self.text().rstrip(WS)[-1:] in tuple(_NUMBER_TAIL):
            stable = stable.rstrip(_NUMBER_TAIL)
        return stable

    def _send(self, upto: str) -> list[dict[str, Any]]:
        if len(upto) <= len(self.sent) or not upto.startswith(self.sent):
            return []
        new, self.sent = upto[len(self.sent) :], upto
        return [self._delta({"function": {"arguments": new}})]

    def _close(self) -> list[dict[str, Any]]:
        """Check the closed object; send the rest of its arguments, header first if due."""
        try:
            obj = _parse(self.text(), partial=False)
        except ValueError:
            obj = None
        final = self._final_arguments(obj) if isinstance(obj, dict) else None
        name = self.given_name if self.given_name is not None else (obj or {}).get("name")
        if final is None or not isinstance(name, str) or not name or (self.name is not None and name != self.name):
            self.failed = True
            return []
        out: list[dict[str, Any]] = []
        if self.name is None:
            self.name = name
            out.append(self._delta({"id": self.id, "type": "function", "function": {"name": name, "arguments": ""}}))
        self.arguments = final
        if not final.startswith(self.sent):  # cannot happen for an object parsed as it grew
            self.failed = True
            return out
        return out + self._send(final)

    def _final_arguments(self, obj: dict[str, Any]) -> Optional[str]:
        key, value = self._args_of(obj)
        if key is None and self.given_name is None:
            return "{}"
        if isinstance(value, dict):
            return _dumps(value)
        if isinstance(value, str):
            try:
                return value if isinstance(json.loads(value), dict) else None
            except (ValueError, RecursionError):
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
