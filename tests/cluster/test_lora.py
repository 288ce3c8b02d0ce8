"""The application's LoRA registry (``cluster/lora.py``: a real detached Ray actor on the
local cluster) and a replica's ``ReplicaAdapters`` around a real (emulated, torch-free)
engine: sync loads what the registry lists and unloads what it dropped (not while in use), a folder spelled
another way is the same adapter (no reload), a request's adapter loads on first use with
the least recently used idle one making room, a restarted registry reads its adapters
and epoch back from the GCS internal KV (and, where that state was lost, gets the
replicas' adapters back), and ending the application deletes that state."""

from __future__ import annotations

import asyncio
import json

import pytest

from kvroute.cluster.config import ClusterConfig
from kvroute.cluster.lora import (
    ReplicaAdapters, delete_state, get_or_create_lora_registry, load_state, lora_registry_name,
)
from kvroute.cluster.router_lookup import kill_router_actors
from kvroute.replica.async_engine import AsyncEngine
from kvroute.replica.engine import Engine
from kvroute.replica.sampling_params import SamplingParams
from tests.cluster.conftest import ray, tiny_engine, wait_until
from tests.conftest import restart_actor


def _folder(path, rank=8) -> str:
    path.mkdir()
    (path / "adapter_config.json").write_text(json.dumps({"r": rank, "lora_alpha": 16, "target_modules": ["q_proj"]}))
    return str(path)


@pytest.fixture
def setup(ray_cluster, tiny_llama_path, tmp_path):
    folders = {n: _folder(tmp_path / n) for n in ("a", "b", "c")}
    engine_config = tiny_engine(tiny_llama_path, emulate="gpu_h100_llama3_8b", enable_lora=True, max_loras=2,
                                max_cpu_loras=2, lora_modules={"a": folders["a"] + "/"})  # fmt: skip
    config = ClusterConfig(engine=engine_config, app_name="kvloras")
    registry = get_or_create_lora_registry(config)
    yield config, registry, AsyncEngine(Engine(engine_config)), folders
    kill_router_actors("kvloras")


def test_sync_follows_the_registry_and_keeps_an_adapter_in_use(setup):
    config, registry, engine, folders = setup
    adapters = ReplicaAdapters(engine, registry, config.engine.max_cpu_loras)

    async def scenario():
        first = engine.engine.lora.adapters["a"]
        assert ray.get(registry.add.remote("b", folders["b"]))
        await adapters.sync()
        await adapters.sync()
        assert list(await engine.list_loras()) == ["a", "b"]
        assert engine.engine.lora.adapters["a"] is first  # "<folder>/" and "<folder>" are one adapter: no reload
        stream = engine.generate([5, 6, 7, 8, 9], SamplingParams(max_tokens=64), lora_name="b")
        await stream.__anext__()  # b is in use now
        assert ray.get(registry.remove.remote("b"))
        await adapters.sync()
        assert "b" in await engine.list_loras()  # still running: kept until the next sync after it ends
        await stream.aclose()
        await adapters.sync()
        assert list(await engine.list_loras()) == ["a"]

    asyncio.run(scenario())


def test_first_use_loads_and_evicts_the_least_recently_used_idle_adapter(setup):
    config, registry, engine, folders = setup
    adapters = ReplicaAdapters(engine, registry, config.engine.max_cpu_loras)
    ray.get([registry.add.remote("b", folders["b"]), registry.add.remote("c", folders["c"])])

    async def scenario():
        await adapters.sync()  # room for two: a (from the config) and b
        assert list(await engine.list_loras()) == ["a", "b"]
        await adapters.ensure("b")
        await adapters.ensure("c")  # max_cpu_loras=2: a, used least recently, makes room
        assert sorted(await engine.list_loras()) == ["b", "c"]
        with pytest.raises(ValueError, match="unknown LoRA adapter 'zz'"):
            await adapters.ensure("zz")
        with pytest.raises(ValueError, match="already loaded"):
            await adapters.load_lora("b", folders["c"])

    asyncio.run(scenario())


def test_a_restarted_registry_reads_its_saved_state_back(setup):
    config, registry, _, folders = setup
    ray.get(registry.add.remote("b", folders["b"]))  # loaded at run time; no replica holds it
    before = ray.get(registry.snapshot.remote())
    assert load_state(lora_registry_name(config.app_name)) == before
    restart_actor(registry)
    assert ray.get(registry.snapshot.remote()) == before  # every adapter, the same epoch
    assert ray.get(registry.remove.remote("b"))
    restart_actor(registry)
    assert ray.get(registry.snapshot.remote()) == (before[0], {"a": folders["a"] + "/"})  # the removal stays
    kill_router_actors(config.app_name)  # the application ends: its registry's state goes too
    assert load_state(lora_registry_name(config.app_name)) is None
    fresh = get_or_create_lora_registry(config)
    epoch, modules = ray.get(fresh.snapshot.remote())
    assert epoch != before[0] and modules == {"a": folders["a"] + "/"}


def test_a_registry_that_lost_its_state_gets_the_replicas_adapters_back(setup):
    config, registry, engine, folders = setup
    adapters = ReplicaAdapters(engine, registry, config.engine.max_cpu_loras)
    ray.get(registry.add.remote("b", folders["b"]))

    async def scenario():
        await adapters.sync()
        assert delete_state(lora_registry_name(config.app_name))  # the store lost it (a GCS without persistence restarted)
        ray.kill(registry, no_restart=False)  # it comes back with the config's adapters only
        wait_until(lambda: _epoch(registry) not in (None, adapters.epoch), 30, "the registry to restart")
        await adapters.sync()
        assert list(await engine.list_loras()) == ["a", "b"]
        assert set(ray.get(registry.snapshot.remote())[1]) == {"a", "b"}

    asyncio.run(scenario())


def _epoch(registry):
    try:
        return ray.get(registry.snapshot.remote(), timeout=2)[0]
    except ray.exceptions.RayError:
        return None
