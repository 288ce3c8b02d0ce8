"""Decision quality at the ingress: the reuse figures and the split of what was not
delivered, as ``/metrics`` renders them."""

from prometheus_client.parser import text_string_to_metric_families

from kvroute.deploy.openai.fanout import Choice
from kvroute.deploy.metrics import DecisionQuality, render
from kvroute.router.types import RouteDecision, RouteOutcome


def finished(outcome: RouteOutcome, prompt: int, cached: int) -> Choice:
    c = Choice(index=0, prompt_index=0, num_prompt_tokens=prompt, num_cached_tokens=cached)
    c.routed(outcome)
    return c


def served(rid: str, expected: int, reason: str, ticket: int, available: int) -> RouteOutcome:
    """Served where the router chose, as it decided."""
    return RouteOutcome(rid, RouteDecision(rid, expected, reason, ticket, available))


FALLBACK = RouteOutcome("x", RouteDecision(None, 0, "fallback"))


def test_reuse_figures_and_losses_add_up_to_the_prompt():
    q = DecisionQuality()
    q.on_finished(finished(served("a", 96, "prefix", 1, 96), 200, 96))  # all captured, delivered
    q.on_finished(finished(served("b", 32, "load", 2, 128), 200, 16))  # gave up 96, 16 stale
    q.on_finished(finished(served("c", 0, "new_prefix", 3, 0), 100, 0))  # cold
    q.on_finished(finished(served("d", 0, "prefix", 4, 0), 50, 48))  # more than expected
    q.on_finished(finished(FALLBACK, 80, 64))  # no prediction
    r = q.reuse
    assert (r.requests, r.offered, r.available, r.captured, r.delivered) == (4, 550, 224, 128, 160)
    assert (r.cold, dict(r.routing), r.stale) == (326, {"load": 96}, 16)
    assert (q.unpredicted_requests, q.unpredicted_delivered) == (1, 64)
    # offered = delivered + cold + routing + stale - (what was delivered beyond the expectation)
    assert r.offered == r.delivered + r.cold + sum(r.routing.values()) + r.stale - 48
    assert r.as_dict()["routing_share"] == 96 / 550
    fams = {f.name: f for f in text_string_to_metric_families(render("m", {}, None, q, 0).decode())}
    reuse = {s.labels["figure"]: s.value for s in fams["kvroute:reuse_tokens"].samples if s.name.endswith("_total")}
    assert reuse == {"offered": 550, "available": 224, "captured": 128, "delivered": 160, "pulled": 0}
    loss = {(s.labels["kind"], s.labels["reason"]): s.value for s in fams["kvroute:reuse_loss_tokens"].samples
            if s.name.endswith("_total")}  # fmt: skip
    assert loss == {("cold", ""): 326, ("routing", "load"): 96, ("stale", ""): 16}
    assert [s.value for s in fams["kvroute:unpredicted_requests"].samples if s.name.endswith("_total")] == [1]


def test_the_application_view_sums_every_ingress_and_labels_nodes():
    """Whichever ingress a scrape lands on renders every ingress's counters, added up,
    and each ingress's process under its node."""
    from kvroute.deploy.metrics import ingress_report, render_app

    a, b = DecisionQuality(), DecisionQuality()
    a.on_finished(finished(served("r1", 96, "prefix", 1, 96), 200, 96))
    b.on_finished(finished(served("r2", 32, "load", 2, 128), 200, 16))
    b.on_finished(finished(FALLBACK, 80, 64))
    reports = {"i1": ingress_report(a, {"fallbacks": 0, "failovers": 2, "spills": 1}, "10.0.0.2"),
               "i2": ingress_report(b, {"fallbacks": 1, "failovers": 0, "spills": 3}, "10.0.0.3")}
    router = {"process": {"pid": 7, "rss_bytes": 1}, "node": "10.0.0.2", "decisions_by_reason": {}}
    fams = {f.name: f for f in text_string_to_metric_families(render_app("m", {}, router, reports).decode())}

    def total(name: str) -> float:
        return sum(s.value for s in fams[name].samples if s.name.endswith("_total"))

    assert (total("kvroute:router_fallbacks"), total("kvroute:router_failovers"), total("kvroute:router_spills")) == (1, 2, 4)
    assert (total("kvroute:routed_requests"), total("kvroute:predicted_cached_tokens")) == (2, 128)
    assert (total("kvroute:actual_cached_tokens"), total("kvroute:unpredicted_requests")) == (112, 1)
    procs = {(s.labels["role"], s.labels["replica"]): s.labels["node"]
             for s in fams["kvroute:process_resident_memory_bytes"].samples}  # fmt: skip
    assert procs == {("router", "0"): "10.0.0.2", ("http", "i1"): "10.0.0.2", ("http", "i2"): "10.0.0.3"}


def test_a_pulled_prefix_is_reuse_delivered_and_counted_apart():
    """A request whose replica pulled its prefix from another delivers it from cache
    (nothing lost to routing); a pull that fell back shows as stale."""
    q = DecisionQuality()
    pull = RouteDecision("b", 1984, "pull", 1, 1984, pull_from="a", pull_tokens=1984)
    q.on_finished(finished(RouteOutcome("b", pull, pulled_tokens=1984), 2040, 1984))
    q.on_finished(finished(RouteOutcome("b", pull, pulled_tokens=0), 2040, 0))  # the source died: recomputed
    r = q.reuse
    assert (r.available, r.captured, r.delivered, r.pulled, r.stale, dict(r.routing)) == (3968, 3968, 1984, 1984, 1984, {})
    fams = {f.name: f for f in text_string_to_metric_families(render("m", {}, None, q, 0).decode())}
    reuse = {s.labels["figure"]: s.value for s in fams["kvroute:reuse_tokens"].samples if s.name.endswith("_total")}
    assert reuse["pulled"] == 1984 and reuse["delivered"] == 1984
