"""Moving a cached prefix between replicas through Ray: a source replica exports the KV of
a prefix's blocks (``replica/kv_transfer.py``) as one payload object, Ray's object store
carries it (a ``uint8`` array: the reader maps it without a copy), and the destination
imports it into its prefix cache, so a request routed there hits the prefix instead of
recomputing it.

``pull_prefix`` is the destination's side, whatever the handle: it awaits a fetch (an
actor's or a Serve replica's ``export_kv`` call) and imports the result, the whole pull
bounded by ``timeout_s``. Any failure ends it with a fallback, the reason the caller
must recompute: ``source_failed`` (the source died, raised or could not be reached),
``timeout``, ``not_cached`` (the source holds none of the prefix), ``refused`` (the
import refused the payload: another spec, model, dtype, block size, adapter, or a block
whose hash does not match its tokens) or ``no_room`` (nothing fitted). A fallback never
leaves wrong or partial KV: a refused payload is never written, and an import the deadline
cuts short is released unregistered once its copy ends (one whose copy had ended is
committed whole, correct KV the next request may hit). The source's blocks are released when its
export ends, whether or not anyone still waits for it. Counted in the destination's
transfer metrics: pulled blocks, tokens and bytes, pull seconds, fallbacks by reason.

The API a router's pricing needs (what a pull of N tokens costs here): the payload's
``nbytes`` (``num_blocks × block_bytes``), ``PullResult.seconds`` per pull and the
metrics' ``pull_bytes_per_s``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Awaitable, Callable, Sequence

if TYPE_CHECKING:  # torch stays out of the processes that only hold a handle
    from kvroute.replica.async_engine import AsyncEngine
    from kvroute.replica.kv_payload import KVPayload

log = logging.getLogger(__name__)

PULL_TIMEOUT_S = 10.0  # a pull's default bound: past it, recomputing is cheaper than waiting on


@dataclass(frozen=True)
class PullResult:
    """How a pull ended: ``blocks`` leading blocks of the prefix (``tokens`` tokens) are
    cached at the destination, ``nbytes`` crossed from the source, in ``seconds``; or a
    ``fallback`` naming why the caller recomputes (with ``detail``), nothing imported."""

    blocks: int
    tokens: int
    nbytes: int
    seconds: float
    fallback: str | None = None
    detail: str = ""

    @property
    def ok(self) -> bool:
        return self.fallback is None


def wall_scale(engine: AsyncEngine) -> float:
    """How much longer than real a transfer's bounds must be on ``engine``: an emulated
    engine's ``time_scale`` (it stretches its steps and its transfers alike), else 1."""
    config = engine.engine.config
    return config.time_scale if config.emulate is not None else 1.0


async def export_payload(
    engine: AsyncEngine, token_ids: Sequence[int] | None, cache_salt: str | None = None, lora_name: str | None = None,
    max_blocks: int | None = None, block_hashes: Sequence[int] | None = None,
) -> KVPayload:
    """A source's answer to a pull: the KV of the longest run of ``token_ids``'s full
    blocks it caches (or of the chain ``block_hashes``: the router's name for a hot
    prefix, whose salt and adapter then come from the cache), as a payload for the object store."""
    if block_hashes is not None:
        return await engine.export_blocks(block_hashes=list(block_hashes), max_blocks=max_blocks)
    return await engine.export_blocks(token_ids, cache_salt=cache_salt, lora_name=lora_name, max_blocks=max_blocks)


async def pull_prefix(
    engine: AsyncEngine, fetch: Callable[[], Awaitable[KVPayload]], timeout_s: float = PULL_TIMEOUT_S
) -> PullResult:
    """Fetch a source's payload and import it into ``engine``, within ``timeout_s``."""
    start = time.perf_counter()
    metrics = engine.engine.kv_transfer.metrics

    def fallback(why: str, detail: str = "") -> PullResult:
        metrics.on_fallback(why)
        log.info("KV pull fell back to recomputing (%s%s)", why, f": {detail}" if detail else "")
        return PullResult(0, 0, 0, time.perf_counter() - start, why, detail)

    deadline = start + timeout_s
    try:
        payload = await asyncio.wait_for(_awaited(fetch), timeout_s)
    except asyncio.TimeoutError:
        return fallback("timeout", f"no payload within {timeout_s:g}s")
    except Exception as exc:  # the source died, was unreachable or raised
        return fallback("source_failed", repr(exc))
    if payload is None or payload.num_blocks == 0:
        return fallback("not_cached")
    try:
        result = await asyncio.wait_for(engine.import_blocks(payload), max(0.0, deadline - time.perf_counter()))
    except asyncio.TimeoutError:
        return fallback("timeout", f"import unfinished within {timeout_s:g}s")
    except ValueError as exc:
        return fallback("refused", str(exc))
    if result.blocks == 0:
        return fallback("no_room")
    seconds = time.perf_counter() - start
    metrics.on_pull(result.blocks, result.tokens, payload.nbytes, seconds)
    return PullResult(result.blocks, result.tokens, payload.nbytes, seconds)


async def _awaited(fetch: Callable[[], Awaitable[Any]]) -> Any:
    return await fetch()
