"""Router cost in-process: route latency, event application rate, directory memory.

``python -m kvroute.benchmarks.router_overhead [--replicas 32] [--blocks 1048576]``

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


def run(args: argparse.Namespace) -> dict:
    rng = random.Random(args.seed)
    n_rep = args.replicas
    chains = _chains(rng, args.blocks, args.request_blocks)
    capacity = 2 * args.blocks // n_rep  # room for the 1/8 duplicates and the churn

    # ---------------------------------------------------------------- event application
    router = Router("kvroute", 16, pending_ttl_s=5.0)
    for i in range(n_rep):
        router.add_replica(f"r{i}", capacity)
    gc.collect()
    gc.disable()  # a real router actor sees the same; the cyclic GC is irrelevant here
    t0, c0 = time.perf_counter(), time.thread_time()
    fill_updates, seqs = _fill(router, chains, n_rep, args.batch)
    fill_s, fill_cpu_s = time.perf_counter() - t0, time.thread_time() - c0
    entries = router.stats()["directory_entries"]

    churn_updates = 0
    churn_s = churn_cpu_s = 0.0
    for rid in seqs:
        held = router.directory.confirmed(rid)[: args.churn_blocks_per_replica]
        fresh = [rng.getrandbits(128) for _ in range(len(held))]
        t0, c0 = time.perf_counter(), time.thread_time()
        for i in range(0, len(held), args.batch):
            seqs[rid] += 1
            router.apply(KVEvents(rid, seqs[rid], fresh[i : i + args.batch], held[i : i + args.batch], False, None))
        churn_s += time.perf_counter() - t0
        churn_cpu_s += time.thread_time() - c0
        churn_updates += 2 * len(held)
        # put the evicted chains back so routes still find them
        seqs[rid] += 1
        router.apply(KVEvents(rid, seqs[rid], held, fresh, False, None))

    # ---------------------------------------------------------------- route latency
    load = LoadFigures(num_waiting=2, num_running=8, queued_prefill_tokens=4000, kv_usage=0.7,
                       prefill_tokens_per_s=20_000.0, decode_step_s=0.02)
    for rid in seqs:
        seqs[rid] += 1
        router.apply(KVEvents(rid, seqs[rid], [], [], False, load))
    bs = router.block_size
    n_tokens = args.request_blocks * bs + 7
    lat_ns: list[int] = []
    reqs = []
    for k in range(args.routes + args.warmup):
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
    route = router.route
    perf = time.perf_counter_ns
    cpu = time.thread_time_ns  # excludes time descheduled: the cost on a shared, busy machine
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
    gc.enable()
    lat_ns.sort()
    cpu_ns.sort()
    for xs in by_kind.values():
        xs.sort()
    stats = router.stats()

    # ---------------------------------------------------------------- memory
    del router
    gc.collect()
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    mem_rng = random.Random(args.seed)
    mem_chains = _chains(mem_rng, args.blocks, args.request_blocks)
    mem_router = Router("kvroute", 16)
    for i in range(n_rep):
        mem_router.add_replica(f"r{i}", capacity)
    _fill(mem_router, mem_chains, n_rep, args.batch)
    del mem_chains
    gc.collect()
    after = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    mem_entries = mem_router.stats()["directory_entries"]
    mem_blocks = mem_router.stats()["directory_blocks"]
    bytes_total = after - before

    def pct(p: float, xs: list[int] = lat_ns) -> float:
        return xs[min(len(xs) - 1, int(p * len(xs)))] / 1000

    return {
        "config": vars(args),
        "directory_blocks": stats["directory_blocks"],
        "directory_entries": entries,
        "fill_updates_per_s": fill_updates / fill_s,
        "churn_updates_per_s": churn_updates / churn_s,
        # per second of this thread's CPU time: the cost on a shared, busy machine
        "fill_updates_per_cpu_s": fill_updates / fill_cpu_s,
        "churn_updates_per_cpu_s": churn_updates / churn_cpu_s,
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


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--replicas", type=int, default=32)
    ap.add_argument("--blocks", type=int, default=1 << 20, help="distinct blocks in the directory")
    ap.add_argument("--request-blocks", type=int, default=128)
    ap.add_argument("--batch", type=int, default=64, help="hashes per KV-event batch")
    ap.add_argument("--churn-blocks-per-replica", type=int, default=4096)
    ap.add_argument("--routes", type=int, default=5000)
    ap.add_argument("--warmup", type=int, default=200)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    r = run(args)
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


if __name__ == "__main__":
    main()
