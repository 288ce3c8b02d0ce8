"""Reasoning parsers: a reasoning model's output split into its reasoning (the text
between ``<think>`` and ``</think>``) and its content (the rest), as vLLM 0.32's
``--reasoning-parser`` reads it.

They work on text, not token ids, so they read a tokenizer whose markers are single
(added) tokens, as Qwen3's and DeepSeek-R1's are, and one that spells them in several
tokens alike. Each parser reads a whole output (``split``) and a stream of text deltas
(``ReasoningStream``), and the two agree: whatever the chunking, the streamed pieces
join to the whole split.

- ``qwen3`` (vLLM 0.32's qwen3 parser engine): the output starts inside the reasoning,
  whether the model writes ``<think>`` first (Qwen3) or the template opened it
  (Qwen3-2507's thinking models); reasoning runs to the first ``</think>``. A
  ``<think>`` inside the reasoning and a ``</think>`` inside the content are dropped,
  and an empty reasoning is none. An output that never closes it (cut off by
  ``max_tokens``) is all reasoning. Qwen3 with ``enable_thinking`` false writes none:
  its template closes an empty think block in the prompt, which ends the reasoning
  there (``deploy/openai/reasoning.py``).
- ``deepseek_r1``: the output may begin already inside the reasoning (DeepSeek-R1's
  template opens ``<think>`` in the prompt), so everything up to the first
  ``</think>`` is reasoning; a leading ``<think>`` the model writes itself is dropped,
  any other marker is kept as text. (vLLM's whole answer also drops everything before
  a ``<think>`` written later in the output, which its own stream does not: the two
  cannot agree on such an output, so it is not followed here.)

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
    reasoning without writing ``<think>``. ``drops_markers``: a ``<think>`` within the
    reasoning and a ``</think>`` within the content are dropped, and an empty reasoning
    is none (qwen3). ``turn_markers``: tokens that start or end a chat turn; the
    prompt's reasoning state is read after the last of them (qwen3's ChatML)."""

    name = ""
    start = THINK_START
    end = THINK_END
    opens_in_prompt = False
    drops_markers = False
    turn_markers: tuple[str, ...] = ()

    @classmethod
    def split(cls, text: str) -> tuple[Optional[str], str]:
        """A whole output as ``(reasoning, content)``; reasoning is None when the output
        has no reasoning section, content "" when nothing follows it."""
        if cls.drops_markers:
            reasoning, _, content = text.partition(cls.end)
            return reasoning.replace(cls.start, "") or None, content.replace(cls.end, "")
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
    opens_in_prompt = True
    drops_markers = True
    turn_markers = ("<|im_start|>", "<|im_end|>")


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
        # start: is the output opening <think>?; then reasoning, then content
        self.mode = "reasoning" if parser.drops_markers else "start"
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
            reasoning = self._reasoning(final)
            if not self.stream_reasoning:
                self.held_reasoning += reasoning
                reasoning = ""
                if self.mode == "content" or final:
                    reasoning, self.held_reasoning = self.held_reasoning, ""
        if self.mode == "content":
            content = self._content(final)
        return reasoning, content

    def _reasoning(self, final: bool) -> str:
        """The reasoning the buffer settles; switches to content at ``</think>``."""
        p, out = self.parser, ""
        while True:
            k = self.buf.find(p.end)
            s = self.buf.find(p.start) if p.drops_markers else -1
            if 0 <= s and (k < 0 or s < k):  # a <think> inside the reasoning: dropped
                out, self.buf = out + self.buf[:s], self.buf[s + len(p.start) :]
                continue
            if k >= 0:
                self.mode = "content"
                out, self.buf = out + self.buf[:k], self.buf[k + len(p.end) :]
                return out
            keep = 0 if final else max(partial_suffix(self.buf, p.end),
                                       partial_suffix(self.buf, p.start) if p.drops_markers else 0)  # fmt: skip
            out, self.buf = out + self.buf[: len(self.buf) - keep], self.buf[len(self.buf) - keep :]
            return out

    def _content(self, final: bool) -> str:
        """The content the buffer settles (less any ``</think>``, where dropped)."""
        if not self.parser.drops_markers:
            out, self.buf = self.buf, ""
            return out
        end, out = self.parser.end, ""
        while (k := self.buf.find(end)) >= 0:
            out, self.buf = out + self.buf[:k], self.buf[k + len(end) :]
        keep = 0 if final else partial_suffix(self.buf, end)
        out, self.buf = out + self.buf[: len(self.buf) - keep], self.buf[len(self.buf) - keep :]
        return out

    def finish(self) -> tuple[str, str]:
        """Everything held back, at the end of the output."""
        return self.feed("", final=True)
