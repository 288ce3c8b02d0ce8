"""Router cost in-process: route latency, event application rate, directory memory.

``kvroute bench router_overhead [--replicas 32] [--blocks 1048576]``

Setup: ``--replicas`` replicas share ``--blocks`` distinct blocks in chains of
``--request-blocks`` (each chain stored on one replica, 1/8 of them on a second one
too), applied through ``Router.apply`` as KV-event batches of ``--batch`` hashes. Then:

* event application rate: block updates (stored + removed) per second, timed over the
  fill and over a churn phase where every batch evicts as many blocks as it stores;
* route latency: ``Router.route`` (kvroute policy, all replicas candidates) for requests
  of ``--request-blocks`` blocks, a mix of full hits, half hits and cold prefixes; the
  time includes the policy, the optimistic insert and the load-view update;
* memory per directory entry: tracemalloc over building the same directory, the hash
  ints included (the directory is what keeps them alive).

Hashes are random 128-bit ints: the directory treats them as opaque keys.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import os
import random
import time
import tracemalloc
from typing import Any

from kvroute.benchmarks import options
from kvroute.benchmarks.common import write_result
from kvroute.replica.kv_events import KVEvents, LoadFigures
from kvroute.router.router import Router


def _chains(rng: random.Random, num_blocks: int, chain_len: int) -> list[list[int]]:
    return [[rng.getrandbits(128) for _ in range(chain_len)] for _ in range(num_blocks // chain_len)]


def _fill(router: Router, chains: list[list[int]], num_replicas: int, batch: int) -> tuple[int, dict[str, int]]:
    """Store every chain on its replica(s) through KV events; returns block updates."""
    per_replica: dict[str, list[int]] = {f"r{i}": [] for i in range(num_replicas)}
    for c, chain in enumerate(chains):
        per_replica[f"r{c % num_replicas}"].extend(chain)
        if c % 8 == 0:
            per_replica[f"r{(c + 1) % num_replicas}"].extend(chain)
    seqs = {rid: 0 for rid in per_replica}
    updates = 0
    for rid, hashes in per_replica.items():
        for i in range(0, len(hashes), batch):
            seqs[rid] += 1
            stored = hashes[i : i + batch]
            router.apply(KVEvents(rid, seqs[rid], stored, [], False, None))
            updates += len(stored)
    return updates, seqs


def _events(router: Router, chains: list[list[int]], args: argparse.Namespace, rng: random.Random) -> dict[str, Any]:
    """Fill the directory through KV events, then churn it (every batch evicts as many
    blocks as it stores, the evicted chains put back after): updates, wall and CPU s."""
    t0, c0 = time.perf_counter(), time.thread_time()
    fill_updates, seqs = _fill(router, chains, args.replicas, args.batch)
    out = {"fill_updates": fill_updates, "fill_s": time.perf_counter() - t0, "fill_cpu_s": time.thread_time() - c0,
           "entries": router.stats()["directory_entries"], "seqs": seqs, "churn_updates": 0, "churn_s": 0.0, "churn_cpu_s": 0.0}
    for rid in seqs:
        held = router.directory.confirmed(rid)[: args.churn_blocks_per_replica]
        fresh = [rng.getrandbits(128) for _ in range(len(held))]
        t0, c0 = time.perf_counter(), time.thread_time()
        for i in range(0, len(held), args.batch):
            seqs[rid] += 1
            router.apply(KVEvents(rid, seqs[rid], fresh[i : i + args.batch], held[i : i + args.batch], False, None))
        out["churn_s"] += time.perf_counter() - t0
        out["churn_cpu_s"] += time.thread_time() - c0
        out["churn_updates"] += 2 * len(held)
        # put the evicted chains back so routes still find them
        seqs[rid] += 1
        router.apply(KVEvents(rid, seqs[rid], held, fresh, False, None))
    return out


def _requests(chains: list[list[int]], n: int, rng: random.Random) -> list[list[int]]:
    """``n`` requests' block hashes, in turn: a full hit, a full hit, a half hit, a cold one."""
    reqs = []
    for k in range(n):
        chain = chains[rng.randrange(len(chains))]
        kind = k % 4
        if kind <= 1:
            hashes = chain
        elif kind == 2:
            half = len(chain) // 2
            hashes = chain[:half] + [rng.getrandbits(128) for _ in range(len(chain) - half)]
        else:
            hashes = [rng.getrandbits(128) for _ in range(len(chain))]
        reqs.append(hashes)
    return reqs


def _routes(router: Router, reqs: list[list[int]], seqs: dict[str, int], args: argparse.Namespace) -> tuple[list[int], list[int], dict[str, list[int]]]:
    """Route every request, the replicas reporting their load every 64: the sorted wall
    and CPU ns of each route after the warm-up, and the CPU ns by request kind."""
    load = LoadFigures(num_waiting=2, num_running=8, queued_prefill_tokens=4000, kv_usage=0.7,
                       prefill_tokens_per_s=20_000.0, decode_step_s=0.02)
    for rid in seqs:
        seqs[rid] += 1
        router.apply(KVEvents(rid, seqs[rid], [], [], False, load))
    n_tokens = args.request_blocks * router.block_size + 7
    route, perf = router.route, time.perf_counter_ns
    cpu = time.thread_time_ns  # excludes time descheduled: the cost on a shared, busy machine
    lat_ns: list[int] = []
    cpu_ns: list[int] = []
    by_kind: dict[str, list[int]] = {"full_hit": [], "half_hit": [], "cold": []}
    kinds = ["full_hit", "full_hit", "half_hit", "cold"]
    ticket = 0
    for k, hashes in enumerate(reqs):
        if k % 64 == 0:  # replicas report, counting every request routed so far
            counted = dataclasses.replace(load, route_ticket=ticket)
            for rid in seqs:
                seqs[rid] += 1
                router.apply(KVEvents(rid, seqs[rid], [], [], False, counted))
        c = cpu()
        t = perf()
        ticket = route(hashes, n_tokens).ticket
        dt = perf() - t
        dc = cpu() - c
        if k >= args.warmup:
            lat_ns.append(dt)
            cpu_ns.append(dc)
            by_kind[kinds[k % 4]].append(dc)
    for xs in (lat_ns, cpu_ns, *by_kind.values()):
        xs.sort()
    return lat_ns, cpu_ns, by_kind


def _memory(args: argparse.Namespace, capacity: int) -> tuple[int, int, int]:
    """The bytes a directory of the same fill takes (tracemalloc), its entries and blocks."""
    gc.collect()
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    mem_chains = _chains(random.Random(args.seed), args.blocks, args.request_blocks)
    mem_router = Router("kvroute", 16)
    for i in range(args.replicas):
        mem_router.add_replica(f"r{i}", capacity)
    _fill(mem_router, mem_chains, args.replicas, args.batch)
    del mem_chains
    gc.collect()
    after = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    stats = mem_router.stats()
    return after - before, stats["directory_entries"], stats["directory_blocks"]


def measure(args: argparse.Namespace) -> dict[str, Any]:
    rng = random.Random(args.seed)
    chains = _chains(rng, args.blocks, args.request_blocks)
    capacity = 2 * args.blocks // args.replicas  # room for the 1/8 duplicates and the churn
    router = Router("kvroute", 16, pending_ttl_s=5.0)
    for i in range(args.replicas):
        router.add_replica(f"r{i}", capacity)
    gc.collect()
    gc.disable()  # a real router actor sees the same; the cyclic GC is irrelevant here
    ev = _events(router, chains, args, rng)
    lat_ns, cpu_ns, by_kind = _routes(router, _requests(chains, args.routes + args.warmup, rng), ev["seqs"], args)
    gc.enable()
    stats = router.stats()
    del router
    bytes_total, mem_entries, mem_blocks = _memory(args, capacity)

    def pct(p: float, xs: list[int] = lat_ns) -> float:
        return xs[min(len(xs) - 1, int(p * len(xs)))] / 1000

    return {
        "config": vars(args),
        "directory_blocks": stats["directory_blocks"],
        "directory_entries": ev["entries"],
        "fill_updates_per_s": ev["fill_updates"] / ev["fill_s"],
        "churn_updates_per_s": ev["churn_updates"] / ev["churn_s"],
        # per second of this thread's CPU time: the cost on a shared, busy machine
        "fill_updates_per_cpu_s": ev["fill_updates"] / ev["fill_cpu_s"],
        "churn_updates_per_cpu_s": ev["churn_updates"] / ev["churn_cpu_s"],
        "route_us": {"p50": pct(0.50), "p90": pct(0.90), "p99": pct(0.99), "max": lat_ns[-1] / 1000,
                     "mean": sum(lat_ns) / len(lat_ns) / 1000},
        "route_cpu_us": {"p50": pct(0.50, cpu_ns), "p90": pct(0.90, cpu_ns), "p99": pct(0.99, cpu_ns)},
        # by request kind: a full hit costs the match and the policy; a half hit and a
        # cold request also record their new blocks as pending (optimistic insert)
        "route_cpu_us_by_kind": {
            kind: {"p50": pct(0.50, xs), "p99": pct(0.99, xs)} for kind, xs in by_kind.items()
        },
        "load_average": os.getloadavg(),
        "decisions_by_reason": stats["decisions_by_reason"],
        "memory_bytes": bytes_total,
        "memory_bytes_per_entry": bytes_total / mem_entries,
        "memory_bytes_per_block": bytes_total / mem_blocks,
    }


def add_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--replicas", type=int, default=32)
    ap.add_argument("--blocks", type=int, default=1 << 20, help="distinct blocks in the directory")
    ap.add_argument("--request-blocks", type=int, default=128)
    ap.add_argument("--batch", type=int, default=64, help="hashes per KV-event batch")
    ap.add_argument("--churn-blocks-per-replica", type=int, default=4096)
    ap.add_argument("--routes", type=int, default=5000)
    ap.add_argument("--warmup", type=int, default=200)
    options.add_seed(ap)
    options.add_output(ap, "router_overhead")


def run(args: argparse.Namespace) -> int:
    r = measure(args)
    rt = r["route_us"]
    summary = (
        f"{args.replicas} replicas, {r['directory_blocks']:,} blocks ({r['directory_entries']:,} entries): "
        f"route p50 {rt['p50']:.1f} us p99 {rt['p99']:.1f} us wall, "
        f"p50 {r['route_cpu_us']['p50']:.1f} us p99 {r['route_cpu_us']['p99']:.1f} us cpu ({args.request_blocks}-block requests; "
        + ", ".join(f"{k} p99 {v['p99']:.0f}" for k, v in r["route_cpu_us_by_kind"].items())
        + " us cpu); "
        f"events {r['fill_updates_per_s'] / 1e6:.2f}M block updates/s (fill), "
        f"{r['churn_updates_per_s'] / 1e6:.2f}M/s (churn) wall, {r['fill_updates_per_cpu_s'] / 1e6:.2f}M/s "
        f"{r['churn_updates_per_cpu_s'] / 1e6:.2f}M/s cpu; "
        f"{r['memory_bytes_per_entry']:.0f} B/entry, {r['memory_bytes_per_block']:.0f} B/block"
    )
    write_result("router_overhead", r, summary, args.out)
    return 0


if __name__ == "__main__":
    from kvroute.benchmarks.cli import module_main

    raise SystemExit(module_main(__spec__.name))
