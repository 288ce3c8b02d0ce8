"""Incremental detokenization with stop strings: O(new tokens) per call.

Text comes from a sliding window over the token ids (vLLM's prefix_offset / read_offset
scheme): ``prefix_text`` is the decode of ``ids[prefix_offset:read_offset]``, a few tokens
already turned into text, and the new text is what decoding ``ids[prefix_offset:]`` adds
beyond it. The context makes a token's leading space (and, for SentencePiece-style
decoders, the stripped first space) come out as in a whole-sequence decode; the window is
seeded with the last prompt tokens so the first output token gets it right too.

A window decode that ends in U+FFFD ends in an incomplete (or invalid) UTF-8 sequence:
the text before that trailing run is final and is taken, the rest waits for more tokens
(or for :meth:`IncrementalDetokenizer.flush`). So a delta never ends in half a character.

Stop strings: text that could still be the start of a stop string (at most
``longest stop - 1`` characters) is held back; a stop string is looked for only where it
would end inside new text, and the first one to complete (earliest end; the longer one
where two end together) stops the request. As in vLLM, stop strings are only honoured
once more than ``min_tokens`` tokens were generated.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

from kvroute.replica.sampling_params import SamplingParams

# Prompt tokens decoded as context ahead of the first output token (vLLM uses 5 too).
PROMPT_CONTEXT_TOKENS = 5
_REPLACEMENT = "\ufffd"


def _decoder(tokenizer: Any, skip_special_tokens: bool) -> Callable[[list[int]], str]:
    """A ``ids -> text`` function without transformers' cleanup pass (not window-stable)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)  # tokenizers.Tokenizer: skip the Python wrapper
    if backend is not None:
        return lambda ids: backend.decode(ids, skip_special_tokens=skip_special_tokens)
    return lambda ids: tokenizer.decode(
        ids, skip_special_tokens=skip_special_tokens, clean_up_tokenization_spaces=False
    )


class IncrementalDetokenizer:
    """Turns one request's output tokens into text deltas, honouring stop strings.

    ``tokenizer`` is a Hugging Face fast tokenizer. Memory and time per call are
    O(new tokens + window), independent of the prompt and output lengths.
    """

    def __init__(self, tokenizer: Any, prompt_token_ids: Sequence[int], params: SamplingParams):
        self._decode = _decoder(tokenizer, params.skip_special_tokens)
        context = list(prompt_token_ids[max(0, len(prompt_token_ids) - PROMPT_CONTEXT_TOKENS) :])
        # Window state. The list holds ids from prefix_offset on (earlier ones are dropped),
        # so prefix_offset is always 0 and _read is read_offset relative to it.
        self._ids: list[int] = context
        self._read = len(context)
        self._prefix_text = self._decode(context) if context else ""
        # Characters past prefix_text already taken while the window ended in U+FFFD.
        self._taken = 0

        self._stops: tuple[str, ...] = params.stop
        self._max_stop = max((len(s) for s in self._stops), default=0)
        self._include_stop = params.include_stop_str_in_output
        self._min_tokens = params.min_tokens
        self._held = ""  # decoded, not yet emitted: could be the start of a stop string
        self._num_tokens = 0
        self._stop_str: str | None = None
        self._parts: list[str] = []  # emitted text, joined lazily

    # ------------------------------------------------------------------ public

    @property
    def output_text(self) -> str:
        """All text emitted so far (deltas returned by add_tokens and flush)."""
        if len(self._parts) > 1:
            self._parts = ["".join(self._parts)]
        return self._parts[0] if self._parts else ""

    @property
    def stop_str(self) -> str | None:
        """The stop string that ended the request, if one did."""
        return self._stop_str

    @property
    def num_tokens(self) -> int:
        """Output tokens added so far (those after a matched stop string are not counted)."""
        return self._num_tokens

    def add_tokens(self, token_ids: Sequence[int]) -> tuple[str, str | None]:
        """Append new output tokens; return (text delta to emit now, the stop string matched or None).

        After a stop string matches, the caller finishes the request: the emitted text
        never includes the stop string (unless ``include_stop_str_in_output``) nor anything
        after it, tokens after the matching one in the same call are ignored, and further
        calls are a ValueError.
        """
        if self._stop_str is not None:
            raise ValueError(f"request already stopped at stop string {self._stop_str!r}")
        out: list[str] = []
        for token_id in token_ids:
            self._ids.append(int(token_id))
            self._num_tokens += 1
            chunk = self._next_text()
            if not self._stops:
                out.append(chunk)
                continue
            buf = self._held + chunk
            if chunk and self._num_tokens > self._min_tokens:
                match = self._find_stop(buf, new_from=len(self._held))
                if match is not None:
                    start, stop = match
                    out.append(buf[:start] + (stop if self._include_stop else ""))
                    self._held = ""
                    self._stop_str = stop
                    break
            keep = self._stop_prefix_len(buf)
            out.append(buf[: len(buf) - keep])
            self._held = buf[len(buf) - keep :]
        text = "".join(out)
        if text:
            self._parts.append(text)
        return text, self._stop_str

    def flush(self) -> str:
        """On finish without a stop string (length / EOS): emit any held-back text.

        This includes a window that still ends in an incomplete character (shown as
        U+FFFD, as a whole-sequence decode shows it). Returns "" after a stop string.
        """
        if self._stop_str is not None:
            return ""
        text = self._decode(self._ids)
        start = len(self._prefix_text) + self._taken
        rest = text[start:]
        self._taken += len(rest)  # the window's text is all taken now
        out = self._held + rest
        self._held = ""
        if out:
            self._parts.append(out)
        return out

    # ------------------------------------------------------------------ internals

    def _next_text(self) -> str:
        """The final text the window gained with its newest id ("" while it must wait)."""
        text = self._decode(self._ids)  # the window: prefix_offset .. end
        if not text.startswith(self._prefix_text):
            # Only when the prompt context ended inside a character the first output bytes
            # complete: the completed character counts as output.
            self._prefix_text = text[: _common_prefix_len(text, self._prefix_text)]
            self._taken = 0
        start = len(self._prefix_text) + self._taken
        if text.endswith(_REPLACEMENT):
            end = len(text.rstrip(_REPLACEMENT))
            if end <= start:
                return ""
            self._taken += end - start
            return text[start:end]
        if len(text) <= len(self._prefix_text):
            return ""  # nothing visible yet (e.g. a skipped special token): keep the context
        # Slide: the old read_offset becomes prefix_offset, the end becomes read_offset.
        self._ids = self._ids[self._read :]
        self._read = len(self._ids)
        self._prefix_text = self._decode(self._ids)
        self._taken = 0
        return text[start:]

    def _find_stop(self, buf: str, new_from: int) -> tuple[int, str] | None:
        """The first stop string to complete inside ``buf[new_from:]``: (start index, stop)."""
        best: tuple[int, int, str] | None = None  # (end, -len, stop)
        for stop in self._stops:
            idx = buf.find(stop, max(0, new_from - len(stop) + 1))
            if idx >= 0:
                cand = (idx + len(stop), -len(stop), stop)
                if best is None or cand < best:
                    best = cand
        if best is None:
            return None
        end, neg_len, stop = best
        return end + neg_len, stop

    def _stop_prefix_len(self, buf: str) -> int:
        """Length of the longest suffix of ``buf`` that is a proper prefix of a stop string."""
        for k in range(min(len(buf), self._max_stop - 1), 0, -1):
            suffix = buf[-k:]
            if any(len(s) > k and s.startswith(suffix) for s in self._stops):
                return k
        return 0


def _common_prefix_len(a: str, b: str) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i
