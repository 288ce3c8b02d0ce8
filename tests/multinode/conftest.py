"""The multi-node harness: a real three-node Ray cluster on this machine (head + two
workers, each in its own network namespace, see ``netns_cluster.py``), and the kvroute
Serve application deployed on it with the real ``serve deploy`` CLI.

Fixtures:

- ``netns_cluster`` (package: up while tests/multinode/ runs, down before the rest
  of the suite goes on): the running ``NetnsCluster``. Nodes: ``head``
  (``--num-cpus 0`` plus the custom resource ``INGRESS_RESOURCE``), ``w1`` and ``w2``
  (2 CPUs each). Handles: ``cluster.nodes[name].ip`` / ``.url()`` (Serve's proxy on that
  node, port 8000), ``cluster.kill_node(name)`` (SIGKILL of every process of the node),
  ``cluster.restart_node(name)``, ``cluster.serve_deploy(config)``,
  ``cluster.serve_details()``, ``cluster.replicas(app, deployment)``,
  ``cluster.alive_nodes()``, ``cluster.get(dashboard_path)``. Torn down (every process
  of every namespace killed, namespaces, veths and bridge deleted) at the end of the
  package's tests, also when a test or the start fails.
- ``kvroute_app`` (package): the application ``APP`` deployed from
  ``serve_config()``, two engine replicas (one per worker) ready and registered with
  the router; a dict with ``placement`` ({replica id: node name}). A test that changes
  the deployment or the nodes (redeploy, node loss) restores them before it ends, also
  when it fails (``restart_node``, ``deploy_and_wait(cluster, serve_config())``), and
  updates ``placement``.

Helpers for more scenarios: ``serve_config(**options)`` (a config dict),
``deploy_and_wait(cluster, config)``, ``wait_fleet(cluster)``, ``metric_samples`` /
``per_replica`` (``/metrics`` by replica id).

Where the ingress runs: the head has no CPUs (so no engine replica can land there),
while the OpenAI ingress asks for ``ingress.num_cpus`` (0.5). ``serve_config`` pins the
ingress to the head through the Serve config's per-deployment override
(``deployments: [{name: OpenAIIngress, ray_actor_options: {num_cpus: 0, resources:
{kvroute_ingress: 1}}}]``): the head offers ``kvroute_ingress: 100`` and no CPU. The
alternative, a CPU on the head, would let Serve's SPREAD scheduling put an engine
replica there. ``serve_config(pin_ingress_to_head=False)`` leaves the product's
placement (one ingress on each node with CPUs for it: each worker, next to its engine replica).

Nodes run Ray's default health checks (a killed node is counted dead about 10-15 s
later); the client side's resume does not wait for that (the streams on a killed
replica fail over within seconds).

Env knobs: ``KVROUTE_MULTINODE_KEEP=1`` keeps ``/tmp/kvt<pid>/`` (every node's Ray
logs) after the run.
"""

from __future__ import annotations

import atexit
import copy
import os
import sys
import time
from pathlib import Path
from typing import Any, Iterator, Optional

import pytest

pytest.importorskip("ray", reason="needs ray[serve] (pip install -e .[serve])")
httpx = pytest.importorskip("httpx")
yaml = pytest.importorskip("yaml")

from tests.multinode.netns_cluster import (  # noqa: E402
    SERVE_PORT,
    NetnsCluster,
    cleanup_stale,
    namespaces_unavailable,
)

REPO = Path(__file__).resolve().parents[2]
APP = "kvroute"
MODEL = "smollm2-135m-instruct"
INGRESS_RESOURCE = "kvroute_ingress"
# Small engines: two of them and the cluster's daemons share this 2-core box. float32:
# with dtype auto (bf16 on AVX512-BF16 CPUs) a stream resumed on another replica (its
# prompt and streamed tokens prefilled at once) drifted from the undisturbed run's
# greedy text some 25 tokens after the resume (2 of 4 streams, one run in three);
# float32 kept them equal in every run.
SMALL_ENGINE = {"block_size": 16, "max_model_len": 1024, "num_kv_blocks": 256, "max_num_seqs": 8, "dtype": "float32",
                "enable_prefix_caching": True}  # fmt: skip


def serve_config(
    *,
    app_name: str = APP,
    num_replicas: int = 2,
    engine_kwargs: Optional[dict[str, Any]] = None,
    ingress: Optional[dict[str, Any]] = None,
    pin_ingress_to_head: bool = True,
    one_replica_per_node: bool = True,
    proxy_location: str = "EveryNode",
) -> dict[str, Any]:
    """A Serve config built from ``deploy/serve.yaml`` (its shape and fields), with the
    small test engine, ``torch_threads: 1``, routers of 0.1 CPU, ``num_replicas`` engine replicas of 1 CPU,
    a proxy on every node that has a replica (and the head) listening on 0.0.0.0:8000,
    (``pin_ingress_to_head``) the ingress on the head, and (``one_replica_per_node``)
    Serve's ``max_replicas_per_node: 1`` for the engine: one replica per worker, and a
    replica lost with its node waits for a node without one (the restarted node)
    instead of doubling up on the survivor."""
    config = yaml.safe_load((REPO / "deploy" / "serve.yaml").read_text())
    config["proxy_location"] = proxy_location
    config["http_options"] = {**config.get("http_options", {}), "host": "0.0.0.0", "port": SERVE_PORT}
    app = config["applications"][0]
    app["name"] = app_name
    app["args"]["app_name"] = app_name
    llm = app["args"]["llm_configs"][0]
    llm["model_loading_config"] = {"model_id": MODEL, "model_source": MODEL}
    engine = {k: v for k, v in llm.get("engine_kwargs", {}).items() if k != "kv_cache_memory_gb"}
    llm["engine_kwargs"] = {**engine, **SMALL_ENGINE, **(engine_kwargs or {})}
    llm["torch_threads"] = 1
    # a router reserves 0.1 CPU (the product's default is 0.5): a new generation's router
    # then fits beside the old one's on a 2-CPU worker instead of waiting for it to end
    llm["router_num_cpus"] = 0.1
    dep = llm["deployment_config"]
    dep["num_replicas"] = num_replicas
    dep["ray_actor_options"] = {"num_cpus": 1}
    app["args"]["ingress"] = {**app["args"].get("ingress", {}), **(ingress or {})}
    overrides = []  # Serve's per-deployment options, applied over build_app's
    if pin_ingress_to_head:
        overrides.append({"name": "OpenAIIngress", "num_replicas": 1,  # (not one per node: only the head has the resource)
                          "ray_actor_options": {"num_cpus": 0, "resources": {INGRESS_RESOURCE: 1}}})  # fmt: skip
    if one_replica_per_node:
        overrides.append({"name": "EngineReplica", "max_replicas_per_node": 1})
    if overrides:
        app["deployments"] = overrides
    return config


def metric_samples(url: str, family: str | tuple[str, ...], timeout: float = 30) -> dict[tuple, float]:
    """The samples of ``family`` (or of several families) from one scrape of a
    ``/metrics`` page, keyed by (sample name, sorted labels)."""
    from prometheus_client.parser import text_string_to_metric_families

    families = (family,) if isinstance(family, str) else family
    text = httpx.get(url + "/metrics", timeout=timeout).text
    out: dict[tuple, float] = {}
    for fam in text_string_to_metric_families(text):
        if fam.name in families:
            for s in fam.samples:
                out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def health(url: str) -> dict[str, Any]:
    """The application's ``/health`` JSON, with its HTTP status under ``status_code``."""
    resp = httpx.get(url + "/health", timeout=10)
    return {"status_code": resp.status_code, **resp.json()}


def per_replica(samples: dict[tuple, float], suffix: str = "") -> dict[str, float]:
    """Sum of samples per ``replica`` label (only sample names ending in ``suffix``)."""
    out: dict[str, float] = {}
    for (name, labels), value in samples.items():
        labels = dict(labels)
        if "replica" in labels and name.endswith(suffix):
            out[labels["replica"]] = out.get(labels["replica"], 0.0) + value
    return out


def wait_fleet(cluster: NetnsCluster, app_name: str = APP, num_replicas: int = 2,
               timeout_s: float = 240.0, deployed_after: float = 0.0) -> dict[str, str]:  # fmt: skip
    """Wait until Serve has applied the application's config deployed at or after
    ``deployed_after`` (wall clock) and reports it RUNNING (every deployment at its
    target: a changed ``args`` rebuilds every deployment, and until the rollout starts
    the old replicas still look ready), ``num_replicas`` engine replicas run, the router
    knows exactly them (each in ``/metrics``, no other) and ``/health`` answers 200 on
    the head's proxy; returns {replica id: node name}."""
    head = cluster.head.url()

    def ready() -> Optional[dict[str, str]]:
        app = cluster.serve_details().get("applications", {}).get(app_name, {})
        if app.get("status") != "RUNNING" or app.get("last_deployed_time_s", 0.0) < deployed_after:
            return None
        replicas = cluster.replicas(app_name, "EngineReplica")
        if len(replicas) != num_replicas:
            return None
        if health(head)["status_code"] != 200:
            return None
        reported = set(per_replica(metric_samples(head, "vllm:num_requests_running")))
        placed = {r["replica_id"]: cluster.node_of_ip(r["node_ip"]) for r in replicas}
        return placed if reported == set(placed) else None

    return cluster.wait_for(ready, timeout_s, f"{num_replicas} engine replicas running and registered", interval_s=1.0)


def deploy_and_wait(cluster: NetnsCluster, config: dict[str, Any], num_replicas: int = 2,
                    timeout_s: float = 240.0) -> dict[str, str]:  # fmt: skip
    """``serve deploy`` ``config``, then ``wait_fleet`` for that deploy."""
    started = time.time() - 1.0  # Serve stamps the deploy with its own clock (this machine's), rounded
    cluster.serve_deploy(config)
    return wait_fleet(cluster, config["applications"][0]["name"], num_replicas, timeout_s, deployed_after=started)


@pytest.fixture(scope="package")
def netns_cluster(smollm2_path: Path) -> Iterator[NetnsCluster]:
    reason = namespaces_unavailable()
    if reason is not None:
        pytest.skip(reason)
    stale = cleanup_stale()
    if stale:
        print(f"multinode: removed what earlier runs left: {stale}", file=sys.stderr)
    # The embedded model is converted once (the session's cache) and copied, as hard
    # links, into every node's own cache: each node still resolves it from its cache.
    cluster = NetnsCluster(bin_dir=Path(sys.executable).parent, workers=(2, 2),
                           head_resources={INGRESS_RESOURCE: 100},
                           seed_cache=[smollm2_path])  # fmt: skip
    keep = os.environ.get("KVROUTE_MULTINODE_KEEP") == "1"

    def stop() -> None:
        try:
            cluster.stop(keep_dir=keep)
        except Exception as exc:  # teardown must not hide the tests' result
            print(f"multinode: teardown: {exc}", file=sys.stderr)

    atexit.register(stop)  # a session that exits past pytest's finalizers still cleans up
    try:
        cluster.start()
        print(f"multinode: cluster up in {cluster.timings['start_s']:.1f} s: "
              + ", ".join(f"{n.name}={n.ip}" for n in cluster.nodes.values()), file=sys.stderr)  # fmt: skip
        yield cluster
    finally:
        stop()
        atexit.unregister(stop)


@pytest.fixture(scope="package")
def kvroute_app(netns_cluster: NetnsCluster) -> Iterator[dict[str, Any]]:
    """The application ``APP`` on the cluster; yields {"config", "placement": {replica
    id: node name}, "deploy_s"}."""
    config = serve_config()
    started = time.monotonic()
    placement = deploy_and_wait(netns_cluster, config)
    deploy_s = time.monotonic() - started
    print(f"multinode: serve deploy to ready in {deploy_s:.1f} s; replicas: {placement}", file=sys.stderr)
    yield {"config": copy.deepcopy(config), "placement": placement, "deploy_s": deploy_s}
