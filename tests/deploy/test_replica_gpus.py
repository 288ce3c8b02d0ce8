"""GPUs per replica on ``kvroute serve``: the defaults with and without GPUs, the flags,
and that the Serve application's config carries them (deploy/replica_gpus.py, the CLI)."""

from __future__ import annotations

import pytest

from kvroute.deploy.cli import build_parser, main, serve_app_args
from kvroute.deploy.replica_gpus import local_gpu_count, replica_gpus


def _app(*flags: str, gpus: int, local: bool = True):
    return serve_app_args(build_parser().parse_args(["serve", *flags]), gpus, local)


def _layout(app) -> tuple[int, dict]:
    dep = app.llm_configs[0].deployment_config
    return dep.num_replicas, dep.ray_actor_options


def test_without_gpus_nothing_changes() -> None:
    app = _app(gpus=0)
    assert _layout(app) == (2, {"num_cpus": 1.0, "num_gpus": 0.0})
    config = app.cluster_config()
    assert (config.num_replicas, config.num_gpus_per_replica) == (2, 0.0)


def test_one_replica_per_visible_gpu_by_default() -> None:
    app = _app(gpus=4)
    assert _layout(app) == (4, {"num_cpus": 1.0, "num_gpus": 1.0})
    config = app.cluster_config()  # what build_engine_deployment puts in ray_actor_options
    assert (config.num_replicas, config.num_gpus_per_replica) == (4, 1.0)


@pytest.mark.parametrize(
    "flags, layout",
    [
        (["--num-gpus-per-replica", "2"], (2, 2.0)),
        (["--num-gpus-per-replica", "0.5"], (8, 0.5)),
        (["--replicas", "3"], (3, 1.0)),
        (["--replicas", "2", "--num-gpus-per-replica", "2"], (2, 2.0)),
        (["--num-gpus-per-replica", "0"], (2, 0.0)),  # CPU replicas on a GPU machine
        (["--emulate", "cpu_measured"], (2, 0.0)),  # no model: no GPU
        (["--engine-kwargs", '{"device": "cpu"}'], (2, 0.0)),
        (["--emulate", "cpu_measured", "--num-gpus-per-replica", "1"], (2, 1.0)),  # asked for: given
    ],
)
def test_flags_on_a_four_gpu_machine(flags: list[str], layout: tuple[int, float]) -> None:
    replicas, options = _layout(_app(*flags, gpus=4))
    assert (replicas, options["num_gpus"]) == layout


def test_a_joined_cluster_may_grow() -> None:
    """With --address the GPUs counted are the cluster's now: more may join, so asking
    for more is left to Ray's scheduler."""
    assert _layout(_app("--replicas", "6", gpus=4, local=False))[0] == 6
    assert _layout(_app("--num-gpus-per-replica", "1", "--replicas", "2", gpus=0, local=False)) == (
        2, {"num_cpus": 1.0, "num_gpus": 1.0})  # fmt: skip


@pytest.mark.parametrize(
    "args, message",
    [
        ((None, -1.0, 4, True, True), "--num-gpus-per-replica must be >= 0, got -1.0"),
        ((0, None, 4, True, True), "--replicas must be >= 1, got 0"),
        ((5, None, 4, True, True), "5 replica(s) x --num-gpus-per-replica 1 need 5 GPUs; this machine has 4"),
        ((None, 8.0, 4, True, True), "1 replica(s) x --num-gpus-per-replica 8 need 8 GPUs; this machine has 4"),
        ((None, 1.0, 0, True, True), "need 2 GPUs; this machine has 0"),
        ((None, None, -1, True, True), "visible_gpus must be >= 0"),
    ],
)
def test_bad_layouts(args: tuple, message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        replica_gpus(*args)


def test_serve_exits_2_before_ray_starts_when_this_machine_lacks_the_gpus(capsys) -> None:
    """On this machine's real GPU count: asking for one more GPU than it has is an error
    before anything starts."""
    have = local_gpu_count()
    assert main(["serve", "--num-gpus-per-replica", "1", "--replicas", str(have + 1)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvroute: error: ") and f"this machine has {have}" in err
    assert main(["serve", "--num-gpus-per-replica", "-2"]) == 2
    assert "--num-gpus-per-replica must be >= 0" in capsys.readouterr().err
