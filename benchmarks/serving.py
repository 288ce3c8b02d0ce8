"""Online serving benchmark: an async load generator against any OpenAI-compatible
endpoint (kvroute's Serve app, ``kvroute serve-replica``, vLLM, SGLang, a router in
front of them).

Requests come from :mod:`kvroute.benchmarks.workloads` (token-id prompts, so every
server sees exactly the same prefixes; ``--prompt-format text`` decodes them for
servers that only take text). They arrive as a Poisson process (or at a fixed rate, or
at a replayed trace's own times scaled to that mean rate: ``--arrival trace``)
at ``--request-rate``, at most ``--max-concurrency`` in flight; multi-turn
conversations are closed loop (turn k+1 leaves when turn k has finished, plus the
think time) and each turn sends the whole history.

Per request it measures, from the SSE stream: TTFT (first chunk with output), ITL
(gaps between output chunks), TPOT ((e2e - TTFT) / (output tokens - 1)), end-to-end
latency, and from ``usage``: prompt, cached (``prompt_tokens_details.cached_tokens``)
and output tokens. It prints the table of ``vllm bench serve`` and one summary line,
and writes JSON with the keys of ``vllm bench serve`` (``duration``, ``completed``,
``failed``, ``request_throughput``, ``output_throughput``, ``total_token_throughput``,
``mean/median/std/pNN_{ttft,tpot,itl,e2el}_ms``) plus ``prefix_cache_hit_rate``
(cached / prompt tokens over completed requests) and ``best_prefix_cache_hit_rate``
(what one cache seeing every request in arrival order would hit, counted in full
blocks of ``--block-size``: the ceiling a router can reach).

    kvroute bench serving --base-url http://127.0.0.1:8000 \\
        --dataset-name generated-shared-prefix --gsp-num-groups 16 \\
        --gsp-prompts-per-group 8 --gsp-system-prompt-len 1024 --gsp-question-len 64 \\
        --gsp-output-len 32 --request-rate 1.5 --max-concurrency 16
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

from kvroute.benchmarks import options
from kvroute.benchmarks import workloads as wl
from kvroute.benchmarks.serving_config import (  # noqa: F401  (the benchmark's inputs, under its name)
    LoadConfig,
    RequestOutcome,
    add_load_args,
    add_workload_args,
    decoder,
    load_config_from_args,
    unscaled,
    workload_from_args,
)
from kvroute.benchmarks.serving_report import (
    best_prefix_cache_hit_rate,
    format_table,
    per_request,
    summarize,
    summary_line,
)


# ---------------------------------------------------------------------- arrivals
def with_arrivals(workload: wl.Workload, rate: float, arrival: str = "poisson", seed: int = 0) -> wl.Workload:
    """A copy of ``workload`` whose independent requests arrive at ``rate``: ``poisson``,
    ``fixed`` (evenly spaced) or ``trace`` (their own arrival times, a trace's, scaled
    to that mean rate with the gaps' proportions kept: ``workloads.with_trace_arrivals``;
    a ValueError where they are all 0); inf: all at 0. Dependent turns keep their
    conversation's start."""
    if math.isinf(rate):
        reqs = [replace(r, arrival_s=0.0) for r in workload.requests]
        return replace(workload, requests=reqs, params={**workload.params, "rate": "inf"})
    if arrival == "poisson":
        return wl.with_poisson_arrivals(workload, rate, seed)
    if arrival == "trace":
        return wl.with_trace_arrivals(workload, rate)
    start: dict[str, float] = {}
    out = []
    i = 0
    for r in workload.requests:
        if r.after is None:
            t, i = i / rate, i + 1
        else:
            t = start.get(r.after, 0.0)
        start[r.request_id] = t
        out.append(replace(r, arrival_s=t))
    return replace(workload, requests=out, params={**workload.params, "rate": rate, "arrival": "fixed"})


# ---------------------------------------------------------------------- one request
def _usage(outcome: RequestOutcome, usage: Optional[dict[str, Any]]) -> None:
    if not usage:
        return
    outcome.prompt_tokens = int(usage.get("prompt_tokens") or outcome.prompt_tokens)
    outcome.output_tokens = int(usage.get("completion_tokens") or outcome.output_tokens)
    details = usage.get("prompt_tokens_details") or {}
    if details.get("cached_tokens") is not None:
        outcome.cached_tokens = int(details["cached_tokens"])


def _chunk_text(chunk: dict[str, Any]) -> str:
    out = []
    for choice in chunk.get("choices") or []:
        if "text" in choice:
            out.append(choice.get("text") or "")
        else:
            out.append((choice.get("delta") or {}).get("content") or "")
    return "".join(out)


async def send_request(
    client: Any, url: str, payload: dict[str, Any], outcome: RequestOutcome, t0: float, config: LoadConfig
) -> RequestOutcome:
    """POST one request and fill ``outcome`` (never raises: errors are recorded)."""
    headers = {"Authorization": f"Bearer {config.api_key}"} if config.api_key else {}
    start = time.perf_counter()
    outcome.start_s = start - t0
    try:
        if not config.stream:
            resp = await client.post(url, json=payload, headers=headers, timeout=config.timeout_s)
            body = resp.json() if resp.content else {}
            if resp.status_code != 200:
                outcome.error = f"HTTP {resp.status_code}: {json.dumps(body)[:300]}"
                return outcome
            outcome.e2el_s = outcome.ttft_s = time.perf_counter() - start
            _usage(outcome, body.get("usage"))
            outcome.success = True
            return outcome
        last = start
        chunks_with_output = 0
        async with client.stream("POST", url, json=payload, headers=headers, timeout=config.timeout_s) as resp:
            if resp.status_code != 200:
                body = (await resp.aread()).decode(errors="replace")
                outcome.error = f"HTTP {resp.status_code}: {body[:300]}"
                return outcome
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    outcome.error = f"stream error: {json.dumps(chunk['error'])[:300]}"
                    return outcome
                now = time.perf_counter()
                if _chunk_text(chunk):
                    if outcome.ttft_s is None:
                        outcome.ttft_s = now - start
                    else:
                        outcome.itl_s.append(now - last)
                    last = now
                    chunks_with_output += 1
                _usage(outcome, chunk.get("usage"))
        outcome.e2el_s = time.perf_counter() - start
        if outcome.ttft_s is None:  # no visible text (e.g. only special tokens): first byte = end
            outcome.ttft_s = outcome.e2el_s
        if outcome.output_tokens == 0:
            outcome.output_tokens = chunks_with_output
        outcome.success = True
    except Exception as exc:  # timeouts, resets, bad JSON: a failed request, not a crash
        outcome.error = f"{type(exc).__name__}: {exc}"[:300]
    return outcome


# ---------------------------------------------------------------------- payloads
def _chat_messages(spec: wl.RequestSpec, by_id: dict[str, wl.RequestSpec], decode: Callable[[Sequence[int]], str]) -> list[dict[str, str]]:
    """The conversation so far as chat messages: each earlier turn's new user text, its
    planned answer as the assistant message, then this turn's new user text."""
    chain = [spec]
    while chain[-1].after is not None and chain[-1].after in by_id:
        chain.append(by_id[chain[-1].after])
    chain.reverse()
    messages: list[dict[str, str]] = []
    consumed = 0
    for turn in chain:
        ids = turn.prompt_token_ids
        messages.append({"role": "user", "content": decode(ids[consumed:])})
        consumed = len(ids)
        if turn is not spec:
            answer = turn.output_token_ids or ()
            messages.append({"role": "assistant", "content": decode(answer)})
            consumed += len(answer)
    return messages


def build_payload(
    spec: wl.RequestSpec,
    model: str,
    config: LoadConfig,
    by_id: dict[str, wl.RequestSpec],
    decode: Optional[Callable[[Sequence[int]], str]] = None,
) -> dict[str, Any]:
    payload: dict[str, Any] = {
        "model": spec.lora_name or model,  # a LoRA request names its adapter, as OpenAI servers take it
        "max_tokens": spec.output_len,
        "temperature": config.temperature,
        "stream": config.stream,
    }
    if config.ignore_eos:
        payload["ignore_eos"] = True  # vLLM / SGLang / kvroute extension: fixed output lengths
    if config.stream:
        payload["stream_options"] = {"include_usage": True}
    if config.endpoint == "/v1/chat/completions":
        assert decode is not None
        payload["messages"] = _chat_messages(spec, by_id, decode)
    elif config.prompt_format == "text":
        assert decode is not None
        payload["prompt"] = decode(spec.prompt_token_ids)
    else:
        payload["prompt"] = list(spec.prompt_token_ids)
    if spec.cache_salt is not None:
        payload["cache_salt"] = spec.cache_salt  # vLLM's field: the tenant's own KV
    return payload


# ---------------------------------------------------------------------- the run
async def run_load(
    base_url: str | Sequence[str],
    model: str,
    workload: wl.Workload,
    config: LoadConfig,
    decode: Optional[Callable[[Sequence[int]], str]] = None,
) -> tuple[list[RequestOutcome], float]:
    """Offer ``workload`` (arrival times already stamped) to ``base_url``; returns the
    outcomes in workload order and the wall time from the first send to the last end.
    Several base URLs (ingresses) share the requests round robin: request *i* goes to
    URL *i* mod their number, as a connection-level balancer spreads clients."""
    import httpx

    urls = [u.rstrip("/") + config.endpoint for u in ([base_url] if isinstance(base_url, str) else base_url)]
    by_id = {r.request_id: r for r in workload.requests}
    done = {r.request_id: asyncio.Event() for r in workload.requests}
    outcomes = [RequestOutcome(r.request_id, prompt_tokens=r.num_prompt_tokens, ingress=i % len(urls))
                for i, r in enumerate(workload.requests)]  # fmt: skip
    sem = asyncio.Semaphore(config.max_concurrency) if config.max_concurrency else None
    bar = None
    if config.progress:
        from tqdm import tqdm

        bar = tqdm(total=len(workload.requests), desc="requests", unit="req", file=sys.stderr, dynamic_ncols=True)
    limits = httpx.Limits(max_connections=config.max_concurrency or len(workload.requests) or 1, max_keepalive_connections=64)
    async with httpx.AsyncClient(limits=limits, timeout=config.timeout_s) as client:
        t0 = time.perf_counter()

        async def one(i: int, spec: wl.RequestSpec) -> None:
            try:
                delay = spec.arrival_s - (time.perf_counter() - t0)
                if delay > 0:
                    await asyncio.sleep(delay)
                if spec.after is not None and spec.after in done:
                    await done[spec.after].wait()
                    if spec.think_time_s > 0:
                        await asyncio.sleep(spec.think_time_s * config.time_scale)
                payload = build_payload(spec, model, config, by_id, decode)
                if sem is None:
                    await send_request(client, urls[outcomes[i].ingress], payload, outcomes[i], t0, config)
                else:
                    async with sem:
                        await send_request(client, urls[outcomes[i].ingress], payload, outcomes[i], t0, config)
            finally:
                done[spec.request_id].set()
                if bar is not None:
                    bar.update(1)

        await asyncio.gather(*(one(i, s) for i, s in enumerate(workload.requests)))
        ends = [o.start_s + o.e2el_s for o in outcomes if o.e2el_s is not None]
        duration = max(ends) if ends else time.perf_counter() - t0
    if bar is not None:
        bar.close()
    return outcomes, duration



async def benchmark(
    base_url: str | Sequence[str],
    workload: wl.Workload,
    config: LoadConfig,
    model: Optional[str] = None,
    decode: Optional[Callable[[Sequence[int]], str]] = None,
) -> dict[str, Any]:
    """Run one benchmark and return its JSON-ready result (metrics, per-request arrays,
    the parameters). Several base URLs share the requests (``run_load``)."""
    if model is None:
        model = await first_model(base_url if isinstance(base_url, str) else base_url[0], config.api_key)
    k = config.time_scale
    stamped = with_arrivals(workload, config.request_rate, config.arrival, config.seed)
    sent = with_arrivals(workload, config.request_rate / k, config.arrival, config.seed) if k != 1.0 else stamped
    outcomes, duration = await run_load(base_url, model, sent, config, decode)
    if k != 1.0:
        outcomes, duration = [unscaled(o, k) for o in outcomes], duration / k
    result = summarize(outcomes, duration, config.percentiles)
    result["best_prefix_cache_hit_rate"] = best_prefix_cache_hit_rate(stamped, config.block_size)
    load = {k: v for k, v in asdict(config).items() if k not in ("api_key", "progress")}
    load["request_rate"] = "inf" if math.isinf(config.request_rate) else config.request_rate
    return {
        "base_url": base_url if isinstance(base_url, str) else list(base_url),
        "model": model,
        "workload": workload.name,
        "workload_params": workload.params,
        "num_prompts": len(workload),
        "load": load,
        "request_rate": load["request_rate"],
        "max_concurrency": config.max_concurrency,
        **result,
        **per_request(outcomes),
    }


async def first_model(base_url: str, api_key: Optional[str] = None) -> str:
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    async with httpx.AsyncClient(timeout=30) as client:
        r = await client.get(base_url.rstrip("/") + "/v1/models", headers=headers)
        r.raise_for_status()
        return r.json()["data"][0]["id"]



def write_json(result: dict[str, Any], path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"benchmark": "serving", "time": time.strftime("%Y-%m-%dT%H:%M:%S"), **result}, indent=1))
    return path


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--base-url", default="http://127.0.0.1:8000", help="the server (its /v1 routes are under it)")
    p.add_argument("--model", default=None, help="the model name to send (default: the first of /v1/models)")
    p.add_argument("--label", default=None, help="name of this run (default: the workload name)")
    p.add_argument("--out", "--result-file", dest="out", default=None,
                   help="JSON path (default: $KVROUTE_RESULTS/serving/<label>.json: a folder of labelled runs)")
    p.add_argument("--plot", action="store_true", help="also write <result>.ttft_cdf.png")
    add_workload_args(p)
    add_load_args(p)


def run(args: argparse.Namespace) -> int:
    workload = workload_from_args(args)
    config = load_config_from_args(args)
    decode = decoder(args.tokenizer)
    if config.prompt_format == "text" and decode is None:
        raise ValueError("text prompts need --tokenizer")
    result = asyncio.run(benchmark(args.base_url, workload, config, args.model, decode))
    label = args.label or workload.name
    path = write_json({"label": label, **result}, Path(args.out) if args.out else options.results_dir("serving") / f"{label}.json")
    print(format_table(result, config.percentiles))
    if args.plot:
        from kvroute.benchmarks.serving_plots import ttft_cdf

        ttft_cdf({label: result}, path.with_suffix(".ttft_cdf.png"))
    print(f"serving[{label}]: {summary_line(result)}  [{path}]")
    return 0 if result["failed"] == 0 else 1


if __name__ == "__main__":
    from kvroute.benchmarks.cli import module_main

    raise SystemExit(module_main(__spec__.name))
