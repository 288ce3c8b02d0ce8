"""Logits constraints: one mechanism for structured outputs (a grammar), ``allowed_token_ids``,
``bad_words`` and ``logit_bias``.

Each constrained request carries a :class:`RequestConstraints`. Every step the engine
builds one :class:`StepMask` for the rows it samples: an int32 bitmask ``[rows, vocab/32]``
(all ones, then each row's grammar matcher fills its row, ``allowed_token_ids`` and the
tokenizer's real vocabulary are ANDed in, the last token of each matching bad word is
cleared) and the sparse ``logit_bias`` entries. The sampler applies it to the logits
before anything else (``StepMask.apply``); logprobs stay those of the raw logits.

A grammar is compiled off the step loop (``structured_output.GrammarCache``): the request
waits in the queue until its compile is done (the scheduler skips it; the rest of the
batch runs), then its matcher is made and replays the output tokens it already has (a
request resumed from another replica). The matcher lives on the request, so preemption
and recompute keep its state: tokens are accepted once, when sampled.

A grammar may start late (``SamplingParams.structured_output_after``, a reasoning model's
``</think>``): until the output holds that token sequence the matcher neither fills its
row nor takes tokens; the token that completes the sequence turns it on, and the next
token is the grammar's first. A replay starts the matcher after the sequence too.
"""

from __future__ import annotations

import logging
import threading
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Any, Sequence

import torch

from kvroute.kernels import ops
from kvroute.kernels.token_bitmask import apply_token_bitmask_reference_, apply_token_bitmask_triton_, bitmask_words
from kvroute.replica.sampling_params import SamplingParams

log = logging.getLogger(__name__)


def _bits(ids: Sequence[int], vocab: int) -> torch.Tensor:
    """int32 bitmask row with the bits of ``ids`` set."""
    bools = torch.zeros(bitmask_words(vocab) * 32, dtype=torch.bool)
    bools[list(ids)] = True
    weights = torch.tensor([1 << i for i in range(31)] + [-(1 << 31)], dtype=torch.int64)
    return (bools.view(-1, 32).long() * weights).sum(dim=1).to(torch.int32)


def bad_words_token_ids(tokenizer: Any, words: Sequence[str]) -> list[tuple[int, ...]]:
    """Token sequences of each bad word, as vLLM tokenizes them: the word without leading
    whitespace, and with one leading space when that gives another first token and as
    many tokens (the same word inside a sentence)."""
    out: list[tuple[int, ...]] = []
    for word in words:
        plain = tuple(tokenizer.encode(word.lstrip(), add_special_tokens=False))
        spaced = tuple(tokenizer.encode(" " + word.lstrip(), add_special_tokens=False))
        if plain:
            out.append(plain)
        if spaced and (not plain or (spaced[0] != plain[0] and len(spaced) == len(plain))):
            out.append(spaced)
    return out


class RequestConstraints:
    """One request's constraints and, with a grammar, its matcher (made by :meth:`start`)."""

    def __init__(self, params: SamplingParams, grammar: Future | None, allowed: torch.Tensor | None,
                 bad_words: list[tuple[int, ...]]) -> None:  # fmt: skip
        self.params = params
        self.grammar = grammar  # future of the compiled grammar (None: no grammar)
        self.matcher: Any = None
        self.allowed = allowed  # int32 bitmask row of allowed_token_ids (None: all)
        self.bad_words = bad_words
        self.bias = tuple(params.logit_bias)
        self.after = params.structured_output_after
        self.grammar_on = not self.after  # False until the output holds ``after``

    def _turns_on(self, output: Sequence[int]) -> bool:
        """Whether ``output`` ends with the sequence the grammar starts after."""
        n = len(self.after)
        return len(output) >= n and tuple(output[len(output) - n :]) == self.after

    @property
    def ready(self) -> bool:
        """False while the request's grammar is compiling (the scheduler leaves it waiting)."""
        return self.grammar is None or self.matcher is not None

    @property
    def masks(self) -> bool:
        return self.grammar is not None or self.allowed is not None or bool(self.bad_words)

    def start(self, output_token_ids: Sequence[int]) -> str | None:
        """Make the matcher once the compile is done and replay the tokens generated so far;
        the reason when the compile failed or a token does not fit the grammar, else None."""
        import xgrammar as xgr

        try:
            compiled = self.grammar.result()  # type: ignore[union-attr]
        except ValueError as e:
            return str(e)
        self.matcher = xgr.GrammarMatcher(compiled)
        first = 0
        if self.after:  # the grammar takes the tokens after the sequence, if it came yet
            self.grammar_on = False
            for i in range(len(output_token_ids)):
                if self._turns_on(output_token_ids[: i + 1]):
                    self.grammar_on, first = True, i + 1
                    break
        for i, t in enumerate(output_token_ids[first:] if self.grammar_on else (), start=first):
            if not self.matcher.accept_token(int(t)):
                return f"output token {i} (id {t}) does not match the {self.params.structured_output.kind}"
        return None

    def accept(self, token: int, output: Sequence[int] = ()) -> str | None:
        """Advance the matcher by a sampled token: "stop" when the grammar is complete,
        an error when the token does not fit, None otherwise (or without a grammar).
        ``output``: the output tokens, ``token`` the last, for a grammar that starts late."""
        if self.matcher is None:
            return None
        if not self.grammar_on:
            self.grammar_on = self._turns_on(output)
            return None
        if not self.matcher.accept_token(int(token)):
            log.error("sampled token %d rejected by the grammar", token)
            return f"sampled token {token} does not match the {self.params.structured_output.kind}"
        return "stop" if self.matcher.is_terminated() else None

    def fill(self, bitmask: torch.Tensor, index: int, output: Sequence[int]) -> None:
        """Row ``index`` of ``bitmask`` (all ones before): this request's allowed tokens."""
        if self.matcher is not None and self.grammar_on and not self.matcher.is_terminated():
            self.matcher.fill_next_token_bitmask(bitmask, index)
        if self.allowed is not None:
            bitmask[index] &= self.allowed
        row = bitmask[index] if self.bad_words else None
        for seq in self.bad_words:
            n = len(seq) - 1
            if n == 0 or (len(output) >= n and tuple(output[len(output) - n :]) == seq[:-1]):
                t = seq[-1]
                row[t // 32] &= ~(1 << (t % 32)) if t % 32 != 31 else 0x7FFFFFFF  # type: ignore[index]


@dataclass
class StepMask:
    """What one step's constraints do to its ``[rows, vocab]`` logits."""

    bitmask: torch.Tensor  # int32 [len(indices), words]
    indices: torch.Tensor  # the rows it masks
    bias_rows: torch.Tensor
    bias_cols: torch.Tensor
    bias_values: torch.Tensor

    @torch.inference_mode()  # the model's logits are inference tensors
    def apply(self, logits: torch.Tensor, inplace: bool = False) -> torch.Tensor:
        """float32 ``logits`` with the biases added and disallowed tokens ``-inf``: a copy,
        or ``logits`` itself when ``inplace`` and already float32. On CUDA the bitmask is
        applied by the Triton kernel; on CPU by xgrammar's native CPU kernel (the torch
        reference of ``kernels/token_bitmask.py`` is several times slower)."""
        out = logits.float()
        if out.data_ptr() == logits.data_ptr() and not inplace:
            out = out.clone()
        device = out.device
        if self.bias_rows.numel():
            out.index_put_((self.bias_rows.to(device), self.bias_cols.to(device)), self.bias_values.to(device), accumulate=True)
        if not self.indices.numel():
            return out
        if ops.uses_triton(device):
            apply_token_bitmask_triton_(out, self.bitmask.to(device, non_blocking=True), self.indices.to(device))
        elif device.type == "cpu" and out.is_contiguous():
            import xgrammar as xgr

            # xgrammar reads bitmask row ``i`` for logits row ``i``: scatter the compact rows
            full = torch.full((out.shape[0], self.bitmask.shape[1]), -1, dtype=torch.int32)
            full[self.indices] = self.bitmask
            vocab = out.shape[1]
            # Its kernel writes -inf past the last id when the vocabulary ends inside a
            # 32-bit word (a heap overflow): give it rows padded to whole words.
            target = out if vocab % 32 == 0 else torch.cat([out, out.new_empty(out.shape[0], -vocab % 32)], dim=1)
            xgr.apply_token_bitmask_inplace(target, full, indices=self.indices.tolist(), backend="cpu")
            if target is not out:
                out.copy_(target[:, :vocab])
        else:
            apply_token_bitmask_reference_(out, self.bitmask, self.indices)
        return out


def step_mask(rows: Sequence[tuple[RequestConstraints | None, Sequence[int]]], vocab_row: torch.Tensor) -> StepMask | None:
    """The step's mask for its sampled rows, each ``(constraints, output token ids)``;
    None when no row is constrained. ``vocab_row``: bitmask of the tokenizer's real ids."""
    masked = [i for i, (c, _) in enumerate(rows) if c is not None and c.masks]
    biased = [i for i, (c, _) in enumerate(rows) if c is not None and c.bias]
    if not masked and not biased:
        return None
    bitmask = torch.full((len(masked), vocab_row.numel()), -1, dtype=torch.int32)
    for j, i in enumerate(masked):
        c, output = rows[i]
        c.fill(bitmask, j, output)  # type: ignore[union-attr]
    bitmask &= vocab_row
    br, bc, bv = [], [], []
    for i in biased:
        for t, b in rows[i][0].bias:  # type: ignore[union-attr]
            br.append(i)
            bc.append(t)
            bv.append(b)
    return StepMask(bitmask, torch.tensor(masked, dtype=torch.long), torch.tensor(br, dtype=torch.long),
                    torch.tensor(bc, dtype=torch.long), torch.tensor(bv, dtype=torch.float32))  # fmt: skip


class EngineConstraints:
    """The engine's side: each request's constraints (validated against the vocabulary),
    the grammar compiles it waits for, and each step's mask.

    ``vocab_size``: the model's logits width; ids at or past the tokenizer's vocabulary
    (padding) are never allowed in a masked row.
    """

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: frozenset[int]) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids
        self.pending: list[Any] = []  # requests whose grammar is compiling (engine thread only)
        self._cache: Any = None
        self._lock = threading.Lock()
        self.vocab_row = _bits(range(min(len(tokenizer), vocab_size)), vocab_size)
        self._mask_pool = ThreadPoolExecutor(1, thread_name_prefix="token-mask")

    @property
    def grammars(self) -> Any:
        """The grammar compiler cache of this tokenizer (made on first use)."""
        with self._lock:
            if self._cache is None:
                from kvroute.replica.structured_output import GrammarCache

                self._cache = GrammarCache(self.tokenizer, self.vocab_size, self.eos_token_ids)
            return self._cache

    def for_request(self, params: SamplingParams) -> RequestConstraints | None:
        """The request's constraints (its grammar's compile started), None without any;
        ValueError naming the field when one does not fit this engine."""
        p = params
        if p.structured_output is None and not p.logit_bias and p.allowed_token_ids is None and not p.bad_words:
            return None
        for name, ids in (("logit_bias", [t for t, _ in p.logit_bias]), ("allowed_token_ids", p.allowed_token_ids or ()),
                          ("structured_output_after", p.structured_output_after)):  # fmt: skip
            bad = [t for t in ids if t >= self.vocab_size]
            if bad:
                raise ValueError(f"{name} token ids must be in [0, {self.vocab_size}); got {bad[:5]}")
        grammar = None
        if p.structured_output is not None:
            p.structured_output.check()
            grammar = self.grammars.submit(p.structured_output)
        allowed = None if p.allowed_token_ids is None else _bits(p.allowed_token_ids, self.vocab_size)
        return RequestConstraints(p, grammar, allowed, bad_words_token_ids(self.tokenizer, p.bad_words))

    def add(self, request: Any) -> None:
        if request.constraints is not None and not request.constraints.ready:
            self.pending.append(request)

    def poll(self) -> list[tuple[Any, str]]:
        """Start the matchers whose compile finished; the requests that cannot run, each
        with the reason (a failed or overdue compile, a replayed token off the grammar)."""
        failed: list[tuple[Any, str]] = []
        still: list[Any] = []
        for req in self.pending:
            c = req.constraints
            if req.is_finished:
                continue
            if not c.grammar.done():
                overdue = self.grammars.overdue(c.params.structured_output)
                if overdue is None:
                    still.append(req)
                else:
                    failed.append((req, overdue))
                continue
            reason = c.start(req.output_token_ids)
            if reason is not None:
                failed.append((req, reason))
        self.pending = still
        return failed

    def wait(self, timeout_s: float) -> None:
        """Block up to ``timeout_s`` for a pending compile (when a step has nothing else to run)."""
        if self.pending:
            wait([r.constraints.grammar for r in self.pending], timeout=timeout_s, return_when=FIRST_COMPLETED)

    def step_mask(self, requests: Sequence[Any]) -> StepMask | None:
        """The mask of a step sampling ``requests`` (None when none is constrained)."""
        if all(r.constraints is None for r in requests):
            return None
        return step_mask([(r.constraints, r.output_token_ids) for r in requests], self.vocab_row)

    def step_mask_async(self, requests: Sequence[Any]) -> Future | None:
        """:meth:`step_mask` on a worker thread, so it is built while the model runs the
        step (nothing changes the matchers or the output tokens meanwhile); None when no
        request is constrained."""
        if all(r.constraints is None for r in requests):
            return None
        return self._mask_pool.submit(self.step_mask, list(requests))
