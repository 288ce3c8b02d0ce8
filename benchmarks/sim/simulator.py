"""Discrete-event simulation of N replicas behind the real Router.

Events, in simulated time (a heap ordered by (time, insertion order), so a run is
deterministic for a fixed workload and seed):

- arrival: hash the prompt (the replicas' HashSpec), ``router.route``, queue the request
  on the chosen replica, start a step there if it is idle;
- step end: the replica finishes its step (tokens, finishes, KV events); its events
  reach the router ``event_delay_s`` later (``apply``; a seq gap is answered with a
  snapshot); a finished multi-turn request releases its next turn ``think_time_s``
  later; the replica starts its next step if it has work;
- events delivered: ``router.apply``;
- join (scale-out): the last ``joining_replicas`` replicas are added to the router;
- failure: the first ``failing_replicas`` replicas die; each is replaced at once by an
  empty one under the same id (the router drops the old one and adds the new), and
  every request it held is routed again, keeping its arrival time and any first token
  already streamed (a retry redoes its whole prefill and decode);
- pulled (``pulls``): a request whose decision names ``pull_from`` is queued at its
  replica once the prefix has moved there (``pulls.py``).

The router's clock is the simulation's clock, so its pending-entry TTL runs in
simulated seconds.

``num_routers`` > 1: that many routers, each receiving every replica's events. With
``peer_delay_s`` >= 0 each decision reaches the other routers that much later
(``Router.note_routed``: kvroute's shared decisions); with ``peer_delay_s`` < 0 they
never do (independent routers, the way users scale the peers' routers). Clients are
spread evenly over ``num_ingresses`` (default: one per router), and a request's router
is chosen by ``router_choice``: ``"own"``, each ingress its own router (the peers' way,
and kvroute's first design); ``"first"``, kvroute's ``cluster/router_choice.py``: every
ingress asks the routers in one order and passes over a router with ``spill_at`` of its
decisions unanswered or whose last answer reported it busy (its share of the last
``LOAD_SAMPLE_S`` spent deciding, as ``RouterService.load`` reports its CPU). A router
takes ``router_decision_s`` per decision, in order (its queue: what makes one router
too few past 1 / ``router_decision_s`` requests/s); the request is routed when its
decision is made, and its TTFT counts the wait.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass
from typing import Any, Callable

from kvroute.replica.profiles import StepProfile
from kvroute.benchmarks.sim import pulls
from kvroute.benchmarks.sim.replica import SimReplica, SimRequest
from kvroute.benchmarks.workloads import RequestSpec, Workload
from kvroute.replica.block_hash import HashSpec, hash_blocks
from kvroute.cluster.router_choice import LOAD_SAMPLE_S, SPILL_AT, RouterChoice
from kvroute.replica.kv_events import KVEvents
from kvroute.replica.scheduler import SchedulerConfig
from kvroute.router.reuse import ReuseAccount

_ARRIVAL, _STEP_END, _EVENTS, _JOIN, _FAIL, _PEER, _DECIDE, _PULLED = 0, 1, 2, 3, 4, 5, 6, 7


@dataclass(frozen=True)
class SimConfig:
    num_replicas: int = 8
    kv_blocks: int = 26_800  # per replica
    block_size: int = 16
    max_num_batched_tokens: int = 8192
    max_num_seqs: int = 256
    event_delay_s: float = 0.0
    pending_ttl_s: float = 5.0
    hash_seed: int = 0
    host_kv_blocks: int = 0  # per replica: a host tier behind the device cache (0: none)
    joining_replicas: int = 0  # scale-out: the last ones of num_replicas join (empty) at join_at_s
    join_at_s: float = 0.0
    failing_replicas: int = 0  # failure: the first ones of num_replicas die at fail_at_s, replaced empty
    fail_at_s: float = 0.0
    num_routers: int = 1  # routers, each fed every replica's events
    peer_delay_s: float = 0.0  # a decision reaches the other routers this much later (< 0: never)
    num_ingresses: int = 0  # clients spread evenly over this many (0: one per router)
    router_choice: str = "own"  # "own": each ingress its router; "first": one order, spilling (router_choice.py)
    router_decision_s: float = 0.0  # a router's time per decision, in order (0: instant)
    spill_at: int = SPILL_AT  # "first": an ingress passes over a router with this many of its decisions waiting
    max_loras: int = 0  # LoRA adapter slots per replica (0: no adapters)
    lora_rank: int = 16  # every adapter's rank (its slot load: the profile's adapter_load_time)
    max_requests: int = 0  # a replica holding this many passes a request to the one holding fewest (Serve's cap; 0: none)
    pulls: bool = False  # replicas report the profile's pull figures and act on a decision's pull_from (pulls.py)
    warmup_prefixes: int = 0  # a joining replica first pulls this many hot prefixes (pulls.warm_up)

    def __post_init__(self) -> None:
        if self.num_replicas < 1:
            raise ValueError(f"num_replicas must be >= 1, got {self.num_replicas}")
        if not 0 <= self.joining_replicas < self.num_replicas:
            raise ValueError(f"joining_replicas must be in [0, num_replicas), got {self.joining_replicas}")
        if not 0 <= self.failing_replicas <= self.num_replicas - self.joining_replicas:
            raise ValueError(f"failing_replicas must be in [0, the replicas present at the start], got {self.failing_replicas}")
        if self.event_delay_s < 0:
            raise ValueError(f"event_delay_s must be >= 0, got {self.event_delay_s}")
        if self.num_routers < 1:
            raise ValueError(f"num_routers must be >= 1, got {self.num_routers}")
        if self.router_choice not in ("own", "first") or self.router_decision_s < 0 or self.num_ingresses < 0:
            raise ValueError(f"need router_choice 'own' or 'first', router_decision_s >= 0 and num_ingresses >= 0, got "
                             f"{self.router_choice!r}, {self.router_decision_s!r}, {self.num_ingresses!r}")


def percentile(xs: list[float], q: float) -> float:
    """Linear-interpolated percentile (numpy's default), ``q`` in [0, 100]."""
    if not xs:
        return float("nan")
    s = sorted(xs)
    k = (len(s) - 1) * q / 100.0
    lo, hi = math.floor(k), math.ceil(k)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


class Simulation:
    def __init__(
        self,
        workload: Workload,
        policy: str,
        cost: StepProfile,
        config: SimConfig = SimConfig(),
        router_factory: Callable[..., Any] | None = None,
        **policy_kwargs: Any,
    ) -> None:
        if router_factory is None:
            from kvroute.router.router import Router

            router_factory = Router
        self.workload = workload
        self.policy = policy
        self.cost = cost
        self.config = config
        self.now = 0.0
        self.hash_spec = HashSpec(config.block_size, config.hash_seed, "sim")
        sched = SchedulerConfig(config.max_num_batched_tokens, config.max_num_seqs, max_loras=config.max_loras)
        self._sched = sched
        self.replicas = {f"r{i}": self._new_replica(f"r{i}") for i in range(config.num_replicas)}
        if policy == "oracle":
            policy_kwargs.setdefault("true_match", lambda rid, hashes: self.replicas[rid].true_match(list(hashes)))
        self.routers = [
            router_factory(policy, config.block_size, pending_ttl_s=config.pending_ttl_s, clock=lambda: self.now, **policy_kwargs)
            for _ in range(config.num_routers)
        ]
        self.router = self.routers[0]
        self._arrivals = 0
        self.router_stats: dict[str, int] = {"spills": 0, "failovers": 0}
        self._choices = [RouterChoice(config.num_routers, self.router_stats, config.spill_at)
                         for _ in range(config.num_ingresses or config.num_routers)]  # fmt: skip
        self._busy_until = [0.0] * config.num_routers  # each router's decisions queue
        self._router_load = [[0.0, 0.0, 0.0] for _ in range(config.num_routers)]  # load, sampled at, busy s then
        self.decisions_per_router = [0] * config.num_routers
        self._add(list(self.replicas)[: config.num_replicas - config.joining_replicas])
        self._heap: list[tuple[float, int, int, Any]] = []
        self._n = 0
        self._dependents: dict[str, list[RequestSpec]] = {}
        self.done: list[SimRequest] = []
        self.num_snapshots = 0
        self.reasons: dict[str, int] = {}
        self.num_retried = 0
        self.passed_on = 0  # requests a full replica passed to another (``max_requests``)
        self.pull_stats = pulls.PullStats()
        self._inflight: dict[str, list[tuple[list, list[SimRequest]]]] = {}  # replica -> pulls: (hashes, waiters)

    def _add(self, replica_ids: list[str]) -> None:
        for router in self.routers:
            for rid in replica_ids:
                router.add_replica(rid, self.config.kv_blocks, self.config.host_kv_blocks)
                router.report_load(rid, self.replicas[rid].load())  # as a replica registers: its slots and cap

    def _join(self, replica_ids: list[str], warm: bool) -> None:
        """Replicas join: each warms up first (``pulls.warm_up``), then the routers add it
        with what it caches."""
        if not warm and self.config.warmup_prefixes:
            for rid in replica_ids:
                s = pulls.warm_up(self.router, self.replicas[rid], self.replicas, self.config.warmup_prefixes, self.config.block_size)
                self._push(self.now + s, _JOIN, ([rid], True))
            return
        self._add(replica_ids)
        for router in self.routers if warm else ():
            for rid in replica_ids:
                rep = self.replicas[rid]
                router.apply_snapshot(rid, rep.kv.cached_block_hashes(), rep.telemetry.seq, rep.load())

    def _new_replica(self, replica_id: str) -> SimReplica:
        c = self.config
        rep = SimReplica(replica_id, c.kv_blocks, self.hash_spec, self.cost, self._sched, c.host_kv_blocks, c.max_loras,
                         c.lora_rank)  # fmt: skip
        rep.telemetry.max_requests = c.max_requests  # reported, as an engine replica under Serve reports its cap
        if c.pulls:
            pulls.report_pulls(rep)
        return rep

    def _push(self, t: float, kind: int, payload: Any) -> None:
        heapq.heappush(self._heap, (t, self._n, kind, payload))
        self._n += 1

    # ------------------------------------------------------------------ run
    def run(self) -> dict[str, Any]:
        for spec in self.workload.requests:
            if spec.after is None:
                self._push(spec.arrival_s, _ARRIVAL, spec)
            else:
                self._dependents.setdefault(spec.after, []).append(spec)
        if self.config.joining_replicas:
            self._push(self.config.join_at_s, _JOIN, (list(self.replicas)[-self.config.joining_replicas :], False))
        if self.config.failing_replicas:
            self._push(self.config.fail_at_s, _FAIL, list(self.replicas)[: self.config.failing_replicas])
        while self._heap:
            t, _, kind, payload = heapq.heappop(self._heap)
            self.now = t
            if kind == _ARRIVAL:
                self._arrive(payload)
            elif kind == _DECIDE:
                spec, ingress, k, arrival_s = payload
                self._choices[ingress].answered(k, True, load=self._load(k))
                self._route(spec, k, arrival_s)
            elif kind == _STEP_END:
                self._step_end(payload)
            elif kind == _JOIN:
                self._join(*payload)
            elif kind == _FAIL:
                self._fail(payload)
            elif kind == _PEER:
                router, args = payload
                router.note_routed(*args)
            elif kind == _PULLED:
                self._pulled(*payload)
            else:
                self._deliver(payload)
        return self.metrics()

    def _arrive(self, spec: RequestSpec) -> None:
        """Hand ``spec`` to its ingress' router; routed when the router gets to it."""
        ingress = self._arrivals % len(self._choices)
        self._arrivals += 1
        if self.config.router_choice == "first":
            k = self._choices[ingress].order()[0]
        else:
            k = ingress % len(self.routers)
        if self.config.router_decision_s <= 0:
            return self._route(spec, k, self.now)
        self._choices[ingress].asking(k)
        self._busy_until[k] = max(self.now, self._busy_until[k]) + self.config.router_decision_s
        self._push(self._busy_until[k], _DECIDE, (spec, ingress, k, self.now))

    def _load(self, k: int) -> float:
        """Router ``k``'s share of the last interval of at least ``LOAD_SAMPLE_S`` spent
        deciding (``RouterService.load``'s CPU use)."""
        sample = self._router_load[k]
        busy = self.decisions_per_router[k] * self.config.router_decision_s
        if self.now - sample[1] >= LOAD_SAMPLE_S:
            sample[:] = [(busy - sample[2]) / (self.now - sample[1]), self.now, busy]
        return sample[0]

    def _route(self, spec: RequestSpec, k: int, arrival_s: float, first_token_s: float | None = None) -> None:
        """Router ``k`` routes ``spec`` and it is queued; a retry passes its original
        arrival and first token."""
        self.decisions_per_router[k] += 1
        hashes = hash_blocks(self.hash_spec, spec.prompt_token_ids, spec.cache_salt, lora_name=spec.lora_name)
        # a text-matching peer sees the prompt, not the salt; it keys an adapter's prompts apart (the model name)
        text = None if spec.cache_salt is None else hash_blocks(self.hash_spec, spec.prompt_token_ids, lora_name=spec.lora_name)
        decision = self.routers[k].route(hashes, spec.num_prompt_tokens, None, text, lora_name=spec.lora_name)
        if self.config.peer_delay_s >= 0:
            for j, peer in enumerate(self.routers):
                args = (decision.replica_id, hashes, spec.num_prompt_tokens, decision.ticket, spec.lora_name)
                if j == k:
                    continue
                if self.config.peer_delay_s == 0:
                    peer.note_routed(*args)
                else:
                    self._push(self.now + self.config.peer_delay_s, _PEER, (peer, args))
        rep = self.replicas[decision.replica_id]
        cap = self.config.max_requests
        if cap and len(rep.requests) >= cap:  # Serve passes it on to the shortest queue, whatever it caches
            rep = min(self.replicas.values(), key=lambda r: len(r.requests))
            self.passed_on += 1
        req = rep.make_request(spec, hashes, self.now)
        req.route_ticket = decision.ticket
        sim = SimRequest(spec, req, arrival_s, rep.replica_id,
                         decision.expected_cached_tokens, decision.reason, first_token_s, decision.available_tokens)  # fmt: skip
        self.reasons[decision.reason] = self.reasons.get(decision.reason, 0) + 1
        if self.config.pulls and decision.pull_from is not None and rep.replica_id == decision.replica_id:
            run = pulls.lease(self.replicas[decision.pull_from], hashes, decision.pull_tokens // self.config.block_size)
            if run.blocks:  # the prefix moves first; the request queues when it is there
                nbytes = pulls.missing(rep, run) * self.config.block_size * self.cost.kv_bytes_per_token
                waiters = [sim]
                self._inflight.setdefault(rep.replica_id, []).append(([b[0] for b in run.blocks], waiters))
                self._push(self.now + self.cost.pull_time(nbytes), _PULLED, (rep, waiters, run, nbytes))
                return
            self.pull_stats.fallbacks["not_cached"] = self.pull_stats.fallbacks.get("not_cached", 0) + 1
        for run_hashes, waiters in self._inflight.get(rep.replica_id, ()):  # a pull of its prefix is on its way
            if hashes[: len(run_hashes)] == run_hashes:
                waiters.append(sim)
                return
        self._queue(rep, sim)

    def _queue(self, rep: SimReplica, sim: SimRequest) -> None:
        rep.add(sim)
        if not rep.busy:
            self._start(rep)

    def _pulled(self, rep: SimReplica, waiters: list[SimRequest], run: "pulls.Lease", nbytes: int) -> None:
        """A pull ends: the run is cached at ``rep`` and the request that asked for it,
        then those that came for the same prefix meanwhile, queue there (if ``rep``
        died meanwhile, they are routed again)."""
        if self.replicas[rep.replica_id] is not rep:
            for sim in waiters:
                self._route(sim.spec, 0, sim.arrival_s, sim.first_token_s)
            return
        self._inflight[rep.replica_id] = [p for p in self._inflight[rep.replica_id] if p[1] is not waiters]
        blocks = pulls.commit(rep, run)
        st = self.pull_stats
        st.pulls, st.pulled_bytes, st.seconds = st.pulls + 1, st.pulled_bytes + nbytes, st.seconds + self.cost.pull_time(nbytes)
        st.pulled_tokens += blocks * self.config.block_size
        waiters[0].pulled_tokens = blocks * self.config.block_size
        for sim in waiters:
            self._queue(rep, sim)

    def _fail(self, replica_ids: list[str]) -> None:
        """The replicas die and come back empty; what they held is routed again."""
        lost = []
        for rid in replica_ids:
            lost += self.replicas[rid].requests.values()
            self.replicas[rid] = self._new_replica(rid)  # the dead one's pending step end is ignored
            self._inflight.pop(rid, None)  # its pulls' requests are routed again when each pull would have ended
            for router in self.routers:
                router.remove_replica(rid)
            self._add([rid])
        self.num_retried += len(lost)
        for sim in lost:  # (routed again at once, by the first router)
            self._route(sim.spec, 0, sim.arrival_s, sim.first_token_s)

    def _start(self, rep: SimReplica) -> None:
        dur = rep.start_step()
        if dur is not None:
            self._push(self.now + dur, _STEP_END, rep)

    def _step_end(self, rep: SimReplica) -> None:
        if self.replicas[rep.replica_id] is not rep:  # a step of a replica that died
            return
        _, finished, events = rep.finish_step(self.now)
        if self.config.event_delay_s > 0:
            self._push(self.now + self.config.event_delay_s, _EVENTS, events)
        else:
            self._deliver(events)
        for sim in finished:
            self.done.append(sim)
            for nxt in self._dependents.pop(sim.spec.request_id, ()):
                self._push(self.now + nxt.think_time_s, _ARRIVAL, nxt)
        if rep.has_work():
            self._start(rep)

    def _deliver(self, events: KVEvents) -> None:
        for router in self.routers:
            if not router.apply(events):
                rep = self.replicas[events.replica_id]
                router.apply_snapshot(rep.replica_id, rep.kv.cached_block_hashes(), rep.telemetry.seq, rep.load(),
                                      rep.kv.host_block_hashes())  # fmt: skip
                self.num_snapshots += 1

    # ------------------------------------------------------------------ metrics
    def metrics(self) -> dict[str, Any]:
        done = self.done
        n_req = len(self.workload.requests)
        prompt = sum(s.spec.num_prompt_tokens for s in done)
        cached = sum(max(s.request.num_cached_tokens, 0) for s in done)
        host_cached = sum(s.request.num_host_cached_tokens for s in done)
        out_tokens = sum(s.request.num_output_tokens for s in done)
        ttft = [s.first_token_s - s.arrival_s for s in done if s.first_token_s is not None]
        e2e = [s.finish_s - s.arrival_s for s in done if s.finish_s is not None]
        start = min((s.arrival_s for s in done), default=0.0)
        end = max((s.finish_s for s in done if s.finish_s is not None), default=0.0)
        err = [
            abs(s.expected_cached_tokens - max(s.request.num_cached_tokens, 0)) / s.spec.num_prompt_tokens for s in done
        ]
        reuse = ReuseAccount()
        for s in done:
            reuse.add(s.spec.num_prompt_tokens, s.available_tokens, s.expected_cached_tokens,
                      max(s.request.num_cached_tokens, 0), s.reason, s.pulled_tokens)  # fmt: skip
        leaked = sum(sum(1 for c in rep.block_ref_counts() if c) for rep in self.replicas.values())
        loads = sum(rep.loras.num_slot_loads for rep in self.replicas.values() if rep.loras is not None)
        per_replica = {rid: 0 for rid in self.replicas}
        for s in done:
            per_replica[s.replica_id] += 1
        return {
            "policy": self.policy,
            "num_requests": n_req,
            "completed": len(done),
            "prompt_tokens": prompt,
            "cached_tokens": cached,
            "hit_rate": cached / prompt if prompt else 0.0,
            "host_hit_rate": host_cached / prompt if prompt else 0.0,
            "ttft_p50_s": percentile(ttft, 50),
            "ttft_p90_s": percentile(ttft, 90),
            "ttft_p99_s": percentile(ttft, 99),
            "ttft_mean_s": sum(ttft) / len(ttft) if ttft else float("nan"),
            "e2e_p50_s": percentile(e2e, 50),
            "output_tokens": out_tokens,
            "makespan_s": end - start,
            "output_tokens_per_s": out_tokens / (end - start) if end > start else 0.0,
            "pred_cached_err": sum(err) / len(err) if err else 0.0,
            "joined": pulls.joined_window(done, set(list(self.replicas)[-self.config.joining_replicas :]),
                                          self.config.join_at_s) if self.config.joining_replicas else None,  # fmt: skip
            "reuse": reuse.as_dict(),
            "preemptions": sum(r.scheduler.num_preemptions for r in self.replicas.values()),
            "snapshots": self.num_snapshots,
            "retried": self.num_retried,
            "passed_on": self.passed_on,
            "adapter_loads": loads,
            "adapter_loads_per_1k": 1000 * loads / len(done) if done else 0.0,
            "leaked_blocks": leaked,
            "requests_per_replica": per_replica,
            "reasons": dict(sorted(self.reasons.items())),
            "pulls": self.pull_stats.as_dict(),
            "decisions_per_router": list(self.decisions_per_router),
            "router_spills": self.router_stats["spills"],
            "busy_fraction": {
                rid: round(r.busy_s / (end - start), 4) if end > start else 0.0 for rid, r in self.replicas.items()
            },
        }
