"""benchmarks.router_scale: the simulated many-ingress sweep (issue 30), small."""

from __future__ import annotations

import json

from kvroute.benchmarks.cli import main as bench
from kvroute.benchmarks import router_scale


def test_a_small_sweep_covers_every_variant_and_reports_the_targets(tmp_path):
    assert bench(["router_scale", "--ingresses", "1,4", "--scenarios", "zipf", "--loads", "0.85", "--scale", "0.05",
                  "--len-scale", "0.5", "--out-dir", str(tmp_path)]) == 0  # fmt: skip
    out = json.loads((tmp_path / "router_scale.json").read_text())
    rows = {(r["ingresses"], r["variant"]): r for r in out["rows"]}
    assert set(rows) == {(i, v) for i in (1, 4) for v in router_scale.VARIANTS}
    assert rows[(4, "kvroute/N=I")]["routers"] == 4 and rows[(4, "kvroute/1")]["routers"] == 1
    assert rows[(4, "prefix_affinity_ray")]["routers"] == 1  # its tree actor is shared by every ingress
    # at one ingress the three kvroute variants are the same router
    assert rows[(1, "kvroute/1")]["hit_rate"] == rows[(1, "kvroute/N=I")]["hit_rate"] == rows[(1, "kvroute/indep")]["hit_rate"]
    assert all(r["errors"] == 0 for r in out["rows"])
    (t4,) = [t for t in out["targets"] if t["ingresses"] == 4]
    assert t4["best_peer"] in router_scale.PEERS and t4["p90_vs_best_peer"] > 0
    assert "| kvroute/N=I |" in (tmp_path / "table.md").read_text()


def test_an_unknown_variant_is_refused(capsys):
    assert bench(["router_scale", "--variants", "kvroute/2"]) == 2
    assert "unknown variant 'kvroute/2'" in capsys.readouterr().err
