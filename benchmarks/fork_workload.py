"""The fork workload: N sub-agents branch from one long prefix at once (llm-d's fork
case: a 43-way fork over a 40K-token prefix). ``num_forks`` parents, each a
``prefix_len``-token prompt with a short answer, arrive by the Poisson process (the
benchmarks stamp them, as any workload's first turns); when a parent finishes, its
``agents_per_fork`` sub-agents arrive together (``after`` the parent, no think time),
each the parent's prefix plus its own ``task_len``-token task. Every sub-agent finds
the prefix on the parent's replica only: the router waits there, recomputes it
elsewhere, or moves it (``router/policies/kv_pull_pricing.py``). Registered in
``workloads.WORKLOADS`` as ``fork``."""

from __future__ import annotations

import numpy as np

from kvroute.benchmarks.workload_types import RequestSpec, Workload

DEFAULT_VOCAB = 32000
_FIRST_TOKEN = 100  # keep clear of special-token ids


def _tokens(rng: np.random.Generator, n: int, vocab: int) -> tuple[int, ...]:
    return tuple(rng.integers(_FIRST_TOKEN, vocab, size=n).tolist())


def _scaled(n: int, s: float) -> int:
    return max(1, int(round(n * s)))


def fork(
    num_forks: int = 8,
    agents_per_fork: int = 43,
    prefix_len: int = 40_000,
    task_len: int = 128,
    output_len: int = 128,
    parent_output_len: int = 16,
    *,
    seed: int = 0,
    scale: float = 1.0,
    len_scale: float = 1.0,
    vocab_size: int = DEFAULT_VOCAB,
) -> Workload:
    """N sub-agents branching from one long prefix at once (module docstring);
    ``scale`` multiplies the forks, ``len_scale`` the lengths."""
    f = _scaled(num_forks, scale)
    pl, tl, ol = (_scaled(x, len_scale) for x in (prefix_len, task_len, output_len))
    rng = np.random.default_rng(seed)
    reqs: list[RequestSpec] = []
    for k in range(f):
        prefix = _tokens(rng, pl, vocab_size)
        parent = RequestSpec(f"fork-{k}", prefix, parent_output_len, group_id=k)
        reqs.append(parent)
        reqs += [RequestSpec(f"fork-{k}-agent-{j}", prefix + _tokens(rng, tl, vocab_size), ol, group_id=k, turn=1,
                             after=parent.request_id) for j in range(agents_per_fork)]  # fmt: skip
    params = dict(num_forks=f, agents_per_fork=agents_per_fork, prefix_len=pl, task_len=tl, output_len=ol,
                  parent_output_len=parent_output_len, seed=seed)  # fmt: skip
    return Workload("fork", reqs, params, shared_prefix_tokens=pl, num_groups=f)
