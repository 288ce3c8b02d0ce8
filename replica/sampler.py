"""The sampler: turns one step's logits into one token per request (plus logprobs).

Processing order, per row (what a vLLM user expects):

1. ``min_tokens``: while fewer than ``min_tokens`` tokens were generated, the model's EOS
   ids and ``stop_token_ids`` get logit ``-inf``.
2. Penalties: ``repetition_penalty`` (Hugging Face semantics, over prompt + output tokens:
   a positive logit is divided by it, a negative one multiplied), then
   ``frequency_penalty * count`` and ``presence_penalty * (count > 0)`` (OpenAI semantics,
   over output tokens) are subtracted.
3. ``temperature == 0``: argmax (ties go to the lowest token id). Otherwise the logits are
   divided by the temperature (at least 1e-5, so logits stay finite), then ``top_k`` keeps exactly the k most likely tokens (ties
   broken towards the lowest id), ``top_p`` keeps the smallest most-likely-first set whose
   cumulative probability reaches ``top_p`` (at least one token), ``min_p`` drops tokens
   whose probability is below ``min_p`` times the largest, and one token is drawn.

The draw is an exponential race, ``argmax(probs / q)`` with ``q ~ Exp(1)`` per vocab entry,
so every sampled token consumes exactly ``vocab`` exponentials. A row with ``params.seed``
draws ``q`` from a generator seeded with a mix of ``(seed, len(output_token_ids))`` only:
its token depends on neither the batch around it nor the sampler's history, so a request
recomputed after preemption, or resumed on another machine (same device type) with its
tokens so far, samples the same tokens. Unseeded rows share the sampler's own generator.

Before step 1, a step's logits constraints (``replica/logits_constraints.py``: grammar,
``allowed_token_ids``, ``bad_words``, ``logit_bias``) are applied when the engine passes
them. Logprobs are taken from the model's raw distribution (``log_softmax`` of the unprocessed
logits), as vLLM does by default.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from kvroute.kernels import ops
from kvroute.replica.outputs import TokenLogprob
from kvroute.replica.sampling_params import SampleRequest, SamplerOutput, SamplingParams

_MASK64 = (1 << 64) - 1
_MIN_TEMPERATURE = 1e-5


def step_seed(seed: int, step: int) -> int:
    """The generator seed for output token ``step`` of a request seeded with ``seed``.

    SplitMix64 over both values, so nearby (seed, step) pairs get unrelated streams.
    """
    z = ((seed & _MASK64) * 0x9E3779B97F4A7C15 + (step & _MASK64) + 0x632BE59BD9B4E019) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    z ^= z >> 31
    return z >> 1  # 63 bits: accepted by every torch.Generator.manual_seed


def _needs_min_tokens(row: SampleRequest) -> bool:
    p = row.params
    return len(row.output_token_ids) < p.min_tokens and bool(row.eos_token_ids or p.stop_token_ids)


def _needs_penalties(p: SamplingParams) -> bool:
    return p.repetition_penalty != 1.0 or p.frequency_penalty != 0.0 or p.presence_penalty != 0.0


def _needs_filters(p: SamplingParams) -> bool:
    return p.temperature != 1.0 or p.top_k != -1 or p.top_p < 1.0 or p.min_p > 0.0


def _plain_greedy(row: SampleRequest) -> bool:
    """The row's token is the argmax of its raw logits, and nothing else is asked."""
    p = row.params
    return p.greedy and p.logprobs is None and not _needs_penalties(p) and not _needs_min_tokens(row)


def _pairs(rows: list[int], seqs: list[Sequence[int]], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Flatten (row index, token id) pairs of ``seqs`` (duplicates kept) into two 1-D tensors."""
    lens = [len(s) for s in seqs]
    flat = [t for s in seqs for t in s]
    r = torch.repeat_interleave(torch.tensor(rows, dtype=torch.long), torch.tensor(lens, dtype=torch.long))
    c = torch.tensor(flat, dtype=torch.long)
    return r.to(device), c.to(device)


def apply_penalties(logits: torch.Tensor, rows: Sequence[SampleRequest]) -> torch.Tensor:
    """Steps 1 and 2: min_tokens suppression and the three penalties.

    Returns float32 logits ``[num_rows, vocab]``; the input is never modified (when no row
    needs any of this, the float32 view of the input itself is returned).
    """
    assert logits.dim() == 2 and logits.shape[0] == len(rows), (tuple(logits.shape), len(rows))
    out = logits.float()
    vocab = out.shape[1]
    min_tok = [i for i, r in enumerate(rows) if _needs_min_tokens(r)]
    pen = [i for i, r in enumerate(rows) if _needs_penalties(r.params)]
    if not min_tok and not pen:
        return out
    out = out.clone()
    device = out.device

    if min_tok:
        ri: list[int] = []
        ci: list[int] = []
        for i in min_tok:
            banned = set(rows[i].eos_token_ids) | set(rows[i].params.stop_token_ids)
            for t in banned:
                if 0 <= t < vocab:
                    ri.append(i)
                    ci.append(t)
        if ri:
            out[torch.tensor(ri, device=device), torch.tensor(ci, device=device)] = float("-inf")

    # Penalties touch only the (row, token) pairs that occurred: O(tokens), not O(vocab).
    rep = [i for i in pen if rows[i].params.repetition_penalty != 1.0]
    if rep:
        r, c = _pairs(rep, [list(rows[i].prompt_token_ids) + list(rows[i].output_token_ids) for i in rep], device)
        penalty = torch.zeros(len(rows), dtype=torch.float32)
        penalty[rep] = torch.tensor([rows[i].params.repetition_penalty for i in rep], dtype=torch.float32)
        pr = penalty.to(device)[r]
        vals = out[r, c]  # duplicates read the same value and write the same result
        out[r, c] = torch.where(vals > 0, vals / pr, vals * pr)

    add = [i for i in pen if rows[i].params.frequency_penalty != 0.0 or rows[i].params.presence_penalty != 0.0]
    if add:
        r, c = _pairs(add, [rows[i].output_token_ids for i in add], device)
        if r.numel():
            freq = torch.zeros(len(rows), dtype=torch.float32)
            pres = torch.zeros(len(rows), dtype=torch.float32)
            freq[add] = torch.tensor([rows[i].params.frequency_penalty for i in add], dtype=torch.float32)
            pres[add] = torch.tensor([rows[i].params.presence_penalty for i in add], dtype=torch.float32)
            freq, pres = freq.to(device), pres.to(device)
            keys = torch.unique(r * vocab + c)  # each occurring (row, token) once
            ur, uc = keys // vocab, keys % vocab
            counts = torch.zeros(keys.numel(), dtype=torch.float32, device=device)
            counts.scatter_add_(0, torch.searchsorted(keys, r * vocab + c), torch.ones_like(r, dtype=torch.float32))
            out[ur, uc] = out[ur, uc] - freq[ur] * counts - pres[ur]
    return out


def apply_filters(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """Step 3 before the draw, for sampled (non-greedy) rows: temperature, top_k, top_p, min_p.

    ``logits`` is float32 ``[num_rows, vocab]``, every row non-greedy. Returns new logits
    whose dropped tokens are ``-inf``; ``softmax`` of a returned row is its sampling
    distribution. The input is never modified.
    """
    assert logits.dim() == 2 and logits.shape[0] == len(params)
    assert not any(p.greedy for p in params), "apply_filters is for sampled rows only"
    out = logits
    device = logits.device
    vocab = logits.shape[1]
    # A positive temperature below _MIN_TEMPERATURE would overflow logits / T to inf.
    temps = [max(p.temperature, _MIN_TEMPERATURE) for p in params]
    if any(t != 1.0 for t in temps):
        out = out / torch.tensor(temps, dtype=torch.float32, device=device).unsqueeze(1)

    # top_k alone needs no full sort: keep what beats the k-th value, then the lowest ids
    # among those equal to it until k are kept.
    topk_rows = [i for i, p in enumerate(params) if 0 < p.top_k < vocab and p.top_p >= 1.0]
    if topk_rows:
        if out is logits:
            out = out.clone()
        idx = torch.tensor(topk_rows, device=device)
        sub = out if len(topk_rows) == len(params) else out[idx]  # [n_topk, vocab]
        ks = torch.tensor([params[i].top_k for i in topk_rows], device=device).unsqueeze(1)  # [n_topk, 1]
        kmax = max(params[i].top_k for i in topk_rows)
        top_vals = sub.topk(kmax, dim=1).values  # [n_topk, kmax], largest first
        kth = top_vals.gather(1, ks - 1)  # [n_topk, 1]
        keep = sub >= kth
        over = (keep.sum(dim=1) > ks.squeeze(1)).nonzero().flatten().tolist()
        if over:  # ties at the k-th value: only the lowest ids among them fill up to k
            o = torch.tensor(over, device=device)
            tied = sub[o] == kth[o]
            room = ks[o] - (sub[o] > kth[o]).sum(dim=1, keepdim=True)
            keep[o] = (sub[o] > kth[o]) | (tied & (tied.cumsum(dim=1) <= room))
        if len(topk_rows) == len(params):
            out.masked_fill_(~keep, float("-inf"))
        else:
            out[idx] = sub.masked_fill(~keep, float("-inf"))

    sort_rows = [i for i, p in enumerate(params) if p.top_p < 1.0]
    if sort_rows:
        if out is logits:
            out = out.clone()
        idx = torch.tensor(sort_rows, device=device)
        sub = out[idx]  # [n_sort, vocab]
        # Stable descending sort: equal logits keep ascending id order, so top_k ties go to
        # the lowest ids here too.
        vals, order = torch.sort(sub, dim=1, descending=True, stable=True)
        pos = torch.arange(vocab, device=device).unsqueeze(0)  # [1, vocab]
        ks = torch.tensor(
            [params[i].top_k if 0 < params[i].top_k < vocab else vocab for i in sort_rows], device=device
        ).unsqueeze(1)  # [n_sort, 1]
        vals = vals.masked_fill(pos >= ks, float("-inf"))
        # top_p on the distribution renormalized over the top_k survivors.
        probs = torch.softmax(vals, dim=1)
        before = probs.cumsum(dim=1) - probs  # mass strictly ahead of each token
        top_p = torch.tensor([params[i].top_p for i in sort_rows], device=device).unsqueeze(1)
        drop = before >= top_p
        drop[:, 0] = False  # always keep the most likely token
        vals = vals.masked_fill(drop, float("-inf"))
        out[idx] = torch.empty_like(vals).scatter_(1, order, vals)

    minp_rows = [i for i, p in enumerate(params) if p.min_p > 0.0]
    if minp_rows:
        if out is logits:
            out = out.clone()
        idx = torch.tensor(minp_rows, device=device)
        sub = out[idx]
        probs = torch.softmax(sub, dim=1)
        mp = torch.tensor([params[i].min_p for i in minp_rows], device=device).unsqueeze(1)
        keep = probs >= mp * probs.max(dim=1, keepdim=True).values
        out[idx] = sub.masked_fill(~keep, float("-inf"))
    return out


def process_logits(logits: torch.Tensor, rows: Sequence[SampleRequest]) -> torch.Tensor:
    """Steps 1-3 up to the draw: the logits each row's token is chosen from.

    Greedy rows get min_tokens + penalties only (their token is the argmax); sampled rows
    also get temperature and the top_k / top_p / min_p filters (dropped tokens are -inf).
    """
    out = apply_penalties(logits, rows)
    sampled = [i for i, r in enumerate(rows) if not r.params.greedy]
    if sampled and any(_needs_filters(rows[i].params) for i in sampled):
        idx = torch.tensor(sampled, device=out.device)
        filtered = apply_filters(out[idx], [rows[i].params for i in sampled])
        if out.data_ptr() == logits.data_ptr():
            out = out.clone()  # apply_penalties returned the input itself
        out[idx] = filtered
    return out


class Sampler:
    """Samples one token per row from a step's logits. Not thread-safe.

    ``seed`` seeds the generator shared by unseeded rows (one per device, made lazily).
    """

    def __init__(self, seed: int = 0):
        self.seed = seed
        self._shared: dict[torch.device, torch.Generator] = {}
        self._per_row: dict[torch.device, torch.Generator] = {}

    def _shared_gen(self, device: torch.device) -> torch.Generator:
        gen = self._shared.get(device)
        if gen is None:
            gen = torch.Generator(device=device)
            gen.manual_seed(self.seed)
            self._shared[device] = gen
        return gen

    def _row_gen(self, device: torch.device, seed: int, step: int) -> torch.Generator:
        gen = self._per_row.get(device)
        if gen is None:
            gen = self._per_row[device] = torch.Generator(device=device)
        gen.manual_seed(step_seed(seed, step))
        return gen

    def __call__(self, logits: torch.Tensor, rows: Sequence[SampleRequest], mask: Any = None) -> SamplerOutput:
        """``logits``: ``[num_rows, vocab]``, any float dtype (computed in float32).
        ``mask``: the step's constraints (``logits_constraints.StepMask``), applied first."""
        if logits.dim() != 2 or logits.shape[0] != len(rows):
            raise ValueError(f"logits must be [num_rows={len(rows)}, vocab], got {tuple(logits.shape)}")
        num_rows = len(rows)
        if num_rows == 0:
            return SamplerOutput([], [])
        # masked in place unless a row's logprobs need the raw logits
        constrained = logits if mask is None else mask.apply(logits, all(r.params.logprobs is None for r in rows))
        if all(_plain_greedy(r) for r in rows):
            # widening is exact and keeps the order, so the argmax of the logits as they
            # are is the argmax in float32 (the first of equal maxima either way)
            return SamplerOutput(ops.argmax_rows(constrained).tolist(), [None] * num_rows)
        raw = logits.float()
        device = raw.device
        token_ids: list[int] = [0] * num_rows

        processed = apply_penalties(raw if mask is None else constrained, rows)
        greedy = [i for i, r in enumerate(rows) if r.params.greedy]
        sampled = [i for i, r in enumerate(rows) if not r.params.greedy]

        if greedy:
            sub = processed if len(greedy) == num_rows else processed[torch.tensor(greedy, device=device)]
            for i, t in zip(greedy, sub.argmax(dim=1).tolist()):
                token_ids[i] = t

        if sampled:
            sub = processed if len(sampled) == num_rows else processed[torch.tensor(sampled, device=device)]
            params = [rows[i].params for i in sampled]
            if any(_needs_filters(p) for p in params):
                sub = apply_filters(sub, params)
            probs = torch.softmax(sub, dim=1)  # [n_sampled, vocab]
            q = torch.empty_like(probs)  # Exp(1) noise, one per vocab entry
            unseeded = [j for j, p in enumerate(params) if p.seed is None]
            if unseeded:
                noise = torch.empty(len(unseeded), probs.shape[1], device=device)
                noise.exponential_(generator=self._shared_gen(device))
                if len(unseeded) == len(params):
                    q = noise
                else:
                    q[torch.tensor(unseeded, device=device)] = noise
            for j, p in enumerate(params):
                if p.seed is not None:
                    step = len(rows[sampled[j]].output_token_ids)
                    q[j].exponential_(generator=self._row_gen(device, p.seed, step))
            # q == 0 would turn a dropped token's 0/0 into NaN; the clamp keeps it 0.
            q.clamp_(min=torch.finfo(torch.float32).tiny)
            for i, t in zip(sampled, (probs / q).argmax(dim=1).tolist()):
                token_ids[i] = t

        logprobs: list[TokenLogprob | None] = [None] * num_rows
        want = [i for i, r in enumerate(rows) if r.params.logprobs is not None]
        if want:
            found = token_logprobs(
                raw[torch.tensor(want, device=device)],
                [token_ids[i] for i in want],
                [rows[i].params.logprobs or 0 for i in want],
            )
            for i, lp in zip(want, found):
                logprobs[i] = lp
        return SamplerOutput(token_ids, logprobs)


def token_logprobs(logits: torch.Tensor, token_ids: Sequence[int], num_top: Sequence[int]) -> list[TokenLogprob]:
    """Row *i*'s logprob of ``token_ids[i]`` under ``log_softmax(logits[i])`` (the raw
    distribution), its rank there and its ``num_top[i]`` most likely tokens: what
    sampled tokens and prompt tokens report alike."""
    lp = torch.log_softmax(logits.float(), dim=1)
    picked = lp.gather(1, torch.tensor(list(token_ids), device=lp.device).unsqueeze(1))
    ranks = (lp >= picked).sum(dim=1).tolist()  # 1-based; a token tied with it counts as ahead of it
    chosen = picked.squeeze(1).tolist()
    k = min(max(num_top, default=0), lp.shape[1])
    top_v: list[list[float]] = [[] for _ in chosen]
    top_i: list[list[int]] = [[] for _ in chosen]
    if k > 0:
        v, ix = lp.topk(k, dim=1)  # sorted, largest first
        top_v, top_i = v.tolist(), ix.tolist()
    return [
        TokenLogprob(t, c, {top_i[j][m]: top_v[j][m] for m in range(min(n, k))}, r)
        for j, (t, c, n, r) in enumerate(zip(token_ids, chosen, num_top, ranks))
    ]


def record_prompt_logprobs(rows: Sequence, logits: torch.Tensor) -> None:
    """Each prompt position a step computed for a request that wants prompt logprobs
    (``rows``: the step's scheduled rows; ``logits``: one row per such position, in the
    model runner's ``prompt_rows`` order): the logprob of the prompt token it predicts,
    appended to ``request.prompt_logprobs``. A position recomputed after preemption is
    not recorded twice."""
    taken = 0
    for row in rows:
        req = row.request
        k = req.params.prompt_logprobs
        count = min(row.num_computed + row.num_new, req.num_prompt_tokens - 1) - row.num_computed
        if k is None or count <= 0:
            continue
        first = row.num_computed + 1  # the prompt position the chunk's first logits predict
        found = token_logprobs(logits[taken : taken + count], req.prompt_token_ids[first : first + count], [k] * count)
        taken += count
        known = len(req.prompt_logprobs)  # positions [0, known) are recorded
        if first <= known < first + count:
            req.prompt_logprobs.extend(found[known - first :])
