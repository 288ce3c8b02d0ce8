"""What a benchmark reads from a running fleet and how it waits for it: replicas' and
routers' counters from ``/metrics``, warm-up requests, free ports and HTTP readiness."""

from __future__ import annotations

import subprocess
import time
from typing import Any, Callable, Optional, Sequence

SERVED_NAME = "kvroute-bench"  # the model name every fleet serves


def wait_until(probe: Callable[[], Any], timeout_s: float, what: str, interval_s: float = 0.5) -> Any:
    """``probe()``'s first truthy value, polled every ``interval_s``; TimeoutError
    naming ``what`` after ``timeout_s``. A probe raises to give up early."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = probe()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} within {timeout_s} s")
        time.sleep(interval_s)


def warm_up(base_url: str, n: int, timeout_s: float = 120.0) -> None:
    """A few requests shorter than one block (nothing gets cached): the new ingress and
    its handle are up before the clock starts."""
    import httpx

    def answered() -> bool:
        try:
            r = httpx.post(base_url + "/v1/completions", json={"model": SERVED_NAME, "prompt": "Hi",
                                                               "max_tokens": 1, "temperature": 0}, timeout=60)
            return r.status_code == 200
        except httpx.HTTPError:
            return False

    for _ in range(n):
        wait_until(answered, timeout_s, f"{base_url} did not answer a warm-up request")


_COUNTED = {"vllm:request_success": "requests", "vllm:prompt_tokens": "prompt_tokens",
            "vllm:prefix_cache_hits": "cached_tokens", "vllm:generation_tokens": "output_tokens",
            "kvroute:lora_slot_loads": "adapter_loads"}


def metric_families(base_url: str) -> list[Any]:
    """The metric families of the app's (or a process's) ``/metrics``, parsed."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    return list(text_string_to_metric_families(httpx.get(base_url + "/metrics", timeout=30).text))


def replica_counters(base_url: str) -> dict[str, dict[str, float]]:
    """Per replica, the cumulative counters of the app's ``/metrics`` (requests, prompt,
    cached and output tokens, LoRA adapter slot loads): a run's difference shows how a
    router spread the load. A ``serve-replica`` answers with its own row."""
    out: dict[str, dict[str, float]] = {}
    for fam in metric_families(base_url):
        key = _COUNTED.get(fam.name)
        if key is None:
            continue
        for sample in fam.samples:
            if sample.name.endswith("_total") and "replica" in sample.labels:
                row = out.setdefault(sample.labels["replica"], dict.fromkeys(_COUNTED.values(), 0.0))
                row[key] += sample.value
    return out


_ROUTER_COUNTED = {"kvroute:router_fallbacks": "fallbacks", "kvroute:predicted_cached_tokens": "predicted_cached_tokens",
                   "kvroute:actual_cached_tokens": "actual_cached_tokens", "kvroute:cached_tokens_abs_error": "cached_tokens_abs_error",
                   "kvroute:routed_requests": "routed_requests", "kvroute:router_failovers": "failovers",
                   "kvroute:router_spills": "spills"}  # fmt: skip


def ingress_requests(base_url: str) -> dict[str, float]:
    """Finished requests per ingress application (``kvroute:ingress_requests``, whose
    ``ingress`` label is ``<application>#<replica>``), summed over its replicas."""
    out: dict[str, float] = {}
    for fam in metric_families(base_url):
        if fam.name == "kvroute:ingress_requests":
            for sample in fam.samples:
                if sample.name.endswith("_total"):
                    app = sample.labels["ingress"].split("#")[0]
                    out[app] = out.get(app, 0.0) + sample.value
    return out


def router_counters(base_url: str) -> dict[str, float]:
    """The app's cumulative routing counters from ``/metrics``: the names above,
    ``decisions:<reason>`` for the router's decisions by reason, ``reuse:<figure>`` for
    the decision-quality figures (offered, available, captured, delivered) and
    ``loss:<kind>[:<reason>]`` for their losses."""
    out: dict[str, float] = {}
    for fam in metric_families(base_url):
        for sample in fam.samples:
            if not sample.name.endswith("_total"):
                continue
            if fam.name == "kvroute:routing_decisions":
                key = "decisions:" + sample.labels["reason"]
            elif fam.name == "kvroute:reuse_tokens":
                key = "reuse:" + sample.labels["figure"]
            elif fam.name == "kvroute:reuse_loss_tokens":
                key = ":".join(filter(None, ("loss", sample.labels["kind"], sample.labels["reason"])))
            elif fam.name in _ROUTER_COUNTED:
                key = _ROUTER_COUNTED[fam.name]
            else:
                continue
            out[key] = out.get(key, 0.0) + sample.value
    return out


def peer_staleness_ms(base_url: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for fam in metric_families(base_url):
        if fam.name == "kvroute:router_peer_staleness_seconds":
            for sample in fam.samples:
                key = {"0.5": "p50", "0.99": "p99"}[sample.labels["quantile"]]
                out[key] = max(out.get(key, 0.0), sample.value * 1e3)
    return out


def wait_counters(base_url: str, replica_ids: Sequence[str], timeout_s: float = 30.0) -> dict[str, dict[str, float]]:
    """The counters once every replica has reported (about once a second); what there
    is after ``timeout_s`` otherwise."""
    last: dict[str, dict[str, float]] = {}

    def probe() -> Optional[dict[str, dict[str, float]]]:
        nonlocal last
        last = replica_counters(base_url)
        return last if set(replica_ids) <= set(last) else None

    try:
        return wait_until(probe, timeout_s, "replica counters")
    except TimeoutError:
        return last


def per_replica(before: dict[str, dict[str, float]], after: dict[str, dict[str, float]]) -> dict[str, dict[str, float]]:
    return {rid: {k: v - before.get(rid, {}).get(k, 0.0) for k, v in row.items()} for rid, row in sorted(after.items())}


# ---------------------------------------------------------------------- external router
def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_http(url: str, procs: Sequence[subprocess.Popen], timeout_s: float) -> None:
    import httpx

    def up() -> bool:
        for p in procs:
            if p.poll() is not None:
                raise RuntimeError(f"{p.args[:4]} exited with {p.returncode} before {url} answered")
        try:
            return httpx.get(url, timeout=5).status_code == 200
        except httpx.HTTPError:
            return False

    wait_until(up, timeout_s, f"{url} did not answer")
