"""Online serving benchmark: an async load generator against any OpenAI-compatible
endpoint (kvroute's Serve app, ``kvroute serve-replica``, vLLM, SGLang, a router in
front of them).

Requests come from :mod:`kvroute.benchmarks.workloads` (token-id prompts, so every
server sees exactly the same prefixes; ``--prompt-format text`` decodes them for
servers that only take text). They arrive as a Poisson process (or at a fixed rate)
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

    python -m kvroute.benchmarks.serving --base-url http://127.0.0.1:8000 \\
        --dataset-name generated-shared-prefix --gsp-num-groups 16 \\
        --gsp-prompts-per-group 8 --gsp-system-prompt-len 1024 --gsp-question-len 64 \\
        --gsp-output-len 32 --request-rate 1.5 --max-concurrency 16
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Optional, Sequence


from kvroute.benchmarks import workloads as wl
from kvroute.benchmarks.serving_report import (
    DEFAULT_PERCENTILES,
    best_prefix_cache_hit_rate,
    format_table,
    per_request,
    summarize,
    summary_line,
)



# ---------------------------------------------------------------------- config
@dataclass(frozen=True)
class LoadConfig:
    """How the load is offered. ``request_rate`` = inf sends everything at once (only
    ``max_concurrency`` holds it back). ``time_scale``: the server is emulated with its
    durations stretched by this factor (``--emulate --time-scale``): arrivals and think
    times are stretched alike, and every reported time and rate is converted back to
    unscaled seconds (``request_rate`` stays the unscaled rate)."""

    endpoint: str = "/v1/completions"
    request_rate: float = math.inf
    arrival: str = "poisson"  # or "fixed"
    max_concurrency: Optional[int] = None
    stream: bool = True
    prompt_format: str = "tokens"  # or "text" (needs a decode function)
    temperature: float = 0.0
    ignore_eos: bool = True
    timeout_s: float = 600.0
    api_key: Optional[str] = None
    seed: int = 0
    percentiles: tuple[float, ...] = DEFAULT_PERCENTILES
    block_size: int = 16
    progress: bool = True
    time_scale: float = 1.0

    def __post_init__(self) -> None:
        if self.endpoint not in ("/v1/completions", "/v1/chat/completions"):
            raise ValueError(f"endpoint must be /v1/completions or /v1/chat/completions, got {self.endpoint!r}")
        if not self.request_rate > 0:
            raise ValueError(f"request_rate must be > 0 (inf: all at once), got {self.request_rate}")
        if not self.time_scale > 0:
            raise ValueError(f"time_scale must be > 0, got {self.time_scale}")
        if self.arrival not in ("poisson", "fixed"):
            raise ValueError(f"arrival must be poisson or fixed, got {self.arrival!r}")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError(f"max_concurrency must be >= 1, got {self.max_concurrency}")
        if self.prompt_format not in ("tokens", "text"):
            raise ValueError(f"prompt_format must be tokens or text, got {self.prompt_format!r}")
        if self.endpoint == "/v1/chat/completions" and self.prompt_format != "text":
            raise ValueError("the chat endpoint takes text: use prompt_format='text' (and a tokenizer)")
        if any(not 0 < p < 100 for p in self.percentiles):
            raise ValueError(f"percentiles must be in (0, 100), got {self.percentiles}")
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")


@dataclass
class RequestOutcome:
    """One request as the client saw it; times in seconds from the run's start."""

    request_id: str
    success: bool = False
    error: str = ""
    start_s: float = 0.0
    ttft_s: Optional[float] = None
    itl_s: list[float] = field(default_factory=list)
    e2el_s: Optional[float] = None
    prompt_tokens: int = 0
    cached_tokens: Optional[int] = None
    output_tokens: int = 0
    ingress: int = 0  # which of the base URLs it was sent to

    @property
    def tpot_s(self) -> Optional[float]:
        if not self.success or self.ttft_s is None or self.e2el_s is None or self.output_tokens < 2:
            return None
        return (self.e2el_s - self.ttft_s) / (self.output_tokens - 1)


def unscaled(o: RequestOutcome, k: float) -> RequestOutcome:
    """``o`` measured against a server emulated ``k`` times slower, in its own seconds."""
    return replace(
        o,
        start_s=o.start_s / k,
        ttft_s=None if o.ttft_s is None else o.ttft_s / k,
        itl_s=[x / k for x in o.itl_s],
        e2el_s=None if o.e2el_s is None else o.e2el_s / k,
    )


# ---------------------------------------------------------------------- arrivals
def with_arrivals(workload: wl.Workload, rate: float, arrival: str = "poisson", seed: int = 0) -> wl.Workload:
    """A copy of ``workload`` whose independent requests arrive at ``rate`` (Poisson or
    evenly spaced; inf: all at 0). Dependent turns keep their conversation's start."""
    if math.isinf(rate):
        reqs = [replace(r, arrival_s=0.0) for r in workload.requests]
        return replace(workload, requests=reqs, params={**workload.params, "rate": "inf"})
    if arrival == "poisson":
        return wl.with_poisson_arrivals(workload, rate, seed)
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


# ---------------------------------------------------------------------- CLI
def add_workload_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("workload")
    g.add_argument("--dataset-name", default="generated-shared-prefix", choices=sorted(wl.WORKLOADS),
                   help="high-hit / low-hit: the seed's system 3,000 / question 128 and 128 / 3,000 cases")
    g.add_argument("--gsp-num-groups", type=int, default=None)
    g.add_argument("--gsp-prompts-per-group", type=int, default=None)
    g.add_argument("--gsp-system-prompt-len", type=int, default=None)
    g.add_argument("--gsp-question-len", type=int, default=None)
    g.add_argument("--gsp-output-len", type=int, default=None)
    g.add_argument("--scale", type=float, default=1.0, help="multiplies the number of groups / conversations / documents")
    g.add_argument("--len-scale", type=float, default=1.0, help="multiplies every token length")
    g.add_argument("--workload-kwargs", default="{}", help='extra generator kwargs as JSON, e.g. \'{"num_conversations": 4}\'')
    g.add_argument("--seed", type=int, default=0)


_GSP = {
    "gsp_num_groups": "num_groups",
    "gsp_prompts_per_group": "prompts_per_group",
    "gsp_system_prompt_len": "system_prompt_len",
    "gsp_question_len": "question_len",
    "gsp_output_len": "output_len",
}


def workload_from_args(args: argparse.Namespace) -> wl.Workload:
    kw: dict[str, Any] = dict(json.loads(args.workload_kwargs))
    gsp = {dst: getattr(args, src) for src, dst in _GSP.items() if getattr(args, src) is not None}
    if gsp and args.dataset_name not in ("generated-shared-prefix", "high-hit", "low-hit"):
        raise ValueError(f"--gsp-* options apply to generated-shared-prefix, high-hit and low-hit, not {args.dataset_name}")
    if args.dataset_name in ("high-hit", "low-hit"):
        # the seed cases fix the two lengths; --gsp-* still override them (to scale down)
        fixed = {"system_prompt_len": 3000, "question_len": 128} if args.dataset_name == "high-hit" else {"system_prompt_len": 128, "question_len": 3000}
        params = {**fixed, **gsp, **kw}
        return wl.generated_shared_prefix(name=args.dataset_name, seed=args.seed, scale=args.scale, len_scale=args.len_scale, **params)
    return wl.make_workload(args.dataset_name, seed=args.seed, scale=args.scale, len_scale=args.len_scale, **gsp, **kw)


def add_load_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("load")
    g.add_argument("--endpoint", default="/v1/completions", choices=["/v1/completions", "/v1/chat/completions"])
    g.add_argument("--request-rate", type=float, default=math.inf, help="requests/s (default inf: all at once)")
    g.add_argument("--arrival", default="poisson", choices=["poisson", "fixed"])
    g.add_argument("--max-concurrency", type=int, default=None)
    g.add_argument("--no-stream", action="store_true", help="non-streaming requests (TTFT = e2e latency)")
    g.add_argument("--prompt-format", default="tokens", choices=["tokens", "text"],
                   help="token-id prompts (exact prefixes) or text decoded with --tokenizer")
    g.add_argument("--tokenizer", default=None, help="embedded model name or checkpoint folder (for text prompts)")
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--no-ignore-eos", action="store_true", help="let the model stop at EOS (output lengths vary)")
    g.add_argument("--timeout-s", type=float, default=600.0)
    g.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"))
    g.add_argument("--metric-percentiles", default="90,99")
    g.add_argument("--block-size", type=int, default=16, help="the server's KV block size (for the best possible hit rate)")
    g.add_argument("--disable-tqdm", action="store_true")
    g.add_argument("--time-scale", type=float, default=1.0,
                   help="the server is emulated K times slower (kvroute --emulate --time-scale K): send K times slower "
                        "and report unscaled times")


def load_config_from_args(args: argparse.Namespace) -> LoadConfig:
    text = args.prompt_format == "text" or args.endpoint == "/v1/chat/completions"
    return LoadConfig(
        endpoint=args.endpoint,
        request_rate=args.request_rate,
        arrival=args.arrival,
        max_concurrency=args.max_concurrency,
        stream=not args.no_stream,
        prompt_format="text" if text else "tokens",
        temperature=args.temperature,
        ignore_eos=not args.no_ignore_eos,
        timeout_s=args.timeout_s,
        api_key=args.api_key,
        seed=args.seed,
        percentiles=tuple(float(x) for x in args.metric_percentiles.split(",") if x.strip()),
        block_size=args.block_size,
        progress=not args.disable_tqdm,
        time_scale=args.time_scale,
    )


def decoder(tokenizer: Optional[str]) -> Optional[Callable[[Sequence[int]], str]]:
    if tokenizer is None:
        return None
    from kvroute.replica.checkpoint import load_tokenizer, resolve_model

    tok = load_tokenizer(resolve_model(tokenizer))
    return lambda ids: tok.decode(list(ids))


def write_json(result: dict[str, Any], path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"benchmark": "serving", "time": time.strftime("%Y-%m-%dT%H:%M:%S"), **result}, indent=1))
    return path


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m kvroute.benchmarks.serving", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base-url", default="http://127.0.0.1:8000", help="the server (its /v1 routes are under it)")
    p.add_argument("--model", default=None, help="the model name to send (default: the first of /v1/models)")
    p.add_argument("--label", default=None, help="name of this run (default: the workload name)")
    p.add_argument("--result-file", default=None, help="JSON path (default: results/serving/<label>.json)")
    p.add_argument("--plot", action="store_true", help="also write <result>.ttft_cdf.png")
    add_workload_args(p)
    add_load_args(p)
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        workload = workload_from_args(args)
        config = load_config_from_args(args)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    decode = decoder(args.tokenizer)
    if config.prompt_format == "text" and decode is None:
        print("error: text prompts need --tokenizer", file=sys.stderr)
        return 2
    result = asyncio.run(benchmark(args.base_url, workload, config, args.model, decode))
    label = args.label or workload.name
    from kvroute.benchmarks.common import results_dir

    path = write_json({"label": label, **result}, Path(args.result_file) if args.result_file else results_dir() / "serving" / f"{label}.json")
    print(format_table(result, config.percentiles))
    if args.plot:
        from kvroute.benchmarks.serving_plots import ttft_cdf

        ttft_cdf({label: result}, path.with_suffix(".ttft_cdf.png"))
    print(f"serving[{label}]: {summary_line(result)}  [{path}]")
    return 0 if result["failed"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
