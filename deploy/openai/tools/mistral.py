"""The ``mistral`` tool-call format: content, then ``[TOOL_CALLS][{"name": ...,
"arguments": {...}}, ...]`` or the newer ``[TOOL_CALLS]name[ARGS]{...}``. Its ids are 9
letters and digits (Mistral's templates reject others), and ``[TOOL_CALLS]`` is a
special token, so the engine must keep special tokens in the text
(``needs_special_tokens``)."""

from __future__ import annotations

import re
from typing import Optional

from kvroute.deploy.openai.tools.call_json import WS
from kvroute.deploy.openai.tools.stream import StreamParser

_NAME_RUN = re.compile(r"[A-Za-z0-9_-]*")


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
