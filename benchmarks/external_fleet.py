"""The external routers' fleet (``benchmarks/fleets.py`` has the ``Fleet`` protocol):
``kvroute serve-replica`` processes with SGLang's or vLLM's router in front, started
afresh for every run (cold caches). With ``--ingresses I`` it runs I independent router
processes in front of the same replicas, the way those routers' users scale them: each
keeps its own tree of what it routed, and each takes 1/I of the clients."""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Any

from kvroute.benchmarks.fleet_probes import SERVED_NAME, free_port, replica_counters, wait_http, wait_until, warm_up
from kvroute.benchmarks.fleets import _CLI, EXTERNAL_ROUTERS, FleetConfig

# how each registers a worker while it runs (sglang-router 0.3: JSON body; vllm-router: query)
_ADD_WORKER = {"sglang_router": lambda url: ("/workers", {"json": {"url": url}}),
               "vllm_router": lambda url: ("/add_worker", {"params": {"url": url}})}


class ExternalFleet:
    """``--replicas`` single-engine servers (``kvroute serve-replica``) with SGLang's or
    vLLM's router in front, started afresh for every run (cold caches)."""

    kind = "serve-replica processes"
    _FORWARDED = ("num_kv_blocks", "max_model_len", "max_num_batched_tokens", "dtype", "seed", "emulate", "time_scale",
                  "host_kv_blocks", "max_loras", "max_lora_rank", "max_cpu_loras")

    def __init__(self, fleet: FleetConfig, engine_kwargs: dict[str, Any]) -> None:
        self.fleet = fleet
        self.engine_kwargs = engine_kwargs
        self.ingresses = fleet.ingresses
        self.procs: list[subprocess.Popen] = []  # the replicas, in the order of self.urls
        self.router_procs: list[subprocess.Popen] = []  # one per ingress, in the order of self.base_urls
        self.urls: list[str] = []
        self.router, self.base_urls = "", []

    def _start_replicas(self, n: int) -> list[str]:
        """``n`` more ``serve-replica`` processes, once each answers ``/health``."""
        kw = self.engine_kwargs
        flags = ["--model", self.fleet.model, "--served-model-name", SERVED_NAME, "--block-size", str(kw.get("block_size", 16))]
        for key in self._FORWARDED:
            if kw.get(key) is not None:
                flags += [f"--{key.replace('_', '-')}", str(kw[key])]
        flags += self._lora_flags()
        new = []
        for _ in range(n):
            port = free_port()
            new.append(f"http://127.0.0.1:{port}")
            self.procs.append(subprocess.Popen([sys.executable, "-c", _CLI, "serve-replica", *flags, "--replica-id",
                                                f"ext-{len(self.urls) + len(new) - 1}", "--port", str(port)], env=self._env()))
        self.urls += new
        for url in new:
            wait_http(url + "/health", self.procs, 300)
        return new

    def start(self, router: str) -> dict[str, Any]:
        self.close()
        try:
            urls = self._start_replicas(self.fleet.replicas - self.fleet.add_replicas)
            self.router = router
            for _ in range(self.ingresses):
                port, metrics_port = free_port(), free_port()  # (a fixed default metrics port would clash)
                self.router_procs.append(subprocess.Popen([
                    sys.executable, "-m", EXTERNAL_ROUTERS[router], "--host", "127.0.0.1", "--port", str(port),
                    "--prometheus-host", "127.0.0.1", "--prometheus-port", str(metrics_port),
                    "--policy", "cache_aware", "--worker-urls", *urls]))  # fmt: skip
                self.base_urls.append(f"http://127.0.0.1:{port}")
            for url in self.base_urls:
                wait_http(url + "/v1/models", [*self.procs, *self.router_procs], 120)
                warm_up(url, -(-len(urls) // self.ingresses))  # as many in all as with one router
        except BaseException:
            self.close()
            raise
        return {"fleet": self.kind, "base_url": self.base_urls[0], "base_urls": list(self.base_urls),
                "worker_urls": list(urls)}  # fmt: skip

    def _lora_flags(self) -> list[str]:
        """``--enable-lora`` and every adapter of ``lora_modules``: each process knows them all."""
        kw = self.engine_kwargs
        if not kw.get("enable_lora"):
            return []
        modules = [f"{name}={path}" for name, path in kw.get("lora_modules", {}).items()]
        return ["--enable-lora", *(["--lora-modules", *modules] if modules else [])]

    def counters(self) -> dict[str, dict[str, float]]:
        """Each process' own cumulative counters (its ``/metrics``), by replica id."""
        out: dict[str, dict[str, float]] = {}
        for url in self.urls:
            out.update(replica_counters(url))
        return out

    def router_counters(self) -> None:
        return None

    def kill_replicas(self, n: int) -> list[str]:
        killed = []
        for i in range(n):
            old = self.procs[i]
            old.kill()
            old.wait()
            self.procs[i] = subprocess.Popen(old.args, env=self._env())
            killed.append(self.urls[i])
        for url in killed:
            wait_http(url + "/health", self.procs, 300)
        return killed

    def add_replicas(self, n: int) -> list[str]:
        """``n`` new processes, registered with the running router through its
        worker API; returns once the router lists them."""
        import httpx

        new = self._start_replicas(n)
        for base, url in ((b, u) for b in self.base_urls for u in new):
            path, kw = _ADD_WORKER[self.router](url)
            r = httpx.post(base + path, timeout=60, **kw)
            if r.status_code >= 400:
                raise RuntimeError(f"{self.router} refused worker {url}: {r.status_code} {r.text[:200]}")

        def listed() -> bool:
            path = "/workers" if self.router == "sglang_router" else "/list_workers"
            return all(url in httpx.get(base + path, timeout=30).text for base in self.base_urls for url in new)

        wait_until(listed, 60, f"{self.router} did not list the new workers {new}")
        return new

    def _env(self) -> dict[str, str]:
        return {**os.environ, "OMP_NUM_THREADS": str(self.fleet.torch_threads)}

    def close(self) -> None:
        procs = [*self.router_procs, *self.procs]
        for p in procs:
            if p.poll() is None:
                p.terminate()
        for p in procs:
            try:
                p.wait(timeout=15)
            except subprocess.TimeoutExpired:
                p.kill()
        self.procs, self.urls, self.router_procs, self.base_urls = [], [], [], []
