"""Structured outputs on CPU: what a JSON schema costs an offline batch.

    python -m kvroute.benchmarks.structured [--num-requests 64] [--model smollm2-135m-instruct]
        [--dtype auto] [--rounds 3] [--compiles 5] [--out FILE]

Three figures, same engine, same run:

- throughput: ``--num-requests`` chat prompts (one person each) constrained by one JSON
  schema, then the same prompts unconstrained, each run for exactly as many tokens as
  its constrained twin produced (``min_tokens = max_tokens``, ``ignore_eos``), so both
  batches have the same shape step by step; output tok/s of each and their ratio (the
  two batches alternate ``--rounds`` times; the best time of each counts);
- compile time of a typical schema (the throughput schema with a fresh property name,
  so nothing is cached), the median of ``--compiles`` compiles on an empty cache;
- the first-token delay a new schema adds: time to the first token of one request on an
  idle engine with a schema never seen before, against the same request whose schema
  is already compiled (median of ``--compiles`` pairs).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from kvroute.benchmarks.common import write_result
from kvroute.replica.llm import LLM
from kvroute.replica.sampling_params import SamplingParams
from kvroute.replica.structured_output import GrammarCache, StructuredOutput

NAMES = ["Ann", "Bo", "Chen", "Dara", "Eli", "Femi", "Gus", "Hana", "Ivo", "Jun", "Kai", "Lea", "Mo", "Nia", "Oz", "Pia"]
CITIES = ["Paris", "Lagos", "Lima", "Oslo"]


def schema(extra: str = "nickname") -> dict:
    """A person: the kind of schema an API client sends (strings, numbers, enum, array)."""
    return {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 24},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "city": {"type": "string", "maxLength": 24},
            "role": {"enum": ["engineer", "teacher", "doctor", "artist", "other"]},
            "hobbies": {"type": "array", "items": {"type": "string", "maxLength": 20}, "maxItems": 3},
            extra: {"type": "string", "maxLength": 16},
            "employed": {"type": "boolean"},
        },
        "required": ["name", "age", "city", "role", "hobbies", extra, "employed"],
    }


def prompts(llm: LLM, n: int) -> list[list[int]]:
    return [
        llm.apply_chat_template([{"role": "user", "content":
            f"Describe {NAMES[i % len(NAMES)]} (person {i}), who lives in {CITIES[i % len(CITIES)]}, as a JSON object."}])  # fmt: skip
        for i in range(n)
    ]


def timed(llm: LLM, batch: list[list[int]], params: list[SamplingParams]) -> tuple[float, list[list[int]], list[str]]:
    t = time.perf_counter()
    outs = llm.generate(batch, params, use_tqdm=False)
    return time.perf_counter() - t, [o.token_ids for o in outs], [o.text for o in outs]


def first_token_s(llm: LLM, ids: list[int], so: StructuredOutput, tag: str) -> float:
    engine = llm.engine
    t = time.perf_counter()
    engine.add_request(tag, ids, SamplingParams(max_tokens=1, temperature=0.0, structured_output=so))
    while engine.has_unfinished():
        if engine.step().deltas:
            break
    return time.perf_counter() - t


def add_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=160)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--compiles", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default=None)


def run(args: argparse.Namespace) -> int:
    llm = LLM(args.model, dtype=args.dtype, device="cpu", kv_cache_memory_gb=2.0)
    batch = prompts(llm, args.num_requests)
    so = StructuredOutput("json", schema())
    llm.generate(batch[:2], SamplingParams(max_tokens=4, structured_output=so), use_tqdm=False)  # warm up, compile
    constrained = [SamplingParams(max_tokens=args.max_tokens, temperature=0.0, structured_output=so)] * len(batch)
    _, tokens, texts = timed(llm, batch, constrained)
    valid = sum(1 for t in texts if _parses(t))
    lens = [len(t) for t in tokens]
    plain = [SamplingParams(max_tokens=n, min_tokens=n, temperature=0.0, ignore_eos=True) for n in lens]
    n_tok = sum(lens)
    times: dict[str, list[float]] = {"constrained": [], "plain": []}
    for _ in range(args.rounds):  # alternated, best of each: robust to other load on the machine
        times["constrained"].append(timed(llm, batch, constrained)[0])
        plain_s, plain_tokens, _ = timed(llm, batch, plain)
        assert [len(t) for t in plain_tokens] == lens
        times["plain"].append(plain_s)
    constrained_s, plain_s = min(times["constrained"]), min(times["plain"])

    cache = GrammarCache(llm.tokenizer, llm.engine.arch.vocab_size, llm.engine.eos_token_ids)
    compiles = []
    for i in range(args.compiles):
        fresh = StructuredOutput("json", schema(f"alias{i}"))
        t = time.perf_counter()
        cache.compile(fresh)
        compiles.append(time.perf_counter() - t)
    cache.shutdown()

    new_s, cached_s = [], []
    for i in range(args.compiles):
        fresh = StructuredOutput("json", schema(f"tag{i}"))
        new_s.append(first_token_s(llm, batch[0], fresh, f"new-{i}"))
        cached_s.append(first_token_s(llm, batch[0], fresh, f"cached-{i}"))
    result = {
        "model": args.model, "num_requests": len(batch), "output_tokens": n_tok, "valid_json": valid,
        "constrained_tok_s": n_tok / constrained_s, "unconstrained_tok_s": n_tok / plain_s,
        "ratio": plain_s / constrained_s, "seconds": times, "compile_s_median": statistics.median(compiles),
        "first_token_new_schema_s": statistics.median(new_s), "first_token_cached_schema_s": statistics.median(cached_s),
    }  # fmt: skip
    summary = (f"{len(batch)} requests, {n_tok} tokens ({valid} valid JSON): constrained {result['constrained_tok_s']:.0f} tok/s, "
               f"unconstrained {result['unconstrained_tok_s']:.0f} tok/s, ratio {result['ratio']:.3f}; compile "
               f"{1e3 * result['compile_s_median']:.1f} ms; first token {1e3 * result['first_token_new_schema_s']:.0f} ms "
               f"(new schema) vs {1e3 * result['first_token_cached_schema_s']:.0f} ms (cached)")  # fmt: skip
    write_result("structured", result, summary, args.out)
    return 0


def _parses(text: str) -> bool:
    try:
        json.loads(text)
        return True
    except ValueError:
        return False


if __name__ == "__main__":
    from kvroute.benchmarks.cli import module_main

    raise SystemExit(module_main(__spec__.name))
