"""The engine request value a backend runs, and a choice backend over a real engine: the
fan-out hands ``generate`` one frozen ``EngineRequest`` per choice, and every choice of a
multi-prompt, ``n > 1`` request answers as its prompt run alone does."""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path

import pytest

from kvroute.deploy.backends.engine import EngineBackend
from kvroute.deploy.openai.fanout import Choice, EngineRequest, collect, run_choices
from kvroute.deploy.openai.protocol import PreparedRequest
from kvroute.replica.async_engine import AsyncEngine
from kvroute.replica.config import EngineConfig
from kvroute.replica.sampling_params import SamplingParams
from kvroute.router.types import RouteOutcome

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
SEEDED = SamplingParams(temperature=1.0, max_tokens=6, ignore_eos=True, seed=7)


@pytest.fixture(scope="module")
def backend(tiny_llama_path: Path) -> EngineBackend:
    engine = AsyncEngine.from_config(EngineConfig(model=str(tiny_llama_path), block_size=8, num_kv_blocks=128,
                                                  dtype="float32"))  # fmt: skip
    return EngineBackend(engine, timeout_s=60.0)


def _prepared(prompts: list[list[int]], params: list[SamplingParams]) -> PreparedRequest:
    return PreparedRequest(chat=False, request_id="cmpl-t", model="m", prompts=prompts, params=params, lora_name=None,
                           cache_salt="tenant", stream=False, include_usage=False, logprobs=None,
                           echo=[""] * len(prompts), body=b"{}")  # fmt: skip


def test_engine_request_is_a_frozen_value():
    seen: list[RouteOutcome] = []
    req = EngineRequest((1, 2, 3), GREEDY, "r-0", cache_salt="s", lora_name=None, on_route=seen.append)
    with pytest.raises(dataclasses.FrozenInstanceError):
        req.request_id = "other"  # type: ignore[misc]
    with pytest.raises(AttributeError):  # slots: no field can be added either
        object.__setattr__(req, "extra", 1)
    assert dataclasses.replace(req, request_id="r-1").token_ids == (1, 2, 3) and req.request_id == "r-0"
    assert EngineRequest((1,), GREEDY, "r-2").on_route(RouteOutcome("x")) is None  # the default drops it


def test_choices_of_two_prompts_equal_each_prompt_run_alone(backend: EngineBackend):
    tok = backend.engine.engine.tokenizer
    prompts = [tok.encode("The capital of France is"), tok.encode("One, two, three,")]
    finished: list[Choice] = []

    async def run() -> tuple[list[Choice], list[list[int]]]:
        fanned = await collect(run_choices(backend.generate, _prepared(prompts, [GREEDY, SEEDED]), finished.append), 60.0)
        alone = []
        for p, prompt in enumerate(prompts):
            for i, params in enumerate([GREEDY, SEEDED]):
                req = EngineRequest(tuple(prompt), params, f"alone-{p}-{i}", cache_salt="tenant")
                alone.append([t async for d in backend.generate(req) for t in d.token_ids])
        return fanned, alone

    fanned, alone = asyncio.run(run())
    assert [(c.index, c.prompt_index) for c in fanned] == [(0, 0), (1, 0), (2, 1), (3, 1)]
    assert [c.token_ids for c in fanned] == alone
    assert all(len(ids) == 6 for ids in alone)
    assert sorted(c.index for c in finished) == [0, 1, 2, 3]
    assert {c.outcome.served_by for c in fanned} == {backend.engine.replica_id}  # on_route reached every choice
    assert all(c.num_prompt_tokens == len(prompts[c.prompt_index]) for c in fanned)
