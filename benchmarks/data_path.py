"""The data path at real speed: the routing layer's own cost, kvroute beside its peers.

    kvroute bench data_path                      # every system, 20 req/s and 32 in flight, 30 s each
    kvroute bench data_path --systems kvroute_haproxy,sglang_router --rate 10 --seconds 3

Every system runs on the same two emulated engine replicas (``--emulate
gpu_h100_llama3_8b --time-scale 0.25`` by default: the real scheduler and KV cache, no
model, each step timed by the profile), started afresh for each system:

- ``kvroute_direct``: ``kvroute serve`` as it starts by default: HAProxy forwards each
  request straight to the engine replica an ingress request router chose
  (``deploy/direct_app.py``),
- ``kvroute_haproxy``: ``kvroute serve --proxy haproxy --data-path composed`` (Ray
  Serve's HAProxy and throughput-optimised path, ``deploy/serve_proxy.py``, in front of
  the ingress deployment),
- ``kvroute_python``: ``kvroute serve --proxy python`` (Serve's proxy actor),
- ``kvroute_workers``: ``kvroute serve --workers`` in front of two ``kvroute
  serve-replica`` processes, their KV events on (``--no-worker-events``: off),
- ``sglang_router`` and ``vllm_router``: the peers' routers with ``--policy
  cache_aware`` in front of two ``serve-replica`` processes (``benchmarks/external_fleet.py``),
- ``direct``: no router: the client sends each prefix's requests straight to one of two
  ``serve-replica`` processes (prefix ``i`` to replica ``i mod 2``), the baseline for the
  added latency.

The workload: chat requests of about 660 prompt tokens (a 600-token prefix, one of 16
shared ones, then 30 fresh tokens, in the model's chat template), ``max_tokens`` 4, not
streamed, greedy. Per system, after a warm-up (every prefix once, then a short burst):

1. idle: the routing layer's cores over ``--idle-seconds`` with no requests;
2. open loop: ``--rate`` requests/s for ``--seconds``: the routing layer's CPU per
   request (every process of the system but the engine replicas, whose CPU is reported
   apart), its split by process kind (``benchmarks/cpu_account.py``), the marginal CPU
   per request (less the idle cores), latency p50/p99;
3. closed loop: ``--concurrency`` requests in flight for ``--seconds``: requests/s at
   saturation, latency p50/p99.

The load generator is this process (aiohttp, one connection pool), left out of the
routing layer's CPU; its own CPU per request is in the JSON. kvroute serve is started
as ``python -c`` of the CLI in its own session and stopped with SIGINT; what is left of
its process group afterwards (HAProxy above all) is ended. One summary line, JSON
(``--out``), and a markdown table beside the JSON (``.md``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import signal
import subprocess
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

from kvroute.benchmarks import cpu_account, options
from kvroute.benchmarks.external_fleet import ExternalFleet
from kvroute.benchmarks.fleet_probes import SERVED_NAME, free_port, wait_http
from kvroute.benchmarks.fleets import _CLI, EXTERNAL_ROUTERS, FleetConfig, external_available

NAME = "data_path"
SYSTEMS = ("kvroute_direct", "kvroute_haproxy", "kvroute_python", "kvroute_workers", "sglang_router", "vllm_router", "direct")
ENGINE_KINDS = ("EngineReplica", "serve-replica")  # the engine replicas: not the routing layer
MODEL = "smollm2-135m-instruct"
BLOCK_SIZE = 16
# words SmolLM2's tokenizer keeps as one token after a space: N words are N tokens
WORDS = "alpha beta gamma delta epsilon theta lambda mu nu xi pi rho sigma tau".split()
LABELS = {"kvroute_direct": "`kvroute serve` (direct path)",
          "kvroute_haproxy": "`kvroute serve --data-path composed` (HAProxy)", "kvroute_python": "`kvroute serve --proxy python`",
          "kvroute_workers": "`kvroute serve --workers` over two `serve-replica`",
          "sglang_router": "sglang-router `cache_aware`", "vllm_router": "vllm-router `cache_aware`",
          "direct": "direct to the replica (no router)"}  # fmt: skip


# ---------------------------------------------------------------------- workload
class Workload:
    """Chat bodies of ``prefix_tokens`` shared tokens (one of ``prefixes``) and
    ``suffix_tokens`` fresh ones, drawn with ``seed``; ``next()`` gives (prefix, body)."""

    def __init__(self, prefixes: int = 16, prefix_tokens: int = 600, suffix_tokens: int = 30, seed: int = 0,
                 max_tokens: int = 4) -> None:  # fmt: skip
        self.rng = random.Random(seed)
        self.prefixes = [" ".join(self.rng.choice(WORDS) for _ in range(prefix_tokens)) for _ in range(prefixes)]
        self.suffix_tokens, self.max_tokens = suffix_tokens, max_tokens

    def body(self, prefix: int) -> bytes:
        text = self.prefixes[prefix] + " " + " ".join(self.rng.choice(WORDS) for _ in range(self.suffix_tokens))
        return json.dumps({"model": SERVED_NAME, "messages": [{"role": "user", "content": text}],
                           "max_tokens": self.max_tokens, "temperature": 0, "stream": False}).encode()  # fmt: skip

    def next(self) -> tuple[int, bytes]:
        prefix = self.rng.randrange(len(self.prefixes))
        return prefix, self.body(prefix)


@dataclass
class Phase:
    """What one phase's requests did."""

    latencies_s: list[float] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    prompt_tokens: int = 0
    cached_tokens: int = 0

    def summary(self, wall_s: float) -> dict[str, Any]:
        q, n = sorted(self.latencies_s), len(self.latencies_s)
        return {"requests": n + len(self.errors), "ok": n, "errors": len(self.errors), "error_examples": self.errors[:5],
                "wall_s": round(wall_s, 3), "requests_per_s": round(n / wall_s, 2) if wall_s else 0.0,
                "p50_ms": round(1e3 * _pct(q, 0.5), 2) if q else None, "p99_ms": round(1e3 * _pct(q, 0.99), 2) if q else None,
                "mean_prompt_tokens": round(self.prompt_tokens / n, 1) if n else None,
                "cached_fraction": round(self.cached_tokens / self.prompt_tokens, 3) if self.prompt_tokens else None}  # fmt: skip


def _pct(sorted_xs: list[float], q: float) -> float:
    return sorted_xs[min(len(sorted_xs) - 1, int(q * len(sorted_xs)))]


class Load:
    """The load generator: one aiohttp session; ``url_for(prefix)`` is the base URL a
    request of that prefix goes to (one router, or a replica for ``direct``)."""

    def __init__(self, url_for: Callable[[int], str], workload: Workload, timeout_s: float = 120.0) -> None:
        self.url_for, self.workload, self.timeout_s = url_for, workload, timeout_s

    async def _one(self, session: Any, phase: Phase, prefix: int, body: bytes) -> None:
        started = time.perf_counter()
        try:
            async with session.post(self.url_for(prefix) + "/v1/chat/completions", data=body,
                                    headers={"Content-Type": "application/json"}) as r:  # fmt: skip
                raw = await r.read()
                if r.status != 200:
                    phase.errors.append(f"{r.status} {raw[:200]!r}")
                    return
        except Exception as exc:  # a dropped connection, a timeout: counted, never fatal
            phase.errors.append(f"{type(exc).__name__}: {exc}"[:300])
            return
        phase.latencies_s.append(time.perf_counter() - started)
        usage = json.loads(raw).get("usage") or {}
        phase.prompt_tokens += usage.get("prompt_tokens") or 0
        phase.cached_tokens += (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0

    def _session(self) -> Any:
        import aiohttp

        return aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=512, force_close=False),
                                     timeout=aiohttp.ClientTimeout(total=self.timeout_s))  # fmt: skip

    async def warm_up(self, burst: int = 16) -> Phase:
        """Every prefix once, in turn, then ``burst`` at once: caches, connections and
        the first request's one-off costs paid before any clock starts."""
        phase = Phase()
        async with self._session() as s:
            for prefix in range(len(self.workload.prefixes)):
                await self._one(s, phase, prefix, self.workload.body(prefix))
            await asyncio.gather(*(self._one(s, phase, *self.workload.next()) for _ in range(burst)))
        return phase

    async def open_loop(self, rate: float, seconds: float, on_start: Callable[[], None]) -> tuple[Phase, float]:
        """Requests at a fixed rate (evenly spaced) for ``seconds``; the wall time from
        the first to the last answer. ``on_start`` runs as the clock starts."""
        phase, tasks = Phase(), []
        async with self._session() as s:
            await asyncio.sleep(0)
            on_start()
            t0, k = time.perf_counter(), 0
            while time.perf_counter() - t0 < seconds:
                tasks.append(asyncio.ensure_future(self._one(s, phase, *self.workload.next())))
                k += 1
                await asyncio.sleep(max(0.0, t0 + k / rate - time.perf_counter()))
            await asyncio.gather(*tasks)
            return phase, time.perf_counter() - t0

    async def closed_loop(self, concurrency: int, seconds: float, on_start: Callable[[], None]) -> tuple[Phase, float]:
        """``concurrency`` clients, each sending its next request on the last's answer,
        for ``seconds``."""
        phase = Phase()
        async with self._session() as s:
            on_start()
            t0 = time.perf_counter()
            stop = t0 + seconds

            async def client() -> None:
                while time.perf_counter() < stop:
                    await self._one(s, phase, *self.workload.next())

            await asyncio.gather(*(client() for _ in range(concurrency)))
            return phase, time.perf_counter() - t0


# ---------------------------------------------------------------------- CPU by process
def _ppid(pid: int) -> Optional[int]:
    s = cpu_account._stat(pid)
    return None if s is None else s[0]


class Accountant:
    """CPU of this process's descendants, split into the routing layer and the engine
    replicas (a process of an engine kind, or one descended from such a process).
    ``names`` relabels processes by pid (the kvroute serve driver, which is otherwise
    just ``python``)."""

    def __init__(self, names: dict[int, str]) -> None:
        self.names = names
        self.root = os.getpid()

    def snapshot(self) -> cpu_account.Snapshot:
        snap = cpu_account.snapshot(self.root)
        return {pid: (self.names.get(pid, k), cpu) for pid, (k, cpu) in snap.items()}

    def _engine(self, snap: cpu_account.Snapshot) -> set[int]:
        engines = {pid for pid, (k, _) in snap.items() if k in ENGINE_KINDS}
        out = set(engines)
        for pid in snap:
            p: Optional[int] = pid
            while p is not None and p != self.root and p > 1:
                if p in engines:
                    out.add(pid)
                    break
                p = _ppid(p)
        return out

    def split(self, before: cpu_account.Snapshot, after: cpu_account.Snapshot, wall_s: float) -> dict[str, Any]:
        """Cores used between two snapshots: the routing layer's (total, by kind) and
        the engines' (total, by kind)."""
        engine = self._engine(after)
        layer = {p: v for p, v in after.items() if p not in engine}
        engines = {p: v for p, v in after.items() if p in engine}
        return {"routing": cpu_account.usage(before, layer, wall_s), "engine": cpu_account.usage(before, engines, wall_s)}


# ---------------------------------------------------------------------- the systems
@dataclass
class Running:
    """A started system: where requests go and which processes are whose."""

    url_for: Callable[[int], str]
    names: dict[int, str]
    info: dict[str, Any]


def _own_session(pid: int) -> list[int]:
    """Live processes of the session that ``pid`` leads (started with start_new_session)."""
    out = []
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            raw = (entry / "stat").read_text()
        except OSError:
            continue
        fields = raw[raw.rindex(")") + 2 :].split()
        if int(fields[3]) == pid and int(entry.name) != pid:  # field 6: the session id
            out.append(int(entry.name))
    return out


def _stop_serve(proc: subprocess.Popen, timeout_s: float = 120.0) -> dict[str, Any]:
    """SIGINT, wait for kvroute serve to tear Ray down, then end what is left of its
    session (HAProxy first: ``serve_proxy``'s list, taken before the stop)."""
    from kvroute.deploy import serve_proxy

    haproxies = serve_proxy.haproxy_pids(proc.pid)
    t0 = time.perf_counter()
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
    try:
        proc.wait(timeout=timeout_s)
        clean = True
    except subprocess.TimeoutExpired:
        clean = False
        proc.kill()
        proc.wait()
    orphans = serve_proxy.stop_orphans(haproxies)
    time.sleep(0.5)
    left = _own_session(proc.pid)
    for pid in left:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return {"stop_s": round(time.perf_counter() - t0, 1), "clean_exit": clean, "exit_code": proc.returncode,
            "haproxy_left": orphans, "processes_left": len(left)}  # fmt: skip


@contextmanager
def kvroute_serve(proxy: Optional[str], engine: dict[str, Any], log: Path, workers: Optional[str] = None) -> Iterator[tuple[str, subprocess.Popen]]:
    """``kvroute serve`` (``python -c`` of the CLI, its own session) with ``--proxy
    proxy``, two emulated replicas or ``--workers``; its base URL once it answers."""
    port = free_port()
    cmd = [sys.executable, "-c", _CLI, "serve", "--model", MODEL, "--served-model-name", SERVED_NAME,
           "--block-size", str(BLOCK_SIZE), "--port", str(port)]  # fmt: skip
    if proxy == "direct":
        cmd += ["--proxy", "haproxy", "--data-path", "direct"]
    elif proxy:
        cmd += ["--proxy", proxy, "--data-path", "composed"]
    if workers is not None:
        cmd += ["--workers", workers]
    else:
        cmd += ["--replicas", "2", "--emulate", engine["emulate"], "--time-scale", str(engine["time_scale"])]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    stopped: dict[str, Any] = {}
    try:
        wait_http(f"http://127.0.0.1:{port}/v1/models", [proc], 300)
        yield f"http://127.0.0.1:{port}", proc
    finally:
        stopped.update(_stop_serve(proc))
        print(f"    stopped kvroute serve: {stopped}", flush=True)


class _Replicas(ExternalFleet):
    """``ExternalFleet``'s ``serve-replica`` processes, optionally each publishing its KV
    events on a port of its own (``--kv-events-config``); ``endpoints``: where."""

    def __init__(self, engine: dict[str, Any], events: bool) -> None:
        super().__init__(FleetConfig(model=MODEL, replicas=2), {"block_size": BLOCK_SIZE, **engine})
        self.events, self.endpoints = events, []

    def _lora_flags(self) -> list[str]:  # called once per _start_replicas: one replica at a time below
        flags = super()._lora_flags()
        if self.events:
            port = free_port()
            self.endpoints.append(f"tcp://127.0.0.1:{port}")
            flags += ["--kv-events-config", json.dumps({"enable_kv_cache_events": True, "endpoint": f"tcp://*:{port}"})]
        return flags

    def start_each(self, n: int) -> list[str]:
        for _ in range(n):
            self._start_replicas(1)
        return list(self.urls)


@contextmanager
def _output_to(log: Path) -> Iterator[None]:
    """This process's stdout and stderr into ``log`` meanwhile: the processes started
    meanwhile inherit it and keep writing there."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = [os.dup(1), os.dup(2)]
    with open(log, "a") as out:
        os.dup2(out.fileno(), 1)
        os.dup2(out.fileno(), 2)
    try:
        yield
    finally:
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        for fd in saved:
            os.close(fd)


@contextmanager
def start_system(name: str, engine: dict[str, Any], log_dir: Path, worker_events: bool) -> Iterator[Running]:
    if name in ("kvroute_direct", "kvroute_haproxy", "kvroute_python"):
        with kvroute_serve(name.split("_")[1], engine, log_dir / f"{name}.log") as (url, proc):
            yield Running(lambda _p: url, {proc.pid: "kvroute serve (driver)"}, {"base_url": url})
        return
    if name in EXTERNAL_ROUTERS:
        fleet = ExternalFleet(FleetConfig(model=MODEL, replicas=2), {"block_size": BLOCK_SIZE, **engine})
        try:
            with _output_to(log_dir / f"{name}.log"):  # the router logs every request at INFO
                meta = fleet.start(name)
            url = meta["base_url"]
            yield Running(lambda _p: url, {}, meta)
        finally:
            fleet.close()
        return
    fleet = _Replicas(engine, events=name == "kvroute_workers" and worker_events)
    try:
        with _output_to(log_dir / f"{name}_replicas.log"):
            urls = fleet.start_each(2)
        if name == "direct":
            yield Running(lambda p: urls[p % len(urls)], {}, {"worker_urls": urls})
            return
        spec = ",".join(f"{u}={e}" for u, e in zip(urls, fleet.endpoints)) if fleet.endpoints else ",".join(urls)
        with kvroute_serve(None, engine, log_dir / f"{name}.log", workers=spec) as (url, proc):
            yield Running(lambda _p: url, {proc.pid: "kvroute serve (driver)"},
                          {"base_url": url, "worker_urls": urls, "kv_events": fleet.endpoints})  # fmt: skip
    finally:
        fleet.close()


# ---------------------------------------------------------------------- one system
def _per_request(cores: float, wall_s: float, n: int) -> Optional[float]:
    """CPU ms per request from cores over ``wall_s`` and ``n`` requests."""
    return round(1e3 * cores * wall_s / n, 3) if n else None


def _kinds_ms(by_kind: dict[str, float], wall_s: float, n: int) -> dict[str, float]:
    return {k: _per_request(v, wall_s, n) for k, v in by_kind.items()}


def measure(name: str, args: argparse.Namespace, log_dir: Path) -> dict[str, Any]:
    engine = {"emulate": args.emulate, "time_scale": args.time_scale}
    t0 = time.perf_counter()
    with start_system(name, engine, log_dir, args.worker_events) as sys_:
        started_s = time.perf_counter() - t0
        acct = Accountant(sys_.names)
        load = Load(sys_.url_for, Workload(seed=args.seed))
        warm = asyncio.run(load.warm_up())
        time.sleep(1.0)  # the warm-up's trailing work (metrics, events) settles

        # idle
        before = acct.snapshot()
        t = time.perf_counter()
        time.sleep(args.idle_seconds)
        idle = acct.split(before, acct.snapshot(), time.perf_counter() - t)

        # open loop
        marks: dict[str, Any] = {}

        def mark() -> None:
            marks["snap"], marks["driver"] = acct.snapshot(), os.times()

        phase, wall = asyncio.run(load.open_loop(args.rate, args.seconds, mark))
        after, driver = acct.snapshot(), os.times()
        used = acct.split(marks["snap"], after, wall)
        n = len(phase.latencies_s)
        driver_s = (driver.user + driver.system) - (marks["driver"].user + marks["driver"].system)
        routing_ms = _per_request(used["routing"]["cores"], wall, n)
        marginal_ms = _per_request(max(0.0, used["routing"]["cores"] - idle["routing"]["cores"]), wall, n)
        open_loop = {**phase.summary(wall), "rate": args.rate, "routing_cpu_ms_per_request": routing_ms,
                     "routing_marginal_cpu_ms_per_request": marginal_ms,
                     "routing_cores": round(used["routing"]["cores"], 4),
                     "routing_cpu_ms_per_request_by_kind": _kinds_ms(used["routing"]["by_kind"], wall, n),
                     "engine_cpu_ms_per_request": _per_request(used["engine"]["cores"], wall, n),
                     "engine_cpu_ms_per_request_by_kind": _kinds_ms(used["engine"]["by_kind"], wall, n),
                     "load_generator_cpu_ms_per_request": round(1e3 * driver_s / n, 3) if n else None}  # fmt: skip

        # closed loop
        phase, wall = asyncio.run(load.closed_loop(args.concurrency, args.seconds, mark))
        used = acct.split(marks["snap"], acct.snapshot(), wall)
        n = len(phase.latencies_s)
        closed_loop = {**phase.summary(wall), "concurrency": args.concurrency,
                       "routing_cpu_ms_per_request": _per_request(used["routing"]["cores"], wall, n),
                       "routing_cores": round(used["routing"]["cores"], 4),
                       "routing_cpu_ms_per_request_by_kind": _kinds_ms(used["routing"]["by_kind"], wall, n),
                       "engine_cores": round(used["engine"]["cores"], 4)}  # fmt: skip
        processes = sorted({k for k, _ in acct.snapshot().values()})
        info = sys_.info
    return {"system": name, "label": LABELS[name], "start_s": round(started_s, 1), "info": info,
            "processes": processes, "warm_up": {"ok": len(warm.latencies_s), "errors": len(warm.errors)},
            "idle": {"seconds": args.idle_seconds, "routing_cores": round(idle["routing"]["cores"], 4),
                     "routing_cores_by_kind": {k: round(v, 4) for k, v in idle["routing"]["by_kind"].items()},
                     "engine_cores": round(idle["engine"]["cores"], 4)},
            "open_loop": open_loop, "closed_loop": closed_loop}  # fmt: skip


# ---------------------------------------------------------------------- report
def cpu_info() -> dict[str, Any]:
    """The CPU model (``/proc/cpuinfo``'s model name, as ``lscpu`` shows it), its cores
    and its AVX-512 and AMX flags."""
    from kvroute.kernels.cpu_capability import machine_flags

    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            model = next((line.partition(":")[2].strip() for line in f if line.startswith("model name")), model)
    except OSError:
        pass
    flags = machine_flags()
    return {"cpu_model": model, "cpu_count": os.cpu_count(), "platform": platform.platform(),
            "avx512": sorted(f for f in flags if f.startswith("avx512")), "amx": sorted(f for f in flags if f.startswith("amx")),
            "load_average_before": os.getloadavg()}  # fmt: skip


def _f(x: Optional[float], digits: int = 1) -> str:
    return "—" if x is None else f"{x:,.{digits}f}"


def table(rows: list[dict[str, Any]]) -> str:
    direct = next((r for r in rows if r["system"] == "direct" and "error" not in r), None)
    head = ("| system | routing-layer CPU / request at the rate (marginal) | idle cores | latency p50 / p99 "
            "(added over direct) | requests/s at saturation (p50 / p99) | errors |\n|---|---|---|---|---|---|")  # fmt: skip
    lines = [head]
    for r in rows:
        if "error" in r:
            lines.append(f"| {LABELS[r['system']]} | failed: {r['error'][:120]} | | | | |")
            continue
        o, c = r["open_loop"], r["closed_loop"]
        added = ""
        if direct is not None and r is not direct and o["p50_ms"] is not None and direct["open_loop"]["p50_ms"] is not None:
            d = direct["open_loop"]
            added = f" ({o['p50_ms'] - d['p50_ms']:+,.1f} / {o['p99_ms'] - d['p99_ms']:+,.1f})"
        lines.append(f"| {r['label']} | {_f(o['routing_cpu_ms_per_request'], 2)} ms ({_f(o['routing_marginal_cpu_ms_per_request'], 2)}) "
                     f"| {_f(r['idle']['routing_cores'], 3)} | {_f(o['p50_ms'])} / {_f(o['p99_ms'])} ms{added} "
                     f"| {_f(c['requests_per_s'])} ({_f(c['p50_ms'])} / {_f(c['p99_ms'])} ms) "
                     f"| {o['errors'] + c['errors']} |")  # fmt: skip
    return "\n".join(lines)


def split_table(rows: list[dict[str, Any]], top: int = 8) -> str:
    """The routing layer's CPU per request at the rate, by process kind."""
    lines = ["| system | routing-layer CPU per request by process kind (ms) | engine replicas (ms) |", "|---|---|---|"]
    for r in rows:
        if "error" in r:
            continue
        o = r["open_loop"]
        kinds = ", ".join(f"{k} {v:.2f}" for k, v in list(o["routing_cpu_ms_per_request_by_kind"].items())[:top]) or "—"
        lines.append(f"| {r['label']} | {kinds} | {_f(o['engine_cpu_ms_per_request'], 2)} |")
    return "\n".join(lines)


# ---------------------------------------------------------------------- command line
def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--systems", default=",".join(SYSTEMS), help=f"comma list of {', '.join(SYSTEMS)}")
    p.add_argument("--emulate", default="gpu_h100_llama3_8b", metavar="PROFILE", help="the replicas' step profile")
    p.add_argument("--time-scale", type=float, default=0.25, help="the emulated steps take K times the profile's time")
    p.add_argument("--rate", type=float, default=20.0, help="open loop: requests/s")
    p.add_argument("--seconds", type=float, default=30.0, help="each loop's length")
    p.add_argument("--concurrency", type=int, default=32, help="closed loop: requests in flight")
    p.add_argument("--idle-seconds", type=float, default=5.0, help="the idle measurement's length")
    p.add_argument("--worker-events", action=argparse.BooleanOptionalAction, default=True,
                   help="kvroute_workers: the serve-replica workers publish KV events to kvroute (default on)")
    p.add_argument("--log-dir", default=None, help="each system's log (default: results/data_path/)")
    options.add_seed(p)
    options.add_output(p, NAME)


def run(args: argparse.Namespace) -> int:
    systems = options.csv(args.systems)
    unknown = [s for s in systems if s not in SYSTEMS]
    if unknown or not systems:
        raise ValueError(f"--systems: unknown {unknown}; choose from {', '.join(SYSTEMS)}")
    log_dir = Path(args.log_dir) if args.log_dir else options.results_dir(NAME)
    log_dir.mkdir(parents=True, exist_ok=True)
    machine = cpu_info()
    rows: list[dict[str, Any]] = []
    skipped: dict[str, str] = {}
    for name in systems:
        if name in EXTERNAL_ROUTERS and not external_available(name):
            skipped[name] = "not installed"
            print(f"  {name}: skipped (not installed)", flush=True)
            continue
        print(f"  {name}: starting", flush=True)
        try:
            row = measure(name, args, log_dir)
        except Exception as exc:  # one system failing to start must not cost the others' figures
            row = {"system": name, "label": LABELS[name], "error": f"{type(exc).__name__}: {exc}"}
            print(f"  {name}: FAILED {row['error']}", flush=True)
        else:
            o, c = row["open_loop"], row["closed_loop"]
            print(f"  {name}: routing CPU {o['routing_cpu_ms_per_request']} ms/req (marginal "
                  f"{o['routing_marginal_cpu_ms_per_request']}), idle {row['idle']['routing_cores']} cores, "
                  f"p50/p99 {o['p50_ms']}/{o['p99_ms']} ms at {args.rate:g} req/s, saturation "
                  f"{c['requests_per_s']} req/s, errors {o['errors'] + c['errors']}", flush=True)  # fmt: skip
        rows.append(row)
    markdown = (f"{table(rows)}\n\n{split_table(rows)}\n\nCPU: {machine['cpu_model']}, {machine['cpu_count']} cores; "
                f"AVX-512: {'yes' if machine['avx512'] else 'no'}, AMX: {'yes' if machine['amx'] else 'no'}\n")  # fmt: skip
    result = {"benchmark": NAME, "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "machine": machine,
              "command": " ".join(["kvroute bench data_path", *sys.argv[2:]]) if sys.argv[1:2] == ["data_path"] else None,
              "config": {"systems": systems, "emulate": args.emulate, "time_scale": args.time_scale, "rate": args.rate,
                         "seconds": args.seconds, "concurrency": args.concurrency, "idle_seconds": args.idle_seconds,
                         "worker_events": args.worker_events, "seed": args.seed, "model": MODEL,
                         "workload": {"prefixes": 16, "prefix_tokens": 600, "suffix_tokens": 30, "max_tokens": 4,
                                      "stream": False}},
              "skipped": skipped, "systems": rows, "markdown": markdown}  # fmt: skip
    path = options.result_file(NAME, args.out)
    path.write_text(json.dumps(result, indent=2))
    path.with_suffix(".md").write_text(markdown)
    print(markdown)
    parts = []
    for r in rows:
        if "error" in r:
            parts.append(f"{r['system']} FAILED")
        else:
            o, c = r["open_loop"], r["closed_loop"]
            parts.append(f"{r['system']} {_f(o['routing_cpu_ms_per_request'], 2)} ms/req, p50/p99 {_f(o['p50_ms'])}/"
                         f"{_f(o['p99_ms'])} ms, {_f(c['requests_per_s'])} req/s")  # fmt: skip
    print(f"{NAME}: {'; '.join(parts)}  [{path}]")
    failed = any("error" in r or r["open_loop"]["errors"] or r["closed_loop"]["errors"] for r in rows)
    return 1 if failed else 0


if __name__ == "__main__":
    from kvroute.benchmarks.cli import module_main

    raise SystemExit(module_main(__spec__.name))
