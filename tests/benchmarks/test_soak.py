"""How the soak benchmark starts and stops a `kvroute serve` of its own (without ``--url``):
the command it runs is one `kvroute serve` accepts, with the soak's settings, and Ctrl-C
stops it. Its run against a live `kvroute serve` (the invariants: every kind sent, no
unexpected status, counts that add up, the hostile bodies' 4xx, the service idle
afterwards, RSS figures for every process) is in tests/deploy/test_chaos.py, on the
one service that module starts."""

from __future__ import annotations

import signal

import pytest

pytest.importorskip("httpx")

from kvroute.benchmarks import soak  # noqa: E402
from kvroute.benchmarks.cli import parser_for  # noqa: E402
from kvroute.deploy.cli import build_parser  # noqa: E402


class FakeServe:
    """Stands in for the `kvroute serve` process: prints its ready line, records signals."""

    def __init__(self, cmd: list[str], **kwargs) -> None:
        self.cmd, self.kwargs, self.signals = cmd, kwargs, []
        self.stdout = iter(["kvroute: starting a local Ray cluster\n", "kvroute: ready at http://127.0.0.1\n"])

    def send_signal(self, sig: int) -> None:
        self.signals.append(sig)

    def wait(self, timeout: float | None = None) -> int:
        return 0

    def kill(self) -> None:
        raise AssertionError("killed: the service was never ready, or would not stop")


def test_the_soak_starts_kvroute_serve_with_its_settings_and_stops_it_with_ctrl_c(monkeypatch):
    started: list[FakeServe] = []
    monkeypatch.setattr(soak.subprocess, "Popen", lambda cmd, **kw: started.append(FakeServe(cmd, **kw)) or started[-1])
    args = parser_for("soak", soak).parse_args([
        "--minutes", "0.1", "--model", "/models/tiny", "--replicas", "2", "--port", "18123", "--dtype", "float32",
        "--block-size", "8", "--num-kv-blocks", "256", "--max-model-len", "512", "--max-body-bytes", "65536",
    ])  # fmt: skip
    proc, url = soak.start_service(args)
    assert url == "http://127.0.0.1:18123" and proc is started[0]
    assert proc.cmd[0].endswith("kvroute") and proc.cmd[1] == "serve"
    assert proc.kwargs["env"]["HF_HUB_OFFLINE"] == "1"
    serve = build_parser().parse_args(proc.cmd[1:])  # flags `kvroute serve` knows, with the soak's values
    assert (serve.model, serve.replicas, serve.port, serve.max_body_bytes) == ("/models/tiny", 2, 18123, 65536)
    assert (serve.dtype, serve.block_size, serve.num_kv_blocks, serve.max_model_len) == ("float32", 8, 256, 512)
    soak.stop_service(proc)
    assert proc.signals == [signal.SIGINT]
