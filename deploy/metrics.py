"""``GET /metrics``: Prometheus text under vLLM's metric names (per replica) plus
kvroute's own routing figures.

Inputs are plain dicts: each replica's ``AsyncEngine.metrics_report()``, the router's
``stats()`` (when a router runs), and every ingress's counters (``ingress_report``):
each ingress sends its own to the routers about once a second, so whichever ingress a
scrape lands on renders the whole application, its counters summed over the ingresses
and its processes labelled by node.
"""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING, Any, Iterable, Optional

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest

from kvroute.replica.request_metrics import process_figures
from kvroute.router.reuse import ReuseAccount
from kvroute.router.types import RouteOutcome

if TYPE_CHECKING:
    from kvroute.deploy.openai.fanout import Choice

CONTENT_TYPE = CONTENT_TYPE_LATEST

_GAUGES = (
    ("vllm:num_requests_running", "num_running", "Requests in the engine's running batch."),
    ("vllm:num_requests_waiting", "num_waiting", "Requests waiting to be scheduled."),
    ("vllm:kv_cache_usage_perc", "kv_usage", "Fraction of KV cache blocks in use or taken by a waiting request's cached prefix (1 = full)."),
    ("kvroute:host_kv_cached_blocks", "num_host_cached_blocks", "Blocks held in the host KV tier."),
    ("kvroute:lora_resident_adapters", "num_resident_loras", "LoRA adapters in the replica's device slots."),
    # the engine's measured figures the router prices it by (cluster/worker_load.py reads them back)
    ("kvroute:prefill_tokens_per_second", "prefill_tokens_per_s", "Measured prefill throughput (0: not yet measured)."),
    ("kvroute:decode_step_seconds", "decode_step_s", "Measured decode-only step time (0: not yet measured)."),
    ("kvroute:queued_prefill_tokens", "queued_prefill_tokens", "Prompt tokens waiting to be prefilled."),
    ("kvroute:queued_prefill_seconds", "queued_prefill_s", "The engine's estimate of its queued prefill's seconds."),
)
_COUNTERS = (
    ("vllm:prefix_cache_queries", "prefix_cache_queries", "Prompt tokens looked up in the prefix cache."),
    ("vllm:prefix_cache_hits", "prefix_cache_hits", "Prompt tokens found in the prefix cache."),
    ("vllm:num_preemptions", "num_preemptions", "Requests preempted (recomputed) under KV pressure."),
    ("kvroute:prefix_cache_host_hits", "prefix_cache_host_hits",
     "Prompt tokens restored from the host KV tier (also counted in vllm:prefix_cache_hits)."),
    ("kvroute:lora_slot_loads", "lora_slot_loads", "LoRA adapters copied into a device slot (cold adapter loads)."),
)
_HISTOGRAMS = (
    ("vllm:time_to_first_token_seconds", "ttft_s", "Time to first token, at the replica."),
    ("vllm:inter_token_latency_seconds", "itl_s", "Time between output tokens."),
    ("vllm:e2e_request_latency_seconds", "e2e_s", "End-to-end request latency, at the replica."),
)


class DecisionQuality:
    """Decision quality of the choices this ingress saw finish (``router/reuse.py``):
    those that carried a router prediction go into ``reuse``; the others (fallback,
    next ranked, resumed) are only counted, with their delivered tokens."""

    def __init__(self) -> None:
        self.reuse = ReuseAccount()
        self.unpredicted_requests = 0
        self.unpredicted_delivered = 0

    def on_finished(self, choice: "Choice") -> None:
        self.add(choice.outcome, choice.num_prompt_tokens, choice.num_cached_tokens)

    def add(self, outcome: RouteOutcome, num_prompt_tokens: int, delivered: int) -> None:
        """One finished request that was routed as ``outcome`` says and found
        ``delivered`` of its ``num_prompt_tokens`` cached."""
        decision = outcome.decision
        if not outcome.predicted or decision is None:
            self.unpredicted_requests += 1
            self.unpredicted_delivered += delivered
            return
        self.reuse.add(num_prompt_tokens, decision.available_tokens, decision.expected_cached_tokens, delivered,
                       decision.reason, outcome.pulled_tokens)  # fmt: skip

    _FIELDS = ("requests", "offered", "available", "captured", "delivered", "pulled", "abs_error", "cold", "stale")

    def as_report(self) -> dict[str, Any]:
        r = self.reuse
        return {**{k: getattr(r, k) for k in self._FIELDS}, "routing": dict(r.routing),
                "unpredicted_requests": self.unpredicted_requests, "unpredicted_delivered": self.unpredicted_delivered}

    @classmethod
    def summed(cls, reports: Iterable[dict[str, Any]]) -> "DecisionQuality":
        """The decision quality of several ingresses (their ``as_report``s) as one."""
        total = cls()
        for rep in reports:
            for k in cls._FIELDS:
                setattr(total.reuse, k, getattr(total.reuse, k) + rep[k])
            total.reuse.routing.update(rep["routing"])
            total.unpredicted_requests += rep["unpredicted_requests"]
            total.unpredicted_delivered += rep["unpredicted_delivered"]
        return total


def ingress_report(quality: DecisionQuality, stats: dict[str, int], node: str) -> dict[str, Any]:
    """What one ingress process tells the routers of itself: its decision quality, its
    request router's fallbacks, failovers and spills, its node and its process."""
    return {"quality": quality.as_report(), "fallbacks": stats["fallbacks"], "failovers": stats["failovers"],
            "spills": stats["spills"], "node": node, "process": process_figures()}


def render_app(model_name: str, replicas: dict[str, dict[str, Any]], router: Optional[dict[str, Any]],
               ingresses: dict[str, dict[str, Any]]) -> bytes:
    """The whole application: every replica, the routers, and every ingress's counters summed."""
    reports = list(ingresses.values())
    return render(model_name, replicas, router, DecisionQuality.summed(r["quality"] for r in reports),
                  *(sum(r[k] for r in reports) for k in ("fallbacks", "failovers", "spills")), ingresses=ingresses)


def freshest_reports(views: list[dict[str, dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    """Several routers' views of the replicas' metrics reports as one: each replica's
    freshest report (least ``age_s``). Every replica reports to every router, but a
    router that registered it late, or a report that reached one router and not yet
    another, leaves the views apart for a round; taking any one router's would show a
    replica's count from seconds ago or miss the replica."""
    merged: dict[str, dict[str, Any]] = {}
    for view in views:
        for rid, rep in view.items():
            if rid not in merged or rep.get("age_s", 0.0) < merged[rid].get("age_s", 0.0):
                merged[rid] = rep
    return merged


def merge_router_stats(stats: list[dict[str, Any]]) -> dict[str, Any]:
    """Several router actors' ``stats()`` as one: decisions (each router counts its own)
    summed, and each router's peer staleness kept under ``peer_staleness_ms_by_router``;
    the rest (directory, replicas, in flight: every router holds all of it) from the
    first."""
    merged = dict(stats[0])
    reasons: Counter[str] = Counter()
    for s in stats:
        reasons.update(s.get("decisions_by_reason", {}))
    merged["decisions_by_reason"] = dict(reasons)
    merged["peer_staleness_ms_by_router"] = [s.get("peer_staleness_ms") or {} for s in stats]
    merged["cpu_load_by_router"] = [s.get("cpu_load", 0.0) for s in stats]
    merged["process_by_router"] = [s.get("process") for s in stats]
    merged["node_by_router"] = [s.get("node", "") for s in stats]
    return merged


def render(
    model_name: str,
    replicas: dict[str, dict[str, Any]],
    router: Optional[dict[str, Any]] = None,
    accuracy: Optional[DecisionQuality] = None,
    fallbacks: Optional[int] = None,
    failovers: Optional[int] = None,
    spills: Optional[int] = None,
    ingresses: Optional[dict[str, dict[str, Any]]] = None,
) -> bytes:
    """The Prometheus text exposition of everything given (``ingresses``: each ingress's
    report, for its process; without them, this process is the one HTTP process)."""

    class _Collector:
        def collect(self) -> Iterable[Metric]:
            yield from _replica_families(model_name, replicas)
            yield from _router_families(model_name, router, accuracy, fallbacks, failovers, spills)
            if ingresses is not None:
                yield _ingress_family(model_name, ingresses)
            yield _process_family(model_name, replicas, router, ingresses)

    return generate_latest(_Collector())  # type: ignore[arg-type]


def _replica_families(model_name: str, replicas: dict[str, dict[str, Any]]) -> Iterable[Metric]:
    labels = ["model_name", "replica"]
    for name, key, doc in _GAUGES:
        fam = GaugeMetricFamily(name, doc, labels=labels)
        for rid, rep in sorted(replicas.items()):
            fam.add_metric([model_name, rid], float(rep["engine"][key]))
        yield fam
    for name, key, doc in _COUNTERS:
        fam = CounterMetricFamily(name, doc, labels=labels)
        for rid, rep in sorted(replicas.items()):
            fam.add_metric([model_name, rid], float(rep["engine"][key]))
        yield fam
    for name, key, doc in (
        ("vllm:prompt_tokens", "prompt_tokens", "Prompt tokens of finished requests."),
        ("vllm:generation_tokens", "generation_tokens", "Output tokens generated."),
    ):
        fam = CounterMetricFamily(name, doc, labels=labels)
        for rid, rep in sorted(replicas.items()):
            fam.add_metric([model_name, rid], float(rep[key]))
        yield fam
    fam = CounterMetricFamily("vllm:request_success", "Finished requests by finish reason.", labels=[*labels, "finished_reason"])
    for rid, rep in sorted(replicas.items()):
        for reason, count in sorted(rep["finished"].items()):
            fam.add_metric([model_name, rid, reason], float(count))
    yield fam
    for name, key, doc in _HISTOGRAMS:
        fam = HistogramMetricFamily(name, doc, labels=labels)
        for rid, rep in sorted(replicas.items()):
            fam.add_metric([model_name, rid], *_buckets(rep[key]))
        yield fam
    yield from _transfer_families(model_name, {rid: rep["kv_transfer"] for rid, rep in replicas.items() if "kv_transfer" in rep})


def _buckets(h: dict[str, Any]) -> tuple[list[tuple[str, float]], float]:
    """A reported histogram (``bounds``, per-bucket ``counts``, ``sum``) as cumulative buckets and sum."""
    cumulative, buckets = 0, []
    for bound, count in zip([*h["bounds"], float("inf")], h["counts"]):
        cumulative += count
        buckets.append(("+Inf" if bound == float("inf") else repr(float(bound)), float(cumulative)))
    return buckets, float(h["sum"])


_TRANSFER_COUNTERS = (
    ("kvroute:kv_pulls", "pulls", "Prefix KV pulls from another replica that completed."),
    ("kvroute:kv_pulled_tokens", "pulled_tokens", "Prompt tokens whose KV was pulled instead of recomputed."),
    ("kvroute:kv_pulled_bytes", "pulled_bytes", "Bytes of KV pulled from other replicas."),
    ("kvroute:kv_import_refusals", "import_refusals", "KV imports refused (spec, model, dtype, adapter or token mismatch)."),
    ("kvroute:kv_warmup_tokens", "warmup_tokens", "Tokens of hot prefixes the replica pulled when it joined, before serving."),
    ("kvroute:kv_warmup_seconds", "warmup_s", "Seconds the replica spent pulling hot prefixes when it joined."),
    ("kvroute:kv_handoff_blocks", "handoff_blocks", "KV blocks the replica handed to survivors when it left."),
)


def _transfer_families(model_name: str, transfers: dict[str, dict[str, Any]]) -> Iterable[Metric]:
    """The replicas' KV pulls (``replica/kv_transfer_metrics.py``): counts, bytes,
    seconds, and the pulls that fell back to recomputing, by why."""
    labels = ["model_name", "replica"]
    for name, key, doc in _TRANSFER_COUNTERS:
        fam = CounterMetricFamily(name, doc, labels=labels)
        for rid, t in sorted(transfers.items()):
            fam.add_metric([model_name, rid], float(t[key]))
        yield fam
    fam = CounterMetricFamily("kvroute:kv_pull_fallbacks", "Pulls that fell back to recomputing, by why.",
                              labels=[*labels, "reason"])  # fmt: skip
    for rid, t in sorted(transfers.items()):
        for reason, count in sorted(t["pull_fallbacks"].items()):
            fam.add_metric([model_name, rid, reason], float(count))
    yield fam
    fam = HistogramMetricFamily("kvroute:kv_pull_seconds", "Seconds a pull took (export, transfer, import).", labels=labels)
    for rid, t in sorted(transfers.items()):
        fam.add_metric([model_name, rid], *_buckets(t["pull_s"]))
    yield fam


def _router_families(
    model_name: str, router: Optional[dict[str, Any]], accuracy: Optional[DecisionQuality], fallbacks: Optional[int],
    failovers: Optional[int] = None, spills: Optional[int] = None,
) -> Iterable[Metric]:
    labels = ["model_name"]
    if router is not None:
        fam = CounterMetricFamily("kvroute:routing_decisions", "Routing decisions by reason.", labels=[*labels, "reason"])
        for reason, count in sorted(router.get("decisions_by_reason", {}).items()):
            fam.add_metric([model_name, reason], float(count))
        yield fam
        for name, key, doc in (
            ("kvroute:directory_blocks", "directory_blocks", "Distinct block hashes replicas have confirmed, in the router's directory."),
            ("kvroute:directory_entries", "directory_entries", "(block, replica) entries in the directory."),
            ("kvroute:directory_pending_entries", "pending_entries", "Blocks in optimistic (routed, not yet confirmed) runs."),
            ("kvroute:router_replicas", "replicas", "Replicas registered with the router."),
        ):
            g = GaugeMetricFamily(name, doc, labels=labels)
            g.add_metric([model_name], float(router.get(key, 0)))
            yield g
        g = GaugeMetricFamily(
            "kvroute:router_in_flight",
            "Requests the router sent to a replica that the replica's load reports do not count yet.",
            labels=[*labels, "replica"],
        )
        for rid, count in sorted(router.get("in_flight_by_replica", {}).items()):
            g.add_metric([model_name, rid], float(count))
        yield g
        yield _staleness_family(model_name, router.get("peer_staleness_ms_by_router", []))
        g = GaugeMetricFamily("kvroute:router_cpu_cores", "Each router actor's CPU use, in cores (the ingresses pass over "
                              "a router from 0.8).", labels=[*labels, "router"])  # fmt: skip
        for i, load in enumerate(router.get("cpu_load_by_router", [])):
            g.add_metric([model_name, str(i)], float(load))
        yield g
    if fallbacks is not None:
        c = CounterMetricFamily("kvroute:router_fallbacks", "Requests routed without the router (power of two).", labels=labels)
        c.add_metric([model_name], float(fallbacks))
        yield c
    if failovers is not None:
        c = CounterMetricFamily("kvroute:router_failovers", "Requests ranked by another router after one did not answer.",
                                labels=labels)  # fmt: skip
        c.add_metric([model_name], float(failovers))
        yield c
    if spills is not None:
        c = CounterMetricFamily("kvroute:router_spills", "Requests ranked by a later router while the first was busy "
                                "(too many of this process's calls unanswered, or its CPU near one core).", labels=labels)  # fmt: skip
        c.add_metric([model_name], float(spills))
        yield c
    if accuracy is not None:
        r = accuracy.reuse
        for name, value, doc in (
            ("kvroute:predicted_cached_tokens", r.captured, "Cached prompt tokens the router expected."),
            ("kvroute:actual_cached_tokens", r.delivered, "Cached prompt tokens the replicas reported."),
            ("kvroute:cached_tokens_abs_error", r.abs_error, "Sum of |expected - actual| cached tokens."),
            ("kvroute:routed_requests", r.requests, "Finished requests that carried a router prediction."),
        ):
            c = CounterMetricFamily(name, doc, labels=labels)
            c.add_metric([model_name], float(value))
            yield c
        yield from _reuse_families(model_name, accuracy)


def _staleness_family(model_name: str, by_router: list[dict[str, float]]) -> Metric:
    g = GaugeMetricFamily(
        "kvroute:router_peer_staleness_seconds",
        "Age of the other routers' decisions when they reached this router (median and 99th percentile of the latest).",
        labels=["model_name", "router", "quantile"],
    )
    for i, ages in enumerate(by_router):
        for q, key in (("0.5", "p50"), ("0.99", "p99")):
            if key in ages:
                g.add_metric([model_name, str(i), q], ages[key] / 1e3)
    return g


def _reuse_families(model_name: str, quality: DecisionQuality) -> Iterable[Metric]:
    q = quality.reuse
    fam = CounterMetricFamily(
        "kvroute:reuse_tokens",
        "Prompt tokens of predicted requests: offered (the prompt), available (longest prefix any candidate held), "
        "captured (the router expected on its choice), delivered (the replica's cached tokens), pulled (of those "
        "delivered, a pull from another replica brought).",
        labels=["model_name", "figure"],
    )
    for figure, value in (("offered", q.offered), ("available", q.available), ("captured", q.captured),
                          ("delivered", q.delivered), ("pulled", q.pulled)):  # fmt: skip
        fam.add_metric([model_name, figure], float(value))
    yield fam
    loss = CounterMetricFamily(
        "kvroute:reuse_loss_tokens",
        "Prompt tokens not delivered from cache, by cause: cold (held nowhere), routing (held elsewhere; by the "
        "decision's reason), stale (the chosen replica held less than expected).",
        labels=["model_name", "kind", "reason"],
    )
    loss.add_metric([model_name, "cold", ""], float(q.cold))
    for reason, value in sorted(q.routing.items()):
        loss.add_metric([model_name, "routing", reason], float(value))
    loss.add_metric([model_name, "stale", ""], float(q.stale))
    yield loss
    un = CounterMetricFamily(
        "kvroute:unpredicted_requests", "Finished requests without a router prediction (fallback, next ranked, resumed).",
        labels=["model_name"],
    )
    un.add_metric([model_name], float(quality.unpredicted_requests))
    yield un


def _ingress_family(model_name: str, ingresses: dict[str, dict[str, Any]]) -> Metric:
    """Each ingress's finished requests (labelled ``<application>#<replica>`` and by
    node): how the clients spread over the ingresses."""
    fam = CounterMetricFamily("kvroute:ingress_requests", "Finished requests by the ingress that served them.",
                              labels=["model_name", "ingress", "node"])  # fmt: skip
    for iid, rep in sorted(ingresses.items()):
        q = rep["quality"]
        fam.add_metric([model_name, iid, rep["node"]], float(q["requests"] + q["unpredicted_requests"]))
    return fam


def _process_family(model_name: str, replicas: dict[str, dict[str, Any]], router: Optional[dict[str, Any]],
                    ingresses: Optional[dict[str, dict[str, Any]]] = None) -> Metric:
    """Resident memory of every process of the service: each replica's, the routers'
    and each HTTP ingress's, labelled with its pid and node (what a soak run watches for
    growth, and what a chaos test kills)."""
    fam = GaugeMetricFamily(
        "kvroute:process_resident_memory_bytes",
        "Resident memory of each process of the service.",
        labels=["model_name", "role", "replica", "pid", "node"],
    )
    procs = [("replica", rid, rep.get("process"), rep.get("node", "")) for rid, rep in sorted(replicas.items())]
    router = router or {}
    router_procs = router.get("process_by_router") or [router.get("process")]
    nodes = router.get("node_by_router") or [router.get("node", "")] * len(router_procs)
    procs += [("router", str(i), proc, node) for i, (proc, node) in enumerate(zip(router_procs, nodes))]
    if ingresses is None:
        procs.append(("http", "", process_figures(), ""))
    else:
        procs += [("http", iid, rep["process"], rep["node"]) for iid, rep in sorted(ingresses.items())]
    for role, rid, proc, node in procs:
        if proc:
            fam.add_metric([model_name, role, rid, str(proc["pid"]), node], float(proc["rss_bytes"]))
    return fam
