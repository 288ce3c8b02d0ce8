"""The multi-ingress matrix: every router at I ingresses, measured on emulated
replicas, with the simulator's prediction beside each cell.

    kvroute bench ingress_matrix [--ingresses 8,1,4,2] [--scenarios b2b,zipf,multi-tenant]
        [--load 0.85] [--routers kvroute,kvroute_1router,prefix_affinity_ray,sglang_router,vllm_router]
        [--replicas 16] [--profile gpu_h100_llama3_8b] [--time-scale 80] [--scale 0.25] [--len-scale 1.0]
        [--sizes b2b=0.5:0.25] [--output-len 32] [--kill-router zipf:8] [--out-dir results/ingress_matrix]
    (as a Ray job: RAY_AUTH_MODE=token ray job submit --working-dir . -- python -m kvroute.benchmarks ingress_matrix ...)

Each (scenario, I) is one ``compare_routers --ingresses I`` run on ``fleet_matrix``'s
scenarios, KV sizing and load (a fraction of the simulator's capacity estimate for the
fleet): kvroute with a router actor per ingress (``kvroute``) and with one
(``kvroute_1router``), Ray's PrefixCacheAffinityRouter behind I Serve ingresses (its tree
actor shared), and sglang-router / vllm-router as I independent processes in front of the
same ``serve-replica --emulate`` workers; the clients are spread round robin over the
ingresses. ``--output-len`` cuts every answer (the decode tail of a 256-token answer at
``--time-scale 80`` is minutes of wall time per cell; a replayed trace's, ``mooncake``,
are capped at it, and its requests keep the trace's arrival times scaled to the rate).
``--kill-router SCENARIO:I`` adds a kvroute run at that cell whose busiest router actor
dies at mid-run, set against the same cell undisturbed: its errors and the hit rate of
the requests that started in the ``--window-s`` after the kill. Cells run in the order
of ``--ingresses`` and the table is rewritten after each, so a cut-short run keeps what
it measured. The simulator cells come from ``router_scale`` (``kvroute`` is its
``kvroute/N=I``, ``kvroute_1router`` its ``kvroute/1``). Times are unscaled seconds;
``--overhead-from DATA_PATH_JSON`` (or ``--overhead-measure``) adds each router's
real-speed added latency beside them and in the ratios (``benchmarks/real_speed.py``).

Outputs in ``--out-dir``: ``matrix.json`` (rows, kill run, targets), ``table.md``, and per
cell the compare_routers outputs (``<scenario>-I<I>/``). One summary line.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import time
from pathlib import Path
from typing import Any, Optional, Sequence

from kvroute.benchmarks import options, real_speed
from kvroute.benchmarks import workloads as wl
from kvroute.benchmarks.fleet_matrix import (
    BLOCK_SIZE, MAX_BATCHED_TOKENS, MAX_NUM_SEQS, SCENARIOS, arrival_of, is_trace, kv_blocks_of, stamped, trace_kwargs,
)
from kvroute.benchmarks.fleets import fleet_from_args
from kvroute.benchmarks.router_report import markdown_table, plus_router_cols, window_hit_rate
from kvroute.benchmarks.serving_config import quiet_load

# (in the order a run takes them: kvroute_1router after the others with one router per ingress, as
# each change of the router count restarts the engine replicas)
SIM_VARIANT = {"kvroute": "kvroute/N=I", "prefix_affinity_ray": "prefix_affinity_ray", "kvroute_1router": "kvroute/1",
               "sglang_router": "sglang_router", "vllm_router": "vllm_router"}  # fmt: skip
PEERS = ("prefix_affinity_ray", "sglang_router", "vllm_router")
COLS = [("scenario", "scenario", "{}"), ("I", "ingresses", "{}"), ("router", "router", "{}"), ("N", "num_routers", "{}"),
        ("ok", "completed", "{}"), ("err", "failed", "{}"), ("TTFT p50 ms", "ttft_median_ms", "{:.0f}"),
        ("p90", "ttft_p90_ms", "{:.0f}"), ("p99", "ttft_p99_ms", "{:.0f}"), ("out tok/s", "out_tok_s", "{:.0f}"),
        ("hit (delivered)", "hit_rate", "{:.3f}"), ("ideal", "ideal_hit_rate", "{:.3f}"), ("avail", "available_rate", "{:.3f}"),
        ("capt", "captured_rate", "{:.3f}"), ("best", "best_hit_rate", "{:.3f}"), ("pred err", "pred_cached_err", "{:.3f}"),
        ("CPU cores", "cpu_cores", "{:.2f}"),
        ("ingress CPU", "ingress_cores", "{:.2f}"), ("router CPU", "router_cores", "{:.2f}"),
        ("peer lag p50 ms", "peer_lag_p50_ms", "{:.1f}"), ("p99", "peer_lag_p99_ms", "{:.1f}"), ("sim p90", "sim_ttft_p90_ms", "{:.0f}"), ("sim hit", "sim_hit_rate", "{:.3f}")]  # fmt: skip
TARGET_COLS = [("scenario", "scenario", "{}"), ("I", "ingresses", "{}"), ("hit / I=1", "hit_vs_I1", "{:.3f}"),
               ("p90 / I=1", "p90_vs_I1", "{:.2f}"), ("best peer", "best_peer", "{}"), ("p90 / best peer", "p90_vs_best_peer", "{:.2f}"),
               ("tok/s / best peer", "throughput_vs_best_peer", "{:.2f}"), ("sim p90 / I=1", "sim_p90_vs_I1", "{:.2f}"),
               ("sim p90 / best peer", "sim_p90_vs_best_peer", "{:.2f}"),
               ("p90 / I=1 +added", "p90_vs_I1_plus_router", "{:.2f}"), ("best peer +added", "best_peer_plus_router", "{}"),
               ("p90 / best peer +added", "p90_vs_best_peer_plus_router", "{:.2f}")]  # fmt: skip
# the processes of the ingress layer, by cpu_account kind
INGRESS_KINDS = ("OpenAIIngress", "ProxyActor", "sglang::router", "vllm::router")  # (the peers retitle their processes)


@dataclasses.dataclass(frozen=True)
class Cell:
    """One scenario's trace and fleet, as every router and I meets it."""

    scenario: str
    scale: float
    len_scale: float
    workload: wl.Workload
    workload_kwargs: dict[str, Any]
    kv_blocks: int
    capacity_rps: float
    rate: float


def make_cell(name: str, args: argparse.Namespace) -> Cell:
    from kvroute.benchmarks.sim.capacity import estimate_capacity
    from kvroute.replica.profiles import get_profile

    s = SCENARIOS[name]
    scale, len_scale = sizes(args).get(name, (args.scale, args.len_scale))
    cut = {("max_output_len" if is_trace(name) else "output_len"): args.output_len} if args.output_len else {}
    kwargs = {**s.workload_kwargs, **trace_kwargs(name, args), **cut}  # (a trace's answers are cut, not set)
    workload = wl.make_workload(s.dataset, seed=args.seed, scale=scale, len_scale=len_scale, **kwargs)
    profile = get_profile(args.profile)
    kv_blocks = kv_blocks_of(name, workload, args.replicas, profile.kv_blocks_per_replica)
    capacity = estimate_capacity(workload, profile, sim_config(args, kv_blocks))["capacity_rps"]
    return Cell(name, scale, len_scale, workload, kwargs, kv_blocks, capacity, round(args.load * capacity, 3))


def sizes(args: argparse.Namespace) -> dict[str, tuple[float, float]]:
    """``--sizes``: scenario -> (scale, len_scale)."""
    out = {}
    for item in filter(None, args.sizes.split(",")):
        name, _, value = item.partition("=")
        scale, _, len_scale = value.partition(":")
        out[name] = (float(scale), float(len_scale or 1.0))
    return out


def sim_config(args: argparse.Namespace, kv_blocks: int) -> Any:
    from kvroute.benchmarks.sim.simulator import SimConfig

    return SimConfig(num_replicas=args.replicas, kv_blocks=kv_blocks, block_size=BLOCK_SIZE,
                     max_num_batched_tokens=MAX_BATCHED_TOKENS, max_num_seqs=MAX_NUM_SEQS,
                     router_decision_s=args.router_decision_s)  # fmt: skip


def simulate(cell: Cell, ingresses: int, router: str, args: argparse.Namespace) -> dict[str, Any]:
    from kvroute.benchmarks.router_scale import run_cell
    from kvroute.replica.profiles import get_profile

    m = run_cell(stamped(cell.workload, cell.rate, args.seed), get_profile(args.profile), sim_config(args, cell.kv_blocks),
                 SIM_VARIANT[router], ingresses, args.peer_delay)  # fmt: skip
    return {"sim_ttft_p90_ms": m["ttft_p90_s"] * 1000, "sim_ttft_p99_ms": m["ttft_p99_s"] * 1000, "sim_hit_rate": m["hit_rate"],
            "sim_out_tok_s": m["output_tokens_per_s"]}  # fmt: skip


def measure(cell: Cell, ingresses: int, routers: Sequence[str], args: argparse.Namespace, root: Path,
            kill_router: bool = False, overhead: Optional[real_speed.RouterOverhead] = None) -> list[dict[str, Any]]:  # fmt: skip
    """One compare_routers run at I = ``ingresses`` (in ``root``): a row per router, with its run's JSON."""
    from kvroute.benchmarks import compare_routers
    from kvroute.replica.profiles import get_profile

    out = root / f"{cell.scenario}-I{ingresses}{'-kill' if kill_router else ''}"
    engine_kwargs = {"block_size": BLOCK_SIZE, "num_kv_blocks": cell.kv_blocks, "max_num_batched_tokens": MAX_BATCHED_TOKENS,
                     "max_model_len": get_profile(args.profile).max_model_len}  # fmt: skip
    combined = compare_routers.compare(compare_routers.CompareConfig(
        workload=cell.workload, load=quiet_load(timeout_s=args.timeout_s, seed=args.seed, time_scale=args.time_scale,
                                                request_rate=cell.rate, arrival=arrival_of(cell.workload)),
        fleet=fleet_from_args(args, ingresses=ingresses), routers=tuple(routers), engine_kwargs=engine_kwargs,
        emulate=args.profile, kill_router=kill_router, window_s=args.window_s, out_dir=str(out), label=out.name,
        overhead=overhead,
    ))  # fmt: skip
    rows = []
    for row in combined["rows"]:
        run = json.loads((out / f"{row['run']}.json").read_text())
        by_kind = (run.get("cpu") or {}).get("by_kind", {})
        rows.append({**row, "scenario": cell.scenario, "ingresses": ingresses, "load": args.load,
                     "ideal_hit_rate": cell.workload.params.get("ideal_hit_rate"),
                     "num_routers": run.get("num_routers"), "requests_per_ingress": run["requests_per_ingress"],
                     "ingress_cores": sum(v for k, v in by_kind.items() if k in INGRESS_KINDS),
                     "router_cores": sum(v for k, v in by_kind.items() if k.endswith("RouterService")),
                     "peer_lag_p50_ms": (run.get("peer_staleness_ms") or {}).get("p50"),
                     "peer_lag_p99_ms": (run.get("peer_staleness_ms") or {}).get("p99"),
                     "cpu_by_kind": by_kind, "run_json": str(out / f"{row['run']}.json")})  # fmt: skip
    return rows


def targets(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per (scenario, I): kvroute (N = I) against kvroute at I = 1 and the best peer at I
    (by p90), measured and simulated; where the rows carry the routers' real-speed added
    latency, the measured p90 ratios again with it (``*_plus_router``)."""
    by = {(r["scenario"], r["ingresses"], r["router"]): r for r in rows}
    out = []
    for (scen, i, router), k in sorted(by.items()):
        base = by.get((scen, 1, "kvroute"))
        if router != "kvroute" or base is None:
            continue
        peers = [by[(scen, i, p)] for p in PEERS if (scen, i, p) in by and by[(scen, i, p)]["completed"]]
        best = min(peers, key=lambda p: p["ttft_p90_ms"]) if peers else None
        plus = real_speed.versus_best_peer(k, {p["router"]: p for p in peers}, ("ttft_p90_ms",))
        ours, base_plus = k.get("ttft_p90_ms" + real_speed.SUFFIX), base.get("ttft_p90_ms" + real_speed.SUFFIX)
        with_added: dict[str, Any] = {"p90_vs_I1_plus_router": ours / max(base_plus, 1e-9)} if ours and base_plus else {}
        if plus:
            with_added.update(best_peer_plus_router=plus["best"], p90_vs_best_peer_plus_router=plus["ratios"]["ttft_p90_ms"],
                              counted_without_added=plus["counted_without_added"])  # fmt: skip
        out.append({
            "scenario": scen, "ingresses": i,
            "hit_vs_I1": k["hit_rate"] / max(base["hit_rate"], 1e-12), "p90_vs_I1": k["ttft_p90_ms"] / max(base["ttft_p90_ms"], 1e-9),
            "sim_p90_vs_I1": k["sim_ttft_p90_ms"] / max(base["sim_ttft_p90_ms"], 1e-9),
            "best_peer": best and best["router"],
            "p90_vs_best_peer": best and k["ttft_p90_ms"] / max(best["ttft_p90_ms"], 1e-9),
            "throughput_vs_best_peer": best and k["out_tok_s"] / max(best["out_tok_s"], 1e-9),
            "sim_p90_vs_best_peer": best and k["sim_ttft_p90_ms"] / max(best["sim_ttft_p90_ms"], 1e-9), **with_added,
        })  # fmt: skip
    return out


def kill_report(killed: dict[str, Any], undisturbed: Optional[dict[str, Any]]) -> dict[str, Any]:
    """The kill run against the same cell undisturbed: the same requests' hit rates."""
    run = json.loads(Path(killed["run_json"]).read_text())
    ids = run.get("after_event_request_ids", [])
    report = {"scenario": killed["scenario"], "ingresses": killed["ingresses"], "killed_routers": run.get("killed_routers"),
              "failed": killed["failed"], "completed": killed["completed"], "window_requests": len(ids),
              "failovers": (run.get("routing") or {}).get("failovers"), "fallbacks": (run.get("routing") or {}).get("fallbacks"),
              "hit_after_kill": run.get("after_event_hit_rate"), "p90_ms": killed["ttft_p90_ms"]}  # fmt: skip
    if undisturbed is not None:
        base = json.loads(Path(undisturbed["run_json"]).read_text())
        report["hit_same_requests_undisturbed"] = window_hit_rate(base, ids)
        report["p90_ms_undisturbed"] = undisturbed["ttft_p90_ms"]
    return report


def write(out: Path, rows: list[dict[str, Any]], kill: Optional[dict[str, Any]], args: argparse.Namespace, t0: float,
          overhead: Optional[real_speed.RouterOverhead] = None) -> list[dict[str, Any]]:  # fmt: skip
    from kvroute.benchmarks.common import machine

    tg = targets(rows)
    out.mkdir(parents=True, exist_ok=True)
    result = {"benchmark": "ingress_matrix", "time": time.strftime("%Y-%m-%dT%H:%M:%S"), "args": vars(args), "rows": rows,
              "targets": tg, "kill": kill, "machine": machine(), "wall_s": time.perf_counter() - t0,
              "router_overhead": overhead and overhead.describe()}  # fmt: skip
    (out / "matrix.json").write_text(json.dumps(result, indent=1))
    text = markdown_table(rows, COLS + plus_router_cols(rows)) + "\n\n" + markdown_table(tg, TARGET_COLS) + "\n"
    if kill:
        text += "\nkill: " + json.dumps(kill) + "\n"
    (out / "table.md").write_text(text)
    return tg


def add_args(p: argparse.ArgumentParser) -> None:
    f = options.add_fleet(p, replicas=16, cpus_per_replica=0.05, app_name="kvroute-ingress", time_scale=80.0)
    f.add_argument("--profile", default="gpu_h100_llama3_8b", help="the step profile the replicas emulate")
    options.add_trace(p, scale=0.25)
    p.add_argument("--ingresses", default="8,1,4,2", help="the I to run, in this order")
    p.add_argument("--scenarios", default="b2b,zipf,multi-tenant")
    p.add_argument("--load", type=float, default=0.85, help="a fraction of the scenario's estimated capacity")
    p.add_argument("--routers", default=",".join(SIM_VARIANT))
    p.add_argument("--sizes", default="", metavar="SCENARIO=SCALE:LEN_SCALE,...", help="per scenario --scale and --len-scale")
    p.add_argument("--output-len", type=int, default=32, help="every answer's length (0: the scenario's own)")
    p.add_argument("--kill-router", default=None, metavar="SCENARIO:I", help="a kvroute run at that cell loses a router mid-run")
    p.add_argument("--window-s", type=float, default=60.0, help="the kill run's hit-rate window after the kill (unscaled s)")
    p.add_argument("--peer-delay", type=float, default=0.002, help="the simulator's lag between kvroute's routers (s)")
    p.add_argument("--router-decision-s", type=float, default=0.0005, help="the simulator's time per decision per router (s)")
    p.add_argument("--timeout-s", type=float, default=900.0)
    options.add_output(p, "ingress_matrix", folder=True)
    real_speed.add_args(p)


def run(args: argparse.Namespace) -> int:
    scenarios, routers = options.csv(args.scenarios), options.csv(args.routers)
    bad = [s for s in scenarios if s not in SCENARIOS] + [r for r in routers if r not in SIM_VARIANT]
    if bad:
        raise ValueError(f"unknown scenarios or routers {bad}")
    t0, out = time.perf_counter(), options.result_folder("ingress_matrix", args.out_dir)
    overhead = real_speed.from_args(args, routers, out, args.time_scale)
    cells = {name: make_cell(name, args) for name in scenarios}
    rows: list[dict[str, Any]] = []
    kill, tg = None, []
    for i in (int(x) for x in args.ingresses.split(",")):
        for cell in cells.values():
            here = [r for r in routers if not (i == 1 and r == "kvroute_1router")]  # the same as kvroute at I = 1
            rows += [{**r, **simulate(cell, i, r["router"], args)} for r in measure(cell, i, here, args, out, overhead=overhead)]
            if args.kill_router == f"{cell.scenario}:{i}":
                killed = measure(cell, i, ["kvroute"], args, out, kill_router=True, overhead=overhead)[0]
                same = next((r for r in rows if (r["scenario"], r["ingresses"], r["router"]) == (cell.scenario, i, "kvroute")), None)
                kill = kill_report(killed, same)
            tg = write(out, rows, kill, args, t0, overhead)
    ours = sum(r["failed"] for r in rows if r["router"].startswith("kvroute")) + (kill["failed"] if kill else 0)
    worst = max((t["p90_vs_I1"] for t in tg), default=math.nan)
    plus = ""
    if overhead is not None:
        vs_peer = max((t["p90_vs_best_peer_plus_router"] for t in tg if "p90_vs_best_peer_plus_router" in t), default=math.nan)
        plus = f"; with each router's real-speed added latency: worst kvroute p90 / best peer {vs_peer:.2f} ({overhead.note(routers)})"
    print(f"ingress_matrix: {len(rows)} runs, {sum(r['failed'] for r in rows)} errors ({ours} kvroute's); "
          f"worst kvroute p90 / I=1 {worst:.2f} (emulated x{args.time_scale:g}, unscaled){plus}  [{out}]")  # fmt: skip
    return 0 if ours == 0 else 1


if __name__ == "__main__":
    from kvroute.benchmarks.cli import module_main

    raise SystemExit(module_main(__spec__.name))
