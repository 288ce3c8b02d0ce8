"""A real multi-node Ray cluster on one Linux machine, each node in its own network
namespace (product-free: nothing of kvroute is imported here).

Layout (``NetnsCluster``)::

    root namespace (pytest, `serve deploy`, the openai client)
      bridge kvt<pid>b  10.77.X.1/24
        veth kvt<pid>h0 <-> eth0 in netns kvt<pid>n0   10.77.X.2  head
        veth kvt<pid>h1 <-> eth0 in netns kvt<pid>n1   10.77.X.3  worker w1
        veth kvt<pid>h2 <-> eth0 in netns kvt<pid>n2   10.77.X.4  worker w2

Every node is ``ip netns exec <ns> env -i ... ray start ... --block`` with its own HOME,
TMPDIR, KVROUTE_CACHE / KVROUTE_CACHE_DIR and Ray ``--temp-dir`` under
``/tmp/kvt<pid>/<node>/``, and the same Ray auth token (one token, written to every
node's ``~/.ray/auth_token``; every node runs with ``RAY_AUTH_MODE=token``, since a
worker's ``ray start --address`` does not turn token auth on from the file by itself).
No namespace has a default route: its processes reach its loopback, the other nodes,
and the bridge's own address (the root namespace, where the tests' clients run; the
nodes open no connection to it, but nothing here firewalls it: no iptables on the box).

Killing a node SIGKILLs every process in its namespace (``ip netns pids``) until none
is left: the raylet, the node's dashboard agent, log monitor and every worker process
(actors and Serve replicas included) die at once, as when a machine loses power, while
the namespace and its address stay, so ``restart_node`` can start the node again (a new
Ray node id, the same IP).

Names carry the pytest process' pid, so a crashed earlier run never collides, and
``cleanup_stale`` removes namespaces, links and folders whose pid is gone.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

PREFIX = "kvt"
SUBNET = "10.77"  # 10.77.X.0/24, X picked free per run
HEAD_PORT = 6379
DASHBOARD_PORT = 8265
SERVE_PORT = 8000
OBJECT_STORE_BYTES = 100 * 2**20
_NS_RE = re.compile(rf"^{PREFIX}(\d+)n\d+$")
_LINK_RE = re.compile(rf"^{PREFIX}(\d+)(?:b|h\d+)$")
_DIR_RE = re.compile(rf"^{PREFIX}(\d+)$")


def _run(cmd: Sequence[str], check: bool = True, timeout: float = 60) -> subprocess.CompletedProcess:
    proc = subprocess.run(list(cmd), capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}): {proc.stderr.strip() or proc.stdout.strip()}")
    return proc


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _die_with_parent() -> None:
    """In a child before exec: SIGTERM when the parent dies (Linux PR_SET_PDEATHSIG)."""
    import ctypes

    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM, 0, 0, 0)


def namespaces_unavailable() -> Optional[str]:
    """Why network namespaces cannot be built here (None when they can), found by
    building one: a namespace, a veth pair into it, loopback up, and deleting them."""
    if os.geteuid() != 0:
        return "needs root to create network namespaces"
    if shutil.which("ip") is None:
        return "needs iproute2's `ip` to create network namespaces"
    ns, link = f"{PREFIX}{os.getpid()}n99", f"{PREFIX}{os.getpid()}h99"
    try:
        _run(["ip", "netns", "add", ns])
        try:
            _run(["ip", "link", "add", link, "type", "veth", "peer", "name", "eth0", "netns", ns])
            _run(["ip", "netns", "exec", ns, "ip", "link", "set", "lo", "up"])
        finally:
            _run(["ip", "link", "del", link], check=False)
            _run(["ip", "netns", "del", ns], check=False)
    except (RuntimeError, OSError, subprocess.TimeoutExpired) as exc:
        return f"cannot create network namespaces here: {exc}"
    return None


def netns_pids(ns: str) -> list[int]:
    proc = _run(["ip", "netns", "pids", ns], check=False)
    return [int(p) for p in proc.stdout.split() if p.strip().isdigit()]


def kill_namespace(ns: str, timeout_s: float = 10.0) -> list[int]:
    """SIGKILL every process in ``ns`` until none is left (processes forked meanwhile
    included); the pids killed."""
    killed: list[int] = []
    deadline = time.monotonic() + timeout_s
    while True:
        pids = [p for p in netns_pids(ns) if p != os.getpid()]
        if not pids:
            return killed
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
                killed.append(pid)
            except ProcessLookupError:
                pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"processes {pids} in namespace {ns} survive SIGKILL")
        time.sleep(0.05)


def cleanup_stale(base: Path = Path("/tmp")) -> list[str]:
    """Remove what earlier runs left (their pid is gone): namespaces (their processes
    killed first), links, and ``/tmp/kvt<pid>`` folders. Returns what was removed."""
    removed: list[str] = []
    for line in _run(["ip", "netns", "list"], check=False).stdout.splitlines():
        name = line.split()[0] if line.split() else ""
        m = _NS_RE.match(name)
        if m and not _pid_alive(int(m.group(1))):
            kill_namespace(name)
            _run(["ip", "netns", "del", name], check=False)
            removed.append(name)
    for line in _run(["ip", "-o", "link", "show"], check=False).stdout.splitlines():
        parts = line.split(":")
        name = parts[1].strip().split("@")[0] if len(parts) > 1 else ""
        m = _LINK_RE.match(name)
        if m and not _pid_alive(int(m.group(1))):
            _run(["ip", "link", "del", name], check=False)
            removed.append(name)
    for path in base.glob(f"{PREFIX}*"):
        m = _DIR_RE.match(path.name)
        if m and path.is_dir() and not _pid_alive(int(m.group(1))):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(str(path))
    return removed


def _free_subnet() -> str:
    taken = _run(["ip", "-4", "-o", "addr"], check=False).stdout + _run(["ip", "-4", "route"], check=False).stdout
    used = set(re.findall(rf"{re.escape(SUBNET)}\.(\d+)\.", taken))
    start = os.getpid() % 200 + 20
    for i in range(200):
        x = str((start + i) % 200 + 20)
        if x not in used:
            return f"{SUBNET}.{x}"
    raise RuntimeError(f"no free {SUBNET}.X.0/24 subnet")


@dataclass
class Node:
    name: str  # "head", "w1", "w2", …
    index: int
    ns: str
    ip: str
    dir: Path
    num_cpus: int
    resources: dict[str, float] = field(default_factory=dict)
    head: bool = False
    env: dict[str, str] = field(default_factory=dict)  # this node's own extra variables
    proc: Optional[subprocess.Popen] = None
    starts: int = 0

    @property
    def home(self) -> Path:
        return self.dir / "home"

    @property
    def cache(self) -> Path:
        return self.dir / "cache"

    @property
    def ray_temp(self) -> Path:
        return self.dir / "ray"

    @property
    def log(self) -> Path:
        return self.dir / f"ray-start.{self.starts}.log"

    def url(self, port: int = SERVE_PORT) -> str:
        return f"http://{self.ip}:{port}"

    def pids(self) -> list[int]:
        return netns_pids(self.ns)


class NetnsCluster:
    """Build with ``start()``, end with ``stop()`` (idempotent, also after a failed start).

    ``workers``: CPUs per worker node. ``head_resources``: the head's custom resources
    (its ``--num-cpus`` is 0, so nothing that asks for a CPU lands there). ``env``:
    extra variables for every node's processes; ``head_env`` for the head's only.
    ``seed_cache``: a folder of a converted model copied (hard links where possible)
    into every node's KVROUTE_CACHE before it starts.
    """

    def __init__(
        self,
        *,
        bin_dir: Path,
        workers: Sequence[int] = (2, 2),
        head_resources: Optional[dict[str, float]] = None,
        env: Optional[dict[str, str]] = None,
        head_env: Optional[dict[str, str]] = None,
        seed_cache: Sequence[Path] = (),
        base: Path = Path("/tmp"),
    ) -> None:
        self.run_id = f"{PREFIX}{os.getpid()}"
        self.bin_dir = Path(bin_dir)
        self.dir = base / self.run_id
        self.bridge = f"{self.run_id}b"
        self.subnet = ""
        self.token = secrets.token_hex(32)
        self.env = dict(env or {})
        self.head_env = dict(head_env or {})
        self.seed_cache = [Path(p) for p in seed_cache]
        self.nodes: dict[str, Node] = {}
        self._worker_cpus = list(workers)
        self._head_resources = dict(head_resources or {})
        self._links: list[str] = []
        self._namespaces: list[str] = []
        self.timings: dict[str, float] = {}

    # ------------------------------------------------------------------ build
    @property
    def head(self) -> Node:
        return self.nodes["head"]

    @property
    def workers(self) -> list[Node]:
        return [n for n in self.nodes.values() if not n.head]

    @property
    def dashboard(self) -> str:
        return self.head.url(DASHBOARD_PORT)

    def start(self, timeout_s: float = 120.0) -> "NetnsCluster":
        started = time.monotonic()
        self.dir.mkdir(parents=True, exist_ok=True)
        self.subnet = _free_subnet()
        _run(["ip", "link", "add", self.bridge, "type", "bridge"])
        self._links.append(self.bridge)
        _run(["ip", "addr", "add", f"{self.subnet}.1/24", "dev", self.bridge])
        _run(["ip", "link", "set", self.bridge, "up"])
        specs = [("head", 0, self._head_resources, True)] + [
            (f"w{i}", cpus, {}, False) for i, cpus in enumerate(self._worker_cpus, start=1)
        ]
        for index, (name, cpus, resources, head) in enumerate(specs):
            node = Node(name, index, f"{self.run_id}n{index}", f"{self.subnet}.{index + 2}", self.dir / name, cpus,
                        dict(resources), head)  # fmt: skip
            self._add_namespace(node)
            self._prepare_dirs(node)
            self.nodes[name] = node
        self.timings["network_s"] = time.monotonic() - started
        self._start_node(self.head)
        self.wait_nodes_alive(["head"], timeout_s)
        for node in self.workers:
            self._start_node(node)
        self.wait_nodes_alive(list(self.nodes), timeout_s)
        self.timings["start_s"] = time.monotonic() - started
        return self

    def _add_namespace(self, node: Node) -> None:
        host = f"{self.run_id}h{node.index}"
        _run(["ip", "netns", "add", node.ns])
        self._namespaces.append(node.ns)
        _run(["ip", "link", "add", host, "type", "veth", "peer", "name", "eth0", "netns", node.ns])
        self._links.append(host)
        _run(["ip", "link", "set", host, "master", self.bridge, "up"])
        inside = ["ip", "netns", "exec", node.ns]
        _run([*inside, "ip", "addr", "add", f"{node.ip}/24", "dev", "eth0"])
        _run([*inside, "ip", "link", "set", "eth0", "up"])
        _run([*inside, "ip", "link", "set", "lo", "up"])

    def _prepare_dirs(self, node: Node) -> None:
        for d in (node.home / ".ray", node.cache, node.dir / "tmp", node.ray_temp):
            d.mkdir(parents=True, exist_ok=True)
        token = node.home / ".ray" / "auth_token"
        token.write_text(self.token)
        token.chmod(0o600)
        for src in self.seed_cache:
            dst = node.cache / src.name
            if not dst.exists():
                try:
                    shutil.copytree(src, dst, copy_function=os.link)
                except OSError:  # another filesystem: a real copy
                    shutil.rmtree(dst, ignore_errors=True)
                    shutil.copytree(src, dst)

    def node_env(self, node: Node) -> dict[str, str]:
        env = {
            "PATH": f"{self.bin_dir}:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
            "HOME": str(node.home),
            "TMPDIR": str(node.dir / "tmp"),
            "KVROUTE_CACHE": str(node.cache),
            "KVROUTE_CACHE_DIR": str(node.cache),
            "RAY_AUTH_MODE": "token",
            "RAY_USAGE_STATS_ENABLED": "0",
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            "LANG": os.environ.get("LANG", "C.UTF-8"),
            **self.env,
        }
        if node.head:
            env.update(self.head_env)
        env.update(node.env)
        return env

    def _start_node(self, node: Node) -> None:
        node.starts += 1
        if node.starts > 1:  # a restart: the killed node's sockets and session files go aside
            if node.ray_temp.exists():
                node.ray_temp.rename(node.dir / f"ray.dead-{node.starts - 1}")
            node.ray_temp.mkdir(parents=True)
        cmd = [str(self.bin_dir / "ray"), "start", "--block", "--disable-usage-stats",
               "--node-ip-address", node.ip, "--num-cpus", str(node.num_cpus),
               "--temp-dir", str(node.ray_temp), "--object-store-memory", str(OBJECT_STORE_BYTES)]  # fmt: skip
        if node.resources:
            cmd += ["--resources", json.dumps(node.resources)]
        if node.head:
            cmd += ["--head", "--port", str(HEAD_PORT), "--include-dashboard", "true",
                    "--dashboard-host", "0.0.0.0", "--dashboard-port", str(DASHBOARD_PORT)]  # fmt: skip
        else:
            cmd += ["--address", f"{self.head.ip}:{HEAD_PORT}"]
        env_args = [f"{k}={v}" for k, v in self.node_env(node).items()]
        log = open(node.log, "wb")
        # Started from the main thread, the node gets SIGTERM (`ray start --block` then
        # stops its Ray processes) if this process dies without tearing down: a pytest
        # killed by a timeout leaves no cluster running. Not from another thread: the
        # signal comes when the starting *thread* exits.
        in_main = threading.current_thread() is threading.main_thread()
        node.proc = subprocess.Popen(["ip", "netns", "exec", node.ns, "env", "-i", *env_args, *cmd],
                                     stdout=log, stderr=subprocess.STDOUT, cwd=node.dir, start_new_session=True,
                                     preexec_fn=_die_with_parent if in_main else None)  # fmt: skip
        log.close()

    # ------------------------------------------------------------------ talk to it
    def client_env(self) -> dict[str, str]:
        """Environment for a Ray CLI (``serve deploy``, ``ray list``) run here in the
        root namespace against this cluster: token auth with the cluster's token."""
        home = self.dir / "client-home"
        home.mkdir(parents=True, exist_ok=True)
        env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
        env.update(HOME=str(home), RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=self.token, RAY_USAGE_STATS_ENABLED="0",
                   PATH=f"{self.bin_dir}:{env.get('PATH', '/usr/bin:/bin')}")  # fmt: skip
        return env

    @property
    def auth_headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.token}"}

    def get(self, path: str, timeout: float = 10.0) -> Any:
        """GET a dashboard route (JSON) with the cluster's token."""
        import httpx

        resp = httpx.get(self.dashboard + path, headers=self.auth_headers, timeout=timeout)
        resp.raise_for_status()
        return resp.json()

    def alive_nodes(self) -> dict[str, str]:
        """{ip: Ray node id} of the nodes the GCS counts alive."""
        data = self.get("/api/v0/nodes?limit=100&detail=true")
        rows = data["data"]["result"]["result"]
        return {r["node_ip"]: r["node_id"] for r in rows if r["state"] == "ALIVE"}

    def actors(self, state: Optional[str] = "ALIVE") -> list[dict[str, Any]]:
        """Ray's state API (what ``ray.util.state.list_actors(detail=True)`` returns):
        every actor with ``name``, ``class_name``, ``node_id``, ``pid``, ``state``…"""
        data = self.get("/api/v0/actors?limit=10000&detail=true")
        rows = data["data"]["result"]["result"]
        return [r for r in rows if state is None or r["state"] == state]

    def node_of_id(self, node_id: str, alive: Optional[dict[str, str]] = None) -> str:
        ips = {nid: ip for ip, nid in (alive or self.alive_nodes()).items()}
        return self.node_of_ip(ips[node_id])

    def wait_nodes_alive(self, names: Sequence[str], timeout_s: float = 120.0) -> dict[str, str]:
        want = {self.nodes[n].ip for n in names}
        deadline = time.monotonic() + timeout_s
        last: Any = None
        while time.monotonic() < deadline:
            for n in names:
                proc = self.nodes[n].proc
                if proc is not None and proc.poll() is not None:
                    raise RuntimeError(f"ray start on {n} exited {proc.returncode}:\n{self.tail(n)}")
            try:
                alive = self.alive_nodes()
                if want <= set(alive):
                    return alive
                last = alive
            except Exception as exc:  # the dashboard not up yet
                last = exc
            time.sleep(0.5)
        raise RuntimeError(f"nodes {list(names)} not alive after {timeout_s} s (last: {last!r}):\n"
                           + "\n".join(self.tail(n) for n in names))  # fmt: skip

    def wait_node_dead(self, name: str, timeout_s: float = 120.0) -> float:
        """Seconds until the GCS no longer counts ``name`` alive."""
        started = time.monotonic()
        ip = self.nodes[name].ip
        while ip in self.alive_nodes():
            if time.monotonic() - started > timeout_s:
                raise RuntimeError(f"node {name} still alive {timeout_s} s after its kill")
            time.sleep(0.2)
        return time.monotonic() - started

    def node_of_ip(self, ip: str) -> str:
        return next(n.name for n in self.nodes.values() if n.ip == ip)

    def serve_deploy(self, config: dict[str, Any], timeout_s: float = 120.0) -> None:
        """``serve deploy <config.yaml> --address http://<head>:8265`` with the real CLI."""
        import yaml

        path = self.dir / f"serve-{time.monotonic_ns()}.yaml"
        path.write_text(yaml.safe_dump(config, sort_keys=False))
        proc = subprocess.run([str(self.bin_dir / "serve"), "deploy", str(path), "--address", self.dashboard],
                              env=self.client_env(), capture_output=True, text=True, timeout=timeout_s)  # fmt: skip
        if proc.returncode != 0:
            raise RuntimeError(f"serve deploy failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")

    def serve_details(self) -> dict[str, Any]:
        """Serve's REST view (``GET /api/serve/applications/``): applications,
        deployments and each replica's ``replica_id``, ``node_ip``, ``node_id``, ``pid``."""
        return self.get("/api/serve/applications/")

    def replicas(self, app: str, deployment: str, states: Sequence[str] = ("RUNNING",)) -> list[dict[str, Any]]:
        apps = self.serve_details().get("applications", {})
        deps = apps.get(app, {}).get("deployments", {})
        return [r for r in deps.get(deployment, {}).get("replicas", []) if r["state"] in states]

    def wait_for(self, predicate: Callable[[], Any], timeout_s: float, what: str, interval_s: float = 0.5) -> Any:
        deadline = time.monotonic() + timeout_s
        last: Any = None
        while True:
            try:
                value = predicate()
                if value:
                    return value
                last = value
            except Exception as exc:  # a node or the dashboard not answering yet
                last = exc
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out after {timeout_s} s waiting for {what} (last: {last!r})")
            time.sleep(interval_s)

    # ------------------------------------------------------------------ chaos
    def kill_node(self, name: str) -> list[int]:
        """SIGKILL every process of node ``name`` (all of its namespace); the pids."""
        node = self.nodes[name]
        killed = kill_namespace(node.ns)
        if node.proc is not None:
            node.proc.wait(timeout=10)
        return killed

    def restart_node(self, name: str, timeout_s: float = 120.0, env: Optional[dict[str, Optional[str]]] = None) -> str:
        """Start a killed node again (same namespace, IP, HOME and cache; a fresh Ray
        temp dir); returns its new Ray node id once the GCS counts it alive. ``env``
        changes the node's own variables from now on (None removes one), e.g.
        ``{"KVROUTE_API_KEY": "k"}`` for every process Ray starts there."""
        node = self.nodes[name]
        if node.pids():
            raise RuntimeError(f"node {name} still has processes {node.pids()}; kill_node first")
        for key, value in (env or {}).items():
            if value is None:
                node.env.pop(key, None)
            else:
                node.env[key] = value
        self._start_node(node)
        return self.wait_nodes_alive([name], timeout_s)[node.ip]

    def spawn(self, name: str, cmd: Sequence[str], log: Optional[Path] = None,
              env: Optional[dict[str, str]] = None) -> subprocess.Popen:  # fmt: skip
        """Run ``cmd`` on node ``name`` (in its namespace, with its environment plus
        ``env``), e.g. an external ``kvroute serve-replica`` worker; it dies with the
        node (``kill_node``, ``stop``). Output goes to ``log`` (default: a file in the
        node's folder)."""
        node = self.nodes[name]
        log = log or node.dir / f"spawn-{time.monotonic_ns()}.log"
        env_args = [f"{k}={v}" for k, v in {**self.node_env(node), **(env or {})}.items()]
        with open(log, "wb") as out:
            return subprocess.Popen(["ip", "netns", "exec", node.ns, "env", "-i", *env_args, *cmd], stdout=out,
                                    stderr=subprocess.STDOUT, cwd=node.dir, start_new_session=True)  # fmt: skip

    def tail(self, name: str, lines: int = 30) -> str:
        node = self.nodes.get(name)
        if node is None or not node.log.exists():
            return f"[{name}: no log]"
        text = node.log.read_text(errors="replace").splitlines()[-lines:]
        return f"[{name} {node.log}]\n" + "\n".join(text)

    # ------------------------------------------------------------------ teardown
    def stop(self, keep_dir: bool = False) -> None:
        """Kill every node's processes, delete namespaces, links and (unless
        ``keep_dir``) the run's folder. Safe to call more than once and after a
        failed ``start``."""
        errors = []
        for ns in self._namespaces:
            try:
                kill_namespace(ns)
            except Exception as exc:
                errors.append(exc)
        for node in self.nodes.values():
            if node.proc is not None and node.proc.poll() is None:
                try:
                    node.proc.kill()
                    node.proc.wait(timeout=10)
                except Exception as exc:
                    errors.append(exc)
        for ns in self._namespaces:
            _run(["ip", "netns", "del", ns], check=False)
        for link in reversed(self._links):
            _run(["ip", "link", "del", link], check=False)
        self._namespaces.clear()
        self._links.clear()
        if not keep_dir:
            shutil.rmtree(self.dir, ignore_errors=True)
        if errors:
            raise RuntimeError(f"teardown errors: {errors}")
