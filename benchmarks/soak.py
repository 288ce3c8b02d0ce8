"""Soak: a mixed load against ``kvroute serve`` for M minutes, watching for leaks.

    kvroute bench soak --minutes 30              # starts `kvroute serve` (embedded model)
    kvroute bench soak --minutes 5 --url http://127.0.0.1:8000   # a running service

Workers send, at random (seeded; every kind once first): completions and chat, streamed
or not, ``n = 2``, two-prompt lists, tenants' salted requests over a shared system
prompt, clients that hang up after the first chunk, and at a low rate hostile bodies
(an unpaired surrogate, invalid JSON, a wrong type, an out-of-vocabulary id, a body over
the limit). Each kind has the statuses it may get: 200 for generation (429/503 count as
overload, reported apart), its 4xx for a hostile body; anything else (another status, a
connection error, an error event inside a 200 stream) is unexpected.

Per minute it reports requests by status, TTFT p50/p99 of streams, e2e p99, and from the
service's ``/metrics`` every replica's KV usage and every process's RSS (replicas, router
actor, HTTP ingress). At the end it waits for the service to go idle (no request
running, no KV block in use). One summary line; JSON in ``results/soak.json``.
Exit status 0 when nothing was unexpected and the service went idle.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

import httpx

from kvroute.benchmarks import options

WORDS = "the archive keeps every record of the river city and its bridges ledgers maps letters".split()
SYSTEM = "You are the archivist of the river city. Answer from the ledgers, briefly and exactly. " * 4
TENANTS = ("tenant-a", "tenant-b", "tenant-c", "tenant-d")
OK = frozenset({200})
OVERLOAD = frozenset({429, 503})


@dataclass
class Outcome:
    kind: str
    status: Any  # the HTTP status, or "error: ..." when none came
    started: float
    e2e_s: float
    ttft_s: Optional[float] = None
    problem: Optional[str] = None  # set when the outcome is unexpected


# ---------------------------------------------------------------------- request kinds
def _words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


async def _post(c: httpx.AsyncClient, route: str, body: Any, raw: bool = False) -> tuple[int, Any, None]:
    if raw:
        r = await c.post(route, content=body, headers={"content-type": "application/json"})
    else:
        r = await c.post(route, json=body)
    return r.status_code, (r.json() if r.headers.get("content-type", "").startswith("application/json") else r.text), None


async def _stream(c: httpx.AsyncClient, route: str, body: dict, hang_up: bool = False) -> tuple[int, Any, Optional[float]]:
    started = time.monotonic()
    ttft = None
    async with c.stream("POST", route, json={**body, "stream": True}) as r:
        if r.status_code != 200:
            return r.status_code, (await r.aread()).decode(errors="replace"), None
        done = False
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                done = True
                break
            event = json.loads(line[6:])
            if "error" in event:
                return 200, f"error event in the stream: {event['error']}", ttft
            choice = (event.get("choices") or [{}])[0]
            if ttft is None and (choice.get("text") or (choice.get("delta") or {}).get("content")):
                ttft = time.monotonic() - started
                if hang_up:
                    return 200, None, ttft
        if not done:
            return 200, "the stream ended without [DONE]", ttft
    return 200, None, ttft


def _kinds(max_tokens: int, max_body_bytes: int) -> dict[str, tuple[float, frozenset, Callable]]:
    """kind -> (weight, expected statuses, send(client, rng) -> (status, body-or-problem, ttft))."""
    gen = {"max_tokens": max_tokens, "ignore_eos": True}

    def completion(c, rng):
        return _post(c, "/v1/completions", {**gen, "prompt": _words(rng, 12)})

    def stream(c, rng):
        return _stream(c, "/v1/completions", {**gen, "prompt": _words(rng, 12)})

    def chat(c, rng):
        return _post(c, "/v1/chat/completions", {**gen, "messages": [{"role": "user", "content": _words(rng, 8)}]})

    def chat_stream(c, rng):
        return _stream(c, "/v1/chat/completions", {**gen, "messages": [{"role": "user", "content": _words(rng, 8)}]})

    def n2(c, rng):
        return _post(c, "/v1/completions", {**gen, "prompt": _words(rng, 10), "n": 2})

    def prompt_list(c, rng):
        return _post(c, "/v1/completions", {**gen, "prompt": [_words(rng, 6), _words(rng, 6)]})

    def salted(c, rng):
        body = {**gen, "prompt": SYSTEM + _words(rng, 6), "cache_salt": rng.choice(TENANTS)}
        return _stream(c, "/v1/completions", body)

    def disconnect(c, rng):
        return _stream(c, "/v1/completions", {**gen, "max_tokens": max(32, max_tokens), "prompt": _words(rng, 12)}, hang_up=True)

    def hostile(body: bytes) -> Callable:
        return lambda c, rng: _post(c, "/v1/completions", body, raw=True)

    return {
        "completion": (3.0, OK, completion),
        "stream": (3.0, OK, stream),
        "chat": (1.5, OK, chat),
        "chat_stream": (1.5, OK, chat_stream),
        "n2": (1.0, OK, n2),
        "prompt_list": (1.0, OK, prompt_list),
        "salted": (2.0, OK, salted),
        "disconnect": (1.0, OK, disconnect),
        "surrogate": (0.15, frozenset({400}), hostile(b'{"prompt": "\\ud800 lone", "max_tokens": 2}')),
        "bad_json": (0.15, frozenset({400}), hostile(b'{"prompt": "x",')),
        "wrong_type": (0.15, frozenset({400}), hostile(b'{"prompt": "x", "max_tokens": "many"}')),
        "oov_ids": (0.15, frozenset({400}), hostile(b'{"prompt": [1000000000], "max_tokens": 2}')),
        "over_limit": (0.1, frozenset({413}), hostile(json.dumps({"prompt": "x" * (max_body_bytes + 1024)}).encode())),
    }


def _check(kind: str, expected: frozenset, status: int, body: Any) -> Optional[str]:
    if status in expected:
        if status == 200 and isinstance(body, str):
            return body  # a problem the stream reader found
        if status == 200 and isinstance(body, dict) and kind in ("n2", "prompt_list") and len(body.get("choices", [])) != 2:
            return f"{kind}: {len(body.get('choices', []))} choices"
        if status >= 400 and not (isinstance(body, dict) and set(body.get("error", {})) >= {"message", "type"}):
            return f"{status} outside OpenAI's error envelope: {str(body)[:200]}"
        return None
    if status in OVERLOAD and expected == OK:
        return None
    return f"{kind}: status {status}, expected {sorted(expected)}: {str(body)[:300]}"


# ---------------------------------------------------------------------- metrics
async def _sample(c: httpx.AsyncClient) -> dict[str, Any]:
    from prometheus_client.parser import text_string_to_metric_families

    text = (await c.get("/metrics", timeout=30)).text
    out: dict[str, Any] = {"kv_usage": {}, "running": 0.0, "rss_mib": {}}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if fam.name == "vllm:kv_cache_usage_perc":
                out["kv_usage"][s.labels["replica"]] = s.value
            elif fam.name == "vllm:num_requests_running":
                out["running"] += s.value
            elif fam.name == "kvroute:process_resident_memory_bytes":
                key = s.labels["role"] + (f":{s.labels['replica'][-8:]}" if s.labels["replica"] else "")
                out["rss_mib"][key] = round(s.value / 2**20, 1)
    return out


def _pct(values: list[float], q: float) -> Optional[float]:
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def _window(outcomes: list[Outcome], sample: dict[str, Any], index: int) -> dict[str, Any]:
    by_status: dict[str, int] = {}
    by_kind: dict[str, int] = {}
    for o in outcomes:
        by_status[str(o.status)] = by_status.get(str(o.status), 0) + 1
        by_kind[o.kind] = by_kind.get(o.kind, 0) + 1
    ttfts = [o.ttft_s for o in outcomes if o.ttft_s is not None]
    problems = [o.problem for o in outcomes if o.problem]
    return {
        "minute": index,
        "requests": len(outcomes),
        "by_status": by_status,
        "by_kind": by_kind,
        "unexpected": len(problems),
        "unexpected_examples": problems[:5],
        "overload": sum(1 for o in outcomes if o.status in OVERLOAD),
        "ttft_p50_s": _pct(ttfts, 0.5),
        "ttft_p99_s": _pct(ttfts, 0.99),
        "e2e_p99_s": _pct([o.e2e_s for o in outcomes], 0.99),
        **sample,
    }


# ---------------------------------------------------------------------- the run
async def run_load(url: str, minutes: float, concurrency: int, max_tokens: int, max_body_bytes: int, seed: int) -> dict[str, Any]:
    kinds = _kinds(max_tokens, max_body_bytes)
    names = list(kinds)
    weights = [kinds[k][0] for k in names]
    total_s = minutes * 60.0
    window_s = min(60.0, total_s)
    start = time.monotonic()
    deadline = start + total_s
    n_windows = max(1, round(total_s / window_s))
    outcomes: list[Outcome] = []
    samples: list[dict[str, Any]] = []
    limits = httpx.Limits(max_connections=concurrency + 4)
    async with httpx.AsyncClient(base_url=url, timeout=120, limits=limits) as c:

        async def worker(w: int) -> None:
            rng = random.Random(seed * 1000 + w)
            i = 0
            while time.monotonic() < deadline:
                kind = names[(w + i) % len(names)] if i < len(names) else rng.choices(names, weights)[0]
                i += 1
                _, expected, send = kinds[kind]
                t0 = time.monotonic()
                try:
                    status, body, ttft = await send(c, rng)
                    problem = _check(kind, expected, status, body)
                except (httpx.HTTPError, json.JSONDecodeError) as exc:
                    status, ttft, problem = f"error: {type(exc).__name__}", None, f"{kind}: {exc!r}"
                outcomes.append(Outcome(kind, status, t0 - start, time.monotonic() - t0, ttft, problem))

        async def sampler() -> None:  # the service's figures at the end of every window but the last
            for index in range(n_windows - 1):
                await asyncio.sleep(max(0.0, start + (index + 1) * window_s - time.monotonic()))
                samples.append(await _sample(c))
                print(f"  min {index}: {sum(1 for o in outcomes if o.started < (index + 1) * window_s)} requests so far", flush=True)

        sampling = asyncio.ensure_future(sampler())
        await asyncio.gather(*(worker(w) for w in range(concurrency)))
        await sampling
        samples.append(await _sample(c))  # the last window ends when its requests have
        idle = await _wait_idle(c)
    windows = []
    for index, sample in enumerate(samples):
        lo = index * window_s
        hi = float("inf") if index == n_windows - 1 else lo + window_s
        windows.append(_window([o for o in outcomes if lo <= o.started < hi], sample, index))
        _print_row(windows[-1])
    return {"windows": windows, "outcomes": outcomes, "idle": idle}


async def _wait_idle(c: httpx.AsyncClient, timeout_s: float = 30.0) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    while True:
        sample = await _sample(c)
        ok = sample["running"] == 0 and all(v == 0 for v in sample["kv_usage"].values())
        if ok or time.monotonic() > deadline:
            return {"ok": ok, **sample}
        await asyncio.sleep(1.0)


def _print_row(w: dict[str, Any]) -> None:
    ttft = "-" if w["ttft_p99_s"] is None else f"{w['ttft_p99_s']:.2f}"
    kv = ",".join(f"{v:.2f}" for v in w["kv_usage"].values())
    rss = " ".join(f"{k}={v:.0f}" for k, v in sorted(w["rss_mib"].items()))
    print(f"  min {w['minute']:>3}: {w['requests']:>5} req {w['unexpected']} unexpected {w['overload']} overload  "
          f"p99 TTFT {ttft} s  KV {kv}  RSS MiB {rss}", flush=True)


# ---------------------------------------------------------------------- the service
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_service(args: argparse.Namespace) -> tuple[subprocess.Popen, str]:
    port = args.port or _free_port()
    cmd = [str(Path(sys.executable).parent / "kvroute"), "serve", "--model", args.model, "--replicas", str(args.replicas),
           "--port", str(port), "--max-body-bytes", str(args.max_body_bytes)]
    for flag in ("dtype", "block_size", "num_kv_blocks", "max_model_len", "emulate", "time_scale", "step_target_s"):
        if getattr(args, flag, None) is not None:
            cmd += [f"--{flag.replace('_', '-')}", str(getattr(args, flag))]
    env = os.environ | {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    deadline = time.monotonic() + 300
    for line in proc.stdout:
        if "kvroute: ready" in line:
            threading.Thread(target=lambda: [None for _ in proc.stdout], daemon=True).start()  # keep the pipe drained
            return proc, f"http://127.0.0.1:{port}"
        if time.monotonic() > deadline:
            break
    proc.kill()
    raise RuntimeError("kvroute serve did not become ready")


def stop_service(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(timeout=120)
    except subprocess.TimeoutExpired:
        proc.kill()


def summarize(result: dict[str, Any]) -> dict[str, Any]:
    outcomes: list[Outcome] = result["outcomes"]
    windows = result["windows"]
    by_status: dict[str, int] = {}
    for o in outcomes:
        by_status[str(o.status)] = by_status.get(str(o.status), 0) + 1
    first, last = windows[0]["rss_mib"], windows[-1]["rss_mib"]
    return {
        "requests": len(outcomes),
        "by_status": by_status,
        "by_kind": {k: sum(1 for o in outcomes if o.kind == k) for k in sorted({o.kind for o in outcomes})},
        "unexpected": sum(1 for o in outcomes if o.problem),
        "unexpected_examples": [o.problem for o in outcomes if o.problem][:10],
        "overload": sum(1 for o in outcomes if o.status in OVERLOAD),
        "ttft_p99_s": _pct([o.ttft_s for o in outcomes if o.ttft_s is not None], 0.99),
        "rss_growth_mib": {k: round(last[k] - first[k], 1) for k in first if k in last},
        "idle": result["idle"],
        "windows": windows,
    }


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--minutes", type=float, default=30.0)
    p.add_argument("--url", default=None, help="a running service (default: start `kvroute serve`)")
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--port", type=int, default=None)
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--max-body-bytes", type=int, default=65536, help="the started service's limit (and the over-limit body's size)")
    options.add_seed(p)
    p.add_argument("--dtype", default=None)
    p.add_argument("--block-size", type=int, default=None)
    p.add_argument("--num-kv-blocks", type=int, default=None)
    p.add_argument("--max-model-len", type=int, default=None)
    options.add_output(p, "soak")


def run(args: argparse.Namespace) -> int:
    if args.minutes <= 0 or args.concurrency < 1:
        raise ValueError("--minutes must be > 0 and --concurrency >= 1")
    proc, url = (None, args.url) if args.url else start_service(args)
    try:
        print(f"soak: {args.minutes} min against {url}, {args.concurrency} workers", flush=True)
        result = asyncio.run(run_load(url, args.minutes, args.concurrency, args.max_tokens, args.max_body_bytes, args.seed))
    finally:
        if proc is not None:
            stop_service(proc)
    summary = summarize(result)
    config = {k: v for k, v in vars(args).items() if k != "out"} | {"url": url}
    out = options.result_file("soak", args.out)
    out.write_text(json.dumps({"benchmark": "soak", "time": time.strftime("%Y-%m-%dT%H:%M:%S"), "config": config, **summary}, indent=2))
    first, last = summary["windows"][0]["rss_mib"], summary["windows"][-1]["rss_mib"]
    replicas = [k for k in sorted(first) if k.startswith("replica") and k in last]
    rss = ", ".join(f"{first[k]:.0f}->{last[k]:.0f}" for k in replicas) or "?"
    ttft = "-" if summary["ttft_p99_s"] is None else f"{summary['ttft_p99_s']:.2f} s"
    idle = summary["idle"]
    print(
        f"soak: {args.minutes:g} min, {summary['requests']:,} requests, {summary['unexpected']} unexpected, "
        f"{summary['overload']} overload, p99 TTFT {ttft}, replica RSS {rss} MiB, "
        f"idle: {idle['running']:g} running, {max(idle['kv_usage'].values(), default=0):.1%} KV  [{out}]"
    )
    return 0 if summary["unexpected"] == 0 and idle["ok"] else 1


if __name__ == "__main__":
    from kvroute.benchmarks.cli import module_main

    raise SystemExit(module_main(__spec__.name))
