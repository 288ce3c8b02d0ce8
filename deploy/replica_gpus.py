"""How many engine replicas ``kvroute serve`` starts and how many GPUs each reserves.

As a ``vllm serve`` user expects of a machine with GPUs: by default each replica takes one
GPU and there is one replica per visible GPU. Without GPUs (or for replicas that run no
model on one: emulated, ``device`` cpu) nothing changes: 2 replicas, no GPU. The Serve
config says the same with ``deployment_config.ray_actor_options.num_gpus`` and
``num_replicas``.
"""

from __future__ import annotations


def replica_gpus(replicas: int | None, gpus_per_replica: float | None, visible_gpus: int, runs_model: bool,
                 local: bool) -> tuple[int, float]:  # fmt: skip
    """``(replicas, GPUs per replica)``: ``replicas`` and ``gpus_per_replica`` where given
    (None: the default). Where ``visible_gpus`` > 0 and the replicas run a model
    (``runs_model``), the defaults are 1 GPU each and as many replicas as the GPUs hold
    (at least one); otherwise 0 GPUs and 2 replicas. ``local``: the GPUs counted are
    all there will be (this machine, not a cluster joined by address that may grow), so
    replicas needing more are a ValueError instead of a deploy that never starts."""
    if gpus_per_replica is not None and not gpus_per_replica >= 0:
        raise ValueError(f"--num-gpus-per-replica must be >= 0, got {gpus_per_replica}")
    if replicas is not None and replicas < 1:
        raise ValueError(f"--replicas must be >= 1, got {replicas}")
    if visible_gpus < 0:
        raise ValueError(f"visible_gpus must be >= 0, got {visible_gpus}")
    on_gpu = visible_gpus > 0 and runs_model
    gpus = float(gpus_per_replica if gpus_per_replica is not None else 1.0 if on_gpu else 0.0)
    if replicas is None:
        replicas = max(1, int(visible_gpus // gpus)) if on_gpu and gpus > 0 else 2
    if local and gpus > 0 and replicas * gpus > visible_gpus:
        raise ValueError(f"{replicas} replica(s) x --num-gpus-per-replica {gpus:g} need {replicas * gpus:g} GPUs; "
                         f"this machine has {visible_gpus}")  # fmt: skip
    return replicas, gpus


def local_gpu_count() -> int:
    """CUDA devices this process sees (``CUDA_VISIBLE_DEVICES`` applies); 0 without torch."""
    try:
        import torch
    except ImportError:
        return 0
    return torch.cuda.device_count()
