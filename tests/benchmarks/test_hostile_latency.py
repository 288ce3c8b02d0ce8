"""The hostile-spec latency benchmark's small version: against a single-engine server on
the tiny model (a short compile limit), every hostile kind is answered without a 5xx
and the plain requests are timed in both phases."""

from __future__ import annotations

import asyncio

import pytest

pytest.importorskip("httpx")

from kvroute.benchmarks.hostile_latency import hostile_body, measure  # noqa: E402
from kvroute.deploy.replica_server import build_replica_server  # noqa: E402
from kvroute.deploy.openai.serving import ServerLimits  # noqa: E402
from kvroute.deploy.openai.tools.serving import ToolServingConfig  # noqa: E402
from kvroute.replica.config import EngineConfig  # noqa: E402
from tests.deploy.server import running  # noqa: E402


def test_hostile_specs_answer_4xx_and_the_plain_requests_are_timed(tiny_llama_path):
    config = EngineConfig(model=str(tiny_llama_path), block_size=8, num_kv_blocks=128, max_model_len=512, dtype="float32")
    tools = ToolServingConfig.from_flags("chatml_tools")
    app, _ = build_replica_server(config, ServerLimits(structured_output_timeout_s=0.5), "smollm2-135m-instruct",
                                  tool_config=tools)  # fmt: skip
    assert len({str(hostile_body(i)) for i in range(8)}) == 8  # every spec new: no compile cache hit
    with running(app) as url:
        result = asyncio.run(measure(url, 2, 2))
    assert len(result["idle_s"]) == len(result["loaded_s"]) == 2 and min(result["loaded_s"]) > 0
    assert result["hostile_5xx"] == 0 and sum(result["hostile_by_status"].values()) >= 2, result
    assert set(result["hostile_by_status"]) <= {"200", "400"}, result
