"""Before/after comparisons against an earlier commit: that commit's code as an
importable ``kvroute`` package beside this checkout's, and runs that alternate between
the two so both see the same machine load (``router_cpu``, ``worker_pool_cpu``)."""

from __future__ import annotations

import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Any, Callable, Optional

REPO = Path(__file__).resolve().parents[1]


def baseline_tree(ref: str, driver: Path) -> str:
    """``ref``'s code as an importable ``kvroute`` package (this checkout's layout), with
    this checkout's ``driver`` benchmark in it (the baseline may not have it); the
    folder to put first on ``sys.path``."""
    tmp = Path(tempfile.mkdtemp(prefix="kvroute-base-"))
    subprocess.run(f"git -C {REPO} archive {ref} | tar -x -C {tmp}", shell=True, check=True)
    pkg = tmp / "pkg" / "kvroute"
    (tmp / "kvroute").rename(tmp / "kvroute_top")
    pkg.parent.mkdir()
    (tmp / "kvroute_top").rename(pkg)
    for sub in ("replica", "router", "cluster", "benchmarks", "kernels", "deploy"):
        (tmp / sub).rename(pkg / sub)
    shutil.copy(driver, pkg / "benchmarks" / driver.name)
    return str(tmp / "pkg")


def alternate(ref: str, driver: Path, rounds: int, run: Callable[[Optional[str]], dict[str, Any]]) -> dict[str, list]:
    """``rounds`` × (``run(baseline tree)``, ``run(None)``: this checkout), alternating;
    the results as ``{"before": [...], "after": [...]}``. The tree is removed after."""
    tree = baseline_tree(ref, driver)
    runs: dict[str, list] = {"before": [], "after": []}
    try:
        for _ in range(rounds):
            runs["before"].append(run(tree))
            runs["after"].append(run(None))
    finally:
        shutil.rmtree(Path(tree).parent)
    return runs
