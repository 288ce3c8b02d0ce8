"""``offline --loras``: runs end to end on the tiny Llama and writes its JSON."""

from __future__ import annotations

import json
from pathlib import Path

from kvroute.benchmarks.cli import main as bench


def test_offline_loras_writes_json(tiny_llama_path: Path, tmp_path: Path, capsys):
    out = tmp_path / "loras.json"
    bench(["offline", "--model", str(tiny_llama_path), "--loras", "0", "2", "--num-requests", "6", "--min-input", "8",
                  "--max-input", "24", "--output-len", "4", "--lora-rank", "4", "--kv-cache-gb", "0.02", "--out", str(out)])  # fmt: skip
    result = json.loads(out.read_text())
    assert set(result["loras"]) == {"0", "2"} and result["base"]["output_tokens_per_s"] > 0
    assert result["loras"]["2"]["max_batch_size"] == 6  # both adapters and every request in one step
    assert "2 adapters" in capsys.readouterr().out
