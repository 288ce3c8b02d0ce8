"""Routing policies: ours (``kvroute``) and the peer baselines, behind one registry.

``POLICIES`` maps a policy name to ``"module:Class"``; ``make_policy`` imports the
module only when asked, so the registry costs nothing to import. See POLICIES.md for
the rules each baseline follows and where they come from.
"""

from __future__ import annotations

import importlib

from kvroute.router.policy import Policy

POLICIES: dict[str, str] = {
    "kvroute": "kvroute.router.policies.kvroute:KVRoutePolicy",
    "round_robin": "kvroute.router.policies.round_robin:RoundRobinPolicy",
    "power_of_two": "kvroute.router.policies.power_of_two:PowerOfTwoPolicy",
    "cache_aware_sglang": "kvroute.router.policies.cache_aware_sglang:CacheAwareSGLangPolicy",
    "cache_aware_vllm": "kvroute.router.policies.cache_aware_vllm:CacheAwareVLLMPolicy",
    "prefix_affinity_ray": "kvroute.router.policies.prefix_affinity_ray:PrefixAffinityRayPolicy",
    "weighted_scorers_gie": "kvroute.router.policies.weighted_scorers_gie:WeightedScorersGIEPolicy",
    "consistent_hash": "kvroute.router.policies.consistent_hash:ConsistentHashPolicy",
    "oracle": "kvroute.router.policies.oracle:OraclePolicy",
}


def policy_names() -> list[str]:
    """Every registered policy name, in registry order."""
    return list(POLICIES)


def make_policy(name: str, **kwargs) -> Policy:
    """Build the policy registered as ``name`` with ``kwargs`` for its constructor.

    ``oracle`` needs ``true_match=`` (the simulator's real cache lookup).
    """
    target = POLICIES.get(name)
    if target is None:
        raise ValueError(f"unknown policy {name!r}; known policies: {', '.join(POLICIES)}")
    module_name, class_name = target.split(":")
    cls = getattr(importlib.import_module(module_name), class_name)
    policy = cls(**kwargs)
    assert isinstance(policy, Policy) and cls.name == name, (name, cls)
    return policy
