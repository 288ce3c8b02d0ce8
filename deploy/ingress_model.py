"""What every HTTP ingress of the Serve application loads where it starts: the model's
tokenizer, context length, vocabulary size and sampling defaults (no weights), and the
address Serve's proxies listen on (for the open-API warning). The composed path's
ingress (``deploy/app.py``), the direct path's engine replicas (``deploy/direct_app.py``)
and its ingress request router (``deploy/direct_router.py``) share them."""

from __future__ import annotations

import asyncio
from typing import Any, Optional

from kvroute.cluster.config import ClusterConfig
from kvroute.deploy.openai.generation_defaults import GenerationDefaults


async def load_model_info(config: ClusterConfig) -> tuple[Any, int, int, GenerationDefaults]:
    """An ingress's view of the model: its tokenizer, context length, vocabulary size and
    sampling defaults (its generation_config.json, unless ``generation_config`` says otherwise)."""
    from kvroute.replica.checkpoint import load_hf_config, load_tokenizer, resolve_model
    from kvroute.replica.models.arch import ModelArch

    path = await asyncio.to_thread(resolve_model, config.engine.model, False)  # config and tokenizer: no weights here
    light = config.engine.emulate is not None
    tokenizer = await asyncio.to_thread(load_tokenizer, path, light)
    arch = ModelArch.from_hf_config(load_hf_config(path, light))
    defaults = GenerationDefaults.load(path, config.engine.generation_config)
    return tokenizer, config.engine.context_length(arch.max_position_embeddings), arch.vocab_size, defaults


def serve_http_host() -> Optional[str]:
    """The address Serve's proxies listen on (None where it cannot be read: Serve keeps it
    in its controller, behind a client that is not public API)."""
    try:
        from ray.serve.context import _get_global_client

        return _get_global_client().http_config.host
    except Exception:  # noqa: BLE001 - only the warning's wording depends on it
        return None
