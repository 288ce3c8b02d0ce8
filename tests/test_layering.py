"""ARCHITECTURE.md §1 import directions, enforced."""

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _imports(folder: str) -> dict[str, set[str]]:
    found: dict[str, set[str]] = {}
    for path in (ROOT / folder).rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [node.module]
            else:
                continue
            for n in names:
                found.setdefault(n, set()).add(str(path.relative_to(ROOT)))
    return found


def test_router_imports_without_torch():
    code = "import sys, kvroute.router, kvroute.replica.block_hash, kvroute.replica.kv_events; " \
        "bad = [m for m in ('torch', 'transformers', 'ray', 'fastapi') if m in sys.modules]; " \
        "assert not bad, bad"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_facade_is_lazy():
    code = "import sys, kvroute; assert 'torch' not in sys.modules; kvroute.SamplingParams; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_no_ray_or_fastapi_below_cluster():
    for folder in ("replica", "router", "kernels"):
        for mod, files in _imports(folder).items():
            top = mod.split(".")[0]
            assert top not in ("ray", "fastapi", "uvicorn", "starlette"), (folder, mod, files)


def test_router_imports_only_block_hash_and_events_of_ours():
    allowed = {"kvroute.replica.block_hash", "kvroute.replica.kv_events"}
    for mod, files in _imports("router").items():
        assert mod.split(".")[0] != "torch", (mod, files)
        if mod.startswith("kvroute."):
            assert mod in allowed or mod.startswith("kvroute.router"), (mod, files)


def test_kernels_import_nothing_of_ours_but_kernels():
    for mod, files in _imports("kernels").items():
        if mod.startswith("kvroute."):
            assert mod.startswith("kvroute.kernels"), (mod, files)


def test_replica_imports_only_kernels_of_ours():
    for mod, files in _imports("replica").items():
        if mod.startswith("kvroute."):
            assert mod.startswith(("kvroute.replica", "kvroute.kernels")), (mod, files)


def test_caller_side_cluster_code_imports_without_torch():
    """The client and the Serve request router run in every caller (HTTP ingress,
    benchmark jobs): they must not drag torch in."""
    code = "import sys, kvroute.cluster.client, kvroute.cluster.request_router, kvroute.cluster.router_actor; " \
        "assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)
