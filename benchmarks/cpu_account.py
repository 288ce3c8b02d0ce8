"""CPU a fleet uses during a run, per process kind.

The fleet is every process descended from the benchmark's driver (a local Ray cluster
that the driver started: GCS, raylet, Serve's controller and proxy, the ingress,
replica and router actors; or the external routers and ``serve-replica`` processes it
launched), the driver itself left out (it is the load generator). CPU seconds are read
from ``/proc/<pid>/stat`` (user + system) before and after; a process that exits in
between is not counted (a killed replica), one that starts counts all it used. Linux only: elsewhere ``snapshot``
returns nothing and the figures are absent.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Optional

_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
Snapshot = dict[int, tuple[str, float]]  # pid -> (kind, CPU seconds)


def _stat(pid: int) -> Optional[tuple[int, float]]:
    """(parent pid, CPU seconds) of a live process, None if it is gone."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = raw[raw.rindex(")") + 2 :].split()  # after "pid (comm) "
    return int(fields[1]), (int(fields[11]) + int(fields[12])) / _TICK


def kind(pid: int) -> str:
    """A process's kind: Ray's title (``ray::ServeReplica:app:EngineReplica`` ->
    ``EngineReplica``, ``ray::RouterActor`` -> ``RouterActor``), Ray's daemons by
    name, ``kvroute serve-replica``, or the program's name."""
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return "?"
    words = [a.decode(errors="replace") for a in argv if a]
    if not words:
        return "?"
    first = words[0]
    if first.startswith("ray::"):
        return first[5:].split(":")[-1].split(".")[0] or first
    line = " ".join(words)
    if "serve-replica" in line:
        return "serve-replica"
    for daemon in ("gcs_server", "raylet", "dashboard", "log_monitor", "runtime_env", "monitor.py"):
        if daemon in line:
            return daemon
    if m := re.search(r"-m\s+(\S+)", line):
        return m.group(1)
    return Path(first).name


def snapshot(root: Optional[int] = None) -> Snapshot:
    """CPU seconds of every live descendant of ``root`` (default: this process), by pid."""
    root = os.getpid() if root is None else root
    stats: dict[int, tuple[int, float]] = {}
    for entry in Path("/proc").glob("[0-9]*"):
        s = _stat(int(entry.name))
        if s is not None:
            stats[int(entry.name)] = s
    children: dict[int, list[int]] = {}
    for pid, (ppid, _) in stats.items():
        children.setdefault(ppid, []).append(pid)
    out: Snapshot = {}
    stack = list(children.get(root, []))
    while stack:
        pid = stack.pop()
        out[pid] = (kind(pid), stats[pid][1])
        stack.extend(children.get(pid, []))
    return out


def usage(before: Snapshot, after: Snapshot, wall_s: float) -> dict:
    """Cores used between two snapshots: in all, and by kind (largest first)."""
    by: dict[str, float] = {}
    for pid, (k, cpu) in after.items():
        by[k] = by.get(k, 0.0) + cpu - (before[pid][1] if pid in before else 0.0)
    cores = {k: v / wall_s for k, v in sorted(by.items(), key=lambda kv: -kv[1]) if v > 0}
    return {"cores": sum(cores.values()), "by_kind": cores}


def describe(u: dict, top: int = 6) -> str:
    parts = ", ".join(f"{k} {v:.2f}" for k, v in list(u["by_kind"].items())[:top])
    return f"{u['cores']:.2f} cores ({parts})"
