"""The KV a replica reports free (``LoadFigures.kv_usage``) leaves out the cached blocks
its waiting requests will hit: a pulled prefix from its import until its request is
admitted, a finished request's prefix a queued one continues; each block counted once
however many queued requests share it, and nothing once they have run."""

from __future__ import annotations

import random

import pytest

from kvroute.replica.config import EngineConfig
from kvroute.replica.engine import Engine
from kvroute.replica.kv_cache_manager import KVCacheManager
from kvroute.replica.scheduler import Scheduler, SchedulerConfig
from kvroute.replica.telemetry import ReplicaTelemetry
from tests.replica.helpers import greedy
from tests.replica.test_scheduler import make_req, run_step

BS = 16
BLOCKS = 48


@pytest.fixture(scope="module")
def prompt() -> list[int]:
    rng = random.Random(7)
    return [rng.randrange(100, 40_000) for _ in range(200)]  # 12 full blocks + 8 tokens


def _emulated(path) -> Engine:
    return Engine(EngineConfig(model=str(path), block_size=BS, num_kv_blocks=BLOCKS,
                               emulate="gpu_h100_llama3_8b", time_scale=0.01))  # fmt: skip


def _free(engine: Engine) -> int:
    """The free blocks the engine reports, as a router reads them."""
    return round((1.0 - engine.load().kv_usage) * BLOCKS)


def test_a_pulled_prefix_is_not_free_until_its_request_runs_and_frees_after_it(tiny_llama_path, prompt):
    src, dst = _emulated(tiny_llama_path), _emulated(tiny_llama_path)
    src.add_request("r", prompt, greedy(1))
    while src.has_unfinished():
        src.step()
    assert dst.import_blocks(src.export_blocks(prompt)).imported == 12
    assert _free(dst) == BLOCKS  # cached, and no request will take them: evictable for anything
    dst.add_request("s", prompt, greedy(2))
    assert dst.kv.pool.num_free_blocks == BLOCKS and _free(dst) == BLOCKS - 12  # its admission takes them
    dst.step()  # admitted: it holds the 12 and a block for the rest
    assert _free(dst) == dst.kv.pool.num_free_blocks == BLOCKS - 13
    while dst.has_unfinished():
        dst.step()
    assert _free(dst) == dst.kv.pool.num_free_blocks == BLOCKS  # all free again, the prefix still cached
    assert dst.load().queued_prefill_tokens == 0


def test_queued_requests_sharing_a_pulled_prefix_count_it_once(tiny_llama_path, prompt):
    src, dst = _emulated(tiny_llama_path), _emulated(tiny_llama_path)
    src.add_request("r", prompt, greedy(1))
    while src.has_unfinished():
        src.step()
    dst.import_blocks(src.export_blocks(prompt))
    dst.add_request("s", prompt, greedy(1))
    dst.add_request("t", prompt[:160] + [5, 6, 7], greedy(1))  # the first 10 of the 12 blocks
    assert _free(dst) == BLOCKS - 12


def test_waiting_hits_on_a_finished_requests_prefix_are_counted_once_and_not_once_held():
    kv = KVCacheManager(32, 4)
    sched = Scheduler(SchedulerConfig(1000, 1), kv)  # one running request at a time
    tel = ReplicaTelemetry("x", sched, kv)
    a = make_req(range(33))  # 8 full blocks + 1 token
    sched.add(a)
    run_step(sched)
    sched.finish(a, "stop")
    assert kv.pool.num_free_blocks == 32 and tel.load().kv_usage == 0.0
    b = make_req(list(range(24)) + [900])  # 6 of a's blocks
    c = make_req(list(range(32)) + [901, 902])  # all 8
    d = make_req(range(500, 509))  # nothing cached
    for r in (b, c, d):
        sched.add(r)
    assert tel.load().kv_usage == 8 / 32  # b's 6 and c's 8 are 8 blocks; d hits none
    assert sched.queued() == (sched.queued_spans(), 8)
    run_step(sched)  # b runs (holds 6 + 1), c and d wait: c still hits 2 free cached blocks
    assert kv.pool.num_free_blocks == 25 and tel.load().kv_usage == (7 + 2) / 32
