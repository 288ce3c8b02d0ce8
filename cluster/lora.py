"""The application's LoRA adapters across the fleet (ARCHITECTURE.md §2, LoRA adapters
in the Serve application): the registry, each replica kept in step with it, and the
adapter host the OpenAI layer (``deploy/openai/served_models.py``'s ``AdapterHost``) sees in
the Serve application (``FleetAdapters``; in front of external workers it is the workers
backend's ``WorkerAdapters``, ``deploy/backends/workers.py``). Each engine's own adapters
are ``replica/lora/``.

``LoRARegistry`` (plain; ``LoRARegistryActor`` is it as a detached Ray actor named
``lora_registry_name(app)``, one for every generation of the application; ended, with
its saved state, by ``kill_lora_registry``) is the fleet's list of adapters,
``{name: folder}``: the engine config's ``lora_modules`` from the start, then what the
ingresses add (``POST /v1/load_lora_adapter``, or an adapter of the
``dynamic_lora_loading_path`` on first use) and remove. Every replica sees the same
folders, so a folder path is the adapter.

The actor keeps its list and ``epoch`` in Ray's GCS internal KV too (``save_state``:
written on every change, read back on start, keyed by the actor's name, so by the
application), so a registry that dies and restarts comes back with every adapter,
those loaded at run time that no replica holds included, and the same epoch. A
registry that comes back without it (the store lost, a new epoch) is handed what the
replicas hold instead.

``ReplicaAdapters`` keeps one replica's engine in step: at start and every
``sync_period_s`` it loads what it lacks (while ``max_cpu_loras`` leaves room) and
unloads what the registry no longer lists (an adapter still in use is unloaded at a
later sync); a request for an adapter the engine has not loaded yet loads it first
(``ensure``), making room by unloading the least recently used idle one.

``FleetAdapters`` (the ingress' host): loading a folder first has one replica load it,
which validates it (a bad folder is a ValueError naming the file and field, and nothing
is registered); then the registry lists it and every other replica loads it at its
next sync or on its first request for it. Unloading takes it off the registry at once
(no new request may name it); each replica drops it at its next sync, once its
requests on it have finished. With ``dynamic_lora_loading_path`` (serve.yaml's
``lora_config``, as in Ray Serve LLM) a request naming an adapter ``X`` the registry
does not list loads it from ``<path>/X`` the same way: a folder every replica's node
has, or an object-store URI (``s3://bucket/loras``: ``X`` is then the objects under
``s3://bucket/loras/X``, which each replica fetches into its node's cache). It is
looked at only by the replica that loads the adapter, never on the ingress' node
(which may lack it); no ``X`` there is a 404 naming the adapter (the ingress logs the
path and the replica's node), a bad one a 400 naming the file and field.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping

import ray

from kvroute.cluster.config import ClusterConfig
from kvroute.cluster.messages import ROUTER_NAMESPACE
from kvroute.cluster.saved_state import delete_saved, load_json, save_json
from kvroute.replica.config import check_adapter_name
from kvroute.replica.model_store import NOT_FOUND, is_uri

if TYPE_CHECKING:
    from kvroute.cluster.client import KVRouteClient
    from kvroute.replica.async_engine import AsyncEngine

log = logging.getLogger(__name__)

LORA_FRESH_S = 1.0  # how long an ingress trusts its copy of the registry for a name it holds

# (epoch, {name: folder}): a registry's state as replicas read it
Snapshot = tuple[str, dict[str, str]]


def save_state(key: str, snapshot: Snapshot) -> None:
    epoch, modules = snapshot
    save_json(key, {"epoch": epoch, "modules": modules})


def load_state(key: str) -> Snapshot | None:
    """The state saved under ``key`` (None: nothing saved)."""
    state = load_json(key)
    return None if state is None else (state["epoch"], dict(state["modules"]))


def delete_state(key: str) -> bool:
    return delete_saved(key)


class LoRARegistry:
    """The adapters of one application, by name. ValueError for a name taken by another
    folder or one that is not a valid adapter name. With ``state_key`` the state is saved
    in the GCS internal KV on every change and, where saved before, read back instead of
    ``modules`` (needs a connected Ray worker); without it, it lives in memory only."""

    def __init__(self, modules: Mapping[str, str] = (), state_key: str | None = None) -> None:
        self.state_key = state_key
        saved = load_state(state_key) if state_key is not None else None
        if saved is not None:
            self.epoch, self.modules = saved
            log.info("LoRA registry %s restored %d adapters (epoch %s)", state_key, len(self.modules), self.epoch)
            return
        self.epoch = secrets.token_hex(8)
        self.modules: dict[str, str] = dict(modules)
        self._save()

    def _save(self) -> None:
        if self.state_key is not None:
            save_state(self.state_key, self.snapshot())

    def snapshot(self) -> Snapshot:
        return self.epoch, dict(self.modules)

    def path(self, name: str) -> str | None:
        return self.modules.get(name)

    def add(self, name: str, path: str) -> bool:
        """Register ``name``; False when it already names ``path`` (nothing to do)."""
        check_adapter_name(name)
        known = self.modules.get(name)
        if known is not None and known != path:
            raise ValueError(f"LoRA adapter {name!r} is already loaded (from {known}); unload it first")
        self.modules[name] = path
        self._save()
        return known is None

    def adopt(self, modules: Mapping[str, str]) -> None:
        """A (re)deployed config's ``lora_modules``: listed, under the config's folders."""
        for name, path in modules.items():
            check_adapter_name(name)
        if any(self.modules.get(name) != path for name, path in modules.items()):
            self.modules.update(modules)
            self._save()

    def remove(self, name: str) -> bool:
        removed = self.modules.pop(name, None) is not None
        self._save()
        return removed

    def restore(self, epoch: str, modules: Mapping[str, str]) -> str:
        """A replica's adapters after this registry restarted (``epoch`` is the one the
        replica last saw): taken where the name is free. Returns the current epoch."""
        if epoch != self.epoch:
            for name, path in modules.items():
                self.modules.setdefault(name, path)
            self._save()
        return self.epoch


LoRARegistryActor = ray.remote(num_cpus=0, max_restarts=-1)(LoRARegistry)


def lora_registry_name(app_name: str) -> str:
    """The registry actor's name (and its saved state's key): keyed by the application
    alone, since every generation of it serves the same adapters."""
    return f"kvroute-loras:{app_name}"


def get_or_create_lora_registry(config: ClusterConfig) -> ray.actor.ActorHandle:
    """The application's registry, created on first use (detached, like the routers);
    one kept from an earlier deploy adopts this config's ``lora_modules``."""
    name = lora_registry_name(config.app_name)
    handle = LoRARegistryActor.options(
        name=name, namespace=ROUTER_NAMESPACE, lifetime="detached", get_if_exists=True
    ).remote(dict(config.engine.lora_modules), name)
    if config.engine.lora_modules:
        handle.adopt.remote(dict(config.engine.lora_modules))
    return handle


def kill_lora_registry(app_name: str) -> bool:
    """End the application's registry and delete its saved state (the application is
    going away); whether a registry was running."""
    name = lora_registry_name(app_name)
    try:
        actor = ray.get_actor(name, namespace=ROUTER_NAMESPACE)
    except ValueError:
        actor = None
    else:
        ray.kill(actor, no_restart=True)
    delete_state(name)
    return actor is not None


REGISTRY_CALL_TIMEOUT_S = 5.0  # a registry on a node that vanished stalls a replica no longer than this


async def _call(ref: Any) -> Any:
    return await asyncio.wait_for(ref, REGISTRY_CALL_TIMEOUT_S)


def _same(a: str | None, b: str | None) -> bool:
    """Two spellings of one folder (the engine keeps ``Path(path).expanduser()``)."""
    return a is not None and b is not None and Path(a).expanduser() == Path(b).expanduser()


class ReplicaAdapters:
    """One replica's engine in step with the registry (one caller: the replica's loop)."""

    def __init__(self, engine: "AsyncEngine", registry: Any, max_cpu_loras: int | None) -> None:
        self.engine, self.registry, self.max_cpu_loras = engine, registry, max_cpu_loras
        self.epoch: str | None = None
        self._last_used: dict[str, float] = {}
        self._loading: dict[str, asyncio.Future] = {}

    async def ensure(self, name: str) -> None:
        """Make ``name`` loaded here (ValueError when the registry does not list it)."""
        self._last_used[name] = time.monotonic()
        if name in await self.engine.list_loras():
            return
        path = await _call(self.registry.path.remote(name))
        if path is None:
            raise ValueError(f"unknown LoRA adapter {name!r} (not loaded in this application)")
        await self.load_lora(name, path)

    async def load_lora(self, name: str, path: str) -> None:
        """Load ``name`` from ``path`` unless already loaded from it (ValueError when the
        folder is bad or another folder holds the name); concurrent calls share one load."""
        pending = self._loading.get(name)
        if pending is not None:
            return await asyncio.shield(pending)
        future = self._loading[name] = asyncio.get_running_loop().create_future()
        try:
            known = (await self.engine.list_loras()).get(name)
            if known is None:
                await self._make_room()
                await self.engine.load_lora(name, path)
                self._last_used.setdefault(name, time.monotonic())
            elif not _same(known, path):
                raise ValueError(f"LoRA adapter {name!r} is already loaded (from {known}); unload it first")
            future.set_result(None)
        except BaseException as exc:
            future.set_exception(exc)
            future.exception()  # retrieved: nobody else may be waiting
            raise
        finally:
            del self._loading[name]

    async def _make_room(self) -> None:
        loaded = await self.engine.list_loras()
        if self.max_cpu_loras is None or len(loaded) < self.max_cpu_loras:
            return
        for victim in sorted(loaded, key=lambda n: self._last_used.get(n, 0.0)):
            try:
                await self.engine.unload_lora(victim)
                return
            except ValueError:  # in use: try the next
                continue
        raise ValueError(f"max_cpu_loras={self.max_cpu_loras} adapters are loaded and in use on this replica")

    async def sync(self) -> None:
        """Unload what the registry dropped; load what it lists while there is room."""
        epoch, modules = await _call(self.registry.snapshot.remote())
        if self.epoch is not None and epoch != self.epoch:  # the registry restarted: tell it what we hold
            epoch = await _call(self.registry.restore.remote(self.epoch, await self.engine.list_loras()))
            _, modules = await _call(self.registry.snapshot.remote())
        self.epoch = epoch
        for name, path in (await self.engine.list_loras()).items():
            if not _same(modules.get(name), path) and name not in self._loading:
                try:
                    await self.engine.unload_lora(name)
                except ValueError:  # in use: the next sync
                    pass
        for name, path in modules.items():
            loaded = await self.engine.list_loras()
            if name in loaded or (self.max_cpu_loras is not None and len(loaded) >= self.max_cpu_loras):
                continue
            try:
                await self.load_lora(name, path)
            except ValueError as exc:
                log.warning("LoRA adapter %r (%s) could not be loaded here: %s", name, path, exc)


class FleetAdapters:
    """The Serve application's adapter host: the registry's list, loads checked by one
    replica first, ``dynamic_path`` for adapters loaded on first use."""

    def __init__(self, registry: Any, client: "KVRouteClient", dynamic_path: str | None = None) -> None:
        self.registry, self.client = registry, client
        self.dynamic_path = dynamic_path
        self._modules: dict[str, str] = {}
        self._read_at = float("-inf")

    async def list_loras(self) -> dict[str, str]:
        _, self._modules = await self.registry.snapshot.remote()
        self._read_at = time.monotonic()
        return dict(self._modules)

    async def find_lora(self, name: str) -> bool:
        if name in self._modules and time.monotonic() - self._read_at < LORA_FRESH_S:
            return True
        if name in await self.list_loras():
            return True
        source = self._dynamic_source(name)
        if source is None:
            return False
        try:
            await self._load(name, source)
        except ValueError as exc:  # (Ray carries the replica's error as text: its message tells which)
            if NOT_FOUND in str(exc):  # not on the loading replica's node: a 404 (the node is in the log)
                log.warning("LoRA adapter %r: %s", name, exc)
                return False
            if "already loaded" in str(exc):  # that replica still holds an adapter of this name the
                return False  # registry dropped (unloaded; its next sync drops it): not served now
            raise  # there but bad: a 400 naming the file and field
        return True

    async def load_lora(self, name: str, path: str) -> None:
        known = await self.registry.path.remote(name)
        if known is not None:
            raise ValueError(f"LoRA adapter {name!r} is already loaded (from {known}); unload it first")
        await self._load(name, path)

    async def unload_lora(self, name: str) -> None:
        if not await self.registry.remove.remote(name):
            raise ValueError(f"unknown LoRA adapter {name!r}")
        self._modules.pop(name, None)

    async def _load(self, name: str, path: str) -> None:
        await self.client.load_lora(name, path)  # one replica reads and checks the folder
        await self.registry.add.remote(name, path)
        self._modules[name] = path

    def _dynamic_source(self, name: str) -> str | None:
        """``<dynamic_lora_loading_path>/<name>``, not checked here (the loading replica
        does); None for a name that is not one plain path component (it never leaves
        the path)."""
        if self.dynamic_path is None or name in ("", ".", "..") or "/" in name or "\\" in name or "\x00" in name:
            return None
        if is_uri(self.dynamic_path):
            return f"{self.dynamic_path.rstrip('/')}/{name}"
        return str(Path(self.dynamic_path).expanduser() / name)
