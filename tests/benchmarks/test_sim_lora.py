"""LoRA adapters in the simulator (benchmarks/sim): adapter slots are LRU and counted, a
LoRA request's blocks never meet another adapter's, nothing leaks, and the Ray peers
prefer replicas with the adapter loaded (Ray Serve's multiplexed-model routing)."""

from __future__ import annotations

import pytest

from kvroute.benchmarks import workloads as W
from kvroute.benchmarks.sim.simulator import SimConfig, Simulation
from kvroute.replica.profiles import get_profile
from kvroute.router.policies.common import multiplex_candidates
from kvroute.router.types import ReplicaLoad, RouteRequest

COST = get_profile("gpu_h100_llama3_8b")


def test_adapter_slots_in_the_simulator_are_lru_and_counted():
    sys_prompt = tuple(range(1000, 1000 + 64))
    names = ["a", "b", "a", "c", "b"]  # one replica; with one slot every change of adapter is a load
    reqs = [W.RequestSpec(f"q{i}", sys_prompt + (i,), 4, arrival_s=i * 1.0, lora_name=n) for i, n in enumerate(names)]
    m = Simulation(W.Workload("t", reqs), "kvroute", COST, SimConfig(num_replicas=1, kv_blocks=500, max_loras=1)).run()
    assert m["completed"] == 5 and m["adapter_loads"] == 5 and m["leaked_blocks"] == 0
    two = Simulation(W.Workload("t", reqs), "kvroute", COST, SimConfig(num_replicas=1, kv_blocks=500, max_loras=2)).run()
    assert two["adapter_loads"] == 4  # a, b, (a resident), c evicts b (least recently used), b evicts a
    # the same tokens under another adapter are other blocks: only the second a and the
    # second b reuse their own adapter's 64 tokens (one shared cache would give 4 x 64)
    assert two["cached_tokens"] == 128


def test_a_lora_request_needs_adapter_slots():
    reqs = [W.RequestSpec("q", (1, 2, 3), 2, lora_name="a")]
    with pytest.raises(ValueError, match="names LoRA adapter 'a'; set max_loras"):
        Simulation(W.Workload("t", reqs), "kvroute", COST, SimConfig(num_replicas=1, kv_blocks=100)).run()


def test_ray_peers_prefer_replicas_with_the_adapter_loaded():
    class View:
        loads = {"r0": ReplicaLoad(resident_loras=("x", "y")), "r1": ReplicaLoad(resident_loras=("z",)),
                 "r2": ReplicaLoad(resident_loras=("x",))}  # fmt: skip

        def load(self, r):
            return self.loads[r]

    req = RouteRequest([], 10, ["r0", "r1", "r2"], lora_name="x")
    assert multiplex_candidates(req, View()) == ["r0", "r2"]
    assert multiplex_candidates(RouteRequest([], 10, ["r0", "r1", "r2"], lora_name="w"), View()) == ["r1", "r2"]
    assert multiplex_candidates(RouteRequest([], 10, ["r0", "r1"]), View()) == ["r0", "r1"]


def test_cold_adapters_of_one_step_load_in_name_order():
    """Not in a set's order, which follows the process' string hashing: the LRU order, and
    so every later eviction of a simulated run, would depend on PYTHONHASHSEED."""
    from kvroute.replica.lora.slots import AdapterInfo, EmulatedSlots

    slots = EmulatedSlots(6, 16, None, COST.adapter_load_time)
    names = ["lora-9", "lora-30", "lora-2", "lora-17", "lora-41", "lora-5"]
    for n in names:
        slots.register(AdapterInfo(n, None, 16))
    assert slots.acquire(names) == pytest.approx(6 * COST.adapter_load_time(16))
    assert list(slots.resident) == sorted(names) and slots.acquire(names[:2]) == 0.0


@pytest.mark.parametrize("policy", ["kvroute", "consistent_hash"])
def test_a_replica_at_its_serving_cap_passes_requests_on_unless_the_router_avoids_it(policy):
    """Two replicas taking at most 2 requests at once, three long requests of one prefix
    at once: consistent hashing sends all three to one replica, which passes the third
    on (Serve's behaviour) to the one holding fewest; kvroute reads the cap in the load
    reports and places the third itself, so nothing is passed on."""
    reqs = [W.RequestSpec(f"q{i}", tuple(range(64)) + (1000 + i,), 64, arrival_s=0.001 * i) for i in range(3)]
    cfg = SimConfig(num_replicas=2, kv_blocks=500, max_requests=2)
    m = Simulation(W.Workload("t", reqs), policy, COST, cfg).run()
    assert m["completed"] == 3 and m["leaked_blocks"] == 0
    assert m["passed_on"] == (0 if policy == "kvroute" else 1)
