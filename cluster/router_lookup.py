"""Finding and ending an application's router actors (and its other detached actors)
by name: operators' and tests' handles on a running generation."""

from __future__ import annotations

from typing import Callable

import ray

from kvroute.cluster.messages import ROUTER_NAMESPACE


def kill_router_actors(app_name: str) -> int:
    """Kill every detached actor of application ``app_name``, of every generation
    (routers, worker pool, LoRA registry, and the registry's saved state, the Responses
    API's store); how many there were."""
    from kvroute.cluster.lora import kill_lora_registry
    from kvroute.cluster.response_store_actor import kill_response_store
    from kvroute.cluster.saved_state import delete_saved

    prefixes = tuple(f"kvroute-{role}:{app_name}@" for role in ("router", "workers"))
    names = _named_actors(lambda n: n.startswith(prefixes))
    killed = sum(kill_router_actor(n) for n in names) + kill_lora_registry(app_name) + kill_response_store(app_name)
    for name in names:  # a pool's saved worker list (cluster/worker_pool.py)
        if name.startswith(prefixes[1]):
            delete_saved(f"worker-pool:{name}")
    return killed


def app_router_names(app_name: str) -> list[str]:
    """The live router actors of application ``app_name``, every generation, sorted."""
    return sorted(_named_actors(lambda n: n.startswith(f"kvroute-router:{app_name}@")))


def _named_actors(match: Callable[[str], bool]) -> list[str]:
    """The names of the live actors in the routers' namespace that ``match``."""
    return [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
            if a.get("namespace") == ROUTER_NAMESPACE and match(a["name"])]  # fmt: skip


def app_router(app_name: str, index: int = 0) -> ray.actor.ActorHandle:
    """Router ``index`` of the one running generation of ``app_name`` (tests, operators);
    ValueError where none or several generations run."""
    names = app_router_names(app_name)
    generations = {n.split("@")[1].split(":")[0] for n in names}
    if len(generations) != 1:
        raise ValueError(f"application {app_name!r} has {len(generations)} router generations: {names}")
    first = min(names, key=len)
    return ray.get_actor(first if index == 0 else f"{first}:{index}", namespace=ROUTER_NAMESPACE)


def kill_router_actor(name: str) -> bool:
    try:
        actor = ray.get_actor(name, namespace=ROUTER_NAMESPACE)
    except ValueError:
        return False
    ray.kill(actor, no_restart=True)
    return True
