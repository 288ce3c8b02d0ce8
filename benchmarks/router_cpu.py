"""One router actor's CPU, replayed without Ray: where it goes, per call kind.

    kvroute bench router_cpu [--replicas 16] [--routers 8] [--block-size 16]
        [--seconds 20] [--rate 150] [--profile] [--baseline REF] [--rounds 3] [--out PATH]

A deterministic replay of what ONE of ``--routers`` router actors receives on a
``--replicas`` emulated run, driven straight into its ``RouterService`` (the actor's
class, called the way Ray calls it, on a virtual clock):

- every replica's pushes, built by its ``EventPublisher`` as ``_RouterLink`` does, one per
  25 ms engine step that changed something: an *event batch* when the step stored or
  evicted blocks (prefill chunks of 512 tokens complete blocks; a 4096-block cache per
  replica evicts its least recent chain tails under pressure), a *load report* when only
  the load figures changed (decode steps), a heartbeat after a quiet second;
- its own decisions: ``rank`` for every ``--routers``-th request (Poisson arrivals at
  ``--rate``/s for 16 replicas, scaled with ``--replicas``; prompts of 1-4k tokens: a
  prefix of one of 400 Zipf(1.1)-popular groups plus a unique suffix; 100 output tokens);
- the other routers' decisions (made by a shadow ``Router`` fed the same events), in
  batches per peer per ``PEER_FLUSH_S`` window: ``note_peer_decisions``.

Each call is timed with ``time.thread_time_ns`` (CPU, not wall: the box is shared) and
reported as µs per event batch, per load report, per peer batch (and per peer decision),
per decision (p50/p99), with the call counts per emulated second and the router's CPU
share (cores) they add up to. ``--profile`` adds cProfile's top functions (calls,
tottime, cumtime). ``--baseline REF`` runs the same replay of git ``REF``'s code
(``git archive`` into a temp dir) in alternating subprocesses, ``--rounds`` each, and
prints before/after with the ratios (medians over rounds): both sides in one run.
``--ray-calls`` adds what the replay leaves out: Ray's own CPU per actor call.

Measured (2-core shared box, CPU time, medians of 5 alternating rounds, 3 at
256 replicas; ``--baseline main`` before the router-CPU commits, block size 16):

    kvroute bench router_cpu --baseline main --rounds 5 --seconds 10
    kvroute bench router_cpu --baseline main --rounds 3 --seconds 3 --replicas 256

| one of 8 routers, µs p50 / p99     | 16 replicas: before | after       | 256 replicas: before | after     |
|------------------------------------|---------------------|-------------|----------------------|-----------|
| event batch (320/s; 4258/s)        | 22.8 / 134          | 22.2 / 117  | 27.6 / 107           | 25.6 / 99 |
| load report (58/s; 554/s)          | 4.0 / 25            | 4.3 / 23    | 5.8 / 26             | 5.4 / 27  |
| peer batch (126/s; 1880/s)         | 19.5 / 119          | 16.2 / 71   | 30.0 / 270           | 23.5 / 162|
| decision (18/s; 293/s)             | 120 / 285           | 74 / 163    | 546 / 1047           | 303 / 682 |
| the router's code, cores           | 0.0154              | 0.0131      | 0.390                | 0.288     |

Block size 32 at 16 replicas: decision p50 104 -> 62 µs, cores 0.0098 -> 0.0083. Ray's
own CPU per call on the same box (``--ray-calls``, callee process / caller): a push of
32 + 32 blocks 557 / 504 µs, a load-only push 442 / 440 µs, a one-decision peer batch
269 / 248 µs: 10-20x the router's own work per call, so the calls a router receives
(here ~520/s each at 16 replicas) and not its code set its CPU.
"""

from __future__ import annotations

import argparse
import bisect
import cProfile
import gc
import io
import json
import os
import pstats
import random
import statistics
import sys
import time
import types
from collections import OrderedDict, deque
from pathlib import Path
from typing import Any

from kvroute.benchmarks.baseline import alternate, child_run

from kvroute.cluster.publisher import EventPublisher
from kvroute.cluster.router_actor import PEER_FLUSH_S, RouterService
from kvroute.replica.block_hash import HashSpec
from kvroute.replica.kv_events import KVEvents, LoadFigures
from kvroute.router import router as router_module
from kvroute.router.router import Router
from kvroute.benchmarks import options

STEP_S = 0.025  # one engine step
PREFILL_TOKENS = 512  # prefill tokens per step (about 20k tokens/s)
OUTPUT_STEPS = 100
CAPACITY = 4096  # KV blocks per replica
GROUPS = 400
KINDS = ("event_batch", "load_report", "peer_batch", "decision")


class _Replica:
    """An emulated engine: a FIFO queue, chunked prefill, an LRU prefix cache whose chain
    tails go first (prefix closure), and the load figures it would report."""

    def __init__(self, rid: str, block_size: int) -> None:
        self.rid, self.bs = rid, block_size
        self.cache: OrderedDict[int, None] = OrderedDict()
        self.queue: deque[list] = deque()  # [hashes, tokens, done tokens]
        self.running: list[list[int]] = []  # [steps left, blocks]
        self.ticket = 0
        self.publisher = EventPublisher(rid)
        self.quiet_since = 0.0

    def accept(self, hashes: list[int], tokens: int, ticket: int) -> None:
        self.ticket = max(self.ticket, ticket)
        held = 0
        while held < len(hashes) and hashes[held] in self.cache:
            held += 1
        self.queue.append([hashes, tokens, min(held * self.bs, tokens - 1)])

    def step(self) -> KVEvents:
        stored: dict[int, None] = {}
        budget = PREFILL_TOKENS
        while self.queue and budget > 0:
            req = self.queue[0]
            hashes, tokens, done = req
            take = min(budget, tokens - done)
            budget -= take
            req[2] = done + take
            for h in reversed(hashes[: req[2] // self.bs]):  # touch the prefix, head most recent
                if h not in self.cache:
                    stored[h] = None
                self.cache[h] = None
                self.cache.move_to_end(h)
            if req[2] >= tokens:
                self.queue.popleft()
                self.running.append([OUTPUT_STEPS, len(hashes) + 1])
        removed = []
        while len(self.cache) > CAPACITY:
            h, _ = self.cache.popitem(last=False)
            if h in stored:
                del stored[h]
            else:
                removed.append(h)
        for r in self.running:
            r[0] -= 1
        self.running = [r for r in self.running if r[0] > 0]
        queued = sum(t - d for _, t, d in self.queue)
        load = LoadFigures(num_waiting=len(self.queue), num_running=len(self.running), queued_prefill_tokens=queued,
                           queued_prefill_s=queued / 20_000, kv_usage=min(1.0, sum(b for _, b in self.running) / CAPACITY),
                           prefill_tokens_per_s=20_000.0, decode_step_s=STEP_S, route_ticket=self.ticket)  # fmt: skip
        return KVEvents(self.rid, 0, list(stored), removed, False, load)


def _workload(args: argparse.Namespace) -> list[tuple[float, list[int], int]]:
    rng = random.Random(args.seed)
    bs = args.block_size
    weights = [1 / (g + 1) ** 1.1 for g in range(GROUPS)]
    prefixes = [[rng.getrandbits(128) for _ in range(rng.randint(512, 3072) // bs)] for _ in range(GROUPS)]
    rate = args.rate * args.replicas / 16
    t, out = 0.0, []
    while t < args.seconds:
        t += rng.expovariate(rate)
        prefix = prefixes[rng.choices(range(GROUPS), weights)[0]]
        tokens = max(1024, min(4096, len(prefix) * bs + rng.randint(64, 1024)))
        n = tokens // bs
        out.append((t, prefix[:n] + [rng.getrandbits(128) for _ in range(n - min(n, len(prefix)))], tokens))
    return out


class _Replay:
    """One router (a ``RouterService``) driven through the emulated run on a virtual
    clock, with a shadow ``Router`` standing in for the other routers; CPU ns per call."""

    def __init__(self, args: argparse.Namespace, profiler: cProfile.Profile | None) -> None:
        self.args, self.profiler = args, profiler
        self.now = 0.0
        clock = lambda: self.now  # noqa: E731
        # tickets follow the wall clock (``Router.route``): on the virtual one, the replay is exact
        router_module.time = types.SimpleNamespace(time_ns=lambda: 1_700_000_000_000_000_000 + int(self.now * 1e9))
        spec = HashSpec(block_size=args.block_size, seed=0, model_id="emulated")
        self.svc = RouterService(spec, clock=clock, share=lambda batch: None)
        self.shadow = Router("kvroute", args.block_size, clock=clock)
        self.reps = {f"r{i:03d}": _Replica(f"r{i:03d}", args.block_size) for i in range(args.replicas)}
        self.cands = list(self.reps)
        for rid in self.reps:
            self.svc.register(rid, spec, CAPACITY, [], 0, None)
            self.shadow.add_replica(rid, CAPACITY)
        self.cost: dict[str, list[int]] = {k: [] for k in KINDS}
        self.peer_decisions = 0
        self.outbox: dict[int, tuple[float, list]] = {}  # peer -> (window end, decisions)
        self.steps = [(i * STEP_S / args.replicas, rid) for i, rid in enumerate(self.reps)]

    def timed(self, kind: str, fn: Any, *a: Any) -> Any:
        if self.profiler is not None:
            self.profiler.enable()
        c = time.thread_time_ns()
        out = fn(*a)
        self.cost[kind].append(time.thread_time_ns() - c)
        if self.profiler is not None:
            self.profiler.disable()
        return out

    def deliver(self, upto: float) -> None:
        for peer, (end, batch) in sorted(self.outbox.items(), key=lambda kv: kv[1][0]):
            if end <= upto:
                self.now = end
                del self.outbox[peer]
                self.timed("peer_batch", self.svc.note_peer_decisions, batch)
                self.peer_decisions += len(batch)

    def step_until(self, t: float) -> None:
        steps = self.steps
        while steps[0][0] <= t:
            at, rid = steps[0]
            self.deliver(at)
            self.now = at
            rep = self.reps[rid]
            events = rep.step()
            self.shadow.apply(KVEvents(rid, self.shadow.directory.last_seq(rid) + 1, events.stored, events.removed, False,
                                       events.load))  # fmt: skip
            rep.publisher.add(events)
            if rep.publisher.has_changes or at - rep.quiet_since >= 1.0:
                rep.quiet_since = at
                batch = rep.publisher.take()
                self.timed("event_batch" if batch.stored or batch.removed else "load_report", self.svc.push, batch)
            bisect.insort(steps, (at + STEP_S, rid))
            steps.pop(0)

    def arrive(self, i: int, t: float, hashes: Any, tokens: int) -> None:
        """Request ``i``: this router decides every ``--routers``-th, the shadow the others
        (their decisions reach this one a flush window later)."""
        self.step_until(t)
        self.deliver(t)
        self.now = t
        peer = i % self.args.routers
        if peer == 0:
            decision = self.timed("decision", self.svc.rank, hashes, tokens, self.cands)
            rid, ticket = decision.replica_id, decision.ticket
            self.shadow.note_routed(rid, hashes, tokens, ticket)
        else:
            d = self.shadow.route(hashes, tokens)
            rid, ticket = d.replica_id, d.ticket
            end, batch = self.outbox.setdefault(peer, (t + PEER_FLUSH_S, []))
            batch.append((rid, list(hashes), tokens, ticket, time.time(), None))
        self.reps[rid].accept(hashes, tokens, ticket)


def replay(args: argparse.Namespace, profiler: cProfile.Profile | None = None) -> dict[str, Any]:
    """Drive one router through the emulated run; CPU ns per call, by kind."""
    r = _Replay(args, profiler)
    workload = _workload(args)
    gc.collect()
    gc.freeze()  # the driver's own objects (the workload): a full collection in a router walks only the router's
    for i, (t, hashes, tokens) in enumerate(workload):
        r.arrive(i, t, hashes, tokens)
    r.step_until(args.seconds)
    r.deliver(float("inf"))
    router_module.time = time
    stats = r.svc.router.stats()
    return {"cost_ns": r.cost, "peer_decisions": r.peer_decisions, "hit_blocks": stats["block_updates"],
            "directory_blocks": stats["directory_blocks"], "decisions_by_reason": stats["decisions_by_reason"]}


def summarize(r: dict[str, Any], seconds: float) -> dict[str, Any]:
    out: dict[str, Any] = {}
    total = 0
    for kind, xs in r["cost_ns"].items():
        xs = sorted(xs)
        if not xs:
            continue
        total += sum(xs)
        out[kind] = {"calls_per_s": len(xs) / seconds, "p50_us": xs[len(xs) // 2] / 1e3,
                     "p99_us": xs[min(len(xs) - 1, int(0.99 * len(xs)))] / 1e3, "mean_us": sum(xs) / len(xs) / 1e3,
                     "cores": sum(xs) / 1e9 / seconds}  # fmt: skip
    if r["peer_decisions"]:
        out["per_peer_decision_us"] = sum(r["cost_ns"]["peer_batch"]) / r["peer_decisions"] / 1e3
    out["router_cores"] = total / 1e9 / seconds
    return out


def profile_top(args: argparse.Namespace, n: int = 25) -> str:
    prof = cProfile.Profile()
    replay(args, prof)
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(n)
    return buf.getvalue()


def _child(args: argparse.Namespace, tree: str | None) -> dict[str, Any]:
    env = {**os.environ, "PYTHONHASHSEED": "0"}  # the same dict layouts (and GC points) in every run
    r = json.loads(child_run("kvroute.benchmarks.router_cpu", _passthrough(args), tree, env))
    r["code"] = r.pop("code_file")
    return r


def child(argv: list[str]) -> None:
    """One side of a ``--baseline`` comparison, in a fresh interpreter (this checkout's
    code or the baseline's): the replay's summary as one JSON line."""
    p = argparse.ArgumentParser()
    add_args(p)
    args = p.parse_args(argv)
    print(json.dumps({**summarize(replay(args), args.seconds), "code_file": sys.modules[Router.__module__].__file__}))


def _passthrough(args: argparse.Namespace) -> list[str]:
    return [f"--replicas={args.replicas}", f"--routers={args.routers}", f"--block-size={args.block_size}",
            f"--seconds={args.seconds}", f"--rate={args.rate}", f"--seed={args.seed}"]  # fmt: skip


def compare(args: argparse.Namespace) -> dict[str, Any]:
    runs = alternate(args.baseline, Path(__file__), args.rounds, lambda tree: _child(args, tree))
    assert runs["before"][0]["code"] != runs["after"][0]["code"], "the baseline ran this checkout's code"
    med = {side: _median(rs) for side, rs in runs.items()}
    lines = [f"| figure | before ({args.baseline}) | after | after/before |", "|---|---|---|---|"]
    for kind in (*KINDS, "per_peer_decision_us", "router_cores"):
        for stat in ("p50_us", "p99_us", "mean_us", "calls_per_s") if kind in KINDS else ("",):
            b, a = (med[s].get(kind, {}).get(stat) if stat else med[s].get(kind) for s in ("before", "after"))
            if b is not None and a is not None:
                lines.append(f"| {kind} {stat} | {b:.4g} | {a:.4g} | {a / b if b else float('nan'):.2f} |")
    return {"before": med["before"], "after": med["after"], "table": "\n".join(lines)}


def _median(rs: list[dict]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in rs[0].items():
        if isinstance(v, str):
            out[k] = v
        elif isinstance(v, dict):
            out[k] = {s: statistics.median(r[k][s] for r in rs) for s in v}
        else:
            out[k] = statistics.median(r[k] for r in rs)
    return out


def ray_call_cpu(calls: int = 2000) -> dict[str, float]:
    """What the replay leaves out: Ray's own CPU per call, in the callee's process (all
    its threads) and the caller's, for a no-op actor method taking this replay's
    messages (a local Ray instance; ``--ray-calls``)."""
    import ray

    @ray.remote(num_cpus=0)
    class Sink:
        def take(self, message: Any) -> bool:
            return True

        def cpu(self) -> float:
            return time.process_time()

    rng = random.Random(0)
    load = LoadFigures(num_waiting=2, num_running=8, queued_prefill_tokens=4000, kv_usage=0.7, route_ticket=1 << 50)
    messages = {"push_32_stored_32_removed": (KVEvents("r000", 5, [rng.getrandbits(128) for _ in range(32)],
                                                       [rng.getrandbits(128) for _ in range(32)], False, load), True),
                "push_load_only": (KVEvents("r000", 5, [], [], False, load), True),
                "peer_batch_1_decision_150_blocks": ([("r000", [rng.getrandbits(128) for _ in range(150)], 2400, 1 << 50,
                                                       time.time(), None)], False)}  # fmt: skip
    ray.init(num_cpus=2, include_dashboard=False, logging_level="ERROR")
    try:
        sink, out = Sink.remote(), {}
        for name, (message, awaited) in messages.items():
            c0, s0 = ray.get(sink.cpu.remote()), time.process_time()
            refs = [sink.take.remote(message) for _ in range(calls)] if not awaited else []
            for _ in range(calls if awaited else 0):  # a replica's push: one in flight
                ray.get(sink.take.remote(message))
            ray.get(refs)
            c1, s1 = ray.get(sink.cpu.remote()), time.process_time()
            out[name] = {"callee_us": 1e6 * (c1 - c0) / calls, "caller_us": 1e6 * (s1 - s0) / calls}
        return out
    finally:
        ray.shutdown()


def add_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--replicas", type=int, default=16)
    ap.add_argument("--routers", type=int, default=8, help="router actors sharing the decisions")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--seconds", type=float, default=20.0, help="emulated seconds")
    ap.add_argument("--rate", type=float, default=150.0, help="requests/s for 16 replicas (scaled with --replicas)")
    options.add_seed(ap)
    ap.add_argument("--profile", action="store_true", help="print cProfile's top functions")
    ap.add_argument("--baseline", default=None, help="git ref to compare against, side by side")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--ray-calls", action="store_true", help="also measure Ray's own CPU per call (starts Ray)")
    options.add_output(ap, "router_cpu")


def run(args: argparse.Namespace) -> int:
    from kvroute.benchmarks.common import write_result

    if args.baseline:
        r = compare(args)
        print(r["table"])
        write_result("router_cpu", {"config": vars(args), **r}, f"router cores after/before "
                     f"{r['after']['router_cores'] / r['before']['router_cores']:.2f}", args.out)  # fmt: skip
        return 0
    s = summarize(replay(args), args.seconds)
    if args.profile:
        print(profile_top(args))
    if args.ray_calls:
        s["ray_call_cpu"] = ray_call_cpu()
        print(json.dumps(s["ray_call_cpu"]))
    parts = [f"{k} p50 {s[k]['p50_us']:.1f} p99 {s[k]['p99_us']:.1f} us x {s[k]['calls_per_s']:.0f}/s" for k in KINDS if k in s]
    write_result("router_cpu", {"config": vars(args), **s}, "; ".join(parts) + f"; {s['router_cores']:.4f} cores", args.out)
    return 0


if __name__ == "__main__":
    from kvroute.benchmarks.cli import module_main

    raise SystemExit(module_main(__spec__.name))
