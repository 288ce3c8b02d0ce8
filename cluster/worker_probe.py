"""What the worker pool (``cluster/worker_pool.py``) asks of the network and of Ray before
it trusts a worker's address: every call bounded in time, every address usable from
wherever the pool and the ingresses run.

- ``bounded_get``: one HTTP GET whose whole answer (connect, headers, body) must come
  within a deadline. httpx's own timeouts bound each read, not the answer, so a worker
  that trickles bytes could otherwise hold a poll for ever. ``bounded`` waits for a
  set of calls (Ray actor calls to the routers) the same way.
- ``endpoint_error``: whether a worker's ZMQ KV event endpoint takes a TCP connection.
  A ZMQ SUB socket connects whether or not anybody listens (it retries in the
  background), so without this an unreachable publisher looks like a quiet one.
- ``check_addresses``: on a Ray cluster of more than one node a loopback or unspecified
  address (``127.0.0.1``, ``localhost``, ``0.0.0.0``, ``::1``) names a different machine
  in the pool's process than in each ingress', and two workers on two nodes would share
  one default id (``host:port``); such addresses are refused there, so a worker's id,
  its URL and its event endpoint mean the same host everywhere.
- ``pool_state_key`` / ``restarted``: where a pool actor keeps its worker list in the GCS
  internal KV (``cluster/saved_state.py``), keyed by the actor's own name, and whether
  Ray restarted this actor (then the saved list, not the config's, is the truth).
"""

from __future__ import annotations

import asyncio
import ipaddress
from typing import Any, Awaitable, Optional, Sequence
from urllib.parse import urlsplit

import httpx

CONNECT_TIMEOUT_S = 2.0  # a TCP connect to a worker's event endpoint


async def bounded_get(client: httpx.AsyncClient, url: str, timeout_s: float) -> httpx.Response:
    """``client.get(url)``, its whole answer within ``timeout_s`` (else ``httpx.TimeoutException``)."""
    try:
        return await asyncio.wait_for(client.get(url), timeout_s)
    except asyncio.TimeoutError:
        raise httpx.TimeoutException(f"no whole answer from {url} within {timeout_s:g} s") from None


async def bounded(calls: list[Awaitable], timeout_s: float) -> list[Any]:
    """The answers of ``calls``, exceptions as values; a call still running after
    ``timeout_s`` is cancelled and answers a ``TimeoutError``."""
    tasks = [asyncio.ensure_future(c) for c in calls]
    if tasks:
        await asyncio.wait(tasks, timeout=timeout_s)
    answers: list[Any] = []
    for t in tasks:
        if not t.done():
            t.cancel()
            answers.append(TimeoutError(f"no answer within {timeout_s:g} s"))
        else:
            answers.append(t.exception() if t.exception() is not None else t.result())
    return answers


def _host_port(endpoint: str) -> Optional[tuple[str, int]]:
    """``(host, port)`` of a ``tcp://host:port`` endpoint; None for another transport."""
    parts = urlsplit(endpoint)
    if parts.scheme != "tcp" or parts.port is None:
        return None
    return parts.hostname or "", parts.port


def binds(endpoint: str) -> bool:
    """vLLM's rule: a wildcard address is bound by the subscriber, any other connected to."""
    return "*" in endpoint


async def endpoint_error(endpoint: str, timeout_s: float = CONNECT_TIMEOUT_S) -> Optional[str]:
    """None when ``endpoint`` (``tcp://host:port``) takes a TCP connection within
    ``timeout_s``, else why not. An endpoint the subscriber binds itself, or of a
    transport other than TCP, is not checked here (None)."""
    if binds(endpoint):
        return None
    try:
        addr = _host_port(endpoint)
    except ValueError as exc:
        return f"bad endpoint {endpoint!r}: {exc}"
    if addr is None:
        return None
    try:
        _, writer = await asyncio.wait_for(asyncio.open_connection(*addr), timeout_s)
    except asyncio.TimeoutError:
        return f"{endpoint} did not accept a connection within {timeout_s:g} s"
    except OSError as exc:
        return f"{endpoint} refused or unreachable: {exc.strerror or exc!r}"
    writer.close()
    try:
        await asyncio.wait_for(writer.wait_closed(), timeout_s)
    except (OSError, asyncio.TimeoutError):
        pass
    return None


def is_local_host(host: str) -> bool:
    """Loopback or unspecified: an address that means "this machine" wherever it is used."""
    host = host.strip("[]").lower()
    if host in ("localhost", "") or host.endswith(".localhost"):
        return True
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return False
    return ip.is_loopback or ip.is_unspecified


def check_addresses(url: str, endpoints: tuple[Optional[str], ...], nodes: int) -> None:
    """ValueError when the cluster has more than one node and ``url`` or an endpoint the
    pool connects to names this machine (module docstring)."""
    if nodes <= 1:
        return
    named = [("url", url, urlsplit(url).hostname or "")]
    for endpoint in endpoints:
        if endpoint and not binds(endpoint):
            try:
                addr = _host_port(endpoint)
            except ValueError:
                continue  # refused later, when the subscriber connects
            if addr is not None:
                named.append(("endpoint", endpoint, addr[0]))
    for what, value, host in named:
        if is_local_host(host):
            raise ValueError(f"worker {what} {value} names this machine ({host or 'no host'}), but the Ray cluster "
                             f"has {nodes} nodes: the pool and the ingresses may run on others; give the worker's "
                             "routable address (its node's IP or DNS name)")  # fmt: skip


def check_specs(specs: Sequence[Any], nodes: int) -> None:
    """``check_addresses`` for each ``WorkerSpec`` (or dict of one) of ``specs``."""
    for spec in specs:
        d = spec if isinstance(spec, dict) else spec.model_dump()
        check_addresses(d["url"], (d.get("kv_events_endpoint"), d.get("replay_endpoint")), nodes)


def cluster_nodes() -> int:
    """How many live nodes the Ray cluster has (1 without Ray)."""
    import ray

    if not ray.is_initialized():
        return 1
    return sum(1 for n in ray.nodes() if n.get("Alive")) or 1


def pool_state_key() -> Optional[str]:
    """The GCS key of this pool actor's worker list: its actor name (one pool per name at
    a time); None outside a named actor (a plain pool keeps nothing)."""
    import ray

    if not ray.is_initialized():
        return None
    name = ray.get_runtime_context().get_actor_name()
    return f"worker-pool:{name}" if name else None


def restarted() -> bool:
    """Whether Ray restarted this actor (its ``__init__`` runs again after a crash)."""
    import ray

    return ray.is_initialized() and ray.get_runtime_context().was_current_actor_reconstructed
