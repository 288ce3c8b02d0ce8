"""The ``llama3_json`` tool-call format (Llama 3.1-3.3): the output is ``{"name": ...,
"parameters": {...}}`` objects separated by ``;``, optionally after ``<|python_tag|>``;
any other output is content."""

from __future__ import annotations

from kvroute.deploy.openai.tools.call_json import WS
from kvroute.deploy.openai.tools.stream import StreamParser

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
