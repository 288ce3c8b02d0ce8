"""What a fleet can serve, from the cost model alone (no simulation): the rate at which a
cache-ideal router saturates it, the figure every load fraction of the simulated and
measured benchmarks is a fraction of."""

from __future__ import annotations

from kvroute.benchmarks.sim.simulator import SimConfig
from kvroute.benchmarks.workload_types import Workload
from kvroute.replica.block_hash import HashSpec, hash_blocks
from kvroute.replica.profiles import StepProfile


def ideal_cache(workload: Workload, block_size: int) -> tuple[list[int], int]:
    """(per request, the prompt tokens a single infinite cache would still compute —
    everything seen before, prompts and planned answers, is a hit —, how many distinct
    blocks some later request hits)."""
    spec = HashSpec(block_size, 0, "capacity")
    seen: set[int] = set()
    reused: set[int] = set()
    out: list[int] = []
    for r in workload.requests:
        hashes = hash_blocks(spec, r.prompt_token_ids, r.cache_salt)
        hit = 0
        for h in hashes[: (r.num_prompt_tokens - 1) // block_size]:
            if h not in seen:
                break
            hit += 1
        reused.update(hashes[:hit])
        out.append(r.num_prompt_tokens - hit * block_size)
        seen.update(hashes)
        if r.output_token_ids is not None:
            seen.update(hash_blocks(spec, tuple(r.prompt_token_ids) + tuple(r.output_token_ids), r.cache_salt))
    return out, len(reused)


def estimate_capacity(workload: Workload, cost: StepProfile, config: SimConfig) -> dict[str, float]:
    """The request rate at which the fleet saturates, from the cost model.

    Per request: its ideally-uncached prompt tokens at the prefill rate, plus its output
    tokens at the per-token cost of a decode step at batch B, where B is the smaller of
    ``max_num_seqs`` and how many running requests fit in a replica's KV cache. Under a
    cache-ideal router the blocks later requests reuse (a group's shared prefix) sit in
    one replica's cache once, those of all groups spread over the replicas, and each
    running request adds only what it computes itself plus half its output; when the
    shared blocks take more than half the cache, each request is counted whole (as
    if nothing stayed shared). Fleet capacity = replicas / mean per-request seconds. An
    upper bound for a cache-ideal router: a policy that misses more saturates earlier.
    """
    reqs = workload.requests
    bs = config.block_size
    uncached, reused_blocks = ideal_cache(workload, bs)
    avg_ctx = sum(r.num_prompt_tokens + r.output_len / 2 for r in reqs) / len(reqs)
    kv_tokens = config.kv_blocks * bs
    resident = reused_blocks * bs / config.num_replicas
    if resident <= kv_tokens / 2:
        own = sum(u + r.output_len / 2 for u, r in zip(uncached, reqs)) / len(reqs)
        fits = (kv_tokens - resident) / max(own, 1.0)
    else:
        fits = kv_tokens / avg_ctx
    batch = max(1, min(config.max_num_seqs, int(fits)))
    step = cost.step_time(0, batch, int(batch * avg_ctx))
    per_req = [u / cost.prefill_tokens_per_s + r.output_len * step / batch for u, r in zip(uncached, reqs)]
    mean_s = sum(per_req) / len(per_req)
    return {
        "capacity_rps": config.num_replicas / mean_s,
        "decode_batch": batch,
        "decode_step_s": step,
        "mean_request_s": mean_s,
        "ideal_hit_rate": 1 - sum(uncached) / workload.prompt_tokens,
    }
