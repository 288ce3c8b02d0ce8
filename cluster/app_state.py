"""What an application keeps in Ray's GCS internal KV across its deploys: the block-hash
seed. Every build of an application's config (``serve deploy``, ``serve run
config.yaml``, KubeRay's ``serveConfigV2``, ``kvroute serve``) runs in a process
connected to the cluster, so the first build draws the seed and stores it under the
application's name, and every later build of that application reads it back: an
unchanged config then has an unchanged generation (``ClusterConfig.generation``) and a
redeploy keeps its replicas, routers and caches. The seed stays secret to the cluster
(a predictable seed would let a client craft prompts whose block hashes collide with
another's). A builder that runs before Ray is connected (``serve run
module:builder``) draws one per build, as ``with_random_hash_seed`` does.
"""

from __future__ import annotations

import dataclasses
import logging
import secrets

from kvroute.cluster.config import ClusterConfig

log = logging.getLogger(__name__)

def stored_hash_seed(app_name: str) -> int | None:
    """The application's block-hash seed, drawn and stored on first use; None when this
    process is not connected to a Ray cluster."""
    import ray

    from kvroute.cluster.saved_state import save_json_once

    if not ray.is_initialized():
        return None
    return int(save_json_once(f"hash_seed:{app_name}", secrets.randbits(63)))


def forget_hash_seed(app_name: str) -> None:
    """Drop the stored seed (the application is gone for good)."""
    from kvroute.cluster.saved_state import delete_saved

    delete_saved(f"hash_seed:{app_name}")


def with_app_hash_seed(config: ClusterConfig) -> ClusterConfig:
    """``config`` with its application's stored seed (a fresh one where Ray is not
    connected yet, logged: such builds redeploy with new replicas)."""
    seed = stored_hash_seed(config.app_name)
    if seed is None:
        log.warning("kvroute: Ray is not connected while building application %r: its block-hash seed is drawn "
                    "for this build only (pin engine_kwargs.hash_seed to keep replicas across redeploys)",
                    config.app_name)  # fmt: skip
        return config.with_random_hash_seed()
    return dataclasses.replace(config, engine=dataclasses.replace(config.engine, hash_seed=seed))
