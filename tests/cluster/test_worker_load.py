"""An external worker's /metrics page into the LoadFigures the routers price it by
(cluster/worker_load.py): vLLM's gauges, serve-replica's own measured figures, and the
estimates from vLLM's histograms."""

from __future__ import annotations

import pytest

from kvroute.cluster.worker_load import WorkerRates, parse_load

# vLLM 0.32's names and label sets (v1/metrics/loggers.py), one engine
GAUGES = (
    'vllm:cache_config_info{block_size="16",cache_dtype="auto",engine="0",num_gpu_blocks="2048",prefix_caching_hash_algo="sha256"} 1.0\n'
    'vllm:num_requests_running{engine="0",model_name="smollm2"} 3.0\n'
    'vllm:num_requests_waiting{engine="0",model_name="smollm2"} 2.0\n'
    'vllm:kv_cache_usage_perc{engine="0",model_name="smollm2"} 0.25\n'
)


def vllm_page(itl_sum: float, itl_count: int, prefill_s: float, computed: int, requests: int) -> str:
    lab = '{engine="0",model_name="smollm2"}'
    hist = lambda name, s, c: (f'vllm:{name}_bucket{{engine="0",le="+Inf",model_name="smollm2"}} {c}\n'  # noqa: E731
                               f"vllm:{name}_count{lab} {c}\nvllm:{name}_sum{lab} {s}\n")  # fmt: skip
    return (
        "# TYPE vllm:inter_token_latency_seconds histogram\n" + hist("inter_token_latency_seconds", itl_sum, itl_count)
        + "# TYPE vllm:request_prefill_time_seconds histogram\n" + hist("request_prefill_time_seconds", prefill_s, requests)
        + "# TYPE vllm:request_prefill_kv_computed_tokens histogram\n"
        + hist("request_prefill_kv_computed_tokens", computed, requests) + GAUGES
    )  # fmt: skip


def test_a_vllm_metrics_page_becomes_load_figures():
    figures, cache = parse_load(GAUGES, 1234)
    assert (figures.num_running, figures.num_waiting, figures.kv_usage, figures.route_ticket) == (3, 2, 0.25, 1234)
    assert cache["num_gpu_blocks"] == 2048 and cache["block_size"] == 16
    assert (figures.prefill_tokens_per_s, figures.decode_step_s, figures.queued_prefill_tokens) == (0.0, 0.0, 0)
    assert parse_load("", 0) == (parse_load("", 0)[0], {}) and parse_load("", 0)[0].num_running == 0


def test_vllm_rates_are_estimated_from_how_its_histograms_moved():
    rates = WorkerRates(window_s=10.0)
    rates.observe({}, now=0.0)  # nothing served yet: nothing estimated
    assert rates.figures(parse_load(GAUGES, 0)[0]).prefill_tokens_per_s == 0.0
    # 4 s later: 2 requests computed 600 tokens in 1.5 s of prefill (not overlapping);
    # 40 output tokens 50 ms apart
    rates.observe({"itl_sum": 2.0, "itl_count": 40, "prefill_s": 1.5, "computed": 600, "requests": 2}, now=4.0)
    figures = rates.figures(parse_load(GAUGES, 0)[0])
    assert figures.prefill_tokens_per_s == pytest.approx(400.0)
    assert figures.decode_step_s == pytest.approx(0.05)
    assert figures.queued_prefill_tokens == 2 * 300  # 2 waiting × 300 computed tokens each
    # overlapping prefills: 8 requests × 3 s each in a 4 s window: the wall time bounds the busy time
    rates.observe({"itl_sum": 2.0, "itl_count": 40, "prefill_s": 25.5, "computed": 2600, "requests": 10}, now=8.0)
    assert rates.prefill_tokens_per_s == pytest.approx(2600 / 8.0)  # the window still starts at t = 0
    # a quiet window keeps the last estimates
    for t in (20.0, 30.0, 40.0):
        rates.observe({"itl_sum": 2.0, "itl_count": 40, "prefill_s": 25.5, "computed": 2600, "requests": 10}, now=t)
    assert (rates.prefill_tokens_per_s, rates.decode_step_s) == (pytest.approx(325.0), pytest.approx(0.05))


def test_the_estimates_follow_the_window_and_survive_a_worker_restart():
    rates = WorkerRates(window_s=5.0)
    rates.observe({"itl_sum": 0.0, "itl_count": 0, "prefill_s": 0.0, "computed": 0, "requests": 0}, now=0.0)
    rates.observe({"itl_sum": 1.0, "itl_count": 10, "prefill_s": 1.0, "computed": 100, "requests": 1}, now=5.0)
    rates.observe({"itl_sum": 1.2, "itl_count": 20, "prefill_s": 1.5, "computed": 600, "requests": 2}, now=10.0)
    # the window now starts at t = 5: 10 tokens in 0.2 s; 500 tokens in 0.5 s
    assert (rates.decode_step_s, rates.prefill_tokens_per_s) == (pytest.approx(0.02), pytest.approx(1000.0))
    assert rates.mean_prompt_tokens == pytest.approx(500.0)
    # counters start over (the worker restarted): the old window is dropped, no negative deltas
    rates.observe({"itl_sum": 0.1, "itl_count": 1, "prefill_s": 0.1, "computed": 50, "requests": 1}, now=11.0)
    assert rates.decode_step_s == pytest.approx(0.02) and rates.prefill_tokens_per_s == pytest.approx(1000.0)
    rates.observe({"itl_sum": 0.4, "itl_count": 11, "prefill_s": 0.3, "computed": 250, "requests": 2}, now=13.0)
    assert (rates.decode_step_s, rates.prefill_tokens_per_s) == (pytest.approx(0.03), pytest.approx(1000.0))


def test_a_vllm_page_feeds_the_estimates_and_serve_replicas_own_figures_win():
    rates = WorkerRates()
    parse_load(vllm_page(0.0, 0, 0.0, 0, 0), 0, rates, now=0.0)
    figures, _ = parse_load(vllm_page(0.5, 10, 0.5, 256, 1), 0, rates, now=1.0)
    assert figures.prefill_tokens_per_s == 0.0  # a 1 s window: too short to tell
    figures, _ = parse_load(vllm_page(0.5, 10, 0.5, 256, 1), 0, rates, now=3.0)
    assert figures.decode_step_s == pytest.approx(0.05) and figures.prefill_tokens_per_s == pytest.approx(512.0)
    assert figures.queued_prefill_tokens == 2 * 256
    own = ("kvroute:prefill_tokens_per_second 9000.0\nkvroute:decode_step_seconds 0.012\n"
           "kvroute:queued_prefill_tokens 700.0\nkvroute:queued_prefill_seconds 0.08\n")  # fmt: skip
    figures, _ = parse_load(vllm_page(0.5, 10, 0.5, 256, 1) + own, 0, rates, now=4.0)
    assert (figures.prefill_tokens_per_s, figures.decode_step_s) == (9000.0, 0.012)
    assert (figures.queued_prefill_tokens, figures.queued_prefill_s, figures.num_waiting) == (700, 0.08, 2)


def _full_parse(text: str) -> dict[str, float]:
    """Every sample of ``text`` summed by name, parsed whole by prometheus_client: what
    ``parse_load`` read before it skipped the series it does not need."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[s.name] = out.get(s.name, 0.0) + s.value
    return out


def test_a_whole_vllm_page_reads_as_the_full_parse_reads_it():
    """``parse_load`` reads only a dozen series of a ~53 KB vLLM page (the rest skipped
    unparsed): its figures equal those of a full parse, with two engines' label sets,
    serve-replica's own figures, a timestamp, and series whose names merely start like
    a wanted one."""
    from kvroute.benchmarks.worker_pool_cpu import vllm_metrics_page

    page = vllm_metrics_page(53_000)
    assert len(page) >= 53_000
    second = ('vllm:num_requests_running{engine="1",model_name="smollm2"} 4.0 1700000000000\n'
              'vllm:num_requests_waiting{engine="1",model_name="smollm2"} 5.0\n'
              'vllm:num_requests_waiting_by_reason{engine="1",reason="capacity"} 99.0\n'
              'vllm:inter_token_latency_seconds_sum{engine="1",model_name="smollm2"} 1.5\n'
              'vllm:inter_token_latency_seconds_count{engine="1",model_name="smollm2"} 30.0\n')  # fmt: skip
    for text in (page, page + second):
        full = _full_parse(text)
        figures, cache = parse_load(text, 0)
        assert figures.num_running == int(full["vllm:num_requests_running"])
        assert figures.num_waiting == int(full["vllm:num_requests_waiting"])
        assert figures.kv_usage == pytest.approx(full["vllm:kv_cache_usage_perc"])
        assert cache == {"block_size": 16, "engine": 0, "num_gpu_blocks": 2048}
    assert parse_load(page + second, 0)[0].num_running == parse_load(page, 0)[0].num_running + 4
    # the histograms' sums feed the estimates as the full parse's do
    rates, zero = WorkerRates(window_s=4.0), page.replace("vllm:inter_token_latency_seconds_sum", "x_sum")
    parse_load(zero.replace("vllm:inter_token_latency_seconds_count", "x_count"), 0, rates, now=0.0)
    parse_load(page + second, 0, rates, now=4.0)
    full = _full_parse(page + second)
    assert rates.decode_step_s == pytest.approx(full["vllm:inter_token_latency_seconds_sum"]
                                                / full["vllm:inter_token_latency_seconds_count"])  # fmt: skip
    own = "kvroute:prefill_tokens_per_second 9000.0\nkvroute:decode_step_seconds 0.012\n"
    assert parse_load(page + own, 0)[0].prefill_tokens_per_s == 9000.0
    with pytest.raises(ValueError):
        parse_load("vllm:num_requests_running{engine=\"0\"} many\n", 0)
