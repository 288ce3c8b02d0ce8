"""The data-path benchmark's small version: kvroute serve (HAProxy) and one external
router if installed, 10 req/s for 3 s each; the JSON's shape, every request answered,
CPU figures positive (no timing assertions)."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("aiohttp")
pytest.importorskip("ray")

from kvroute.benchmarks import cli  # noqa: E402
from kvroute.benchmarks.fleets import external_available  # noqa: E402


@pytest.mark.slow
def test_data_path_small_version(tmp_path):
    systems = ["kvroute_haproxy"] + [r for r in ("sglang_router", "vllm_router") if external_available(r)][:1]
    out = tmp_path / "data_path.json"
    rc = cli.main(["data_path", "--systems", ",".join(systems), "--rate", "10", "--seconds", "3", "--idle-seconds", "1",
                   "--concurrency", "8", "--out", str(out), "--log-dir", str(tmp_path / "logs")])  # fmt: skip
    result = json.loads(out.read_text())
    assert rc == 0, result
    assert result["machine"]["cpu_model"] and isinstance(result["machine"]["avx512"], list)
    assert "amx" in result["machine"] and out.with_suffix(".md").exists()
    assert [r["system"] for r in result["systems"]] == systems
    for row in result["systems"]:
        assert "error" not in row, row
        for loop in ("open_loop", "closed_loop"):
            phase = row[loop]
            assert phase["errors"] == 0 and phase["ok"] == phase["requests"] > 0, (row["system"], phase)
            assert phase["p50_ms"] > 0 and phase["p99_ms"] >= phase["p50_ms"]
            assert phase["routing_cpu_ms_per_request"] > 0, (row["system"], phase)
        assert row["open_loop"]["engine_cpu_ms_per_request"] > 0
        assert row["open_loop"]["mean_prompt_tokens"] > 600
        assert row["idle"]["routing_cores"] >= 0
    haproxy = result["systems"][0]
    assert "haproxy" in haproxy["processes"] and "EngineReplica" in haproxy["processes"]
    assert "EngineReplica" not in haproxy["open_loop"]["routing_cpu_ms_per_request_by_kind"]
