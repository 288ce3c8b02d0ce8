"""The Serve config schema: deploy/serve.yaml and the KubeRay manifest parse and are
accepted by build_app's schema; bad args are refused with the field named."""

from __future__ import annotations

from pathlib import Path

import pytest

yaml = pytest.importorskip("yaml")
pytest.importorskip("ray")

from kvroute.deploy.app_config import parse_args, router_choice  # noqa: E402

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"


def _app_args(serve_config: dict) -> dict:
    (app,) = serve_config["applications"]
    assert app["import_path"] == "kvroute.deploy.app:build_app"
    return app["args"]


def test_serve_yaml_is_accepted():
    args = parse_args(_app_args(yaml.safe_load((DEPLOY / "serve.yaml").read_text())))
    config = args.cluster_config()
    assert config.engine.model == "smollm2-135m-instruct" and config.num_replicas == 2
    assert config.request_router == "kvroute" and config.router_policy == "kvroute"
    assert args.limits().max_body_bytes == 4 * 2**20


def test_kuberay_manifest_is_accepted():
    manifest = yaml.safe_load((DEPLOY / "k8s" / "rayservice.yaml").read_text())
    assert manifest["apiVersion"] == "ray.io/v1" and manifest["kind"] == "RayService"
    cluster = manifest["spec"]["rayClusterConfig"]
    assert cluster["headGroupSpec"]["rayStartParams"]["num-cpus"] == "0"
    head = cluster["headGroupSpec"]["template"]["spec"]["containers"][0]
    assert "nvidia.com/gpu" not in head["resources"]["limits"]
    (workers,) = cluster["workerGroupSpecs"]
    assert workers["template"]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == "1"
    args = parse_args(_app_args(yaml.safe_load(manifest["spec"]["serveConfigV2"])))
    config = args.cluster_config()
    assert config.num_gpus_per_replica == 1 and config.num_replicas is None
    assert config.autoscaling_config == {"min_replicas": 2, "max_replicas": 8, "target_ongoing_requests": 48}
    assert config.engine.device == "cuda" and config.engine.dtype == "bfloat16"


def test_an_application_keeps_its_stored_hash_seed_across_builds(ray_cluster):
    """Two builds of one application share the seed stored in the cluster (so an
    unchanged config keeps its generation, its routers and replicas); another
    application gets its own; a pinned seed wins; a build before Ray is connected draws one."""
    from kvroute.cluster.app_state import forget_hash_seed, with_app_hash_seed

    def build(app: str, **engine):
        args = {"app_name": app, "llm_configs": [{"model_loading_config": {"model_id": "m"}, "engine_kwargs": engine}]}
        return with_app_hash_seed(parse_args(args).cluster_config())

    try:
        a, b, other = build("seed-a"), build("seed-a"), build("seed-b")
        assert a.engine.hash_seed == b.engine.hash_seed != 0 and a.generation == b.generation
        assert other.engine.hash_seed != a.engine.hash_seed
        changed = build("seed-a", block_size=32)
        assert changed.engine.hash_seed == a.engine.hash_seed and changed.generation != a.generation
        assert changed.router_actor_name != a.router_actor_name and changed.router_actor_name.startswith("kvroute-router:seed-a@")
    finally:
        forget_hash_seed("seed-a")
        forget_hash_seed("seed-b")
    pinned = {"llm_configs": [{"model_loading_config": {"model_id": "m"}, "engine_kwargs": {"hash_seed": 7}}]}
    assert parse_args(pinned).cluster_config().engine.hash_seed == 7


def test_a_build_without_ray_draws_a_seed_per_build():
    """Run apart: this test process may be connected to Ray already."""
    import subprocess
    import sys

    code = ("from kvroute.cluster.app_state import with_app_hash_seed; from kvroute.deploy.app import parse_args; "
            "c = parse_args({'llm_configs': [{'model_loading_config': {'model_id': 'm'}}]}).cluster_config(); "
            "print(with_app_hash_seed(c).engine.hash_seed, with_app_hash_seed(c).engine.hash_seed)")
    a, b = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert a != b and int(a) > 0


@pytest.mark.parametrize(
    "args, field",
    [
        ({}, "llm_configs"),
        ({"llm_configs": []}, "llm_configs"),
        ({"llm_configs": [{"model_loading_config": {"model_id": "m"}}] * 2}, "llm_configs"),
        ({"llm_configs": [{"model_loading_config": {}}]}, "model_id"),
        ({"llm_configs": [{"model_loading_config": {"model_id": "m"}, "engine_kwargs": {"blocksize": 16}}]}, "blocksize"),
        ({"llm_configs": [{"model_loading_config": {"model_id": "m"}, "deployment_config": {"num_replicas": 0}}]}, "num_replicas"),
        ({"llm_configs": [{"model_loading_config": {"model_id": "m"},
                           "deployment_config": {"request_router_config": {"request_router_class": "magic"}}}]}, "magic"),
        ({"llm_configs": [{"model_loading_config": {"model_id": "m"},
                           "deployment_config": {"ray_actor_options": {"memory": 1}}}]}, "memory"),
        ({"llm_configs": [{"model_loading_config": {"model_id": "m"}}], "ingress": {"max_body_bytes": 10}}, "max_body_bytes"),
        ({"llm_configs": [{"model_loading_config": {"model_id": "m"}}], "surprise": 1}, "surprise"),
    ],
)
def test_bad_args_name_the_field(args, field):
    with pytest.raises(ValueError, match=field):
        parse_args(args)


def test_engine_and_cluster_checks_still_apply():
    with pytest.raises(ValueError, match="block_size must be a power of two"):
        parse_args({"llm_configs": [{"model_loading_config": {"model_id": "m"}, "engine_kwargs": {"block_size": 3}}]}).cluster_config()
    with pytest.raises(ValueError, match="router_policy must be one of"):
        parse_args({"llm_configs": [{"model_loading_config": {"model_id": "m"}, "router_policy": "nope"}]}).cluster_config()


def test_router_choices():
    assert router_choice("round_robin") == {"request_router_class": "kvroute", "router_policy": "round_robin"}
    assert router_choice("prefix_affinity_ray")["request_router_class"] == "prefix_affinity_ray"
    with pytest.raises(ValueError, match="router must be one of"):
        router_choice("random")


def test_serve_accepts_build_app_as_a_builder():
    """What ``serve run deploy/serve.yaml`` does with the import path, through Ray
    Serve's own builder call (it refuses builders with more than one parameter)."""
    from ray._common.utils import import_attr
    from ray.serve._private.api import call_user_app_builder_with_args_if_necessary
    from ray.serve.deployment import Application

    serve_config = yaml.safe_load((DEPLOY / "serve.yaml").read_text())
    (app,) = serve_config["applications"]
    built = call_user_app_builder_with_args_if_necessary(import_attr(app["import_path"]), app["args"])
    assert isinstance(built, Application)


def test_serve_workers_yaml_is_accepted():
    args = parse_args(_app_args(yaml.safe_load((DEPLOY / "serve_workers.yaml").read_text())))
    assert [w.url for w in args.workers] == ["http://127.0.0.1:8101", "http://127.0.0.1:8102"]
    assert [w.worker_id for w in args.workers] == ["127.0.0.1:8101", "127.0.0.1:8102"]
    assert args.workers[0].kv_events_endpoint == "tcp://127.0.0.1:5557" and args.worker_poll_interval_s == 1.0
    assert args.cluster_config().hash_spec.block_size == 16


@pytest.mark.parametrize(
    "workers, message",
    [
        ([{"url": "ftp://host:1"}], "workers.0.url: Value error, url must be http(s)://host[:port][/path], got 'ftp://host:1'"),
        ([{"url": "http://host:99999"}], "workers.0.url: Value error, url has a bad port: 'http://host:99999'"),
        ([{"url": "http://h:1", "colour": "red"}], "workers.0.colour: Extra inputs are not permitted"),
        ([{"url": "http://h:1", "capacity_blocks": 0}], "workers.0.capacity_blocks: Input should be greater than or equal to 1"),
    ],
)
def test_bad_workers_are_refused_with_the_field_named(workers, message):
    args = _app_args(yaml.safe_load((DEPLOY / "serve_workers.yaml").read_text())) | {"workers": workers}
    with pytest.raises(ValueError) as exc:
        parse_args(args)
    assert str(exc.value) == f"invalid kvroute application args: {message}"


def test_lora_config_turns_adapters_on_in_ray_serve_llms_shape():
    llm = {"model_loading_config": {"model_id": "m"}, "lora_config": {"dynamic_lora_loading_path": "/adapters",
           "max_num_adapters_per_replica": 4}}  # fmt: skip
    engine = parse_args({"llm_configs": [llm]}).cluster_config().engine
    assert engine.enable_lora and engine.max_loras == 4
    clash = {**llm, "engine_kwargs": {"max_loras": 2}}
    with pytest.raises(ValueError, match=r"\['max_loras'\] disagree with lora_config"):
        parse_args({"llm_configs": [clash]}).cluster_config()
    with pytest.raises(ValueError, match="lora_config.download_timeout_s"):
        parse_args({"llm_configs": [{**llm, "lora_config": {"download_timeout_s": 5}}]})


def test_an_ingress_only_app_needs_the_engine_apps_seed_and_an_engine_app():
    """compose_ingress_app (the multi-ingress benchmark's extra ingresses) refuses args
    that could not share the engine application's directory: no pinned hash seed, or an
    external-workers application (which has no engine deployment)."""
    from ray.serve.deployment import Application

    from kvroute.deploy.app import compose_ingress_app

    base = _app_args(yaml.safe_load((DEPLOY / "serve.yaml").read_text()))
    with pytest.raises(ValueError, match="needs engine_kwargs.hash_seed"):
        compose_ingress_app(base, "kvroute")
    llm = {**base["llm_configs"][0], "engine_kwargs": {**base["llm_configs"][0].get("engine_kwargs", {}), "hash_seed": 7}}
    assert isinstance(compose_ingress_app({**base, "llm_configs": [llm]}, "kvroute"), Application)
    workers = _app_args(yaml.safe_load((DEPLOY / "serve_workers.yaml").read_text()))
    with pytest.raises(ValueError, match="external-workers app has none"):
        compose_ingress_app(workers, "kvroute")


_LLM = [{"model_loading_config": {"model_id": "m"}}]

def test_fleet_prefixes_reach_the_cluster_config():
    """The warm-up and hand-off bound, from the Serve config to ClusterConfig (0: off; negative refused)."""
    assert parse_args({"llm_configs": _LLM}).cluster_config().fleet_prefixes == 8
    assert parse_args({"llm_configs": [{**_LLM[0], "fleet_prefixes": 0}]}).cluster_config().fleet_prefixes == 0
    with pytest.raises(ValueError, match="fleet_prefixes"):
        parse_args({"llm_configs": [{**_LLM[0], "fleet_prefixes": -1}]})
