"""``/metrics`` of the Serve application, whichever ingress a scrape lands on: each
ingress sends its own counters to every router actor about once a second
(``IngressReporter``), and ``router_metrics`` renders the replicas' reports, the
routers' stats and every ingress's counters from what the routers hold."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import ray
from ray import serve

log = logging.getLogger(__name__)


class IngressReporter:
    """Sends this ingress's counters to every router about once a second (also its
    sign of life: a generation's routers end themselves once no ingress reports), so
    ``/metrics`` on any ingress can add up all of them."""

    PERIOD_S = 1.0

    def __init__(self, router_actors: list[Any], quality: Any, routing: dict[str, int]) -> None:
        # routing: this ingress's counts of fallbacks, failovers and spills (its
        # client's or its backend's stats), read at each report
        self.router_actors, self.quality, self.routing = router_actors, quality, routing
        context = serve.get_replica_context()
        self.ingress_id = f"{context.app_name}#{context.replica_id.unique_id}"  # application (route) and replica
        self.node = ray.util.get_node_ip_address()
        self._task = asyncio.get_running_loop().create_task(self._loop())

    def report(self) -> dict[str, Any]:
        from kvroute.deploy.metrics import ingress_report

        return ingress_report(self.quality, self.routing, self.node)

    async def _loop(self) -> None:
        while True:
            report = self.report()
            calls = [asyncio.wait_for(a.report_ingress.remote(self.ingress_id, report), 2.0) for a in self.router_actors]
            for exc in await asyncio.gather(*calls, return_exceptions=True):
                if isinstance(exc, Exception):  # a router restarting: the next round reaches it
                    log.debug("ingress %s: a router did not take its report: %r", self.ingress_id, exc)
            await asyncio.sleep(self.PERIOD_S)


async def router_metrics(router_actors: list[Any], model_name: str, reporter: IngressReporter) -> tuple[bytes, str]:
    """``/metrics`` of the application, whichever ingress renders it: the replicas'
    reports, the routers' stats, and every ingress's counters (this one's current)."""
    from kvroute.deploy.metrics import CONTENT_TYPE, freshest_reports, merge_router_stats, render_app

    answers = await asyncio.gather(*(asyncio.wait_for(a.metrics.remote(), 5.0) for a in router_actors),
                                   return_exceptions=True)  # fmt: skip
    snapshots = [a for a in answers if isinstance(a, dict)]
    for exc in (a for a in answers if not isinstance(a, dict)):  # a router restarting
        log.warning("a router actor did not answer for /metrics: %r", exc)
    replicas = freshest_reports([s["replicas"] for s in snapshots])
    router = merge_router_stats([s["router"] for s in snapshots]) if snapshots else None
    ingresses = {iid: rep for s in snapshots for iid, rep in s["ingresses"].items()}
    ingresses[reporter.ingress_id] = reporter.report()
    return render_app(model_name, replicas, router, ingresses), CONTENT_TYPE
