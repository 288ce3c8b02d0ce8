"""Real request traces as workloads: the Mooncake (FAST'25) JSON-lines format.

Each line is one request::

    {"timestamp": 27482, "input_length": 6955, "output_length": 52, "hash_ids": [46, 47, 48, ...]}

``timestamp`` is milliseconds from the trace's start; ``hash_ids`` names the prompt's
blocks of 512 tokens each (the last one may be partial): two requests with the same id
at the same position share that block's content, so equal leading ids are a shared
prefix. ``load_mooncake`` turns a trace into a ``Workload``: hash id ``h`` becomes a
deterministic block of ``tokens_per_id`` token ids (the same for every request that
names it; a smaller ``tokens_per_id`` shrinks every prompt in proportion), the prompt is
its blocks' tokens cut to ``input_length`` scaled the same way, and arrival times are
the timestamps divided by ``compression`` (2.0: twice the rate, the burstiness kept).
``ideal_hit_rate`` is what a single infinite cache would serve of the trace's prompt
tokens (the figure each router's hit rate is read against).
"""

from __future__ import annotations

import json
import zlib
from pathlib import Path
from typing import Any, Iterable

import numpy as np

from kvroute.benchmarks.workload_types import RequestSpec, Workload

MOONCAKE_TOKENS_PER_ID = 512
VOCAB = 32000
FIRST_TOKEN = 100  # keep clear of special-token ids


def read_jsonl(path: str | Path) -> list[dict[str, Any]]:
    """The trace's records, in file order (blank lines skipped)."""
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def block_tokens(hash_id: int, tokens_per_id: int, seed: int = 0, vocab: int = VOCAB) -> tuple[int, ...]:
    """The token ids that hash id ``hash_id`` stands for: the same for every request, a
    different run for every id (a generator seeded by the id)."""
    rng = np.random.default_rng([seed, zlib.crc32(str(hash_id).encode())])
    return tuple(rng.integers(FIRST_TOKEN, vocab, size=tokens_per_id).tolist())


def _prompt(ids: list[int], length: int, tokens_per_id: int, seed: int, memo: dict[int, tuple[int, ...]]) -> tuple[int, ...]:
    out: list[int] = []
    for h in ids:
        if len(out) >= length:
            break
        if h not in memo:
            memo[h] = block_tokens(h, tokens_per_id, seed)
        out.extend(memo[h])
    if len(out) < length:  # a trace whose ids cover less than its input length: unique filler
        out.extend(block_tokens(-len(memo) - 1, length - len(out), seed))
    return tuple(out[:length])


def load_mooncake(
    source: str | Path | Iterable[dict[str, Any]],
    *,
    tokens_per_id: int = MOONCAKE_TOKENS_PER_ID,
    compression: float = 1.0,
    max_requests: int | None = None,
    max_output_len: int | None = None,
    seed: int = 0,
    name: str = "mooncake",
) -> Workload:
    """A trace file (or its records) as a ``Workload`` (module docstring). ``tokens_per_id``
    below 512 scales every prompt by ``tokens_per_id / 512``; ``max_output_len`` caps the
    answers (a shorter run); ``max_requests`` keeps the first ones."""
    if tokens_per_id < 1 or compression <= 0:
        raise ValueError(f"need tokens_per_id >= 1 and compression > 0, got {tokens_per_id!r}, {compression!r}")
    records = read_jsonl(source) if isinstance(source, (str, Path)) else list(source)
    if max_requests is not None:
        records = records[:max_requests]
    if not records:
        raise ValueError("the trace has no requests")
    t0 = min(float(r["timestamp"]) for r in records)
    memo: dict[int, tuple[int, ...]] = {}
    reqs = []
    for i, r in enumerate(records):
        ids = [int(h) for h in r["hash_ids"]]
        length = max(1, round(int(r["input_length"]) * tokens_per_id / MOONCAKE_TOKENS_PER_ID))
        out = max(1, int(r["output_length"]) if max_output_len is None else min(int(r["output_length"]), max_output_len))
        arrival = (float(r["timestamp"]) - t0) / 1000.0 / compression
        reqs.append(RequestSpec(f"{name}-{i}", _prompt(ids, length, tokens_per_id, seed, memo), out, arrival_s=arrival,
                                group_id=ids[0] if ids else -1))  # fmt: skip
    reqs.sort(key=lambda s: s.arrival_s)
    params = {"tokens_per_id": tokens_per_id, "compression": compression, "requests": len(reqs), "seed": seed}
    return Workload(name, reqs, params, shared_prefix_tokens=0, num_groups=len({s.group_id for s in reqs}))


def ideal_hit_rate(records: Iterable[dict[str, Any]], tokens_per_id: int = MOONCAKE_TOKENS_PER_ID) -> float:
    """The share of the trace's prompt tokens a single infinite cache would serve: each
    request's leading ids seen whole before (as a chain: the same ids at the same
    positions after the same ids), the last prompt token always computed, in timestamp
    order."""
    seen: set[int] = set()
    hit = total = 0
    for r in sorted(records, key=lambda r: float(r["timestamp"])):
        chain = _chain([int(h) for h in r["hash_ids"]])
        length = max(1, round(int(r["input_length"]) * tokens_per_id / MOONCAKE_TOKENS_PER_ID))
        full = min(len(chain), (length - 1) // tokens_per_id)  # whole blocks before the last token
        k = 0
        while k < full and chain[k] in seen:
            k += 1
        hit += k * tokens_per_id
        total += length
        seen.update(chain[: length // tokens_per_id])  # a cache keeps whole blocks only
    return hit / total if total else 0.0


def _chain(ids: list[int]) -> list[int]:
    """Each position's id folded with every id before it (equal iff the prefixes are)."""
    out, h = [], 0
    for x in ids:
        h = hash((h, x))
        out.append(h)
    return out


def synthetic_mooncake(num_requests: int = 200, *, num_prefixes: int = 8, seed: int = 0) -> list[dict[str, Any]]:
    """A small trace in the Mooncake format: bursts of requests (an exponential gap
    between bursts, a few ms within one), each request a shared prefix of 2-8 ids drawn
    from ``num_prefixes`` (Zipf-popular, as system prompts and documents are), sometimes
    a follow-up that extends an earlier request's ids (a conversation's next turn), then
    1-4 ids of its own."""
    rng = np.random.default_rng(seed)
    weights = 1.0 / np.arange(1, num_prefixes + 1) ** 1.1
    prefixes = [list(range(1000 * p, 1000 * p + int(rng.integers(2, 9)))) for p in range(num_prefixes)]
    next_id, t, out = 100_000, 0.0, []
    while len(out) < num_requests:
        t += float(rng.exponential(400.0))  # ms between bursts
        for _ in range(int(rng.integers(1, 9))):
            if out and rng.random() < 0.25:  # a next turn: an earlier request's ids, extended
                ids = list(out[int(rng.integers(len(out)))]["hash_ids"])
            else:
                ids = list(prefixes[int(rng.choice(num_prefixes, p=weights / weights.sum()))])
            own = int(rng.integers(1, 5))
            ids += list(range(next_id, next_id + own))
            next_id += own
            length = 512 * (len(ids) - 1) + int(rng.integers(1, 513))
            out.append({"timestamp": int(t), "input_length": length, "output_length": int(rng.integers(8, 257)),
                        "hash_ids": ids})  # fmt: skip
            t += float(rng.uniform(0.0, 5.0))
            if len(out) == num_requests:
                break
    return out
