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


PACKAGES = ("cluster", "replica", "router", "kernels", "deploy", "benchmarks", "kvroute")


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(["kvroute", *parts] if parts[0] != "kvroute" else parts)


def _import_graph() -> dict[str, set[str]]:
    """Our modules and the modules of ours each one imports, at any depth of the file
    (a lazy import inside a function still ties the two modules together)."""
    files = {_module_name(p): p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for mod, path in files.items():
        package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
        deps: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                    base = f"{anchor}.{base}" if base else anchor
                targets = [base] + [f"{base}.{a.name}" for a in node.names]
            else:
                continue
            deps.update(t for t in targets if t in files and t != mod)
        graph[mod] = deps
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    return found


def test_no_import_cycles_between_our_modules():
    """A package's ``__init__`` re-exporting its own modules is not a cycle between
    modules; anything else that imports back (even lazily, inside a function) is."""
    graph = _import_graph()
    for mod, deps in graph.items():
        graph[mod] = {d for d in deps if not (mod.startswith(d + ".") and graph.get(d) is not None)}
    assert _cycles(graph) == []


def test_ray_only_in_cluster_deploy_benchmarks():
    for folder in ("replica", "router", "kernels", "kvroute"):
        for mod, files in _imports(folder).items():
            assert mod.split(".")[0] != "ray", (folder, mod, files)


OPENAI_MAY_IMPORT = ("kvroute.deploy.openai", "kvroute.replica", "kvroute.router")
OPENAI_MAY_IMPORT_EXACTLY = {"kvroute", "kvroute.cluster.response_store_actor"}
BACKENDS_MAY_IMPORT = ("kvroute.deploy.openai", "kvroute.deploy.backends", "kvroute.cluster", "kvroute.replica",
                       "kvroute.router")  # fmt: skip
BACKENDS_MAY_IMPORT_EXACTLY = {"kvroute.deploy.metrics"}


def _ours_outside(folder: str, prefixes: tuple[str, ...], exactly: set[str]) -> list[tuple[str, set[str]]]:
    return [(mod, files) for mod, files in _imports(folder).items()
            if mod.startswith("kvroute") and mod not in exactly and not mod.startswith(prefixes)]  # fmt: skip


def test_openai_layer_imports_no_ray_no_host_no_backend():
    """deploy/openai/ is the HTTP layer every host serves: of ours it imports only itself,
    the engine's and the router's plain types, and the Ray-free bounded response store
    (ARCHITECTURE.md §1); no Ray, no Serve, no host, no backend."""
    for mod, files in _imports("deploy/openai").items():
        assert mod.split(".")[0] != "ray", (mod, files)
    assert _ours_outside("deploy/openai", OPENAI_MAY_IMPORT, OPENAI_MAY_IMPORT_EXACTLY) == []


def test_openai_layer_loads_neither_ray_nor_torch():
    """Importing every module of deploy/openai/ (what it imports of cluster/ included)
    leaves Ray and torch unloaded: a process that only serves HTTP pays for neither."""
    code = ("import sys, pkgutil, importlib, kvroute.deploy.openai as o\n"
            "for m in pkgutil.walk_packages(o.__path__, 'kvroute.deploy.openai.'): importlib.import_module(m.name)\n"
            "bad = [m for m in ('ray', 'torch') if m in sys.modules]\n"
            "assert not bad, bad")  # fmt: skip
    subprocess.run([sys.executable, "-c", code], check=True)


def test_backends_import_no_host_and_no_ray_directly():
    """deploy/backends/ implement the OpenAI layer's ``Backend`` over cluster/ (Ray stays
    behind it) or an in-process engine; no backend imports a host (the Serve app, the
    replica server, the CLI, their config), so every host can pick any backend."""
    for mod, files in _imports("deploy/backends").items():
        assert mod.split(".")[0] != "ray", (mod, files)
    assert _ours_outside("deploy/backends", BACKENDS_MAY_IMPORT, BACKENDS_MAY_IMPORT_EXACTLY) == []


def test_nothing_below_deploy_imports_it():
    """deploy/ sits on cluster/, replica/ and router/ (ARCHITECTURE.md §1): none of them,
    nor the facade, imports anything of deploy/, so its hosts choose the backends."""
    for folder in ("cluster", "replica", "router", "kernels", "kvroute"):
        for mod, files in _imports(folder).items():
            assert not mod.startswith("kvroute.deploy"), (folder, mod, files)
