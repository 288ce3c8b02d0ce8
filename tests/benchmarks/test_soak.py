"""The soak benchmark's invariants on a short run against `kvroute serve` (not its speed):
every kind sent, no unexpected status, counts that add up, the hostile bodies' 4xx, the
service idle afterwards, and RSS figures for every process."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("ray")
pytest.importorskip("httpx")

from kvroute.benchmarks.cli import main as bench  # noqa: E402
from kvroute.benchmarks import soak  # noqa: E402


def test_short_soak_against_kvroute_serve(tiny_llama_path, tmp_path, capsys):
    out = tmp_path / "soak.json"
    rc = bench([
        "soak", "--minutes", "0.1", "--model", str(tiny_llama_path), "--replicas", "2", "--dtype", "float32",
        "--block-size", "8", "--num-kv-blocks", "256", "--max-model-len", "512", "--concurrency", "3",
        "--max-tokens", "8", "--out", str(out),
    ])
    result = json.loads(out.read_text())
    assert rc == 0, result["unexpected_examples"]
    assert result["unexpected"] == 0 and result["idle"]["ok"]
    assert set(result["by_kind"]) == set(soak._kinds(8, 65536))  # every kind was sent
    assert sum(result["by_status"].values()) == result["requests"] == sum(result["by_kind"].values())
    assert sum(w["requests"] for w in result["windows"]) == result["requests"]
    assert result["by_status"].get("413", 0) == result["by_kind"]["over_limit"]
    hostile_400 = sum(result["by_kind"][k] for k in ("surrogate", "bad_json", "wrong_type", "oov_ids"))
    assert result["by_status"].get("400", 0) == hostile_400
    roles = {k.split(":")[0] for k in result["windows"][-1]["rss_mib"]}
    assert roles == {"replica", "router", "http"} and len(result["windows"][-1]["kv_usage"]) == 2
    assert set(result["rss_growth_mib"]) == set(result["windows"][0]["rss_mib"])
    assert result["ttft_p99_s"] is not None
    assert "soak: 0.1 min" in capsys.readouterr().out
