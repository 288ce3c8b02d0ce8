"""deploy/k8s/rayservice.yaml against what it names and what it runs:

- the RayService CRD of KubeRay (tests/fixtures/k8s/ray.io_rayservices.yaml, v1.7.0): the
  manifest, and each commented-out option of it, validates against the CRD's
  ``openAPIV3Schema`` with unknown fields refused where Kubernetes refuses them (objects
  with ``properties`` and no ``x-kubernetes-preserve-unknown-fields``);
- kvroute's application schema: ``serveConfigV2``'s args parse with ``parse_args``, and the
  worker group's min/max pods are what the Serve autoscaling_config's replicas need;
- the images: every ``image:`` is the tag that a build command documented in
  deploy/docker/Dockerfile.* produces, that Dockerfile's base image carries the Ray this
  project installs (.venv) and the manifest's rayVersion, and it installs the checkout with
  the ``serve`` extra; .dockerignore sends every package folder.

Docker does not run here, so the Dockerfiles are read, not built; the CRD's CEL rules
(``x-kubernetes-validations``) are not evaluated.
"""

from __future__ import annotations

import copy
import math
import re
import shlex
import tomllib
from fnmatch import fnmatch
from importlib.metadata import version
from pathlib import Path
from typing import Any

import pytest

yaml = pytest.importorskip("yaml")
jsonschema = pytest.importorskip("jsonschema")

REPO = Path(__file__).resolve().parents[2]
MANIFEST = REPO / "deploy" / "k8s" / "rayservice.yaml"
CRD = REPO / "tests" / "fixtures" / "k8s" / "ray.io_rayservices.yaml"
DOCKERFILES = {"cpu": REPO / "deploy" / "docker" / "Dockerfile.cpu", "cuda": REPO / "deploy" / "docker" / "Dockerfile.cuda"}
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())
_Loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)  # the CRD is 1 MB of YAML


# ---------------------------------------------------------------------- CRD schema
def _strict(schema: Any) -> Any:
    """The CRD's structural schema as JSON Schema with Kubernetes' own rules made explicit:
    an object with ``properties`` keeps no unknown field unless it says
    ``x-kubernetes-preserve-unknown-fields`` (the API server prunes, and ``kubectl apply``'s
    strict field validation refuses, any other), and ``x-kubernetes-int-or-string`` is an
    integer or a string."""
    if isinstance(schema, list):
        return [_strict(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: _strict(v) for k, v in schema.items()}
    if out.get("x-kubernetes-int-or-string"):
        out["anyOf"] = [{"type": "integer"}, {"type": "string"}]
    if "properties" in out and "additionalProperties" not in out and not out.get("x-kubernetes-preserve-unknown-fields"):
        out["additionalProperties"] = False
    return out


@pytest.fixture(scope="module")
def validator() -> Any:
    crd = yaml.load(CRD.read_text(), Loader=_Loader)
    assert crd["kind"] == "CustomResourceDefinition" and crd["spec"]["names"]["kind"] == "RayService"
    (v1,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1"]
    assert v1["served"] and v1["storage"]
    return jsonschema.Draft7Validator(_strict(v1["schema"]["openAPIV3Schema"]))


def _manifest() -> dict:
    return yaml.safe_load(MANIFEST.read_text())


def _errors(validator: Any, doc: dict) -> list[str]:
    return [f"{'.'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(doc)]


def test_manifest_validates_against_the_rayservice_crd(validator):
    manifest = _manifest()
    assert manifest["apiVersion"] == "ray.io/v1" and manifest["kind"] == "RayService"
    assert _errors(validator, manifest) == []


@pytest.mark.parametrize(
    "path, value, complaint",
    [
        (("spec", "rayClusterConfig", "headGroupSpec", "bogusField"), 1, "bogusField"),
        (("spec", "rayClusterConfig", "headGroupSpec", "template", "spec", "containers", 0, "imagee"), "x", "imagee"),
        (("spec", "rayClusterConfig", "authOptions", "mode"), "tokens", "tokens"),
        (("spec", "rayClusterConfig", "headGroupSpec", "rayStartParams", "num-cpus"), 0, "not of type 'string'"),
        (("spec", "rayClusterConfig", "workerGroupSpecs", 0, "maxReplicas"), "8", "not of type 'integer'"),
    ],
)
def test_crd_validation_refuses_unknown_fields_and_bad_values(validator, path, value, complaint):
    """The validation has teeth: a typo'd field, an enum outside the CRD's and a YAML
    integer where Kubernetes wants a string are each refused, naming the field."""
    manifest = _manifest()
    node = manifest
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    errors = _errors(validator, manifest)
    assert any(complaint in e for e in errors), errors


_OPTION = re.compile(r"^(?P<indent>[ \t]*)# >>> option (?P<path>\S+)\n(?P<body>.*?)^[ \t]*# <<< option$", re.M | re.S)


def _options() -> list[tuple[str, Any]]:
    """The manifest's commented-out options: ``# >>> option <where>`` ... ``# <<< option``,
    each a YAML fragment to merge at ``<where>`` (a dotted path, list indices as numbers)."""
    found = []
    for m in _OPTION.finditer(MANIFEST.read_text()):
        lines = [re.sub(r"^[ \t]*# ?", "", line, count=1) for line in m["body"].splitlines()]
        found.append((m["path"], yaml.safe_load("\n".join(lines))))
    return found


def _merge(base: Any, extra: Any) -> Any:
    if isinstance(base, dict) and isinstance(extra, dict):
        return {**base, **{k: _merge(base[k], v) if k in base else v for k, v in extra.items()}}
    return extra


_CONTAINERS = {"head": "spec.rayClusterConfig.headGroupSpec.template.spec.containers.0",
               "gpu-workers": "spec.rayClusterConfig.workerGroupSpecs.0.template.spec.containers.0"}


def test_commented_options_validate_once_switched_on(validator):
    options = _options()
    assert sorted(where for where, _ in options) == sorted(["spec.rayClusterConfig", *_CONTAINERS.values()])
    for where, fragment in options:
        manifest = _manifest()
        *parents, last = [int(k) if k.isdigit() else k for k in where.split(".")]
        node = manifest
        for key in parents:
            node = node[key]
        node[last] = _merge(node[last], fragment)
        assert _errors(validator, manifest) == [], where
    fragments = dict(options)
    assert set(fragments["spec.rayClusterConfig"]) == {"gcsFaultToleranceOptions"}
    for where in _CONTAINERS.values():  # the S3 option: credentials from one secret on every pod
        assert fragments[where] == {"envFrom": [{"secretRef": {"name": "kvroute-aws"}}]}


def test_s3_model_source_of_the_option_is_accepted():
    pytest.importorskip("ray")
    from kvroute.deploy.app import parse_args

    (uri,) = re.findall(r"model_source: \S+\s+# or (s3://\S+)", _manifest()["spec"]["serveConfigV2"])
    args = copy.deepcopy(_serve_args())
    args["llm_configs"][0]["model_loading_config"]["model_source"] = uri
    assert parse_args(args).cluster_config().engine.model == uri


# ---------------------------------------------------------------------- the cluster
def _pods() -> list[tuple[str, dict]]:
    cluster = _manifest()["spec"]["rayClusterConfig"]
    return [("head", cluster["headGroupSpec"])] + [(g["groupName"], g) for g in cluster["workerGroupSpecs"]]


def test_cluster_settings():
    cluster = _manifest()["spec"]["rayClusterConfig"]
    assert cluster["enableInTreeAutoscaling"] is True and cluster["autoscalerOptions"]["idleTimeoutSeconds"] > 0
    assert cluster["authOptions"] == {"mode": "token", "secretName": "kvroute-ray-token"}
    assert "gcsFaultToleranceOptions" not in cluster  # an option, in comments
    assert cluster["headGroupSpec"]["rayStartParams"]["num-cpus"] == "0"
    head = cluster["headGroupSpec"]["template"]["spec"]["containers"][0]
    assert "nvidia.com/gpu" not in head["resources"]["limits"]


@pytest.mark.parametrize("group", ["head", "gpu-workers"])
def test_every_pod_has_the_api_key_required_and_the_model(group):
    """The ingress and the application build read KVROUTE_API_KEY in their own process,
    wherever Ray places them; a missing secret must stop the pod (no ``optional``), and
    the model folder must be where model_source says on every pod."""
    spec = dict(_pods())[group]["template"]["spec"]
    (ray,) = spec["containers"]
    (key,) = [e for e in ray["env"] if e["name"] == "KVROUTE_API_KEY"]
    ref = key["valueFrom"]["secretKeyRef"]
    assert ref["name"] == "kvroute-api-key" and ref["key"] == "key" and ref.get("optional", False) is False
    source = _serve_args()["llm_configs"][0]["model_loading_config"]["model_source"]
    mounts = [m for m in ray["volumeMounts"] if Path(source).is_relative_to(m["mountPath"])]
    assert len(mounts) == 1 and mounts[0]["readOnly"] is True
    assert any(v["name"] == mounts[0]["name"] for v in spec["volumes"])


# ---------------------------------------------------------------------- the application
def _serve_config() -> dict:
    return yaml.safe_load(_manifest()["spec"]["serveConfigV2"])


def _serve_args() -> dict:
    (app,) = _serve_config()["applications"]
    assert app["import_path"] == "kvroute.deploy.app:build_app"
    return app["args"]


def test_serve_config_parses_with_kvroutes_own_schema():
    pytest.importorskip("ray")
    from kvroute.deploy.app import parse_args

    raw = _serve_args()
    assert raw["ingress"]["require_api_key"] is True and "api_key" not in raw["ingress"]  # the key only from the secret
    args = parse_args(raw)
    assert args.ingress.require_api_key is True
    config = args.cluster_config()
    assert config.engine.device == "cuda" and config.num_gpus_per_replica == 1 and config.num_replicas is None


def test_worker_group_bounds_follow_serve_autoscaling():
    """Pods hold whole replicas: per pod, as many as its GPUs and CPUs fit. minReplicas
    pods hold the minimum replicas with no GPU idle, maxReplicas pods the maximum, and the
    pod's spare CPUs hold its ingress replica (the head has none for Ray)."""
    args = _serve_args()
    llm = args["llm_configs"][0]["deployment_config"]
    scaling, actor = llm["autoscaling_config"], llm["ray_actor_options"]
    (group,) = _manifest()["spec"]["rayClusterConfig"]["workerGroupSpecs"]
    limits = group["template"]["spec"]["containers"][0]["resources"]["limits"]
    gpus, cpus = int(limits["nvidia.com/gpu"]), int(limits["cpu"])
    per_pod = min(gpus // actor["num_gpus"], cpus // actor["num_cpus"])
    assert per_pod >= 1
    assert group["minReplicas"] == math.ceil(scaling["min_replicas"] / per_pod)
    assert group["minReplicas"] * per_pod == scaling["min_replicas"]  # no idle GPU at the minimum
    assert group["maxReplicas"] == math.ceil(scaling["max_replicas"] / per_pod)
    assert group["minReplicas"] <= group["replicas"] <= group["maxReplicas"]
    # one ingress on every worker pod (per_node; the head has no CPUs for Ray): each pod's
    # spare CPUs beside its engine replicas hold one
    assert args["ingress"]["num_replicas"] == "per_node"
    assert cpus - per_pod * actor["num_cpus"] >= args["ingress"]["num_cpus"]


# ---------------------------------------------------------------------- the images
def _instructions(path: Path) -> list[tuple[str, str]]:
    """A Dockerfile's instructions, continuation lines joined, comments dropped."""
    out, pending = [], ""
    for line in path.read_text().splitlines():
        if not pending and (not line.strip() or line.lstrip().startswith("#")):
            continue
        pending += line.rstrip()
        if pending.endswith("\\"):
            pending = pending[:-1] + " "
            continue
        word, _, rest = pending.strip().partition(" ")
        out.append((word.upper(), rest.strip()))
        pending = ""
    return out


def _build_commands(text: str) -> dict[str, str]:
    """``docker build -f FILE -t TAG .`` commands in comments: {TAG: FILE}."""
    found = {}
    for line in text.splitlines():
        if line.lstrip().startswith("#") and "docker build" in line:
            argv = shlex.split(line.lstrip()[1:])
            argv = argv[argv.index("docker"):]
            assert argv[:2] == ["docker", "build"] and argv[-1] == ".", line  # from the repository root
            found[argv[argv.index("-t") + 1]] = argv[argv.index("-f") + 1]
    return found


class _Dockerfile:
    def __init__(self, path: Path) -> None:
        self.instructions = _instructions(path)
        self.args: dict[str, str] = {}
        self.base = None
        for word, rest in self.instructions:
            if word == "ARG" and "=" in rest:
                name, _, default = rest.partition("=")
                self.args[name] = default
            elif word == "FROM":
                self.base = self.expand(rest.split()[0])

    def expand(self, text: str) -> str:
        return re.sub(r"\$\{(\w+)\}|\$(\w+)", lambda m: self.args[m[1] or m[2]], text)

    def runs(self) -> list[str]:
        return [self.expand(rest) for word, rest in self.instructions if word == "RUN"]


def _pip_installs(dockerfile: _Dockerfile) -> list[list[str]]:
    """The arguments of every ``pip install`` the RUN lines make (shell-split, quotes
    respected, commands separated at ``&&``, ``||``, ``;`` and ``|``)."""
    found = []
    for run in dockerfile.runs():
        lexer = shlex.shlex(run, posix=True, punctuation_chars=True)
        lexer.whitespace_split = True
        command: list[str] = []
        for token in [*lexer, ";"]:
            if token in ("&&", "||", ";", "|"):
                if command[:2] == ["pip", "install"] or command[:4] == ["python", "-m", "pip", "install"]:
                    found.append(command[command.index("install") + 1:])
                command = []
            else:
                command.append(token)
    return found


def test_manifest_images_are_the_documented_builds():
    documented = {}
    for variant, path in DOCKERFILES.items():
        commands = _build_commands(path.read_text())
        assert list(commands.values()) == [str(path.relative_to(REPO))], path
        (tag,) = commands
        assert tag == f"kvroute/kvroute:{PYPROJECT['project']['version']}-{variant}"
        documented[tag] = variant
    images = {c["image"] for _, g in _pods() for c in g["template"]["spec"]["containers"]}
    assert {documented.get(image) for image in images} == {"cuda"}  # GPU workers, and the head on the same image
    assert _build_commands(MANIFEST.read_text()) == {tag: str(DOCKERFILES["cuda"].relative_to(REPO)) for tag in images}


@pytest.mark.parametrize("variant", sorted(DOCKERFILES))
def test_dockerfile_base_image_is_this_projects_ray(variant):
    dockerfile = _Dockerfile(DOCKERFILES[variant])
    m = re.fullmatch(r"rayproject/ray:(?P<ray>[\d.]+)-py(?P<py>3)(?P<minor>\d+)(?P<gpu>-gpu)?", dockerfile.base or "")
    assert m, dockerfile.base
    assert m["ray"] == version("ray") == _manifest()["spec"]["rayClusterConfig"]["rayVersion"]
    serve_extra = PYPROJECT["project"]["optional-dependencies"]["serve"]
    (ray_req,) = [r for r in serve_extra if r.startswith("ray")]
    from packaging.requirements import Requirement
    from packaging.specifiers import SpecifierSet

    assert m["ray"] in Requirement(ray_req).specifier
    assert f"{m['py']}.{m['minor']}" in SpecifierSet(PYPROJECT["project"]["requires-python"])
    assert bool(m["gpu"]) == (variant == "cuda")


@pytest.mark.parametrize("variant", sorted(DOCKERFILES))
def test_dockerfile_installs_checkout_with_serve_extra_and_matching_torch(variant):
    from packaging.requirements import Requirement

    dockerfile = _Dockerfile(DOCKERFILES[variant])
    (copy_args,) = [rest.split() for word, rest in dockerfile.instructions if word == "COPY"]
    src, dest = copy_args[-2:]
    assert src == "."  # the whole build context (what .dockerignore lets through): the checkout
    installs = _pip_installs(dockerfile)
    kvroute = [argv for argv in installs if f"{dest}[serve]" in argv]
    assert len(kvroute) == 1, installs
    assert f"ray[serve]=={version('ray')}" in kvroute[0]
    (torch,) = [argv for argv in installs if any(a.startswith("torch==") for a in argv)]
    torch_version = next(a for a in torch if a.startswith("torch=="))[len("torch=="):]
    assert torch_version == version("torch").split("+")[0]  # the torch this project tests with
    (torch_req,) = [r for r in PYPROJECT["project"]["dependencies"] if r.startswith("torch")]
    assert torch_version in Requirement(torch_req).specifier
    index = torch[torch.index("--index-url") + 1]
    if variant == "cpu":
        assert index == "https://download.pytorch.org/whl/cpu"
    else:
        assert "/whl/cpu" not in index  # PyPI's Linux torch is the CUDA build


def _dockerignored(path: str, patterns: list[str]) -> bool:
    """Docker's rule for the build context: the last pattern matching the path or one of
    its parent folders decides; ``!`` re-includes; ``**/`` matches at any depth."""
    parts = path.split("/")
    prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    ignored = False
    for pattern in patterns:
        negate = pattern.startswith("!")
        pat = pattern.lstrip("!").rstrip("/")
        variants = [pat, pat[3:]] if pat.startswith("**/") else [pat]
        if any(fnmatch(p, v) if "**" in v else _match_levels(p, v) for p in prefixes for v in variants):
            ignored = not negate
    return ignored


def _match_levels(path: str, pattern: str) -> bool:
    """Go's filepath.Match as Docker uses it: ``*`` never crosses a ``/``."""
    a, b = path.split("/"), pattern.split("/")
    return len(a) == len(b) and all(fnmatch(x, y) for x, y in zip(a, b))


def test_dockerignore_sends_the_packages_and_nothing_heavy():
    patterns = [line.strip() for line in (REPO / ".dockerignore").read_text().splitlines()
                if line.strip() and not line.lstrip().startswith("#")]  # fmt: skip
    needed = ["pyproject.toml", "README.md"]
    for folder in PYPROJECT["tool"]["setuptools"]["package-dir"].values():
        needed += [str(p.relative_to(REPO)) for p in (REPO / folder).rglob("*")
                   if p.is_file() and "__pycache__" not in p.parts]  # fmt: skip
    assert len(needed) > 50
    assert [p for p in needed if _dockerignored(p, patterns)] == []
    for heavy in [".venv/bin/python", ".git/HEAD", "tests/conftest.py", "results/x.json", "replica/__pycache__/x.pyc",
                  "kvroute.egg-info/PKG-INFO", "cluster/__pycache__/a.cpython-311.pyc", "replica/__pycache__"]:
        assert _dockerignored(heavy, patterns), heavy
