"""The ``hermes`` tool-call format (Qwen2.5, Qwen3, Hermes 2/3 and our ``chatml_tools``
template): content, then ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``
blocks; a missing closing tag is tolerated."""

from __future__ import annotations

from kvroute.deploy.openai.tools.call_json import WS
from kvroute.deploy.openai.tools.stream import StreamParser

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
