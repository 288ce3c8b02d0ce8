"""The argument groups benchmarks share, each defined once, and the one rule for where
results go.

Results: every benchmark writes under ``$KVROUTE_RESULTS`` (default ``results/``). One
that writes a single JSON writes ``<results>/<name>.json`` unless ``--out PATH``; one
that writes several files writes them in ``<results>/<name>/`` unless ``--out-dir DIR``.
No torch here: the simulated benchmarks import this without it.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any, Optional


def results_dir(name: Optional[str] = None) -> Path:
    """``$KVROUTE_RESULTS`` (default ``results``), or its folder ``name``; created."""
    path = Path(os.environ.get("KVROUTE_RESULTS", "results"))
    if name:
        path = path / name
    path.mkdir(parents=True, exist_ok=True)
    return path


def result_file(name: str, out: Optional[str]) -> Path:
    """Where a one-file benchmark's JSON goes: ``out``, else ``<results>/<name>.json``."""
    path = Path(out) if out else results_dir() / f"{name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    return path


def result_folder(name: str, out_dir: Optional[str]) -> Path:
    """Where a many-file benchmark writes: ``out_dir``, else ``<results>/<name>/``."""
    path = Path(out_dir) if out_dir else results_dir(name)
    path.mkdir(parents=True, exist_ok=True)
    return path


def add_output(p: argparse.ArgumentParser, name: str, folder: bool = False) -> None:
    """``--out`` (one JSON) or ``--out-dir`` (a folder of results), default by the rule above."""
    if folder:
        p.add_argument("--out-dir", default=None, help=f"results folder (default: $KVROUTE_RESULTS/{name}, results/{name})")
    else:
        p.add_argument("--out", default=None, help=f"JSON path (default: $KVROUTE_RESULTS/{name}.json, results/{name}.json)")


def add_seed(p: argparse.ArgumentParser) -> None:
    p.add_argument("--seed", type=int, default=0, help="seeds the workload, its arrivals and every random choice")


def add_trace(p: argparse.ArgumentParser, scale: float = 1.0, len_scale: float = 1.0) -> argparse._ArgumentGroup:
    """The trace's size: ``--scale`` (groups / tenants / conversations / requests) and
    ``--len-scale`` (every token length), and its ``--seed``."""
    g = p.add_argument_group("trace")
    g.add_argument("--scale", type=float, default=scale, help="multiplies the number of groups / tenants / conversations / requests")
    g.add_argument("--len-scale", type=float, default=len_scale, help="multiplies every token length")
    add_seed(g)
    return g


def add_fleet(p: argparse.ArgumentParser, *, replicas: int, cpus_per_replica: float, app_name: str,
              time_scale: Optional[float] = None) -> argparse._ArgumentGroup:  # fmt: skip
    """The Ray fleet a measured benchmark starts (or joins): its size, each replica's
    logical CPUs, the Serve application, its HTTP port, the cluster and, for emulated
    replicas, ``--time-scale``."""
    g = p.add_argument_group("fleet")
    g.add_argument("--replicas", type=int, default=replicas)
    g.add_argument("--num-cpus-per-replica", type=float, default=cpus_per_replica)
    g.add_argument("--app-name", default=app_name)
    g.add_argument("--http-port", type=int, default=8000, help="Serve's HTTP proxy port")
    g.add_argument("--address", default=None, help="Ray cluster address (default: RAY_ADDRESS, as in a Ray job, else start one)")
    add_policy_kwargs(g)
    if time_scale is not None:
        g.add_argument("--time-scale", type=float, default=time_scale, help="the emulated steps take K times the profile's time")
    return g


def add_policy_kwargs(g: argparse._ActionsContainer) -> None:
    """``--policy-kwargs``: the kvroute policy's options for the fleet's router actors."""
    g.add_argument("--policy-kwargs", type=json_object, default={}, metavar="JSON",
                   help="options of the kvroute policy (router/policies/kvroute.py), e.g. '{\"balance_prefixes\": false}'; "
                        "fleet_matrix's simulated prediction gets them too")


def json_object(text: str) -> dict[str, Any]:
    """A JSON object given on the command line (argparse type): anything else is a clear error."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"must be a JSON object, got {text!r}")
    return value


def csv(text: Optional[str]) -> list[str]:
    """A comma list's items, blanks left out."""
    return [x.strip() for x in (text or "").split(",") if x.strip()]
