"""Logprobs as OpenAI answers carry them, shaped as vLLM's OpenAI server shapes them.

- Completions' ``logprobs``: parallel lists ``tokens``, ``token_logprobs``,
  ``top_logprobs`` (per token: the token itself, then the top alternatives, by text)
  and ``text_offset``. With echo and logprobs they start with the prompt's tokens; the
  prompt's first token has no context, so its logprob and top are null
  (lm-evaluation-harness's ``local-completions`` reads loglikelihoods from this).
- Chat's ``logprobs.content``: per token ``{token, logprob, bytes, top_logprobs}``.
- ``prompt_logprobs`` (vLLM's own field): null for the prompt's first token, then per
  position ``{token_id: {logprob, rank, decoded_token}}``, the prompt's token first,
  then the top alternatives (rank 1 is the most likely).

JSON has no infinity: a logprob of ``-inf`` is written as -9999.0, as vLLM writes it.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

from kvroute.replica.outputs import TokenLogprob

FLOOR = -9999.0

# (token id, its logprob record): the prompt's first token has no record.
Entry = tuple[int, Optional[TokenLogprob]]


class TokenText:
    """One token's text, decoded once (logprobs name every token they report)."""

    def __init__(self, tokenizer: Any, max_cached: int = 1_000_000) -> None:
        self.tokenizer = tokenizer
        self.max_cached = max_cached
        self._text: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        text = self._text.get(token_id)
        if text is None:
            text = self.tokenizer.decode([token_id])
            if len(self._text) < self.max_cached:
                self._text[token_id] = text
        return text


def token_id_text(token_id: int) -> str:
    """vLLM's ``return_tokens_as_token_ids``: a token named by its id, whatever its text
    (a byte-fallback token decodes to no valid text on its own)."""
    return f"token_id:{token_id}"


def finite(logprob: float) -> float:
    return max(logprob, FLOOR)


def generated_entries(lps: Optional[Sequence[TokenLogprob]]) -> list[Entry]:
    return [(lp.token_id, lp) for lp in lps or ()]


def prompt_entries(prompt_ids: Sequence[int], lps: Optional[Sequence[Optional[TokenLogprob]]]) -> list[Entry]:
    """The prompt's tokens with their records (the engine sends one per prompt token,
    None first; a choice that ended before its first token has none)."""
    lps = lps or ()
    return [(t, lps[i] if i < len(lps) else None) for i, t in enumerate(prompt_ids)]


def completion_logprobs(entries: Sequence[Entry], start_offset: int, text_of: TokenText) -> dict[str, Any]:
    """Completions' ``logprobs`` object for ``entries``; ``text_offset`` counts from
    ``start_offset`` by each token's text."""
    tokens: list[str] = []
    token_lps: list[Optional[float]] = []
    tops: list[Optional[dict[str, float]]] = []
    offsets: list[int] = []
    offset = start_offset
    for token_id, lp in entries:
        s = text_of(token_id)
        tokens.append(s)
        offsets.append(offset)
        offset += len(s)
        if lp is None:
            token_lps.append(None)
            tops.append(None)
            continue
        token_lps.append(finite(lp.logprob))
        top = {s: finite(lp.logprob)}  # the token itself comes first, then the top alternatives
        for tid, v in lp.top.items():
            top.setdefault(text_of(tid), finite(v))
        tops.append(top)
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}


def chat_logprobs(lps: Sequence[TokenLogprob], text_of: TokenText) -> list[dict[str, Any]]:
    """Chat's ``logprobs.content`` list."""
    out = []
    for lp in lps:
        s = text_of(lp.token_id)
        out.append(
            {
                "token": s,
                "logprob": finite(lp.logprob),
                "bytes": list(s.encode("utf-8")),
                "top_logprobs": [
                    {"token": (t := text_of(tid)), "logprob": finite(v), "bytes": list(t.encode("utf-8"))}
                    for tid, v in lp.top.items()
                ],
            }
        )
    return out


def prompt_logprobs(
    prompt_ids: Sequence[int], lps: Optional[Sequence[Optional[TokenLogprob]]], text_of: TokenText
) -> list[Optional[dict[int, dict[str, Any]]]]:
    """vLLM's ``prompt_logprobs`` list for one prompt. A prompt token's rank is the
    engine's; where the engine gave none, its place among the top alternatives (null
    when it is not among them)."""
    out: list[Optional[dict[int, dict[str, Any]]]] = []
    for token_id, lp in prompt_entries(prompt_ids, lps):
        if lp is None:
            out.append(None)
            continue
        ranked = {tid: (rank, v) for rank, (tid, v) in enumerate(lp.top.items(), 1)}
        rank = lp.rank if lp.rank is not None else ranked[token_id][0] if token_id in ranked else None
        position = {token_id: _vllm_logprob(lp.logprob, rank, text_of(token_id))}
        for tid, (r, v) in ranked.items():
            position.setdefault(tid, _vllm_logprob(v, r, text_of(tid)))
        out.append(position)
    return out


def _vllm_logprob(logprob: float, rank: Optional[int], text: str) -> dict[str, Any]:
    return {"logprob": finite(logprob), "rank": rank, "decoded_token": text}
