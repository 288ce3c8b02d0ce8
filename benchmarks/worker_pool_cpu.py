"""The worker pool's CPU per worker per second (``kvroute serve --workers``), before and
after a change: what parsing a vLLM ``/metrics`` page costs, and what a pool polling
emulated workers spends in all.

    kvroute bench worker_pool_cpu [--baseline REF] [--workers 2,64]
        [--seconds 10] [--poll-interval 1.0] [--rounds 1] [--out PATH]

- *parse*: ``cluster/worker_load.py``'s ``parse_load`` on a realistic vLLM page
  (``vllm_metrics_page``: vLLM's v1 gauges, counters and per-request histograms with its
  buckets and labels, Python process metrics and the HTTP instrumentator's, grown to
  ``--page-bytes``, 53 KB as a vLLM 0.x worker serves one), CPU µs per call
  (``time.thread_time``, median of ``--parses`` calls).
- *pool*: a ``WorkerPool`` in this process (no router actors: ``routers=[]``, so Ray's
  own per-call CPU is left out) polling N emulated workers every ``--poll-interval``:
  tiny HTTP/1.1 servers in one child process (asyncio, keep-alive), each serving
  ``/health``, ``/v1/models`` and that page at ``/metrics``. Once every worker is up,
  this process's CPU (``time.process_time``: all its threads) over ``--seconds``, per
  worker per second and per poll, in ms, and the polls it made per worker per second (a
  pool whose loop cannot keep up polls less often than ``--poll-interval``).

``--baseline REF`` runs both with git ``REF``'s ``deploy/`` and ``cluster/`` code (``git
archive`` into a temp dir, in a child process, alternating with this checkout's for
``--rounds``) and prints before / after. One summary line, and JSON to ``--out``
(``benchmarks/common.py``'s ``write_result``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from kvroute.benchmarks import options
from kvroute.benchmarks.baseline import alternate, child_run

# vLLM v1's histograms (vllm/v1/metrics/loggers.py): name -> buckets
_TIME_BUCKETS = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0,
                 960.0, 1920.0, 7680.0]  # fmt: skip
_TOKEN_BUCKETS = [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000]
_HISTOGRAMS = {
    "vllm:request_prompt_tokens": _TOKEN_BUCKETS, "vllm:request_generation_tokens": _TOKEN_BUCKETS,
    "vllm:iteration_tokens_total": [1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384],
    "vllm:request_max_num_generation_tokens": _TOKEN_BUCKETS, "vllm:request_params_n": [1, 2, 5, 10, 20],
    "vllm:request_params_max_tokens": _TOKEN_BUCKETS,
    "vllm:time_to_first_token_seconds": [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                                         7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0],
    "vllm:time_per_output_token_seconds": [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
                                           7.5, 10.0, 20.0, 40.0, 80.0],
    "vllm:inter_token_latency_seconds": [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
                                         7.5, 10.0, 20.0, 40.0, 80.0],
    "vllm:e2e_request_latency_seconds": _TIME_BUCKETS, "vllm:request_queue_time_seconds": _TIME_BUCKETS,
    "vllm:request_inference_time_seconds": _TIME_BUCKETS, "vllm:request_prefill_time_seconds": _TIME_BUCKETS,
    "vllm:request_decode_time_seconds": _TIME_BUCKETS,
    "vllm:request_prefill_kv_computed_tokens": _TOKEN_BUCKETS,
}  # fmt: skip
_HANDLERS = ["/v1/completions", "/v1/chat/completions", "/metrics", "/health", "/v1/models", "/tokenize", "/detokenize",
             "/v1/embeddings", "/load", "/ping", "/version", "/v1/responses", "/invocations", "/pooling", "/score"]  # fmt: skip


def vllm_metrics_page(target_bytes: int = 53_000, model: str = "smollm2", seed: int = 0) -> str:
    """A vLLM worker's ``/metrics`` page as its ``prometheus_client`` writes it (module
    docstring), at least ``target_bytes`` long: the HTTP instrumentator's per-handler
    series are added until it is."""
    from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Summary
    from prometheus_client.exposition import generate_latest
    from prometheus_client.gc_collector import GCCollector
    from prometheus_client.platform_collector import PlatformCollector
    from prometheus_client.process_collector import ProcessCollector

    rng = random.Random(seed)
    reg = CollectorRegistry()
    GCCollector(registry=reg), PlatformCollector(registry=reg), ProcessCollector(registry=reg)
    lab = {"engine": "0", "model_name": model}
    Gauge("vllm:cache_config_info", "Information of the LLMEngine CacheConfig", ["block_size", "cache_dtype", "engine",
          "num_gpu_blocks", "prefix_caching_hash_algo", "enable_prefix_caching", "gpu_memory_utilization"],
          registry=reg).labels("16", "auto", "0", "2048", "sha256", "True", "0.9").set(1)  # fmt: skip
    for name, value in (("vllm:num_requests_running", 3), ("vllm:num_requests_waiting", 2), ("vllm:kv_cache_usage_perc", 0.25)):
        Gauge(name, "doc", list(lab), registry=reg).labels(**lab).set(value)
    for name in ("vllm:prefix_cache_queries", "vllm:prefix_cache_hits", "vllm:num_preemptions", "vllm:prompt_tokens",
                 "vllm:generation_tokens"):  # fmt: skip
        Counter(name, "doc", list(lab), registry=reg).labels(**lab).inc(rng.randint(1, 10**6))
    success = Counter("vllm:request_success", "doc", [*lab, "finished_reason"], registry=reg)
    for reason in ("stop", "length", "abort", "error"):
        success.labels(**lab, finished_reason=reason).inc(rng.randint(1, 1000))
    for name, buckets in _HISTOGRAMS.items():
        h = Histogram(name, "doc", list(lab), buckets=buckets, registry=reg).labels(**lab)
        for _ in range(50):
            h.observe(rng.choice(buckets) * rng.random())
    reqs = Counter("http_requests", "Total number of requests by method, status and handler.", ["handler", "method", "status"],
                   registry=reg)  # fmt: skip
    size = Summary("http_request_size_bytes", "doc", ["handler"], registry=reg)
    resp = Summary("http_response_size_bytes", "doc", ["handler"], registry=reg)
    dur = Histogram("http_request_duration_seconds", "doc", ["handler", "method"], buckets=[0.1, 0.5, 1], registry=reg)
    Histogram("http_request_duration_highr_seconds", "doc", buckets=[0.01 * 1.3**i for i in range(30)], registry=reg).observe(0.2)
    for i in range(10_000):
        page = generate_latest(reg).decode()
        if len(page) >= target_bytes:
            return page
        handler = _HANDLERS[i] if i < len(_HANDLERS) else f"/v1/handler_{i}"
        for status in ("2xx", "4xx", "5xx"):
            reqs.labels(handler, "POST", status).inc(rng.randint(1, 1000))
        size.labels(handler).observe(100), resp.labels(handler).observe(1000), dur.labels(handler, "POST").observe(0.2)
    raise AssertionError("the page did not grow")


# ---------------------------------------------------------------------- emulated workers
def _serve_workers(ports: list[int], page: str, model: str) -> None:
    """The child process: one keep-alive HTTP/1.1 server per port, all on one event loop."""
    bodies = {b"/health": b"{}", b"/v1/models": json.dumps({"data": [{"id": model, "root": model}]}).encode(),
              b"/metrics": page.encode()}  # fmt: skip

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                path = head.split(b" ", 2)[1]
                body = bodies.get(path)
                status = b"200 OK" if body is not None else b"404 Not Found"
                body = body if body is not None else b"{}"
                writer.write(b"HTTP/1.1 " + status + b"\r\ncontent-type: text/plain\r\ncontent-length: "
                             + str(len(body)).encode() + b"\r\n\r\n" + body)  # fmt: skip
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            writer.close()

    async def main() -> None:
        servers = [await asyncio.start_server(handle, "127.0.0.1", p) for p in ports]
        print("ready", flush=True)
        await asyncio.gather(*(s.serve_forever() for s in servers))

    asyncio.run(main())


def _free_ports(n: int) -> list[int]:
    import socket

    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def measure_pool(n: int, seconds: float, poll_interval_s: float, page_bytes: int) -> dict[str, Any]:
    """This process's CPU while a ``WorkerPool`` polls ``n`` emulated workers (module docstring)."""
    from kvroute.cluster.config import ClusterConfig
    from kvroute.cluster.worker_pool import WorkerPool
    from kvroute.replica.config import EngineConfig

    ports = _free_ports(n)
    child = subprocess.Popen([sys.executable, "-c", "import sys, json; from kvroute.benchmarks.worker_pool_cpu import "
                              "_serve_workers, vllm_metrics_page; ports = json.loads(sys.argv[1]); "
                              f"_serve_workers(ports, vllm_metrics_page({page_bytes}), 'smollm2')", json.dumps(ports)],
                             stdout=subprocess.PIPE, text=True, env=os.environ)  # fmt: skip
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "ready"
        config = ClusterConfig(engine=EngineConfig(model="smollm2", block_size=16))
        specs = [{"url": f"http://127.0.0.1:{p}"} for p in ports]

        async def run() -> dict[str, Any]:
            logging.getLogger("kvroute.cluster.worker_pool").setLevel(logging.ERROR)  # 64 "taken out" lines at the end
            pool = WorkerPool(config, specs, ["smollm2"], poll_interval_s, routers=[])
            await pool.up_workers()
            deadline = time.monotonic() + 60
            while sum(w.up for w in pool.workers.values()) < n:
                assert time.monotonic() < deadline, "the emulated workers did not come up"
                await asyncio.sleep(0.05)
            await asyncio.sleep(2 * poll_interval_s)  # past the probes
            polls0, cpu0, t0 = sum(w.counters["polls"] for w in pool.workers.values()), time.process_time(), time.monotonic()
            await asyncio.sleep(seconds)
            cpu, wall = time.process_time() - cpu0, time.monotonic() - t0
            polls = sum(w.counters["polls"] for w in pool.workers.values()) - polls0
            await pool.stop()
            return {"workers": n, "cpu_s": cpu, "wall_s": wall, "polls": polls,
                    "cpu_ms_per_worker_s": 1e3 * cpu / wall / n, "polls_per_worker_s": polls / wall / n,
                    "cpu_ms_per_poll": 1e3 * cpu / max(polls, 1)}  # fmt: skip

        return asyncio.run(run())
    finally:
        child.kill()
        child.wait()


def measure_parse(page: str, calls: int) -> dict[str, Any]:
    from kvroute.cluster.worker_load import WorkerRates, parse_load

    rates, times = WorkerRates(), []
    for i in range(calls):
        t0 = time.thread_time()
        parse_load(page, 0, rates, now=float(i))
        times.append(time.thread_time() - t0)
    return {"page_bytes": len(page.encode()), "parse_us_p50": 1e6 * statistics.median(times), "calls": calls}


def run_all(args: argparse.Namespace) -> dict[str, Any]:
    from kvroute.cluster import worker_load

    page = vllm_metrics_page(args.page_bytes)
    out = {"parse": measure_parse(page, args.parses), "code_file": worker_load.__file__}
    out["pool"] = [measure_pool(n, args.seconds, args.poll_interval, args.page_bytes) for n in args.workers]
    return out


# ---------------------------------------------------------------------- before / after
def _passthrough(args: argparse.Namespace) -> list[str]:
    return [f"--workers={','.join(map(str, args.workers))}", f"--seconds={args.seconds}",
            f"--poll-interval={args.poll_interval}", f"--page-bytes={args.page_bytes}", f"--parses={args.parses}"]  # fmt: skip


def _child(args: argparse.Namespace, tree: str | None) -> dict[str, Any]:
    return json.loads(child_run("kvroute.benchmarks.worker_pool_cpu", _passthrough(args), tree))


def child(argv: list[str]) -> None:
    """One side of a ``--baseline`` comparison, in a fresh interpreter (this checkout's
    code or the baseline's): its figures as one JSON line."""
    p = argparse.ArgumentParser()
    add_args(p)
    print(json.dumps(run_all(p.parse_args(argv))))


def compare(args: argparse.Namespace) -> dict[str, Any]:
    runs = alternate(args.baseline, Path(__file__), args.rounds, lambda tree: _child(args, tree))
    assert runs["before"][0]["code_file"] != runs["after"][0]["code_file"], "the baseline ran this checkout's code"

    def med(side: str, pick: Any) -> float:
        return statistics.median(pick(r) for r in runs[side])

    out: dict[str, Any] = {"parse_us_p50": {s: med(s, lambda r: r["parse"]["parse_us_p50"]) for s in runs}}
    for i, n in enumerate(args.workers):
        out[f"pool_{n}_cpu_ms_per_worker_s"] = {s: med(s, lambda r: r["pool"][i]["cpu_ms_per_worker_s"]) for s in runs}
        out[f"pool_{n}_polls_per_worker_s"] = {s: med(s, lambda r: r["pool"][i]["polls_per_worker_s"]) for s in runs}
        out[f"pool_{n}_cpu_ms_per_poll"] = {s: med(s, lambda r: r["pool"][i]["cpu_ms_per_poll"]) for s in runs}
    return {"figures": out, "runs": runs}


def add_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--workers", type=lambda s: [int(x) for x in s.split(",")], default=[2, 64])
    ap.add_argument("--seconds", type=float, default=10.0, help="measured seconds per pool size")
    ap.add_argument("--poll-interval", type=float, default=1.0, help="the pool's worker_poll_interval_s")
    ap.add_argument("--page-bytes", type=int, default=53_000)
    ap.add_argument("--parses", type=int, default=300)
    ap.add_argument("--baseline", default=None, help="git ref to compare against, side by side")
    ap.add_argument("--rounds", type=int, default=1)
    options.add_output(ap, "worker_pool_cpu")


def run(args: argparse.Namespace) -> int:
    from kvroute.benchmarks.common import write_result

    if args.baseline:
        r = compare(args)
        parts = [f"{k} {v['before']:.3g} -> {v['after']:.3g}" for k, v in r["figures"].items() if "cpu" in k or "parse" in k]
        write_result("worker_pool_cpu", {"config": vars(args), **r}, f"before ({args.baseline}) -> after: "
                     + "; ".join(parts), args.out)  # fmt: skip
        return 0
    r = run_all(args)
    parts = [f"parse {r['parse']['parse_us_p50']:.0f} us/page ({r['parse']['page_bytes']} B)"]
    parts += [f"{p['workers']} workers {p['cpu_ms_per_worker_s']:.2f} ms CPU per worker-s ({p['polls_per_worker_s']:.2f} polls/s)"
              for p in r["pool"]]  # fmt: skip
    write_result("worker_pool_cpu", {"config": vars(args), **r}, "; ".join(parts), args.out)
    return 0


if __name__ == "__main__":
    from kvroute.benchmarks.cli import module_main

    raise SystemExit(module_main(__spec__.name))
