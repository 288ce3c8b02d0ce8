"""AsyncEngine: streaming over asyncio, cancellation, validation, events.

Plain tests that drive their coroutines with ``asyncio.run`` (no pytest-asyncio), each
run on a fresh event loop over the same module-scoped engine.
"""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path

import pytest

from kvroute.replica.async_engine import AsyncEngine
from kvroute.replica.config import EngineConfig
from kvroute.replica.kv_events import KVEvents
from kvroute.replica.llm import LLM
from kvroute.replica.outputs import TokenDelta
from kvroute.replica.sampling_params import SamplingParams
from tests.replica.helpers import TEXTS, assert_no_leak

KW = dict(block_size=8, num_kv_blocks=128, dtype="float32")
LONG = SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True)


@pytest.fixture(scope="module")
def aengine(tiny_llama_path: Path) -> AsyncEngine:
    return AsyncEngine.from_config(EngineConfig(model=str(tiny_llama_path), **KW))


@pytest.fixture(scope="module")
def prompts(aengine: AsyncEngine) -> list[list[int]]:
    return [aengine.engine.tokenizer.encode(t) for t in TEXTS]


async def _collect(agen) -> list[TokenDelta]:
    return [d async for d in agen]


async def _wait_idle(ae: AsyncEngine, timeout: float = 10.0) -> None:
    """Let the step loop run until the engine holds no request."""
    deadline = time.monotonic() + timeout
    while ae.engine.has_unfinished() or ae._to_add or ae._to_abort:
        assert time.monotonic() < deadline, "engine did not go idle"
        await asyncio.sleep(0.01)


def test_concurrent_generate_matches_offline(aengine, prompts, tiny_llama_path):
    params = [SamplingParams(temperature=0.0, max_tokens=12 + i) for i in range(len(prompts))]
    params[2] = SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_tokens=10)  # seeded: batch-independent

    async def main():
        return await asyncio.gather(*(_collect(aengine.generate(p, sp)) for p, sp in zip(prompts, params)))

    streams = asyncio.run(main())
    offline = LLM(str(tiny_llama_path), **KW).generate(prompts, params, use_tqdm=False)
    for deltas, want, prompt in zip(streams, offline, prompts):
        assert all(len(d.token_ids) == 1 for d in deltas)
        assert [d.finish_reason for d in deltas[:-1]] == [None] * (len(deltas) - 1)
        assert [t for d in deltas for t in d.token_ids] == want.token_ids
        assert "".join(d.text for d in deltas) == want.text
        assert deltas[-1].finish_reason == want.finish_reason == "length"
        assert {d.num_prompt_tokens for d in deltas} == {len(prompt)}
    assert_no_leak(aengine)


def test_event_loop_stays_responsive_during_steps(aengine, prompts, monkeypatch):
    # Stretch every step by 100 ms (as a big model's forward pass would): if steps ran
    # on the event loop's thread, no tick could ever happen while a step is in flight.
    step = aengine.engine.step
    in_step = threading.Event()
    steps = []

    def slow_step():
        in_step.set()
        try:
            time.sleep(0.1)
            steps.append(1)
            return step()
        finally:
            in_step.clear()

    monkeypatch.setattr(aengine.engine, "step", slow_step)
    ticks_during_steps = []

    async def main():
        done = asyncio.Event()

        async def ticker():
            while not done.is_set():
                await asyncio.sleep(0.01)
                if in_step.is_set():
                    ticks_during_steps.append(1)

        tick = asyncio.create_task(ticker())
        params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
        await asyncio.gather(*(_collect(aengine.generate(p + [i], params)) for i, p in enumerate(prompts)))
        done.set()
        await tick

    asyncio.run(main())
    assert len(steps) >= 8
    # Each step sleeps 100 ms with the loop free: expect ~10 ticks per step; ask for one.
    assert len(ticks_during_steps) >= len(steps), (len(ticks_during_steps), len(steps))
    assert_no_leak(aengine)


def test_bad_input_raises_at_first_anext_and_queues_nothing(aengine, prompts):
    async def main():
        with pytest.raises(ValueError, match=r"prompt must not be empty"):
            await aengine.generate([], LONG).__anext__()
        with pytest.raises(ValueError, match=r"prompt token ids must be in \[0, 49152\); got \[49152\]"):
            await aengine.generate(prompts[0] + [49152], LONG).__anext__()
        with pytest.raises(ValueError, match=r"needs 129 KV blocks but the cache has only num_kv_blocks=128"):
            await aengine.generate(list(range(100, 1100)), SamplingParams(max_tokens=26)).__anext__()
        assert aengine._to_add == [] and aengine._queues == {}
        assert not aengine.engine.has_unfinished()
        # A duplicate of a live request id is rejected; the live one is untouched.
        live = aengine.generate(prompts[0], SamplingParams(temperature=0.0, max_tokens=4), request_id="dup")
        first = await live.__anext__()
        with pytest.raises(ValueError, match=r"request_id 'dup' is already in use"):
            await aengine.generate(prompts[1], LONG, request_id="dup").__anext__()
        rest = await _collect(live)
        return [first] + rest

    deltas = asyncio.run(main())
    assert len(deltas) == 4 and deltas[-1].finish_reason == "length"
    assert_no_leak(aengine)


def test_breaking_out_of_the_stream_aborts_the_request(aengine, prompts):
    steps: list[int] = []
    aengine.add_event_listener(lambda ev: steps.append(ev.seq))

    async def main():
        got = 0
        async for delta in aengine.generate(prompts[1], LONG, request_id="quitter"):
            got += 1
            if got == 3:
                break
        await _wait_idle(aengine)
        return got

    try:
        assert asyncio.run(main()) == 3
    finally:
        aengine._event_listeners.clear()
    assert "quitter" not in aengine.engine.requests
    assert len(steps) < 10  # aborted, not run to its 60 tokens
    assert_no_leak(aengine)


def test_cancelling_the_consumer_task_aborts_the_request(aengine, prompts):
    async def main():
        started = asyncio.Event()
        got: list[TokenDelta] = []

        async def consume():
            async for delta in aengine.generate(prompts[3], LONG, request_id="cancelled"):
                got.append(delta)
                started.set()

        task = asyncio.create_task(consume())
        await started.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await _wait_idle(aengine)
        return got

    got = asyncio.run(main())
    assert 1 <= len(got) < 60 and got[-1].finish_reason is None
    assert "cancelled" not in aengine.engine.requests
    assert_no_leak(aengine)


def test_abort_ends_the_stream_with_an_abort_delta(aengine, prompts):
    async def main():
        agen = aengine.generate(prompts[4], LONG, request_id="to-abort")
        first = await agen.__anext__()
        await aengine.abort("to-abort")
        rest = await asyncio.wait_for(_collect(agen), timeout=10)
        return [first] + rest

    deltas = asyncio.run(main())
    last = deltas[-1]
    assert (last.finish_reason, last.token_ids, last.text) == ("abort", [], "")
    assert last.num_prompt_tokens == len(prompts[4])
    assert len(deltas) < 60
    assert_no_leak(aengine)


def test_event_listeners_get_kv_events_in_sequence(aengine, prompts):
    events: list[KVEvents] = []
    aengine.add_event_listener(events.append)

    async def main():
        fresh = [[40000 + 7 * i + j for j in range(20)] for i in range(3)]  # nothing cached yet
        await asyncio.gather(*(_collect(aengine.generate(p, SamplingParams(temperature=0.0, max_tokens=5)))
                               for p in fresh))
        await asyncio.sleep(0.05)
        # The step loop is idle and healthy (waiting for work on this loop), not crashed.
        return not aengine._loop_task.done()

    try:
        alive = asyncio.run(main())
    finally:
        aengine._event_listeners.clear()
    assert len(events) >= 5
    seqs = [e.seq for e in events]
    assert seqs == list(range(seqs[0], seqs[0] + len(seqs)))
    assert {e.replica_id for e in events} == {"replica-0"}
    assert sum(len(e.stored) for e in events) >= 3 * 2  # each prompt fills 2 blocks of 8
    assert aengine.last_events is events[-1]
    assert events[-1].load is not None and events[-1].load.num_running == 0
    assert alive
    assert_no_leak(aengine)
