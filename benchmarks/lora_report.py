"""What the LoRA fleet benchmark reports, simulated or measured: kvroute against the best
peer on each figure, and the one summary line."""

from __future__ import annotations

from typing import Any

from kvroute.benchmarks.real_speed import SUFFIX, versus_best_peer


def compare(results: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """kvroute against the best peer present on each figure (ratios < 1: kvroute is lower);
    where the results carry the routers' real-speed added latency, the p90 ratio again
    with it (``p90_ratio_plus_router``; a peer without a figure counts with 0 ms)."""
    ours = results.get("kvroute")
    peers = {p: r for p, r in results.items() if p != "kvroute"}
    if ours is None or not peers:
        return {}
    p90_peer = min(peers, key=lambda p: peers[p]["ttft_p90_s"])
    loads_peer = min(peers, key=lambda p: peers[p]["adapter_loads_per_1k"])
    plus = versus_best_peer(ours, peers, ("ttft_p90_s",))
    return {
        **({"best_p90_peer_plus_router": plus["best"], "p90_ratio_plus_router": plus["ratios"]["ttft_p90_s"],
            "counted_without_added": plus["counted_without_added"]} if plus else {}),
        "best_p90_peer": p90_peer,
        "p90_ratio": ours["ttft_p90_s"] / peers[p90_peer]["ttft_p90_s"],
        "best_loads_peer": loads_peer,
        "loads_ratio": ours["adapter_loads_per_1k"] / max(peers[loads_peer]["adapter_loads_per_1k"], 1e-9),
    }


def summary_line(out: dict[str, Any]) -> str:
    c, res = out["comparison"], out["results"]
    parts = [f"{p}: loads/1k {r['adapter_loads_per_1k']:.1f} hit {r['hit_rate']:.3f} p50 {1e3 * r['ttft_p50_s']:.0f} "
             f"p90 {1e3 * r['ttft_p90_s']:.0f} ms{_plus(r)} {r['output_tokens_per_s']:.0f} tok/s"
             + (f" {r['errors']} errors" if "errors" in r else "") for p, r in res.items()]  # fmt: skip
    cfg = out["config"]
    how = "simulated" if out["simulated"] else f"emulated x{out['time_scale']:g}"
    head = (f"lora_fleet ({how}, {out['profile']}): {cfg['replicas']} replicas, {cfg['adapters']} adapters "
            f"zipf {cfg['zipf']}, max_loras {cfg['max_loras']}, {cfg['load']} load ({out['rate_rps']:.1f} req/s)")  # fmt: skip
    tail = (f"; kvroute/best peer: p90 {c['p90_ratio']:.3g}x ({c['best_p90_peer']}), loads {c['loads_ratio']:.3g}x "
            f"({c['best_loads_peer']})") if c else ""  # fmt: skip
    if "p90_ratio_plus_router" in c:
        tail += f"; with the routers' real-speed added latency: p90 {c['p90_ratio_plus_router']:.3g}x ({c['best_p90_peer_plus_router']})"
    return head + " | " + "; ".join(parts) + tail


def _plus(r: dict[str, Any]) -> str:
    """A measured router's TTFT p50/p90 with its real-speed added latency, where known."""
    if ("ttft_p90_s" + SUFFIX) not in r:
        return ""
    if r["ttft_p90_s" + SUFFIX] is None:
        return " (+router: no real-speed figure)"
    return f" (+router {1e3 * r['ttft_p50_s' + SUFFIX]:.0f}/{1e3 * r['ttft_p90_s' + SUFFIX]:.0f} ms)"
