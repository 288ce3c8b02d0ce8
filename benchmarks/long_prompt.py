"""A long prompt beside short requests: the short ones' TTFT while it prefills.

    kvroute bench long_prompt             # starts `kvroute serve` (2 replicas, SmolLM2, fp32)
    kvroute bench long_prompt --url http://127.0.0.1:8000

Sends one long chat (``--long-messages`` "ok" messages; 1,000 is a 6.5k-token prompt
for SmolLM2), then, from ``--delay-s`` later until it answers, keeps ``--concurrency``
short streamed chats (``max_tokens`` 4) in flight and times each one's first token.
Reports the short ones' TTFT p50 / p99 / max, how many finished before the long one, and
the long one's seconds. ``--background-tokens N --background-concurrency M`` keeps M
more requests of about N distinct tokens each in flight meanwhile (a busy fleet, like
a user's report of edge cases; not in the TTFT figures). One summary line; JSON in
``results/long_prompt.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import time
from typing import Any, Optional

import httpx

from kvroute.benchmarks.common import write_result
from kvroute.benchmarks.soak import start_service, stop_service
from kvroute.benchmarks import options

MODEL = "smollm2-135m-instruct"


async def _short(c: httpx.AsyncClient, i: int, words: int = 0) -> dict[str, Any]:
    """One short streamed chat (``words`` more words after a distinct start): its TTFT
    and end, in seconds from its start."""
    content = f"Say a word ({i})." + " ok" * words
    body = {"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": 4,
            "temperature": 0, "stream": True}  # fmt: skip
    started = time.monotonic()
    ttft = None
    async with c.stream("POST", "/v1/chat/completions", json=body) as r:
        async for line in r.aiter_lines():
            if ttft is None and line.startswith("data: ") and '"content"' in line:
                ttft = time.monotonic() - started
    return {"status": r.status_code, "ttft_s": ttft, "e2e_s": time.monotonic() - started, "end": time.monotonic()}


async def _shorts_until(
    c: httpx.AsyncClient, done: asyncio.Future, concurrency: int, limit_s: float, words: int = 0, first: int = 0
) -> list[dict]:
    """Keep ``concurrency`` requests of ``words`` more words in flight until ``done``
    (or ``limit_s``); request ids from ``first``."""
    results: list[dict] = []
    deadline = time.monotonic() + limit_s
    count = first

    async def worker() -> None:
        nonlocal count
        while not done.done() and time.monotonic() < deadline:
            count += 1
            results.append(await _short(c, count, words))

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return results


async def measure(
    url: str, long_messages: int, concurrency: int, delay_s: float, limit_s: float, background: tuple[int, int] = (0, 0)
) -> dict[str, Any]:
    messages = [{"role": ("user", "assistant")[i % 2], "content": "ok"} for i in range(long_messages)]
    async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(600.0)) as c:
        started = time.monotonic()
        long = asyncio.ensure_future(c.post("/v1/chat/completions", json={
            "model": MODEL, "messages": messages, "max_tokens": 1, "temperature": 0}))  # fmt: skip
        words, workers = background
        busy = asyncio.ensure_future(_shorts_until(c, long, workers, limit_s, words, first=1 << 20))
        await asyncio.sleep(delay_s)
        shorts = await _shorts_until(c, long, concurrency, limit_s)
        resp = await long
        busy_results = await busy
        long_s, long_end = time.monotonic() - started, time.monotonic()
    ttfts = sorted(s["ttft_s"] for s in shorts if s["ttft_s"] is not None)
    return {
        "long_status": resp.status_code,
        "long_prompt_tokens": resp.json()["usage"]["prompt_tokens"] if resp.status_code == 200 else None,
        "long_s": long_s,
        "shorts": len(shorts),
        "shorts_failed": sum(s["status"] != 200 or s["ttft_s"] is None for s in shorts),
        "shorts_before_long": sum(s["end"] < long_end for s in shorts),
        "ttft_p50_s": _pct(ttfts, 0.5),
        "ttft_p99_s": _pct(ttfts, 0.99),
        "ttft_max_s": ttfts[-1] if ttfts else None,
        "background": len(busy_results),
        "background_failed": sum(s["status"] != 200 for s in busy_results),
    }


def _s(x: Optional[float]) -> str:
    return "-" if x is None else f"{x:.2f}"


def _pct(values: list[float], q: float) -> Optional[float]:
    return values[min(len(values) - 1, int(q * len(values)))] if values else None


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--url", default=None, help="a running service (default: start `kvroute serve`)")
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--long-messages", type=int, default=1000)
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--delay-s", type=float, default=1.0, help="start the short requests this long after the long one")
    p.add_argument("--limit-s", type=float, default=300.0, help="stop the short requests after this long at most")
    p.add_argument("--background-tokens", type=int, default=0, help="words per background request")
    p.add_argument("--background-concurrency", type=int, default=0)
    p.add_argument("--emulate", default=None, help="emulated replicas of this step profile (e.g. cpu_avx2_slow)")
    p.add_argument("--time-scale", type=float, default=None, help="with --emulate: stretch every step by this")
    p.add_argument("--step-target-s", type=float, default=None, help="the engines' step target (0: tokens only)")
    p.add_argument("--label", default="", help="a note kept in the JSON (e.g. the commit measured)")
    options.add_output(p, "long_prompt")


def run(args: argparse.Namespace) -> int:
    proc = None
    url = args.url
    if url is None:
        serve_args = argparse.Namespace(model=MODEL, replicas=args.replicas, port=None, max_body_bytes=8 << 20,
                                        dtype=args.dtype, block_size=None, num_kv_blocks=None, max_model_len=None,
                                        emulate=args.emulate, time_scale=args.time_scale,
                                        step_target_s=args.step_target_s)  # fmt: skip
        proc, url = start_service(serve_args)
    try:
        background = (args.background_tokens, args.background_concurrency)
        result = asyncio.run(measure(url, args.long_messages, args.concurrency, args.delay_s, args.limit_s, background))
    finally:
        if proc is not None:
            stop_service(proc)
    result.update(label=args.label, replicas=args.replicas, dtype=args.dtype, emulate=args.emulate,
                  time_scale=args.time_scale, step_target_s=args.step_target_s, concurrency=args.concurrency,
                  background_tokens=args.background_tokens, background_concurrency=args.background_concurrency)
    summary = (f"long {result['long_prompt_tokens']} tokens in {result['long_s']:.1f} s; {result['shorts']} short "
               f"({result['shorts_failed']} failed, {result['shorts_before_long']} done before it): TTFT p50 "
               f"{_s(result['ttft_p50_s'])} s, p99 {_s(result['ttft_p99_s'])} s, max {_s(result['ttft_max_s'])} s")  # fmt: skip
    write_result("long_prompt", result, summary, args.out)
    return 0 if result["long_status"] == 200 and not (result["shorts_failed"] or result["background_failed"]) else 1


if __name__ == "__main__":
    from kvroute.benchmarks.cli import module_main

    raise SystemExit(module_main(__spec__.name))
