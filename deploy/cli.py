"""The ``kvroute`` command line. Heavy imports happen inside each subcommand."""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from typing import TYPE_CHECKING, Callable, Sequence

from kvroute.cluster.config import ROUTER_CHOICES
from kvroute.deploy import serve_proxy
from kvroute.deploy.serve_proxy import PROXIES

if TYPE_CHECKING:
    from kvroute.deploy.app_config import AppArgs


def _add_engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="smollm2-135m-instruct", help="embedded model name or checkpoint folder")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--num-kv-blocks", type=int, default=None)
    p.add_argument("--max-num-batched-tokens", type=int, default=None, help="tokens per engine step (default: EngineConfig's)")
    p.add_argument("--max-num-seqs", type=int, default=None, help="requests running at once (default: EngineConfig's)")
    p.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction, default=None,
                   help="split long prompts over steps (default: on)")
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--no-prefix-caching", action="store_true")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--emulate", default=None, metavar="PROFILE",
        help="run no model: the real scheduler and KV cache with each step timed by this profile "
        "(replica/profiles.py: gpu_h100_llama3_8b, cpu_measured); tokens are deterministic",
    )  # fmt: skip
    p.add_argument("--time-scale", type=float, default=1.0, help="with --emulate: stretch every step's time by this factor")
    p.add_argument("--host-kv-blocks", type=int, default=0,
                   help="a host-memory KV tier of this many blocks behind the device cache (0: none)")
    p.add_argument("--host-kv-gb", type=float, default=0.0, help="or the host KV tier's size in GiB")
    p.add_argument("--step-target-s", type=float, default=0.25,
                   help="cut prefill chunks so a step shared with other requests takes about this long (0: tokens only)")
    p.add_argument("--generation-config", default=None, metavar="auto|vllm|DIR",
                   help="sampling defaults for requests that leave them unset: the model's generation_config.json "
                        "(auto, the default), none (vllm), or DIR's")
    p.add_argument("--engine-kwargs", default="{}", metavar="JSON",
                   help="any other EngineConfig field, as a JSON object (e.g. '{\"page_aligned\": false}')")
    p.add_argument("--enable-lora", action="store_true", help="serve LoRA adapters (PEFT folders) beside the base model")
    p.add_argument("--lora-modules", nargs="+", default=[], metavar="NAME=PATH", help="adapters loaded at start")
    p.add_argument("--max-loras", type=int, default=1, help="adapters resident at once (LRU)")
    p.add_argument("--max-lora-rank", type=int, default=16)
    p.add_argument("--max-cpu-loras", type=int, default=None, help="adapters registered at most (default: no limit)")


# EngineConfig fields that have their own flag (so --engine-kwargs may not name them)
_FLAGGED = ("dtype", "block_size", "num_kv_blocks", "max_num_batched_tokens", "max_num_seqs", "enable_chunked_prefill",
            "max_model_len", "enable_prefix_caching", "seed", "emulate", "time_scale", "host_kv_blocks", "host_kv_gb", "step_target_s",
            "enable_lora", "lora_modules", "max_loras", "max_lora_rank", "max_cpu_loras", "generation_config")


def parse_engine_kwargs(text: str) -> dict:
    """``--engine-kwargs``: a JSON object of EngineConfig fields (ValueError naming the
    bad part; the values are checked by EngineConfig itself)."""
    import dataclasses

    from kvroute.replica.config import EngineConfig

    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"--engine-kwargs is not valid JSON ({exc}): {text!r}") from None
    if not isinstance(value, dict):
        raise ValueError(f"--engine-kwargs must be a JSON object of EngineConfig fields, got {text!r}")
    fields = {f.name for f in dataclasses.fields(EngineConfig)} - {"model", "replica_id"}
    unknown = sorted(set(value) - fields)
    if unknown:
        raise ValueError(f"--engine-kwargs: unknown EngineConfig fields {unknown}; it takes {sorted(fields)}")
    return value


def _worker_spec(item: str) -> dict:
    """``URL[=EVENTS[=REPLAY]]`` of ``--workers`` as a worker entry of the app config."""
    parts = item.split("=")
    if len(parts) > 3:
        raise ValueError(f"--workers entry {item!r}: expected URL[=EVENTS[=REPLAY]]")
    keys = ("url", "kv_events_endpoint", "replay_endpoint")
    return {k: v for k, v in zip(keys, parts)}


def _engine_kwargs(args: argparse.Namespace) -> dict:
    extra = parse_engine_kwargs(args.engine_kwargs)
    flagged = sorted(set(extra) & set(_FLAGGED))
    if flagged:
        raise ValueError(f"--engine-kwargs names {flagged}; use their own flags ({', '.join('--' + f.replace('_', '-') for f in flagged)})")
    optional = {"max_num_batched_tokens": args.max_num_batched_tokens, "max_num_seqs": args.max_num_seqs,
                "enable_chunked_prefill": args.enable_chunked_prefill, "generation_config": args.generation_config}  # fmt: skip
    return extra | {k: v for k, v in optional.items() if v is not None} | dict(
        dtype=args.dtype,
        block_size=args.block_size,
        num_kv_blocks=args.num_kv_blocks,
        max_model_len=args.max_model_len,
        enable_prefix_caching=not args.no_prefix_caching,
        seed=args.seed,
        emulate=args.emulate,
        time_scale=args.time_scale,
        host_kv_blocks=args.host_kv_blocks,
        host_kv_gb=args.host_kv_gb,
        step_target_s=args.step_target_s or None,
        **_lora_kwargs(args),
    )


def _lora_kwargs(args: argparse.Namespace) -> dict:
    """The LoRA fields, only when ``--enable-lora`` is given (or adapters are named)."""
    if not args.enable_lora and not args.lora_modules:
        return {}
    return dict(enable_lora=args.enable_lora, lora_modules=_lora_modules(args.lora_modules), max_loras=args.max_loras,
                max_lora_rank=args.max_lora_rank, max_cpu_loras=args.max_cpu_loras)  # fmt: skip


def _lora_modules(specs: list[str]) -> dict[str, str]:
    """``name=path`` pairs (ValueError for another shape or a repeated name)."""
    out: dict[str, str] = {}
    for spec in specs:
        name, sep, path = spec.partition("=")
        if not sep or not name or not path:
            raise ValueError(f"--lora-modules takes NAME=PATH pairs, got {spec!r}")
        if name in out:
            raise ValueError(f"--lora-modules names {name!r} twice")
        out[name] = path
    return out


def _generate(args: argparse.Namespace) -> int:
    from kvroute.replica.llm import LLM
    from kvroute.replica.sampling_params import SamplingParams

    params = SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.sampling_seed,
        stop=tuple(args.stop or ()),
        logprobs=args.logprobs,
    )
    llm = LLM(args.model, **_engine_kwargs(args))
    if args.chat:
        out = llm.chat([{"role": "user", "content": args.prompt}], params, use_tqdm=False)[0]
    else:
        out = llm.generate([args.prompt], params, use_tqdm=False)[0]
    if args.json:
        print(
            json.dumps(
                {
                    "text": out.text,
                    "token_ids": out.token_ids,
                    "finish_reason": out.finish_reason,
                    "num_prompt_tokens": out.num_prompt_tokens,
                    "num_cached_tokens": out.num_cached_tokens,
                    "logprobs": None
                    if out.logprobs is None
                    else [{"token_id": lp.token_id, "logprob": lp.logprob, "top": lp.top} for lp in out.logprobs],
                    "model_path": str(llm.model_path),
                }
            )
        )
    else:
        print(out.text)
    return 0


def _add_server_args(p: argparse.ArgumentParser, port: int) -> None:
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0 for every interface)")
    p.add_argument("--port", type=int, default=port)
    p.add_argument("--served-model-name", default=None, help="the name clients send as `model` (default: --model)")
    p.add_argument("--api-key", default=None, help="require `Authorization: Bearer <key>` on /v1 (or set KVROUTE_API_KEY)")
    p.add_argument("--max-body-bytes", type=int, default=4 * 2**20)
    p.add_argument("--request-timeout-s", type=float, default=600.0)
    # what /v1/responses keeps, least recently used evicted first (unset: ServerLimits' defaults)
    p.add_argument("--response-store-max-entries", type=_positive(int), metavar="N", help="responses (default 10000)")
    p.add_argument("--response-store-max-mib", type=_positive(float), metavar="MIB", help="their JSON (default 256)")
    p.add_argument("--response-store-ttl-s", type=_positive(float), metavar="S", help="each one's time (default 86400)")


def _positive(convert: type) -> Callable[[str], float]:
    """An argparse type: ``convert`` the text, which must give a finite number above 0."""

    def check(text: str) -> float:
        value = convert(text)  # (argparse reports a ValueError as an invalid value)
        if not (value > 0 and math.isfinite(value)):
            raise argparse.ArgumentTypeError(f"must be a number above 0, got {text!r}")
        return value

    check.__name__ = convert.__name__
    return check


def _add_tool_args(p: argparse.ArgumentParser) -> None:
    from kvroute.deploy.openai.tools.serving import add_tool_args

    add_tool_args(p)


def _limits(args: argparse.Namespace):
    from kvroute.deploy.openai.serving import ServerLimits

    api_key = args.api_key or os.environ.get("KVROUTE_API_KEY") or None
    store = {k: v for k in _STORE_BOUNDS if (v := getattr(args, k)) is not None}  # unset: ServerLimits' defaults
    return ServerLimits(max_body_bytes=args.max_body_bytes, request_timeout_s=args.request_timeout_s, api_key=api_key,
                        **store)  # fmt: skip


_STORE_BOUNDS = ("response_store_max_entries", "response_store_max_mib", "response_store_ttl_s")


def _serve_replica(args: argparse.Namespace) -> int:
    from kvroute.deploy.kv_event_publisher import KVEventsConfig
    from kvroute.deploy.replica_server import serve_replica
    from kvroute.deploy.openai.tools.serving import tool_config_from_args
    from kvroute.replica.config import EngineConfig
    from kvroute.replica.console_log import log_info_to_stderr

    kv_events = KVEventsConfig.from_json(args.kv_events_config) if args.kv_events_config else KVEventsConfig()
    config = EngineConfig(model=args.model, replica_id=args.replica_id, **_engine_kwargs(args))
    limits = _limits(args)
    tools = tool_config_from_args(args)
    log_info_to_stderr()  # the engine's start-up lines (its KV cache size)
    print(f"kvroute: serving {args.model} on http://{args.host}:{args.port}/v1 (one engine, Ctrl-C stops)", flush=True)
    serve_replica(config, args.host, args.port, limits, args.served_model_name, kv_events, tools)
    return 0


def data_path(args: argparse.Namespace) -> str:
    """``--data-path``, or its default: direct on a cluster this command starts with
    HAProxy, composed in front of workers, with Serve's Python proxy, or on a joined
    cluster (whose proxy this command cannot know)."""
    if args.data_path is not None:
        return args.data_path
    fast = args.address is None and (args.proxy or "haproxy") == "haproxy"
    return "direct" if fast and args.workers is None else "composed"


def _local_ingresses(app_args: AppArgs) -> int:
    """Ingress replicas on a cluster this command starts: one node, so per_node is one."""
    count = app_args.ingress.num_replicas
    return 1 if count == "per_node" else count


def serve_app_args(args: argparse.Namespace, visible_gpus: int = 0, local: bool = True):
    """The application ``kvroute serve`` runs, as ``deploy/serve.yaml``'s ``args``, on a
    machine (``local``) or cluster with ``visible_gpus`` GPUs (``deploy/replica_gpus.py``)."""
    from kvroute.deploy.app_config import parse_args, router_choice
    from kvroute.deploy.replica_gpus import replica_gpus

    engine = parse_engine_kwargs(args.engine_kwargs)
    runs_model = args.emulate is None and engine.get("device") != "cpu" and args.workers is None
    replicas, gpus = replica_gpus(args.replicas, args.num_gpus_per_replica, visible_gpus, runs_model, local)
    route = router_choice(args.router)
    limits = _limits(args)
    app: dict = {
        "app_name": args.app_name,
        "llm_configs": [
            {
                "model_loading_config": {"model_id": args.served_model_name or args.model, "model_source": args.model},
                "engine_kwargs": _engine_kwargs(args),
                "deployment_config": {
                    "num_replicas": replicas,
                    "ray_actor_options": {"num_cpus": args.num_cpus_per_replica, "num_gpus": gpus},
                    "request_router_config": {"request_router_class": route["request_router_class"]},
                },
                "router_policy": route["router_policy"],
                "num_routers": args.num_routers,
            }
        ],
        "ingress": {"api_key": limits.api_key, "max_body_bytes": limits.max_body_bytes,
                    "request_timeout_s": limits.request_timeout_s, "num_replicas": args.ingress_replicas or "per_node",
                    **{k: getattr(limits, k) for k in _STORE_BOUNDS}, **_tool_ingress_args(args),
                    "data_path": data_path(args)},
    }  # fmt: skip
    if args.dynamic_lora_path is not None:  # serve.yaml's lora_config (enable_lora implied)
        app["llm_configs"][0]["lora_config"] = {"dynamic_lora_loading_path": args.dynamic_lora_path,
                                                "max_num_adapters_per_replica": args.max_loras}  # fmt: skip
    if args.workers is not None:
        if route["request_router_class"] != "kvroute":
            raise ValueError(f"--router {args.router} is a Serve request router, which external workers do not go "
                             "through; with --workers use kvroute or round_robin (the router actors' policies)")  # fmt: skip
        app["workers"] = [_worker_spec(w.strip()) for w in args.workers.split(",") if w.strip()]
        app["worker_poll_interval_s"] = args.worker_poll_interval_s
    parsed = parse_args(app)
    parsed.cluster_config()  # the engine settings' own checks, before anything starts
    return parsed


def _tool_ingress_args(args: argparse.Namespace) -> dict:
    """The tool flags as the ingress's args; the template travels as its text, so the
    ingress need not find the file on its own node."""
    from kvroute.deploy.openai.tools.serving import tool_config_from_args

    config = tool_config_from_args(args)  # checks the flags here, before anything starts
    return {"chat_template": config.chat_template, "tool_call_parser": config.tool_call_parser,
            "enable_auto_tool_choice": config.enable_auto_tool_choice, "reasoning_parser": config.reasoning_parser}  # fmt: skip


def _serve(args: argparse.Namespace) -> int:
    import signal
    import time

    if args.address and args.proxy is not None:
        raise SystemExit("kvroute serve: --proxy applies to a cluster this command starts, not to one joined with "
                         "--address (start that one with the proxy's environment: docs/cluster.md)")
    if not args.address:  # before Ray is imported: its processes read the proxy's environment at start
        serve_proxy.apply(args.proxy or "haproxy")

    import ray
    from ray import serve

    from kvroute.cluster.router_lookup import kill_router_actors
    from kvroute.deploy.app import build_app
    from kvroute.deploy.replica_gpus import local_gpu_count

    if args.address:
        ray.init(address=args.address, namespace="kvroute-serve", logging_level="warning")
        app_args = serve_app_args(args, int(ray.cluster_resources().get("GPU", 0)), local=False)
    else:
        app_args = serve_app_args(args, local_gpu_count())  # (before ray.init: its CPUs depend on the replicas)
    engines = 0 if app_args.workers is not None else app_args.llm_configs[0].deployment_config.num_replicas
    if not args.address:
        # Logical CPUs are bookkeeping: give Ray room for every replica plus the ingress
        # even on a small machine (each replica still runs num_cpus torch threads).
        config = app_args.cluster_config()
        need = int(engines * args.num_cpus_per_replica + config.num_routers * config.router_num_cpus
                   + _local_ingresses(app_args) * app_args.ingress.num_cpus + 2)
        ray.init(address="local", num_cpus=max(os.cpu_count() or 1, need), include_dashboard=False, logging_level="warning")
    serve.start(http_options={"host": args.host, "port": args.port})
    if app_args.workers is not None:
        print(f"kvroute: routing to {len(app_args.workers)} worker(s) of {args.model} (router: {args.router})…", flush=True)
    else:
        gpus = app_args.llm_configs[0].deployment_config.ray_actor_options["num_gpus"]
        on = f", {gpus:g} GPU(s) each" if gpus else ""
        print(f"kvroute: starting {engines} replica(s) of {args.model}{on} (router: {args.router})…", flush=True)
    serve.run(build_app(app_args), name=args.app_name, route_prefix="/")
    print(f"kvroute: ready on http://{args.host}:{args.port}/v1 (Ctrl-C stops)", flush=True)

    def interrupt(*_: object) -> None:
        raise KeyboardInterrupt  # (setting a threading.Event here can deadlock the main thread)

    signal.signal(signal.SIGTERM, interrupt)
    signal.signal(signal.SIGINT, interrupt)
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        pass
    for sig in (signal.SIGINT, signal.SIGTERM):  # a second signal must not cut the clean-up short
        signal.signal(sig, signal.SIG_IGN)
    print("kvroute: stopping…", flush=True)
    serve.delete(args.app_name)
    kill_router_actors(args.app_name)
    haproxies = [] if args.address else serve_proxy.haproxy_pids()
    serve.shutdown()
    ray.shutdown()
    serve_proxy.stop_orphans(haproxies)  # a proxy whose manager died before stopping it
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvroute", description="kvroute: prefix-cache-aware LLM serving")
    sub = parser.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="generate text offline with one in-process engine")
    _add_engine_args(g)
    g.add_argument("--prompt", required=True)
    g.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    g.add_argument("--max-tokens", type=int, default=64)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=-1)
    g.add_argument("--sampling-seed", type=int, default=None)
    g.add_argument("--stop", action="append", help="stop string (repeatable)")
    g.add_argument("--logprobs", type=int, default=None)
    g.add_argument("--json", action="store_true", help="print one JSON object instead of the text")
    g.set_defaults(func=_generate)

    r = sub.add_parser("serve-replica", help="serve one engine over the OpenAI API (no Ray)")
    _add_engine_args(r)
    _add_server_args(r, port=8001)
    _add_tool_args(r)
    r.add_argument("--replica-id", default="replica-0")
    r.add_argument("--kv-events-config", default=None, metavar="JSON",
                   help="publish KV events as vLLM does, same keys: "
                        "'{\"enable_kv_cache_events\": true, \"endpoint\": \"tcp://*:5557\", \"replay_endpoint\": ...}'")
    r.set_defaults(func=_serve_replica)

    s = sub.add_parser("serve", help="start a local Ray cluster with N engine replicas, the router and the OpenAI API")
    _add_engine_args(s)
    _add_server_args(s, port=8000)
    _add_tool_args(s)
    s.add_argument("--replicas", type=int, default=None,
                   help="engine replicas (default: one per visible GPU where there are GPUs, else 2)")
    s.add_argument("--router", default="kvroute", choices=ROUTER_CHOICES)
    s.add_argument("--num-routers", type=int, default=1,
                   help="active router actors, each with the whole directory; ingresses fail over between them")
    s.add_argument("--ingress-replicas", type=int, default=None,
                   help="HTTP ingress replicas (default: one on every node, each proxy preferring its own node's)")
    s.add_argument("--num-cpus-per-replica", type=float, default=1.0)
    s.add_argument("--num-gpus-per-replica", type=float, default=None,
                   help="GPUs each replica reserves, fractions allowed (default: 1 where there are GPUs, else 0)")
    s.add_argument("--app-name", default="kvroute")
    s.add_argument("--address", default=None, help="join a running Ray cluster (e.g. auto) instead of starting one")
    s.add_argument("--proxy", default=None, choices=PROXIES,
                   help="the HTTP proxy of the cluster this command starts: haproxy (the default; Ray Serve's "
                        "high-throughput path) or python (Serve's proxy actor); a cluster joined with --address keeps "
                        "its own (docs/cluster.md)")
    s.add_argument("--data-path", default=None, choices=("direct", "composed"),
                   help="direct (the default with HAProxy): the engine replicas serve the API themselves, HAProxy "
                        "forwards each request to the one an ingress request router chooses; composed (the default "
                        "otherwise): an ingress deployment in front of them, which resumes a stream whose replica "
                        "dies on another")
    s.add_argument("--workers", default=None, metavar="URL[=EVENTS[=REPLAY]][,...]",
                   help="route to these OpenAI-compatible servers (vLLM, kvroute serve-replica) instead of starting "
                        "replicas; --model is their model folder (the tokenizer), --block-size their block size; "
                        "=EVENTS: the worker's ZMQ KV event publisher (e.g. tcp://10.0.0.5:5557), =REPLAY its replay "
                        "endpoint; '' starts with none (add them at POST /admin/workers)")
    s.add_argument("--dynamic-lora-path", default=None, metavar="DIR",
                   help="load an adapter named X from DIR/X on its first request (implies --enable-lora)")
    s.add_argument("--worker-poll-interval-s", type=float, default=1.0, help="with --workers: how often each worker's "
                   "/metrics is read")
    s.set_defaults(func=_serve)

    b = sub.add_parser("bench", add_help=False, help="run a benchmark: kvroute bench NAME [args] (no NAME: the list)")
    b.add_argument("-h", "--help", action="store_true", dest="bench_list", help=argparse.SUPPRESS)
    b.add_argument("bench_args", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    b.set_defaults(func=_bench)
    return parser


def _bench(args: argparse.Namespace) -> int:
    from kvroute.benchmarks.cli import main as bench_main

    return bench_main([] if args.bench_list else args.bench_args)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except ValueError as exc:
        print(f"kvroute: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
