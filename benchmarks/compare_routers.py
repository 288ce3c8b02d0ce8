"""Routers side by side on ONE set of engine replicas: the same workload, at the same
request rates, through kvroute's router, round robin, power of two (Ray Serve's
default) and Ray Serve LLM's real ``PrefixCacheAffinityRouter``; and, where the
``sglang-router`` / ``vllm-router`` packages are installed, SGLang's and vLLM's real
routers (``--policy cache_aware``) in front of single-engine servers (``kvroute
serve-replica``) on the same engine settings.

How one fleet serves every router: the engine deployment gets a pinned Serve
``version`` that ignores the router fields (``replica_version``), so redeploying the
application with another ``request_router_config`` / ``router_policy`` only
reconfigures the running replicas (Serve's ``NeedsActorReconfigure`` update); the
HTTP ingress, which holds the handle whose request router routes, is replaced and so
builds the new router. Before every run each replica's prefix cache is reset
(``EngineReplica.reset_prefix_cache``, addressed through a control handle built while
kvroute's request router was active), the router actor's directory is emptied and
Ray's prefix-tree actor is killed, so every router starts cold. The JSON records the
replica ids seen in every run: they must be the same set.

Each kind of fleet is a ``Fleet`` (``ServeFleet``, ``ExternalFleet``): ``start(router)``
serves that router from cold caches and gives its base URL; one loop runs every router
at every rate. With ``--emulate PROFILE [--time-scale K]`` the replicas are emulated
(``replica/emulated.py``: real scheduler and KV cache, the profile's step times × K)
and every reported time is in unscaled seconds.

Outputs (``--out-dir``, default ``results/compare_routers/<workload>``): one JSON per
router and rate, ``combined.json`` (table rows + target ratios), ``table.md`` and PNG
plots (``ttft_cdf.png``, ``hit_rate.png``, ``ttft_vs_rate.png``).

Locally (starts a Ray cluster):
    python -m kvroute.benchmarks.compare_routers --gsp-num-groups 16 ...
As a Ray job (``ray start --head --num-cpus 4``; Ray 2.60 token auth, see the README):
    RAY_AUTH_MODE=token ray job submit --working-dir . -- python -m kvroute.benchmarks.compare_routers ...
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import secrets
import subprocess
import sys
import time
from pathlib import Path
import dataclasses
from typing import Any, Callable, Optional, Protocol, Sequence

from kvroute.benchmarks import serving
from kvroute.benchmarks.router_report import format_rows, write_outputs
from kvroute.cluster.config import ROUTER_CHOICES
from kvroute.benchmarks import workloads as wl

SERVE_ROUTERS = ROUTER_CHOICES
# External routers: module run with ``python -m`` (each is an sglang-router-style CLI:
# --host/--port/--policy/--worker-urls), started with --policy cache_aware.
EXTERNAL_ROUTERS = {"sglang_router": "sglang_router.launch_router", "vllm_router": "vllm_router.launch_router"}
SERVED_NAME = "kvroute-bench"
_CLI = "import sys; from kvroute.deploy.cli import main; sys.exit(main(sys.argv[1:]))"


def external_available(name: str) -> bool:
    import importlib.util

    return name in EXTERNAL_ROUTERS and importlib.util.find_spec(name) is not None


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


class Fleet(Protocol):
    """Engine replicas behind one router at a time."""

    kind: str

    def start(self, router: str) -> dict[str, Any]:
        """Serve ``router`` with every cache cold; the run's metadata, with ``base_url``."""

    def counters(self) -> Optional[dict[str, dict[str, float]]]:
        """Per replica, cumulative requests and prompt/cached/output tokens (None: not
        available), so a run's difference shows how the router spread the load."""

    def close(self) -> None: ...


# ---------------------------------------------------------------------- Serve fleet
class ServeFleet:
    """One kvroute Serve application whose router is swapped between runs while the
    engine replicas stay up."""

    kind = "serve"

    def __init__(self, args: argparse.Namespace, engine_kwargs: dict[str, Any]) -> None:
        self.args = args
        self.engine_kwargs = engine_kwargs
        self.app_name = args.app_name
        self.base_url = f"http://127.0.0.1:{args.http_port}/{self.app_name}"
        self.replica_ids: list[str] = []
        self._control = None  # handle whose request router is kvroute's (addressed calls)

    def app_args(self, router: str) -> Any:
        from kvroute.deploy.app import parse_args, router_choice

        route = router_choice(router)
        return parse_args({
            "app_name": self.app_name,
            "llm_configs": [{
                "model_loading_config": {"model_id": SERVED_NAME, "model_source": self.args.model},
                "engine_kwargs": self.engine_kwargs,
                "deployment_config": {
                    "num_replicas": self.args.replicas,
                    "ray_actor_options": {"num_cpus": self.args.num_cpus_per_replica},
                    "request_router_config": {"request_router_class": route["request_router_class"]},
                    "max_ongoing_requests": self.args.max_ongoing_requests,
                },
                "router_policy": route["router_policy"],
                "torch_threads": self.args.torch_threads,
            }],
            "ingress": {"num_cpus": 0.1},
        })

    def build(self, router: str) -> Any:
        """``deploy.app.build_app`` with the engine deployment's version pinned, so a
        router swap only reconfigures the replicas."""
        from kvroute.cluster.replica_deployment import replica_version
        from kvroute.deploy.app import build_app

        parsed = self.app_args(router)
        config = parsed.cluster_config()  # hash_seed is set: the same config build_app makes
        # between runs the old ingress is idle: no need to wait out Serve's drain loop
        app = build_app(parsed, engine_version=replica_version(config), graceful_shutdown_wait_loop_s=0.2,
                        graceful_shutdown_timeout_s=5.0)  # fmt: skip
        return app, config

    def deploy(self, router: str) -> None:
        from ray import serve

        app, self.config = self.build(router)
        if self._control is None:
            # a run that was stopped leaves its app and detached actors behind (a router
            # actor with another hash seed would refuse these replicas): start clean
            self.close()
        if router == "prefix_affinity_ray":  # Ray's router keeps its tree in a detached actor
            self._kill_prefix_tree_actor()
        serve.run(app, name=self.app_name, route_prefix=f"/{self.app_name}")
        if self._control is None:
            self._control = serve.get_deployment_handle(self.config.deployment_name, app_name=self.app_name)

    def router_actor(self) -> Any:
        import ray

        from kvroute.cluster.messages import ROUTER_NAMESPACE

        return ray.get_actor(self.config.router_actor_name, namespace=ROUTER_NAMESPACE)

    def registered(self) -> list[str]:
        import ray

        return sorted(ray.get(self.router_actor().replicas.remote()))

    def wait_registered(self, n: int, timeout_s: float = 120.0) -> list[str]:
        def probe() -> Optional[list[str]]:
            ids = self.registered()
            return ids if len(ids) >= n else None

        return wait_until(probe, timeout_s, f"{n} replicas did not all register with the router", 0.2)

    def start(self, router: str) -> dict[str, Any]:
        """Deploy ``router`` and make every replica and router state cold."""
        import ray

        from kvroute.cluster.messages import ReplicaCall
        from kvroute.deploy.app import router_choice

        t0 = time.perf_counter()
        self.deploy(router)
        t_deploy = time.perf_counter() - t0
        ids = self.wait_registered(self.args.replicas)
        if not self.replica_ids:
            self.replica_ids = ids
        elif ids != self.replica_ids:
            raise RuntimeError(f"the replicas changed across a router swap: {self.replica_ids} -> {ids}")

        async def reset_all() -> list[dict[str, Any]]:
            out = []
            for rid in self.replica_ids:
                for attempt in range(50):  # a replica still finishing or being reconfigured
                    try:
                        r = await asyncio.wait_for(self._control.reset_prefix_cache.remote(ReplicaCall(rid)), 30)
                    except Exception:
                        if attempt == 49:
                            raise
                        await asyncio.sleep(0.2)
                        continue
                    if r["reset"]:
                        out.append(r)
                        break
                    await asyncio.sleep(0.2)
                else:
                    raise RuntimeError(f"replica {rid} kept blocks in use: cannot reset its prefix cache")
            return out

        resets = asyncio.run(reset_all())
        assert sorted(r["replica_id"] for r in resets) == self.replica_ids, resets
        ray.get(self.router_actor().reset.remote(router_choice(router)["router_policy"], {}))
        after = self.wait_registered(self.args.replicas)
        assert after == self.replica_ids, (after, self.replica_ids)
        for rid in self.replica_ids:  # the directory starts empty
            assert ray.get(self.router_actor().directory.remote(rid)) == [], rid
        t_reset = time.perf_counter() - t0 - t_deploy
        warm_up(self.base_url, self.args.replicas)
        time.sleep(1.5)  # the warm-up reaches the replicas' metrics reports before the run's baseline
        return {"fleet": self.kind, "base_url": self.base_url, "replica_ids": list(self.replica_ids),
                "prepare_s": time.perf_counter() - t0, "deploy_s": t_deploy, "reset_s": t_reset}

    def counters(self) -> dict[str, dict[str, float]]:
        return wait_counters(self.base_url, self.replica_ids)

    def _kill_prefix_tree_actor(self) -> None:
        import ray

        namespace = f"serve::{self.app_name}::{self.args.deployment_name}"
        try:
            ray.kill(ray.get_actor("LlmPrefixTreeActor", namespace=namespace), no_restart=True)
        except ValueError:
            pass

    def close(self) -> None:
        from ray import serve

        from kvroute.cluster.router_actor import kill_router_actor

        try:
            if self.app_name in serve.status().applications:
                serve.delete(self.app_name)
        finally:
            kill_router_actor(f"kvroute-router:{self.app_name}")
            self._kill_prefix_tree_actor()


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
            "vllm:prefix_cache_hits": "cached_tokens", "vllm:generation_tokens": "output_tokens"}


def replica_counters(base_url: str) -> dict[str, dict[str, float]]:
    """Per replica, the cumulative counters of the app's ``/metrics`` (requests, prompt,
    cached and output tokens): a run's difference shows how a router spread the load."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, dict[str, float]] = {}
    text = httpx.get(base_url + "/metrics", timeout=30).text
    for fam in text_string_to_metric_families(text):
        key = _COUNTED.get(fam.name)
        if key is None:
            continue
        for sample in fam.samples:
            if sample.name.endswith("_total") and "replica" in sample.labels:
                row = out.setdefault(sample.labels["replica"], dict.fromkeys(_COUNTED.values(), 0.0))
                row[key] += sample.value
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
def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_http(url: str, procs: Sequence[subprocess.Popen], timeout_s: float) -> None:
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


class ExternalFleet:
    """``--replicas`` single-engine servers (``kvroute serve-replica``) with SGLang's or
    vLLM's router in front, started afresh for every run (cold caches)."""

    kind = "serve-replica processes"
    _FORWARDED = ("num_kv_blocks", "max_model_len", "max_num_batched_tokens", "dtype", "seed", "emulate", "time_scale")

    def __init__(self, args: argparse.Namespace, engine_kwargs: dict[str, Any]) -> None:
        self.args = args
        self.engine_kwargs = engine_kwargs
        self.procs: list[subprocess.Popen] = []

    def start(self, router: str) -> dict[str, Any]:
        self.close()
        kw = self.engine_kwargs
        env = {**os.environ, "OMP_NUM_THREADS": str(self.args.torch_threads)}
        flags = ["--model", self.args.model, "--served-model-name", SERVED_NAME, "--block-size", str(kw.get("block_size", 16))]
        for key in self._FORWARDED:
            if kw.get(key) is not None:
                flags += [f"--{key.replace('_', '-')}", str(kw[key])]
        try:
            urls = []
            for i in range(self.args.replicas):
                port = _free_port()
                urls.append(f"http://127.0.0.1:{port}")
                self.procs.append(subprocess.Popen([sys.executable, "-c", _CLI, "serve-replica", *flags,
                                                    "--replica-id", f"ext-{i}", "--port", str(port)], env=env))
            for url in urls:
                _wait_http(url + "/health", self.procs, 300)
            port = _free_port()
            self.procs.append(subprocess.Popen([sys.executable, "-m", EXTERNAL_ROUTERS[router], "--host", "127.0.0.1",
                                                "--port", str(port), "--policy", "cache_aware", "--worker-urls", *urls]))
            base = f"http://127.0.0.1:{port}"
            _wait_http(base + "/v1/models", self.procs, 120)
            warm_up(base, self.args.replicas)
        except BaseException:
            self.close()
            raise
        return {"fleet": self.kind, "base_url": base, "worker_urls": urls}

    def counters(self) -> None:
        return None

    def close(self) -> None:
        for p in reversed(self.procs):
            if p.poll() is None:
                p.terminate()
        for p in reversed(self.procs):
            try:
                p.wait(timeout=15)
            except subprocess.TimeoutExpired:
                p.kill()
        self.procs = []


# ---------------------------------------------------------------------- main
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m kvroute.benchmarks.compare_routers", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-instruct", help="embedded model name or checkpoint folder")
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--num-cpus-per-replica", type=float, default=1.0)
    p.add_argument("--torch-threads", type=int, default=1)
    p.add_argument("--max-ongoing-requests", type=int, default=64)
    p.add_argument("--engine-kwargs", default='{"block_size": 16}', help="EngineConfig fields as JSON (every router's engines)")
    p.add_argument("--emulate", default=None, metavar="PROFILE",
                   help="emulated replicas with this step-time profile (replica/profiles.py); see --time-scale")
    p.add_argument("--routers", default=None,
                   help=f"comma list of {SERVE_ROUTERS + tuple(EXTERNAL_ROUTERS)} (default: the four Serve routers, plus "
                        "sglang_router / vllm_router where the sglang-router / vllm-router package is installed)")
    p.add_argument("--request-rates", default=None, help="comma list of request rates to sweep (default: --request-rate)")
    p.add_argument("--app-name", default="kvroute-bench")
    p.add_argument("--deployment-name", default="EngineReplica", help=argparse.SUPPRESS)
    p.add_argument("--http-port", type=int, default=8000, help="Serve's HTTP proxy port")
    p.add_argument("--address", default=None, help="Ray cluster address (default: RAY_ADDRESS, as in a Ray job, else start one)")
    p.add_argument("--out-dir", default=None, help="default: results/compare_routers/<workload>")
    p.add_argument("--label", default=None)
    serving.add_workload_args(p)
    serving.add_load_args(p)
    return p


def _settings(args: argparse.Namespace, routers: list[str]) -> tuple[dict[str, Any], serving.LoadConfig]:
    """The engines' settings (one hash seed for every redeploy; emulation) and the load."""
    engine_kwargs = dict(json.loads(args.engine_kwargs))
    engine_kwargs.setdefault("hash_seed", secrets.randbits(63))
    if args.emulate:
        engine_kwargs["emulate"] = args.emulate
    if args.time_scale != 1.0:
        engine_kwargs.setdefault("time_scale", args.time_scale)
    if engine_kwargs.get("time_scale", 1.0) != args.time_scale:
        raise ValueError(f"--time-scale {args.time_scale} and engine_kwargs time_scale {engine_kwargs['time_scale']} differ")
    config = dataclasses.replace(serving.load_config_from_args(args), block_size=int(engine_kwargs.get("block_size", 16)))
    if any(r in EXTERNAL_ROUTERS for r in routers) and config.prompt_format == "tokens":
        # sglang-router and vllm-router take text prompts only (their OpenAI schema has no token-id
        # prompt): every router gets the same decoded text, so the runs stay comparable
        print("compare_routers: an external router is in the run: sending text prompts to every router", flush=True)
        config = dataclasses.replace(config, prompt_format="text")
    return engine_kwargs, config


def _routers(args: argparse.Namespace) -> list[str]:
    routers = [r.strip() for r in args.routers.split(",")] if args.routers else [
        *SERVE_ROUTERS, *(r for r in EXTERNAL_ROUTERS if external_available(r))]
    unknown = [r for r in routers if r not in SERVE_ROUTERS + tuple(EXTERNAL_ROUTERS)]
    if unknown:
        raise ValueError(f"unknown routers {unknown}; choose from {SERVE_ROUTERS + tuple(EXTERNAL_ROUTERS)}")
    missing = [r for r in routers if r in EXTERNAL_ROUTERS and not external_available(r)]
    if missing:
        raise ValueError(f"{missing} not installed (pip install {' '.join(r.replace('_', '-') for r in missing)})")
    return routers


def _join_ray(args: argparse.Namespace) -> None:
    import ray
    from ray import serve

    address = args.address or os.environ.get("RAY_ADDRESS")
    if ray.is_initialized():
        pass  # a caller (a test, a notebook) already joined a cluster
    elif address:
        ray.init(address=address, logging_level="warning")
    else:  # logical CPUs: room for every replica and the ingress even on a small machine
        need = int(math.ceil(args.replicas * args.num_cpus_per_replica + 2))
        # address="local": a new cluster even where an old `ray start` left its address behind
        ray.init(address="local", num_cpus=max(os.cpu_count() or 1, need), include_dashboard=False, logging_level="warning")
    serve.start(http_options={"host": "127.0.0.1", "port": args.http_port})


def run(args: argparse.Namespace) -> dict[str, Any]:
    workload = serving.workload_from_args(args)
    routers = _routers(args)
    engine_kwargs, config = _settings(args, routers)
    decode = serving.decoder(args.tokenizer or (args.model if config.prompt_format == "text" else None))
    rates = [float(x) for x in args.request_rates.split(",")] if args.request_rates else [args.request_rate]
    label = args.label or workload.name
    out_dir = Path(args.out_dir) if args.out_dir else Path(os.environ.get("KVROUTE_RESULTS", "results")) / "compare_routers" / label

    serve_fleet, external_fleet = ServeFleet(args, engine_kwargs), ExternalFleet(args, engine_kwargs)
    fleets: dict[str, Fleet] = {r: serve_fleet if r in SERVE_ROUTERS else external_fleet for r in routers}
    if any(f is serve_fleet for f in fleets.values()):
        _join_ray(args)
        if routers[0] != "kvroute":
            serve_fleet.start("kvroute")  # the control handle must be built under kvroute's request router
    results: dict[str, dict[str, Any]] = {}
    t_start = time.perf_counter()
    try:
        for rate in rates:
            for router in routers:
                fleet = fleets[router]
                info = fleet.start(router)
                print(f"compare_routers: {router} at {rate} req/s ({len(workload)} requests)…", flush=True)
                before = fleet.counters()
                r = asyncio.run(serving.benchmark(info["base_url"], workload, dataclasses.replace(config, request_rate=rate),
                                                  SERVED_NAME, decode))  # fmt: skip
                run_info = {"router": router, **info}
                if before is not None:
                    time.sleep(1.5)  # the replicas' last metrics report
                    run_info["per_replica"] = spread = per_replica(before, fleet.counters() or {})
                    print("  per replica (requests, prompt, cached): " + "; ".join(
                        f"{rid}: {c['requests']:.0f}, {c['prompt_tokens']:.0f}, {c['cached_tokens']:.0f}"
                        for rid, c in spread.items()), flush=True)  # fmt: skip
                results[f"{router}_rate{rate:g}"] = {**run_info, **r}
                print(f"  {router}: {serving.summary_line(r)}", flush=True)
    finally:
        for fleet in {id(f): f for f in fleets.values()}.values():
            fleet.close()  # (one external router at a time: each start() stops the one before)
    meta = {
        "label": label, "workload": workload.name, "workload_params": workload.params, "model": args.model,
        "replicas": args.replicas, "torch_threads": args.torch_threads, "engine_kwargs": engine_kwargs,
        "routers": routers, "request_rates": rates, "max_concurrency": config.max_concurrency,
        "same_replicas_for_every_serve_router": bool(serve_fleet.replica_ids), "replica_ids": serve_fleet.replica_ids,
        "wall_s": time.perf_counter() - t_start,
    }
    from kvroute.benchmarks.common import machine

    meta["machine"] = machine()
    combined = write_outputs(out_dir, results, meta)
    print(format_rows(combined["rows"]))
    for t in combined["targets"]:
        print("targets:", json.dumps({k: (round(v, 3) if isinstance(v, float) else v) for k, v in t.items()}))
    combined["out_dir"] = str(out_dir)
    return combined


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        combined = run(args)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    t = combined["targets"][-1] if combined["targets"] else {}
    line = ", ".join(f"{k} {v:.3f}" for k, v in t.items() if isinstance(v, float) and k != "rate")
    errors = sum(r["failed"] for r in combined["rows"])
    print(f"compare_routers[{combined['label']}]: {len(combined['rows'])} runs, {errors} errors; {line}  [{combined['out_dir']}]")
    return 0 if errors == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
