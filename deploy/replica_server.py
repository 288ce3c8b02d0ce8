"""The single-engine server (``kvroute serve-replica``): one in-process engine behind the
same OpenAI API, no Ray. Besides the OpenAI routes it answers the endpoints that other
routers probe their workers with (``/get_model_info``, ``/get_server_info``,
``/get_load`` for sglang-router; ``/load`` for vllm-router), so several of these
servers can stand behind such a router on the same engine settings as ours. With
``kv_events`` enabled it publishes its cache changes on vLLM's ZMQ KV event format
(``deploy/kv_event_publisher.py``), as a vLLM worker does. Its backend is
``EngineBackend`` (``deploy/backends/engine.py``).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

from fastapi import FastAPI

from kvroute.deploy.backends.engine import EngineBackend
from kvroute.deploy.kv_event_publisher import KVEventsConfig, ZmqKVEventPublisher, vllm_events
from kvroute.deploy.metrics import CONTENT_TYPE, render
from kvroute.deploy.openai.api import build_api, warn_if_open
from kvroute.deploy.openai.generation_defaults import GenerationDefaults
from kvroute.deploy.openai.serving import OpenAIServing, ServerLimits
from kvroute.deploy.openai.tools.serving import ToolServingConfig
from kvroute.replica.async_engine import AsyncEngine
from kvroute.replica.config import EngineConfig
from kvroute.replica.engine import Engine, EngineStats


def build_replica_server(
    config: EngineConfig, limits: ServerLimits = ServerLimits(), served_model_name: Optional[str] = None,
    kv_events: KVEventsConfig = KVEventsConfig(), tool_config: ToolServingConfig = ToolServingConfig(),
) -> tuple[FastAPI, AsyncEngine]:
    """The ASGI app of one engine, and the engine (loaded here, before serving).
    ``tool_config``: the chat template and tool-call parser (``--chat-template``, ...)."""
    engine = Engine(config)
    async_engine = AsyncEngine(engine)
    if kv_events.enabled:
        publisher = ZmqKVEventPublisher(kv_events)
        async_engine.add_event_listener(lambda events: publisher.publish(vllm_events(engine.kv, events)))
    # an emulated engine is named after its step profile (the model shape whose times it
    # takes), not after the checkpoint that only lends it a tokenizer (still an alias)
    name = served_model_name or (f"emulated-{config.emulate}" if config.emulate else config.model)
    serving = OpenAIServing(
        name,
        engine.tokenizer,
        engine.max_model_len,
        engine.arch.vocab_size,
        EngineBackend(async_engine, limits.request_timeout_s),
        limits,
        served_model_aliases=() if name == config.model else (config.model,),
        adapters=async_engine if config.enable_lora else None,
        tool_config=tool_config,
        generation_defaults=GenerationDefaults.load(engine.model_path, config.generation_config),
    )
    replica_id = config.replica_id

    async def metrics() -> tuple[bytes, str]:
        report = await async_engine.metrics_report()
        return render(name, {replica_id: report}), CONTENT_TYPE

    app = build_api(serving, metrics, lambda app: _probe_routes(app, async_engine, config, name))
    if kv_events.enabled:
        app.router.on_shutdown.append(publisher.close)
    return app, async_engine


def _probe_routes(app: FastAPI, async_engine: AsyncEngine, config: EngineConfig, name: str) -> None:
    """The endpoints sglang-router and vllm-router probe their workers with."""
    engine = async_engine.engine

    async def load() -> EngineStats:
        return await async_engine.between_steps(lambda: engine.stats(with_ref_counts=False))

    @app.get("/get_model_info")
    async def get_model_info() -> dict[str, Any]:
        return {"model_path": str(engine.model_path), "tokenizer_path": str(engine.model_path), "is_generation": True,
                "emulated_profile": config.emulate}  # fmt: skip

    @app.get("/get_server_info")
    async def get_server_info() -> dict[str, Any]:
        info = dataclasses.asdict(config)
        info.update(served_model_name=name, max_model_len=engine.max_model_len, num_kv_blocks=engine.kv.num_blocks)
        return info

    @app.get("/get_load")
    async def get_load() -> dict[str, Any]:
        stats = await load()
        return {
            "num_reqs": stats.num_running + stats.num_waiting,
            "num_running_reqs": stats.num_running,
            "num_waiting_reqs": stats.num_waiting,
            "num_tokens": stats.queued_prefill_tokens,
            "kv_cache_usage": stats.kv_usage,
        }

    @app.get("/load")
    async def server_load() -> dict[str, Any]:
        stats = await load()
        return {"server_load": stats.num_running + stats.num_waiting}


def serve_replica(config: EngineConfig, host: str, port: int, limits: ServerLimits, served_model_name: Optional[str] = None,
                  kv_events: KVEventsConfig = KVEventsConfig(),
                  tool_config: ToolServingConfig = ToolServingConfig()) -> None:  # fmt: skip
    """Load the engine and serve until interrupted (Ctrl-C stops cleanly)."""
    import uvicorn

    app, _ = build_replica_server(config, limits, served_model_name, kv_events, tool_config)
    warn_if_open(limits.api_key, host)
    uvicorn.run(app, host=host, port=port, log_level="warning", timeout_graceful_shutdown=5)
