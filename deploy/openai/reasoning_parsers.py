"""Reasoning parsers: a reasoning model's output split into its reasoning (the text
between ``<think>`` and ``</think>``) and its content (the rest), as vLLM's
``--reasoning-parser`` chooses them.

They work on text, not token ids, so they read a tokenizer whose markers are single
(added) tokens, as Qwen3's and DeepSeek-R1's are, and one that spells them in several
tokens alike. Each parser reads a whole output (``split``) and a stream of text deltas
(``ReasoningStream``), and the two agree: whatever the chunking, the streamed pieces
join to the whole split.

- ``qwen3``: reasoning only when the output starts with ``<think>`` (Qwen3 with
  ``enable_thinking`` false writes none, and its template puts an empty think block in
  the prompt instead). An output that opens ``<think>`` but never closes it (cut off by
  ``max_tokens``) is all reasoning, as vLLM's qwen3 parser reads it.
- ``deepseek_r1``: the output may begin already inside the reasoning (DeepSeek-R1's
  template opens ``<think>`` in the prompt), so everything up to ``</think>`` is
  reasoning; a leading ``<think>`` the model writes itself is dropped.

Neither strips the whitespace around the markers (vLLM keeps it too): Qwen3's content
typically starts with the ``"\\n\\n"`` after ``</think>``.
"""

from __future__ import annotations

from typing import Optional

from kvroute.deploy.openai.tools.stream import partial_suffix

THINK_START = "<think>"
THINK_END = "</think>"


class ReasoningParser:
    """One reasoning format. ``opens_in_prompt``: the output may start inside the
    reasoning without writing ``<think>`` (deepseek_r1); else reasoning needs the output
    to start with it (qwen3)."""

    name = ""
    start = THINK_START
    end = THINK_END
    opens_in_prompt = False

    @classmethod
    def split(cls, text: str) -> tuple[Optional[str], str]:
        """A whole output as ``(reasoning, content)``; reasoning is None when the output
        has no reasoning section, content "" when nothing follows it."""
        if text.startswith(cls.start):
            rest = text[len(cls.start) :]
        elif cls.opens_in_prompt:
            rest = text
        else:
            return None, text
        reasoning, marker, content = rest.partition(cls.end)
        return reasoning, content if marker else ""


class Qwen3ReasoningParser(ReasoningParser):
    name = "qwen3"


class DeepSeekR1ReasoningParser(ReasoningParser):
    name = "deepseek_r1"
    opens_in_prompt = True


REASONING_PARSERS: dict[str, type[ReasoningParser]] = {p.name: p for p in (Qwen3ReasoningParser, DeepSeekR1ReasoningParser)}


def get_reasoning_parser(name: str) -> type[ReasoningParser]:
    """The parser ``--reasoning-parser NAME`` selects (ValueError naming the choices)."""
    try:
        return REASONING_PARSERS[name]
    except KeyError:
        raise ValueError(f"--reasoning-parser: unknown parser {name!r}; choose one of {sorted(REASONING_PARSERS)}") from None


class ReasoningStream:
    """One choice's text deltas in, ``(reasoning, content)`` pieces out, each sent as
    soon as it is known: text that could still begin a marker is held back until the
    next delta (or ``finish``) settles it. ``stream_reasoning`` false (SGLang's) holds
    the reasoning back until it ends, then sends it in one piece."""

    def __init__(self, parser: type[ReasoningParser], stream_reasoning: bool = True) -> None:
        self.parser = parser
        self.stream_reasoning = stream_reasoning
        self.mode = "start"  # start: is the output opening <think>?; then reasoning, then content
        self.buf = ""
        self.held_reasoning = ""  # stream_reasoning false: the reasoning so far

    def feed(self, text: str, final: bool = False) -> tuple[str, str]:
        """The reasoning and content this delta settles (``final``: the output ends here)."""
        self.buf += text
        reasoning = content = ""
        if self.mode == "start":
            start = self.parser.start
            if self.buf.startswith(start):
                self.buf = self.buf[len(start) :]
                self.mode = "reasoning"
            elif start.startswith(self.buf) and not final:
                return "", ""  # may still become <think>
            else:
                self.mode = "reasoning" if self.parser.opens_in_prompt else "content"
        if self.mode == "reasoning":
            k = self.buf.find(self.parser.end)
            if k >= 0:
                reasoning, self.buf = self.buf[:k], self.buf[k + len(self.parser.end) :]
                self.mode = "content"
            else:
                keep = 0 if final else partial_suffix(self.buf, self.parser.end)  # held back
                reasoning, self.buf = self.buf[: len(self.buf) - keep], self.buf[len(self.buf) - keep :]
            if not self.stream_reasoning:
                self.held_reasoning += reasoning
                reasoning = ""
                if self.mode == "content" or final:
                    reasoning, self.held_reasoning = self.held_reasoning, ""
        if self.mode == "content":
            content, self.buf = self.buf, ""
        return reasoning, content

    def finish(self) -> tuple[str, str]:
        """Everything held back, at the end of the output."""
        return self.feed("", final=True)
