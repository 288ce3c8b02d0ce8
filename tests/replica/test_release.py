"""The load report's KV release: when the running request nearest its ``max_tokens``
ends, and the blocks that frees net of what the other running requests allocate as
they decode until then (what a request short of free blocks there waits for)."""

import pytest

from kvroute.replica.block_hash import HashSpec
from kvroute.replica.kv_cache_manager import KVCacheManager
from kvroute.replica.outputs import RequestId
from kvroute.replica.request import Request
from kvroute.replica.sampling_params import SamplingParams
from kvroute.replica.scheduler import Scheduler, SchedulerConfig
from kvroute.replica.telemetry import ReplicaTelemetry

BS = 16


def _req(rid: str, tokens: list[int], max_tokens: int) -> Request:
    return Request(RequestId(rid), tokens, SamplingParams(max_tokens=max_tokens), HashSpec(BS))


def _step(sched: Scheduler) -> None:
    out = sched.schedule()
    sched.update_after_step(out)
    for row in out.rows:
        if row.samples:
            row.request.append_token(7)


def _fleet(long_suffix: int) -> tuple[Scheduler, ReplicaTelemetry, Request, Request]:
    kv = KVCacheManager(256, BS, True)
    sched = Scheduler(SchedulerConfig(4096, 16), kv)
    telemetry = ReplicaTelemetry("r", sched, kv)
    prefix = list(range(64))  # 4 shared blocks
    short = _req("short", prefix + list(range(1000, 1064)), max_tokens=6)
    long = _req("long", prefix + list(range(2000, 2000 + long_suffix)), max_tokens=100)
    sched.add(short)
    sched.add(long)
    for _ in range(3):
        _step(sched)
    return sched, telemetry, short, long


def test_nothing_running_or_no_step_measured_releases_nothing():
    sched, telemetry, _, _ = _fleet(40)
    assert (telemetry.load().release_s, telemetry.load().release_blocks) == (0.0, 0)  # no decode step timed yet
    kv = KVCacheManager(64, BS, True)
    idle = ReplicaTelemetry("idle", Scheduler(SchedulerConfig(4096, 16), kv), kv)
    idle.decode_step_s = 0.01
    assert (idle.load().release_s, idle.load().release_blocks) == (0.0, 0)


@pytest.mark.parametrize(("long_suffix", "growth"), [(40, 0), (44, 1)])
def test_the_soonest_end_frees_its_own_blocks_less_the_others_growth(long_suffix, growth):
    """``short`` (3 answer tokens left of 6) ends first; it frees its 5 unshared blocks
    (the 4 prefix blocks stay with ``long``), less the blocks ``long`` takes as its
    answer grows over those 3 steps: none while its last block has room (107 + 3 tokens
    in 7 blocks), one when it crosses a block boundary (111 + 3)."""
    sched, telemetry, short, long = _fleet(long_suffix)
    telemetry.decode_step_s = 0.01
    left = short.params.max_tokens - short.num_output_tokens
    assert left > 0 and short in sched.running and long in sched.running
    load = telemetry.load()
    assert load.release_s == pytest.approx(left * 0.01)
    own = len(sched.kv.req_blocks[short.request_id]) - 4
    assert left == 3 and own == 5 and load.release_blocks == own - growth
