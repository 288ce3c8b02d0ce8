"""A plain request's latency while hostile structured-output specs compile.

    kvroute bench hostile_latency                 # starts `kvroute serve` (2 replicas, SmolLM2, fp32)
    kvroute bench hostile_latency --url http://127.0.0.1:8000

Times ``--requests`` plain chats (``max_tokens`` 8, greedy, one at a time) on an idle
service, then the same number again while ``--hostile`` clients keep sending requests
whose structured outputs are each new and slow or impossible to compile: regexes with
long bounded repeats, JSON schemas nested near the depth limit, enums of thousands of
values, and a tool whose parameters nest past it. The ingress compiles every spec
under its time limit before any engine work, so a hostile request should cost the
plain ones little, and none may answer 5xx. Reports the plain latency's median and p90
in both phases, their ratio, and the hostile answers by status. One summary line; JSON
in ``results/hostile_latency.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import statistics
import time
from typing import Any, Optional

import httpx

from kvroute.benchmarks import options
from kvroute.benchmarks.common import write_result
from kvroute.benchmarks.soak import start_service, stop_service

MODEL = "smollm2-135m-instruct"
PLAIN = {"model": MODEL, "messages": [{"role": "user", "content": "Name a colour."}], "max_tokens": 8, "temperature": 0}


def hostile_body(i: int) -> dict[str, Any]:
    """The ``i``-th hostile request: a spec never sent before (no compile cache hit)."""
    kind = i % 4
    body: dict[str, Any] = {"model": MODEL, "messages": [{"role": "user", "content": f"Answer {i}."}], "max_tokens": 8}
    if kind == 0:  # a long bounded repeat: seconds to compile against the vocabulary
        body["structured_outputs"] = {"regex": f"[a-z0-9 ]{{1,{900 + i}}}x"}
    elif kind == 1:  # nested near the limit
        node: dict[str, Any] = {"type": "string", "maxLength": 1 + i % 7}
        for _ in range(60):
            node = {"type": "object", "properties": {f"k{i}": node}, "required": [f"k{i}"]}
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": "deep", "schema": node}}
    elif kind == 2:  # thousands of alternatives
        body["structured_outputs"] = {"choice": [f"option-{i}-{j}" for j in range(4000)]}
    else:  # a tool nested past the limit: refused before any compile
        node = {"type": "string"}
        for _ in range(300):
            node = {"type": "object", "properties": {"a": node}}
        body["tools"] = [{"type": "function", "function": {"name": "deep", "parameters": node}}]
        body["tool_choice"] = "required"
    return body


async def _plain(c: httpx.AsyncClient, n: int) -> list[float]:
    times = []
    for _ in range(n):
        started = time.monotonic()
        r = await c.post("/v1/chat/completions", json=PLAIN)
        r.raise_for_status()
        times.append(time.monotonic() - started)
    return times


async def _hostile(c: httpx.AsyncClient, ids: "itertools.count[int]", stop: asyncio.Event, statuses: dict[str, int]) -> None:
    while not stop.is_set():
        r = await c.post("/v1/chat/completions", json=hostile_body(next(ids)))
        statuses[str(r.status_code)] = statuses.get(str(r.status_code), 0) + 1


async def measure(url: str, requests: int, hostile: int) -> dict[str, Any]:
    async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(600.0)) as c:
        await _plain(c, 3)  # warm: the prompt cached, the first request's one-off costs paid
        idle = await _plain(c, requests)
        stop, statuses, ids = asyncio.Event(), {}, itertools.count()
        workers = [asyncio.ensure_future(_hostile(c, ids, stop, statuses)) for _ in range(hostile)]
        await asyncio.sleep(1.0)  # every hostile client under way
        loaded = await _plain(c, requests)
        stop.set()
        await asyncio.gather(*workers)
    return {"idle_s": idle, "loaded_s": loaded, "hostile_by_status": statuses,
            "hostile_5xx": sum(v for k, v in statuses.items() if k.startswith("5"))}  # fmt: skip


def _p90(xs: list[float]) -> float:
    return sorted(xs)[min(len(xs) - 1, int(0.9 * len(xs)))]


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--url", default=None, help="a running service (default: start `kvroute serve`)")
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--requests", type=int, default=15, help="plain requests per phase")
    p.add_argument("--hostile", type=int, default=4, help="hostile clients during the second phase")
    p.add_argument("--label", default="", help="a note kept in the JSON (e.g. the commit measured)")
    options.add_output(p, "hostile_latency")


def run(args: argparse.Namespace) -> int:
    proc: Optional[Any] = None
    url = args.url
    if url is None:
        serve_args = argparse.Namespace(model=MODEL, replicas=args.replicas, port=None, max_body_bytes=8 << 20,
                                        dtype=args.dtype, block_size=None, num_kv_blocks=None, max_model_len=None,
                                        emulate=None, time_scale=None, step_target_s=None)  # fmt: skip
        proc, url = start_service(serve_args)
    try:
        result = asyncio.run(measure(url, args.requests, args.hostile))
    finally:
        if proc is not None:
            stop_service(proc)
    idle, loaded = statistics.median(result["idle_s"]), statistics.median(result["loaded_s"])
    result.update(label=args.label, replicas=args.replicas, dtype=args.dtype, hostile=args.hostile,
                  idle_p50_s=idle, idle_p90_s=_p90(result["idle_s"]), loaded_p50_s=loaded,
                  loaded_p90_s=_p90(result["loaded_s"]), ratio_p50=loaded / idle)  # fmt: skip
    summary = (f"plain p50 {idle * 1e3:.0f} ms idle, {loaded * 1e3:.0f} ms beside {args.hostile} hostile clients "
               f"({loaded / idle:.2f}x; p90 {result['idle_p90_s'] * 1e3:.0f} / {result['loaded_p90_s'] * 1e3:.0f} ms); "
               f"hostile answers {result['hostile_by_status']}, 5xx {result['hostile_5xx']}")  # fmt: skip
    write_result("hostile_latency", result, summary, args.out)
    return 1 if result["hostile_5xx"] else 0


if __name__ == "__main__":
    from kvroute.benchmarks.cli import module_main

    raise SystemExit(module_main(__spec__.name))
