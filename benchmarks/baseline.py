"""Before/after comparisons against an earlier commit: that commit's code as an
importable ``kvroute`` package beside this checkout's, and runs that alternate between
the two so both see the same machine load (``router_cpu``, ``worker_pool_cpu``)."""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

REPO = Path(__file__).resolve().parents[1]
# what the driver needs beside itself: the shared argument groups (a baseline may predate them)
_SHARED = ("options.py", "baseline.py")
# a fresh interpreter's first statements: the tree in argv[1] first on sys.path, and not the
# editable install's finder (it would win)
BOOT = (
    "import sys; sys.path.insert(0, sys.argv.pop(1)); "
    "sys.meta_path[:] = [f for f in sys.meta_path if '__editable__' not in getattr(f, '__module__', '')]; "
)


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
    for name in _SHARED:
        shutil.copy(REPO / "benchmarks" / name, pkg / "benchmarks" / name)
    return str(tmp / "pkg")


def child_run(module: str, argv: Sequence[str], tree: Optional[str], env: Optional[dict[str, str]] = None) -> str:
    """``module.child(argv)`` in a fresh interpreter, on this checkout's code or (``tree``)
    the baseline's; the last line it printed."""
    call = f"import sys; from {module} import child; child(sys.argv[1:])"
    cmd = [sys.executable, "-c", BOOT + call, tree, *argv] if tree else [sys.executable, "-c", call, *argv]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, env=env)
    return out.stdout.strip().splitlines()[-1]


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
