"""The serving benchmark's typed inputs: how the load is offered (``LoadConfig``), what one
request's outcome is (``RequestOutcome``), and the workload and load argument groups that
``serving`` and ``compare_routers`` share, with the functions that turn them into values."""

from __future__ import annotations

import argparse
import json
import math
import os
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Optional, Sequence

from kvroute.benchmarks import options
from kvroute.benchmarks import workloads as wl

DEFAULT_PERCENTILES = (90.0, 99.0)

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
    arrival: str = "poisson"  # or "fixed", or "trace" (the workload's own arrival times, scaled to the rate)
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
        if self.arrival not in ("poisson", "fixed", "trace"):
            raise ValueError(f"arrival must be poisson, fixed or trace, got {self.arrival!r}")
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
    g.add_argument("--workload-kwargs", default="{}", help='extra generator kwargs as JSON, e.g. \'{"num_conversations": 4}\'')
    options.add_trace(p)


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
    g.add_argument("--arrival", default="poisson", choices=["poisson", "fixed", "trace"],
                   help="trace: the workload's own arrival times (a replayed trace's, e.g. --dataset-name mooncake) "
                        "scaled to --request-rate on average, the bursts kept")
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



def quiet_load(**fields: Any) -> LoadConfig:
    """The load another benchmark offers through ``compare_routers``: the CLI's defaults
    (the API key from ``OPENAI_API_KEY``), no progress bar, and ``fields``."""
    return LoadConfig(**{"api_key": os.environ.get("OPENAI_API_KEY"), "progress": False, **fields})
