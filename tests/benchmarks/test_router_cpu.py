"""benchmarks/router_cpu: the replay of one router actor's calls is exact and covers
every call kind; the baseline tree imports its own code."""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
from pathlib import Path

from kvroute.benchmarks import router_cpu


def _args(**kw) -> argparse.Namespace:
    return argparse.Namespace(**{"replicas": 4, "routers": 4, "block_size": 16, "seconds": 2.0, "rate": 150.0,
                                 "seed": 0, **kw})  # fmt: skip


def test_the_replay_is_exact_and_reaches_every_call_kind():
    a, b = router_cpu.replay(_args()), router_cpu.replay(_args())
    counts = {k: len(v) for k, v in a["cost_ns"].items()}
    assert counts == {k: len(v) for k, v in b["cost_ns"].items()}
    assert all(counts[k] > 0 for k in router_cpu.KINDS), counts
    assert a["decisions_by_reason"] == b["decisions_by_reason"] and a["peer_decisions"] == b["peer_decisions"] > 0
    s = router_cpu.summarize(a, 2.0)
    assert s["decision"]["calls_per_s"] == counts["decision"] / 2.0 and s["router_cores"] > 0
    other = router_cpu.replay(_args(seed=1))  # another seed, another run
    assert {k: len(v) for k, v in other["cost_ns"].items()} != counts


def test_the_baseline_tree_runs_its_own_code():
    repo = Path(router_cpu.__file__).resolve().parents[1]
    if subprocess.run(["git", "-C", str(repo), "rev-parse", "HEAD"], capture_output=True).returncode:
        raise AssertionError("router_cpu --baseline needs the git checkout it ships in")
    from kvroute.benchmarks.baseline import BOOT, baseline_tree

    tree = baseline_tree("HEAD", Path(router_cpu.__file__))
    try:
        boot = BOOT + "import kvroute.router.router as r; print(r.__file__)"
        out = subprocess.run([sys.executable, "-c", boot, tree], capture_output=True, text=True, check=True).stdout
        assert out.strip() == str(Path(tree) / "kvroute" / "router" / "router.py")
    finally:
        shutil.rmtree(Path(tree).parent)
