"""The routing layer's real-speed added latency, carried into the fleet benchmarks.

A fleet benchmark on emulated replicas at ``--time-scale K`` divides every time by K
(``serving.unscaled``), so the wall time a routing layer adds (its proxy, ingress,
tokenizing and decision, measured in real milliseconds) shrinks K times in its figures.
``kvroute bench data_path`` measures that time at real speed on one box: each system's
latency at a fixed rate less that of a request sent straight to a replica (``direct``).
This module reads such a JSON (``--overhead-from PATH``), or runs a short data_path
itself (``--overhead-measure``), and gives each fleet router its added p50 and p99:

- a fleet router maps to the data_path system that stands for it in production
  (``MAPPING``: ``kvroute`` is ``kvroute serve``'s default path, ``kvroute_direct``,
  else the composed path with HAProxy; the peers' routers are themselves);
  ``--overhead-map ROUTER=SYSTEM,...`` overrides it;
- a router with no data_path system (Ray Serve's own routers: power of two, round
  robin, PrefixCacheAffinityRouter) gets no figure, and its rows say so;
- added = the system's open-loop p50 (p99) less ``direct``'s, negative differences
  (noise) counting as 0.

The rule (``plus``): TTFT p50 + added p50; TTFT p90 and p99 + added p99. By the union
bound, p90 + added p99 is at least the 0.89 quantile of the sum whatever the two's
dependence, and in practice above its p90: a conservative estimate, not a measurement.
In a ratio against peers, a peer without a figure counts with 0 ms added, so the ratio
is then an upper bound for kvroute (``counted``). The added latency was measured at
data_path's rate on two replicas; a fleet sending more requests per second through one
routing layer would see at least as much.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Optional

# fleet router -> the data_path systems that stand for it, the first found in the JSON used
MAPPING: dict[str, tuple[str, ...]] = {
    "kvroute": ("kvroute_direct", "kvroute_haproxy"),
    "kvroute_1router": ("kvroute_direct", "kvroute_haproxy"),
    "sglang_router": ("sglang_router",),
    "vllm_router": ("vllm_router",),
}
SUFFIX = "_plus_router"  # a row's TTFT key + this: the TTFT with the router's real-speed added latency
RULE = ("TTFT p50 + added p50; TTFT p90 and p99 + added p99 (added: data_path open-loop latency less direct's, "
        "at real speed); a peer without a figure counts with 0 ms added in ratios (an upper bound for kvroute)")  # fmt: skip


@dataclass(frozen=True)
class Added:
    """One data_path system's added latency over ``direct`` (ms, at real speed)."""

    system: str
    p50_ms: float
    p99_ms: float


@dataclass(frozen=True)
class RouterOverhead:
    """Added latencies by data_path system, where they came from, and which system
    stands for each fleet router."""

    added: dict[str, Added]
    source: dict[str, Any]
    mapping: dict[str, tuple[str, ...]] = field(default_factory=lambda: dict(MAPPING))

    def for_router(self, router: str) -> Optional[Added]:
        """The added latency that counts for fleet router ``router``, or None."""
        return next((self.added[s] for s in self.mapping.get(router, ()) if s in self.added), None)

    def plus(self, router: str, ms: Optional[float], pct: str) -> Optional[float]:
        """``ms`` (a TTFT percentile, unscaled) with the router's added ``pct`` ("p50" or
        "p99") added; None where the router has no figure or ``ms`` is None."""
        a = self.for_router(router)
        if a is None or ms is None:
            return None
        return ms + (a.p50_ms if pct == "p50" else a.p99_ms)

    def counted(self, router: str, ms: float, pct: str) -> float:
        """As ``plus``, but a router without a figure counts with 0 ms added."""
        v = self.plus(router, ms, pct)
        return ms if v is None else v

    def annotate(self, row: dict[str, Any]) -> dict[str, Any]:
        """``row`` (``router``, ``ttft_median_ms``, ``ttft_p90_ms``, ``ttft_p99_ms``) with
        the added latency and the TTFTs plus it, or a note that there is none."""
        router, a = row["router"], self.for_router(row["router"])
        out = {**row, "router_added_system": a and a.system, "router_added_p50_ms": a and a.p50_ms,
               "router_added_p99_ms": a and a.p99_ms}  # fmt: skip
        for key, pct in (("ttft_median_ms", "p50"), ("ttft_p90_ms", "p99"), ("ttft_p99_ms", "p99")):
            out[key + SUFFIX] = self.plus(router, row.get(key), pct)
        if a is None:
            out["router_added_note"] = f"{self.why_none(router)}: TTFT without its routing layer's own time"
        return out

    def why_none(self, router: str) -> str:
        """Why ``router`` has no figure: no data_path system stands for it, or its system
        was not measured (or failed) in the source JSON."""
        systems = self.mapping.get(router, ())
        if not systems:
            return f"no data_path system for {router}"
        return f"{'/'.join(systems)} not measured in {Path(str(self.source.get('path'))).name}"

    def describe(self) -> dict[str, Any]:
        """What a benchmark's JSON records: the source, the rule, the figures, the mapping."""
        return {"source": self.source, "rule": RULE,
                "added_ms": {s: {"p50": a.p50_ms, "p99": a.p99_ms} for s, a in self.added.items()},
                "mapping": {r: list(s) for r, s in self.mapping.items()}}  # fmt: skip

    def note(self, routers: Iterable[str]) -> str:
        """One line: each router's added p50/p99 (or that it has none)."""
        parts = []
        for r in dict.fromkeys(routers):
            a = self.for_router(r)
            parts.append(f"{r} +{a.p50_ms:.1f}/+{a.p99_ms:.1f} ms ({a.system})" if a else f"{r} none ({self.why_none(r)})")
        return "router added p50/p99 at real speed: " + ", ".join(parts)


def _this_cpu() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.partition(":")[2].strip() for line in f if line.startswith("model name")), "")
    except OSError:
        return ""


def load(path: str | Path, mapping: Optional[dict[str, tuple[str, ...]]] = None) -> RouterOverhead:
    """A data_path JSON's added latencies (it must hold ``direct``, the baseline)."""
    data = json.loads(Path(path).read_text())
    rows = {r["system"]: r for r in data.get("systems", []) if "error" not in r and r.get("open_loop", {}).get("p50_ms") is not None}
    if "direct" not in rows:
        raise ValueError(f"{path}: no 'direct' system measured: the added latency needs it (kvroute bench data_path --systems ...,direct)")
    d = rows["direct"]["open_loop"]
    added = {s: Added(s, round(max(0.0, r["open_loop"]["p50_ms"] - d["p50_ms"]), 2), round(max(0.0, r["open_loop"]["p99_ms"] - d["p99_ms"]), 2))
             for s, r in rows.items() if s != "direct"}  # fmt: skip
    machine, config = data.get("machine") or {}, data.get("config") or {}
    source = {"path": str(path), "time": data.get("time"), "cpu_model": machine.get("cpu_model"), "cpu_count": machine.get("cpu_count"),
              "rate": config.get("rate"), "seconds": config.get("seconds"), "emulate": config.get("emulate"),
              "time_scale": config.get("time_scale"), "direct_p50_ms": d["p50_ms"], "direct_p99_ms": d["p99_ms"],
              "this_cpu_model": _this_cpu()}  # fmt: skip
    source["same_cpu_model"] = source["cpu_model"] == source["this_cpu_model"]
    if not source["same_cpu_model"]:
        print(f"real_speed: {path} was measured on {source['cpu_model']!r}, this box is {source['this_cpu_model']!r}", flush=True)
    return RouterOverhead(added, source, {**MAPPING, **(mapping or {})})


def systems_for(routers: Iterable[str], mapping: Optional[dict[str, tuple[str, ...]]] = None) -> list[str]:
    """The data_path systems to measure for ``routers``: each one's first choice (an
    external router's only where it is installed), once, then ``direct``."""
    from kvroute.benchmarks.fleets import EXTERNAL_ROUTERS, external_available

    table = {**MAPPING, **(mapping or {})}
    systems = [table[r][0] for r in routers if r in table and (r not in EXTERNAL_ROUTERS or external_available(r))]
    return [*dict.fromkeys(systems), "direct"]


def measure(routers: Iterable[str], out: Path, seconds: float, mapping: Optional[dict[str, tuple[str, ...]]] = None) -> Path:
    """A short ``kvroute bench data_path`` (``seconds`` per loop, 20 req/s) of the systems
    that stand for ``routers`` (each one's first choice that is installed) and ``direct``;
    its JSON's path. Run it before the fleet starts: it starts its own services."""
    from kvroute.benchmarks import data_path

    systems = systems_for(routers, mapping)
    p = argparse.ArgumentParser()
    data_path.add_args(p)
    args = p.parse_args(["--systems", ",".join(systems), "--seconds", str(seconds), "--idle-seconds", "1",
                         "--out", str(out), "--log-dir", str(out.parent / "data_path_logs")])  # fmt: skip
    print(f"real_speed: measuring the routing layers at real speed first: {', '.join(systems)}", flush=True)
    data_path.run(args)
    return out


def add_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("the routing layer at real speed (benchmarks/real_speed.py)")
    g.add_argument("--overhead-from", default=None, metavar="PATH",
                   help="a `kvroute bench data_path` JSON from this box: each router's added latency is added to its TTFT")
    g.add_argument("--overhead-measure", action="store_true",
                   help="run a short data_path first (the run's routers and direct) and use it")
    g.add_argument("--overhead-seconds", type=float, default=10.0, help="--overhead-measure: each loop's length")
    g.add_argument("--overhead-map", default="", metavar="ROUTER=SYSTEM,...",
                   help=f"which data_path system stands for a fleet router (default {json.dumps({k: v[0] for k, v in MAPPING.items()})})")


def from_args(args: argparse.Namespace, routers: Iterable[str], out_dir: Path,
              time_scale: Optional[float] = None) -> Optional[RouterOverhead]:  # fmt: skip
    """The overhead the arguments ask for (None: neither ``--overhead-from`` nor
    ``--overhead-measure``); a measured one's JSON goes to ``out_dir/data_path.json``.
    A measured run at ``time_scale`` <= 1 is refused: its TTFTs already hold the time."""
    if time_scale is not None and not time_scale > 1 and (getattr(args, "overhead_from", None) or getattr(args, "overhead_measure", False)):
        raise ValueError(f"--overhead-from / --overhead-measure: for emulated runs at --time-scale > 1, got {time_scale:g}")
    mapping = {}
    for item in filter(None, (x.strip() for x in getattr(args, "overhead_map", "").split(","))):
        router, _, system = item.partition("=")
        if not system:
            raise ValueError(f"--overhead-map: {item!r} is not ROUTER=SYSTEM")
        mapping[router] = (system,)
    path = getattr(args, "overhead_from", None)
    if getattr(args, "overhead_measure", False):
        if path:
            raise ValueError("--overhead-from and --overhead-measure: one or the other")
        out_dir.mkdir(parents=True, exist_ok=True)
        path = measure(routers, out_dir / "data_path.json", args.overhead_seconds, mapping)
    return load(path, mapping) if path else None


def counted_row(row: dict[str, Any], key: str) -> float:
    """A row's TTFT ``key`` plus its router's added latency, or as measured where the
    router has no figure (0 ms added)."""
    v = row.get(key + SUFFIX)
    return row[key] if v is None else v


def versus_best_peer(ours: dict[str, Any], peers: dict[str, dict[str, Any]],
                     keys: tuple[str, ...] = ("ttft_p90_ms", "ttft_p99_ms")) -> dict[str, Any]:  # fmt: skip
    """kvroute's annotated row against the best peer by ``keys[0]``, every TTFT plus its
    router's added latency (``counted_row``): ``best``, ``ratios`` by key, and the peers
    ``counted_without_added``. Empty where kvroute's row has no figure or no peer ran."""
    if ours.get(keys[0] + SUFFIX) is None or not peers:
        return {}
    best = min(peers, key=lambda n: counted_row(peers[n], keys[0]))
    return {"best": best, "ratios": {k: ours[k + SUFFIX] / max(counted_row(peers[best], k), 1e-9) for k in keys},
            "counted_without_added": sorted(n for n, r in peers.items() if r.get(keys[0] + SUFFIX) is None)}  # fmt: skip
