"""Request workloads shared by the policy simulator and the serving benchmarks.

Pure Python + numpy (no torch, no simulator): a workload is a list of
:class:`RequestSpec` (token ids, output length, arrival time, group / session), built by
seeded, deterministic generators. Every generator takes ``scale`` (multiplies the number
of groups / prompts / conversations) and ``len_scale`` (multiplies every token length)
so CPU runs stay small; the defaults are the published ones.

Generators and where their parameters come from:

- :func:`generated_shared_prefix`: SGLang ``bench_serving --dataset-name
  generated-shared-prefix`` (``gsp_num_groups=64``, ``gsp_prompts_per_group=16``,
  ``gsp_system_prompt_len=2048``, ``gsp_question_len=128``, ``gsp_output_len=256``);
  prompts are shuffled, as SGLang does. :func:`high_hit` (system 3,000 / question 128)
  and :func:`low_hit` (system 128 / question 3,000) are the seed's two cases.
- :func:`b2b`: the llm-d "B2B" case, 150 groups x 5 prompts, 6,000-token shared prefix,
  1,200-token question, 1,000 output tokens.
- :func:`zipf_groups`: requests draw their group (shared system prompt) from a Zipf
  distribution over groups, P(group k) ∝ 1 / k**s with s = 1.1.
- :func:`multi_turn`: vLLM ``benchmarks/multi_turn/generate_multi_turn.json``: 24
  conversations; ``num_turns`` uniform 12-18 *messages* (user + assistant, so 6-9 user
  turns); a 500-token prefix common to all conversations; a per-conversation prefix
  lognormal with mean 1,000 tokens capped at 5,000 (sigma 0.5 here; the JSON gives only
  the mean and cap); user messages uniform 120-160 tokens; answers uniform 80-120.
  Each turn's prompt is the whole history (previous prompt + the previous answer's
  planned token ids) + a new user message. **Arrival choice**: a conversation's first
  turn arrives by the Poisson process; turn k+1 is *closed loop*, sent ``think_time_s``
  (default 0) after turn k's last token. Its ``arrival_s`` is only a lower bound and
  ``after`` names the request it waits for. The answer's token ids are fixed in the
  spec (``output_token_ids``) so a simulator replays exactly the history the next turn
  sends; a real server generates its own answer, and a serving benchmark that wants
  exact prefix reuse sends the planned answer as the assistant message.

- :func:`fork` (``fork_workload.py``): N sub-agents branch from one long prefix at once.
- :func:`long_document_qa`: vLLM ``benchmark_long_document_qa_throughput.py``: 8
  documents of 20,000 tokens, each asked twice (``repeat_mode`` random / tile /
  interleave), 10 output tokens.
- :func:`mooncake`: a Mooncake-format trace replayed (``traces.load_mooncake``; default
  the tests' small synthetic trace), its requests arriving at the trace's own times:
  ``params["arrival"] == "trace"``, and ``params["ideal_hit_rate"]`` is the trace's
  infinite-cache hit rate (``traces.ideal_hit_rate``).

Arrivals: :func:`with_poisson_arrivals` stamps exponential inter-arrival times at a
given rate onto a workload (turn-0 requests only); :func:`with_trace_arrivals` keeps a
trace's own arrival times, stretched or compressed to a mean rate (the bursts kept);
:func:`rate_sweep` turns a capacity into the rates to test.
"""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from kvroute.benchmarks import traces
from kvroute.benchmarks.fork_workload import fork
from kvroute.benchmarks.workload_types import RequestSpec, Workload

DEFAULT_VOCAB = 32000
_FIRST_TOKEN = 100  # keep clear of special-token ids


def scaled(n: int, s: float) -> int:
    """``n * s`` rounded, at least 1."""
    return max(1, int(round(n * s)))


def _tokens(rng: np.random.Generator, n: int, vocab: int) -> tuple[int, ...]:
    return tuple(rng.integers(_FIRST_TOKEN, vocab, size=n).tolist())


def _grouped(
    name: str,
    group_of: Sequence[int],
    num_groups: int,
    system_len: int,
    question_len: int,
    output_len: int,
    seed: int,
    vocab: int,
    params: dict[str, Any],
) -> Workload:
    rng = np.random.default_rng(seed)
    systems = [_tokens(rng, system_len, vocab) for _ in range(num_groups)]
    reqs = [
        RequestSpec(f"{name}-{i}", systems[g] + _tokens(rng, question_len, vocab), output_len, group_id=g)
        for i, g in enumerate(group_of)
    ]
    return Workload(name, reqs, params, shared_prefix_tokens=system_len, num_groups=num_groups)


def generated_shared_prefix(
    num_groups: int = 64,
    prompts_per_group: int = 16,
    system_prompt_len: int = 2048,
    question_len: int = 128,
    output_len: int = 256,
    *,
    seed: int = 0,
    scale: float = 1.0,
    len_scale: float = 1.0,
    vocab_size: int = DEFAULT_VOCAB,
    name: str = "generated-shared-prefix",
) -> Workload:
    """SGLang's generated-shared-prefix: groups share a system prompt; order shuffled.

    ``scale`` multiplies ``num_groups`` (prompts per group stay, so the hit structure is
    unchanged); ``len_scale`` multiplies the three lengths.
    """
    g, p = scaled(num_groups, scale), prompts_per_group
    sl, ql, ol = (scaled(x, len_scale) for x in (system_prompt_len, question_len, output_len))
    order = np.random.default_rng(seed + 1).permutation(g * p)
    group_of = [int(i) // p for i in order]
    params = dict(num_groups=g, prompts_per_group=p, system_prompt_len=sl, question_len=ql, output_len=ol, seed=seed)
    return _grouped(name, group_of, g, sl, ql, ol, seed, vocab_size, params)


def high_hit(**kw: Any) -> Workload:
    """The seed's high-hit case: system prompt 3,000 tokens, question 128."""
    kw.setdefault("name", "high-hit")
    return generated_shared_prefix(system_prompt_len=3000, question_len=128, **kw)


def low_hit(**kw: Any) -> Workload:
    """The seed's low-hit case: system prompt 128 tokens, question 3,000."""
    kw.setdefault("name", "low-hit")
    return generated_shared_prefix(system_prompt_len=128, question_len=3000, **kw)


def b2b(
    num_groups: int = 150,
    prompts_per_group: int = 5,
    prefix_len: int = 6000,
    question_len: int = 1200,
    output_len: int = 1000,
    *,
    seed: int = 0,
    scale: float = 1.0,
    len_scale: float = 1.0,
    vocab_size: int = DEFAULT_VOCAB,
) -> Workload:
    """llm-d's B2B case: 150 tenants x 5 prompts on a 6k-token shared prefix."""
    w = generated_shared_prefix(
        num_groups, prompts_per_group, prefix_len, question_len, output_len,
        seed=seed, scale=scale, len_scale=len_scale, vocab_size=vocab_size, name="b2b",
    )
    return w


def zipf_weights(n: int, s: float = 1.1) -> np.ndarray:
    w = 1.0 / np.arange(1, n + 1, dtype=np.float64) ** s
    return w / w.sum()


def zipf_groups(
    num_groups: int = 64,
    num_requests: int = 1024,
    system_prompt_len: int = 2048,
    question_len: int = 128,
    output_len: int = 256,
    s: float = 1.1,
    *,
    seed: int = 0,
    scale: float = 1.0,
    len_scale: float = 1.0,
    vocab_size: int = DEFAULT_VOCAB,
) -> Workload:
    """Shared-prefix groups whose popularity is Zipf(s): group 0 is the hottest.

    ``scale`` multiplies both the groups and the requests.
    """
    g, n = scaled(num_groups, scale), scaled(num_requests, scale)
    sl, ql, ol = (scaled(x, len_scale) for x in (system_prompt_len, question_len, output_len))
    rng = np.random.default_rng(seed + 2)
    group_of = rng.choice(g, size=n, p=zipf_weights(g, s)).tolist()
    params = dict(num_groups=g, num_requests=n, system_prompt_len=sl, question_len=ql, output_len=ol, s=s, seed=seed)
    return _grouped("zipf", group_of, g, sl, ql, ol, seed, vocab_size, params)


def multi_tenant(
    num_tenants: int = 32,
    num_system_prompts: int = 4,
    requests_per_tenant: int = 32,
    system_prompt_len: int = 2048,
    question_len: int = 128,
    output_len: int = 256,
    *,
    seed: int = 0,
    scale: float = 1.0,
    len_scale: float = 1.0,
    vocab_size: int = DEFAULT_VOCAB,
) -> Workload:
    """Tenants over a few shared system prompts, each tenant with its own ``cache_salt``:
    tenant ``t`` uses system prompt ``t % num_system_prompts``, so equal text is shared
    by several tenants whose KV can never be shared. A router matching on text sees
    ``num_system_prompts`` groups; the caches hold ``num_tenants``. Order shuffled.
    ``scale`` multiplies the tenants."""
    t, k = scaled(num_tenants, scale), min(num_system_prompts, scaled(num_tenants, scale))
    sl, ql, ol = (scaled(x, len_scale) for x in (system_prompt_len, question_len, output_len))
    rng = np.random.default_rng(seed + 3)
    systems = [_tokens(rng, sl, vocab_size) for _ in range(k)]
    order = rng.permutation(t * requests_per_tenant)
    reqs = []
    for i, j in enumerate(order.tolist()):
        tenant = j // requests_per_tenant
        prompt = systems[tenant % k] + _tokens(rng, ql, vocab_size)
        reqs.append(RequestSpec(f"multi-tenant-{i}", prompt, ol, group_id=tenant, cache_salt=f"tenant-{tenant}"))
    params = dict(num_tenants=t, num_system_prompts=k, requests_per_tenant=requests_per_tenant,
                  system_prompt_len=sl, question_len=ql, output_len=ol, seed=seed)  # fmt: skip
    return Workload("multi-tenant", reqs, params, shared_prefix_tokens=sl, num_groups=t)


def multi_turn(
    num_conversations: int = 24,
    num_turns_min: int = 12,
    num_turns_max: int = 18,
    common_prefix_len: int = 500,
    prefix_len_mean: int = 1000,
    prefix_len_max: int = 5000,
    prefix_len_sigma: float = 0.5,
    user_len_min: int = 120,
    user_len_max: int = 160,
    output_len_min: int = 80,
    output_len_max: int = 120,
    think_time_s: float = 0.0,
    *,
    seed: int = 0,
    scale: float = 1.0,
    len_scale: float = 1.0,
    vocab_size: int = DEFAULT_VOCAB,
) -> Workload:
    """vLLM's multi_turn synthetic conversations (see the module docstring).

    ``num_turns_*`` count messages (user + assistant), as in vLLM; odd counts round up.
    """
    rng = np.random.default_rng(seed + 3)
    n_conv = scaled(num_conversations, scale)
    L = lambda x: scaled(x, len_scale)  # noqa: E731
    common = _tokens(rng, L(common_prefix_len), vocab_size)
    mu = math.log(prefix_len_mean) - prefix_len_sigma**2 / 2  # lognormal with this mean
    reqs: list[RequestSpec] = []
    for c in range(n_conv):
        messages = int(rng.integers(num_turns_min, num_turns_max + 1))
        user_turns = (messages + 1) // 2
        plen = min(int(rng.lognormal(mu, prefix_len_sigma)), prefix_len_max)
        history = common + _tokens(rng, L(max(plen, 1)), vocab_size)
        prev: str | None = None
        for t in range(user_turns):
            prompt = history + _tokens(rng, L(int(rng.integers(user_len_min, user_len_max + 1))), vocab_size)
            out_len = L(int(rng.integers(output_len_min, output_len_max + 1)))
            answer = _tokens(rng, out_len, vocab_size)
            rid = f"conv{c}-turn{t}"
            reqs.append(
                RequestSpec(rid, prompt, out_len, 0.0, group_id=c, session_id=c, turn=t, after=prev,
                            think_time_s=think_time_s if prev else 0.0, output_token_ids=answer)
            )
            history = prompt + answer
            prev = rid
    params = dict(
        num_conversations=n_conv, num_turns=[num_turns_min, num_turns_max], common_prefix_len=L(common_prefix_len),
        prefix_len_mean=L(prefix_len_mean), user_len=[L(user_len_min), L(user_len_max)],
        output_len=[L(output_len_min), L(output_len_max)], think_time_s=think_time_s, seed=seed,
    )
    return Workload("multi-turn", reqs, params, shared_prefix_tokens=L(common_prefix_len), num_groups=n_conv)


def long_document_qa(
    num_documents: int = 8,
    document_length: int = 20000,
    question_len: int = 32,
    output_len: int = 10,
    repeat_count: int = 2,
    repeat_mode: str = "random",
    *,
    seed: int = 0,
    scale: float = 1.0,
    len_scale: float = 1.0,
    vocab_size: int = DEFAULT_VOCAB,
) -> Workload:
    """Long-document QA after vLLM's ``benchmark_long_document_qa_throughput.py``
    (``--num-documents 8 --document-length 20000 --output-len 10 --repeat-count 2
    --repeat-mode random``): each document is asked ``repeat_count`` questions; a
    request is the whole document followed by a short question (``question_len``,
    our addition: vLLM repeats the bare document). ``repeat_mode``: ``tile`` sends
    every document once, then again (d0 d1 .. d0 d1 ..); ``interleave`` sends each
    document's questions back to back (d0 d0 d1 d1 ..); ``random`` shuffles.

    ``scale`` multiplies ``num_documents``; ``len_scale`` the three lengths.
    """
    if repeat_mode not in ("random", "tile", "interleave"):
        raise ValueError(f"repeat_mode must be random, tile or interleave, got {repeat_mode!r}")
    if repeat_count < 1:
        raise ValueError(f"repeat_count must be >= 1, got {repeat_count}")
    d = scaled(num_documents, scale)
    dl, ql, ol = (scaled(x, len_scale) for x in (document_length, question_len, output_len))
    if repeat_mode == "tile":
        group_of = [g for _ in range(repeat_count) for g in range(d)]
    elif repeat_mode == "interleave":
        group_of = [g for g in range(d) for _ in range(repeat_count)]
    else:
        order = np.random.default_rng(seed + 5).permutation(d * repeat_count)
        group_of = [int(i) // repeat_count for i in order]
    params = dict(num_documents=d, document_length=dl, question_len=ql, output_len=ol,
                  repeat_count=repeat_count, repeat_mode=repeat_mode, seed=seed)
    return _grouped("long-document-qa", group_of, d, dl, ql, ol, seed, vocab_size, params)


# ---------------------------------------------------------------------- arrivals
def poisson_arrivals(n: int, rate: float, seed: int = 0) -> list[float]:
    """``n`` arrival times of a Poisson process with ``rate`` requests/s, from 0."""
    if rate <= 0:
        raise ValueError(f"rate must be > 0 requests/s, got {rate}")
    gaps = np.random.default_rng(seed + 4).exponential(1.0 / rate, size=n)
    return (np.cumsum(gaps) - gaps[0]).tolist() if n else []


def with_poisson_arrivals(workload: Workload, rate: float, seed: int = 0) -> Workload:
    """A copy whose independent requests (turn 0) arrive as a Poisson process at
    ``rate``; later turns keep their closed-loop dependency (their ``arrival_s``
    becomes their conversation's start)."""
    firsts = [r for r in workload.requests if r.after is None]
    times = poisson_arrivals(len(firsts), rate, seed)
    start = {r.request_id: t for r, t in zip(firsts, times)}
    out: list[RequestSpec] = []
    for r in workload.requests:  # a dependent request follows the one it waits for
        t = start[r.request_id] if r.after is None else start.get(r.after, 0.0)
        start[r.request_id] = t
        out.append(replace(r, arrival_s=t))
    params = {**workload.params, "rate": rate, "arrival": "poisson", "arrival_seed": seed}
    return replace(workload, requests=out, params=params)


def with_trace_arrivals(workload: Workload, rate: float) -> Workload:
    """A copy whose independent requests (turn 0) keep their own ``arrival_s`` (a
    trace's timestamps), measured from the first and scaled by one factor so that their
    mean rate over the run, count / span, is ``rate``: every gap keeps its share of the
    span, so the bursts stay bursts. Later turns keep their closed-loop dependency (their
    ``arrival_s`` becomes their conversation's start), as with Poisson arrivals."""
    if not rate > 0 or math.isinf(rate):
        raise ValueError(f"rate must be a finite number > 0 requests/s, got {rate}")
    firsts = [r.arrival_s for r in workload.requests if r.after is None]
    if not any(firsts):
        raise ValueError(f"arrival 'trace' keeps each request's own arrival time, but every request of workload "
                         f"{workload.name!r} arrives at 0: replay a trace (e.g. the 'mooncake' workload), or use "
                         f"arrival 'poisson' or 'fixed'")  # fmt: skip
    t0, span = min(firsts), max(firsts) - min(firsts)
    if span <= 0:
        raise ValueError(f"arrival 'trace' needs arrival times that differ; workload {workload.name!r} has all "
                         f"{len(firsts)} at {t0} s, so no rate can be set from them")  # fmt: skip
    factor = (len(firsts) / rate) / span
    start: dict[str, float] = {}
    out: list[RequestSpec] = []
    for r in workload.requests:
        t = (r.arrival_s - t0) * factor if r.after is None else start.get(r.after, 0.0)
        start[r.request_id] = t
        out.append(replace(r, arrival_s=t))
    params = {**workload.params, "rate": rate, "arrival": "trace", "trace_time_factor": factor}
    return replace(workload, requests=out, params=params)


def rate_sweep(capacity_rps: float, fractions: Sequence[float] = (0.5, 0.7, 0.85, 0.95)) -> list[float]:
    """Request rates at the given fractions of a fleet's capacity."""
    return [capacity_rps * f for f in fractions]


def lora_zipf(num_adapters: int = 64, num_requests: int = 4096, system_prompt_len: int = 2048, question_len: int = 128,
              output_len: int = 256, s: float = 1.1, *, seed: int = 0, scale: float = 1.0, len_scale: float = 1.0) -> Workload:  # fmt: skip
    """Zipf-popular LoRA adapters, each with its own system prompt: request ``i`` names
    adapter ``lora-<g>`` of its group ``g`` (group 0 the most popular)."""
    base = zipf_groups(num_adapters, num_requests, system_prompt_len, question_len, output_len, s, seed=seed, scale=scale,
                       len_scale=len_scale)  # fmt: skip
    reqs = [replace(r, lora_name=f"lora-{r.group_id}") for r in base.requests]
    return replace(base, name="lora-zipf", requests=reqs, params={**base.params, "adapters": base.num_groups})


MOONCAKE_FIXTURE = Path(__file__).parents[1] / "tests" / "fixtures" / "mooncake_small.jsonl"


def mooncake(path: str | Path | None = None, tokens_per_id: int = 64, max_output_len: int | None = 128, *,
             seed: int = 0, scale: float = 1.0, len_scale: float = 1.0) -> Workload:  # fmt: skip
    """A Mooncake-format trace (``benchmarks/traces.py``; default ``MOONCAKE_FIXTURE``,
    the tests' 200-request synthetic trace) as a workload at the trace's own arrival
    times (``params["arrival"] == "trace"``: replay it with arrival ``trace``).
    ``tokens_per_id`` tokens stand for each of the trace's 512-token hash ids (prompts
    shrink in proportion), answers are cut to ``max_output_len`` (None: the trace's
    own), ``seed`` draws the ids' token content. ``scale`` keeps the first
    round(``scale`` × N) requests (at least 1); ``len_scale`` multiplies
    ``tokens_per_id`` (at least 1). ``params["ideal_hit_rate"]``: what one infinite
    cache would serve of the kept requests' prompt tokens, in whole ids
    (``traces.ideal_hit_rate``)."""
    source = Path(path) if path is not None else MOONCAKE_FIXTURE
    records = traces.read_jsonl(source)
    kept = records[: scaled(len(records), scale)]
    tpi = max(1, int(round(tokens_per_id * len_scale)))
    w = traces.load_mooncake(kept, tokens_per_id=tpi, max_output_len=max_output_len, seed=seed)
    params = {**w.params, "path": str(source), "max_output_len": max_output_len, "trace_requests": len(records),
              "arrival": "trace", "ideal_hit_rate": traces.ideal_hit_rate(kept, tpi)}  # fmt: skip
    return replace(w, params=params)


WORKLOADS = {
    "generated-shared-prefix": generated_shared_prefix,
    "high-hit": high_hit,
    "low-hit": low_hit,
    "b2b": b2b,
    "zipf": zipf_groups,
    "lora-zipf": lora_zipf,
    "multi-tenant": multi_tenant,
    "multi-turn": multi_turn,
    "long-document-qa": long_document_qa,
    "fork": fork,
    "mooncake": mooncake,
}


def make_workload(name: str, **kw: Any) -> Workload:
    if name not in WORKLOADS:
        raise ValueError(f"unknown workload {name!r}; choose one of {sorted(WORKLOADS)}")
    return WORKLOADS[name](**kw)
