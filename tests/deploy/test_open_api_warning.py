"""Secure by default, end to end: ``kvroute serve-replica`` serving ``/v1`` without an API
key on an address other machines reach says so at start (a WARNING on its log) and in
``/health`` (``"auth": "none"``), so an open server is never open silently."""

from __future__ import annotations

import time

ENGINE_ARGS = ["--block-size", "8", "--num-kv-blocks", "64", "--dtype", "float32"]


def test_serve_replica_on_every_interface_without_a_key_warns_and_health_says_so(tiny_llama_path):
    import httpx

    from tests.conftest import free_port
    from tests.deploy.server import start_cli, stop_cli

    port = free_port()
    proc, lines = start_cli(["serve-replica", "--model", str(tiny_llama_path), "--host", "0.0.0.0", "--port", str(port),
                             *ENGINE_ARGS], "serving")  # fmt: skip
    try:
        url = f"http://127.0.0.1:{port}"
        health = None
        for _ in range(300):  # the engine loads before uvicorn binds
            try:
                health = httpx.get(url + "/health")
                break
            except httpx.ConnectError:
                time.sleep(0.1)
        assert health is not None and health.status_code == 200
        assert health.json()["auth"] == "none"
    finally:
        output = stop_cli(proc, lines)
    warnings = [line for line in output.splitlines() if line.startswith("WARNING") and "WITHOUT an API key" in line]
    assert len(warnings) == 1 and "0.0.0.0" in warnings[0], output
