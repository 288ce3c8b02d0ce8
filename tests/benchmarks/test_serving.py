"""The serving load generator against a real single-engine server (tiny model, loopback):
counts add up, the JSON carries every ``vllm bench serve`` key, percentiles are
monotone, the plot is a PNG; plus the pure parts (arrivals, best hit rate, payloads)."""

from __future__ import annotations

import asyncio
import json
import math

import pytest

httpx = pytest.importorskip("httpx")

from kvroute.benchmarks.cli import main as bench  # noqa: E402
from kvroute.benchmarks import serving  # noqa: E402
from kvroute.benchmarks import workloads as wl  # noqa: E402
from kvroute.deploy.replica_server import build_replica_server  # noqa: E402
from kvroute.deploy.openai.serving import ServerLimits  # noqa: E402
from kvroute.replica.config import EngineConfig  # noqa: E402
from tests.deploy.server import running  # noqa: E402

MODEL = "tiny-bench"
BLOCK = 8
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"

VLLM_KEYS = ["duration", "completed", "failed", "request_throughput", "output_throughput", "total_token_throughput"] + [
    f"{stat}_{m}_ms" for m in ("ttft", "tpot", "itl", "e2el") for stat in ("mean", "median", "p90", "p99")
]


@pytest.fixture(scope="module")
def server(tiny_llama_path):
    config = EngineConfig(model=str(tiny_llama_path), block_size=BLOCK, num_kv_blocks=512, max_model_len=1024, dtype="float32")
    app, engine = build_replica_server(config, ServerLimits(), MODEL)
    with running(app) as url:
        yield url


def test_cli_run_against_a_local_server(server, tmp_path, capsys):
    out = tmp_path / "gsp.json"
    rc = bench([
        "serving", "--base-url", server, "--dataset-name", "generated-shared-prefix",
        "--gsp-num-groups", "3", "--gsp-prompts-per-group", "4", "--gsp-system-prompt-len", "64",
        "--gsp-question-len", "8", "--gsp-output-len", "6", "--request-rate", "20", "--max-concurrency", "4",
        "--block-size", str(BLOCK), "--result-file", str(out), "--plot", "--disable-tqdm",
    ])
    assert rc == 0
    printed = capsys.readouterr().out
    assert "Serving Benchmark Result" in printed and "serving[generated-shared-prefix]:" in printed
    r = json.loads(out.read_text())
    for key in VLLM_KEYS + ["prefix_cache_hit_rate", "best_prefix_cache_hit_rate", "ttfts", "itls", "errors"]:
        assert key in r, key
    n = 12
    assert r["completed"] + r["failed"] == n == r["num_prompts"] == len(r["ttfts"])
    assert r["failed"] == 0 and not any(r["errors"])
    assert r["model"] == MODEL  # discovered from /v1/models
    assert r["output_lens"] == [6] * n and r["total_output_tokens"] == 6 * n
    assert r["input_lens"] == [72] * n and r["total_input_tokens"] == 72 * n
    # every token after the first arrives as one chunk: ITLs per request = output - 1
    assert [len(x) for x in r["itls"]] == [5] * n
    for m in ("ttft", "tpot", "itl", "e2el"):
        assert 0 < r[f"median_{m}_ms"] <= r[f"p90_{m}_ms"] <= r[f"p99_{m}_ms"], m
    assert r["median_ttft_ms"] <= r["median_e2el_ms"]
    assert math.isclose(r["request_throughput"], n / r["duration"])
    assert math.isclose(r["total_token_throughput"], (72 * n + 6 * n) / r["duration"])
    # one server: later requests of a group hit the system prompt, up to the best possible
    assert sum(c for c in r["cached_lens"]) == r["total_cached_tokens"] > 0
    assert 0 < r["prefix_cache_hit_rate"] <= r["best_prefix_cache_hit_rate"] == pytest.approx(9 * 64 / (12 * 72))
    png = out.with_suffix(".ttft_cdf.png").read_bytes()
    assert png.startswith(PNG_MAGIC) and len(png) > 1000


def test_multi_turn_over_chat_sends_history_and_waits_for_the_previous_turn(server, smollm2_tokenizer):
    w = wl.multi_turn(num_conversations=2, num_turns_min=4, num_turns_max=4, common_prefix_len=16, prefix_len_mean=24,
                      prefix_len_max=40, user_len_min=8, user_len_max=8, output_len_min=3, output_len_max=3)
    config = serving.LoadConfig(endpoint="/v1/chat/completions", prompt_format="text", request_rate=50, progress=False, block_size=BLOCK)
    decode = lambda ids: smollm2_tokenizer.decode(list(ids))  # noqa: E731
    by_id = {r.request_id: r for r in w.requests}
    msgs = serving.build_payload(w.requests[1], MODEL, config, by_id, decode)["messages"]
    assert [m["role"] for m in msgs] == ["user", "assistant", "user"]
    result = asyncio.run(serving.benchmark(server, w, config, MODEL, decode))
    assert (result["completed"], result["failed"]) == (4, 0)
    starts = dict(zip(result["request_ids"], result["start_times"]))
    ends = {rid: s + e for rid, s, e in zip(result["request_ids"], result["start_times"], result["e2els"])}
    for r in w.requests:
        if r.after:
            assert starts[r.request_id] >= ends[r.after] - 1e-3  # closed loop
    assert result["output_lens"] == [3] * 4


def test_errors_are_counted_not_raised(server):
    w = wl.generated_shared_prefix(1, 2, 16, 4, 2)
    config = serving.LoadConfig(request_rate=math.inf, progress=False)
    result = asyncio.run(serving.benchmark(server, w, config, model="no-such-model"))
    assert (result["completed"], result["failed"]) == (0, 2)
    assert all(e.startswith("HTTP 404") or e.startswith("HTTP 400") for e in result["errors"]), result["errors"]
    assert result["prefix_cache_hit_rate"] is None and result["median_ttft_ms"] == 0.0


def test_arrivals_fixed_and_poisson_and_dependents():
    w = wl.multi_turn(num_conversations=3, num_turns_min=4, num_turns_max=4, len_scale=0.05)
    fixed = serving.with_arrivals(w, 2.0, "fixed")
    firsts = [r.arrival_s for r in fixed.requests if r.after is None]
    assert firsts == [0.0, 0.5, 1.0]
    by_id = {r.request_id: r for r in fixed.requests}
    assert all(r.arrival_s == by_id[r.after].arrival_s for r in fixed.requests if r.after)
    assert all(r.arrival_s == 0.0 for r in serving.with_arrivals(w, math.inf).requests)
    pois = serving.with_arrivals(w, 2.0, "poisson", seed=3)
    assert sorted(r.arrival_s for r in pois.requests if r.after is None)[0] == 0.0


def test_best_hit_rate_counts_full_shared_blocks_once_per_group():
    w = wl.generated_shared_prefix(num_groups=2, prompts_per_group=3, system_prompt_len=32, question_len=5, output_len=1)
    # 4 of 6 requests find their group's 32-token (4-block) system prompt
    assert serving.best_prefix_cache_hit_rate(w, 8) == pytest.approx(4 * 32 / (6 * 37))
    # a repeated identical prompt keeps its last token uncached
    same = wl.Workload("same", [wl.RequestSpec("a", tuple(range(100, 116)), 1), wl.RequestSpec("b", tuple(range(100, 116)), 1)])
    assert serving.best_prefix_cache_hit_rate(same, 8) == pytest.approx(8 / 32)


def test_long_document_qa_orders():
    tile = wl.long_document_qa(num_documents=3, document_length=40, repeat_count=2, repeat_mode="tile")
    assert [r.group_id for r in tile.requests] == [0, 1, 2, 0, 1, 2]
    inter = wl.make_workload("long-document-qa", num_documents=3, document_length=40, repeat_count=2, repeat_mode="interleave")
    assert [r.group_id for r in inter.requests] == [0, 0, 1, 1, 2, 2]
    assert inter.requests[0].prompt_token_ids[:40] == inter.requests[1].prompt_token_ids[:40]
    with pytest.raises(ValueError, match="repeat_mode"):
        wl.long_document_qa(repeat_mode="zigzag")
