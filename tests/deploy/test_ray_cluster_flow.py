"""The Ray-cluster flow of docs/cluster.md, as a new user runs it: ``ray get-auth-token
--generate``, ``ray start --head`` with the high-throughput path's variables set, then
(in a shell with ``RAY_AUTH_MODE=token``, which Ray 2.60's token authentication needs)
``serve run`` of deploy/serve.yaml with ``ingress.data_path: direct`` answering a
completion through HAProxy and the ingress request router, and ``ray job submit`` of a
small benchmark against it; then that cluster is stopped through its own processes (``ray stop`` would
take every Ray cluster on the machine with it, the test session's own included). The
same cluster (one start, module-scoped) also runs test_working_dir's real ``ray job
submit --working-dir`` of a checkout copy."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest

httpx = pytest.importorskip("httpx")
yaml = pytest.importorskip("yaml")
pytest.importorskip("ray")

from kvroute.deploy.serve_proxy import FAST_PATH_ENV  # noqa: E402
from tests.conftest import free_port  # noqa: E402
from tests.deploy.test_working_dir import SITE_PACKAGES, _copy_checkout  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
CURRENT_CLUSTER = Path("/tmp/ray/ray_current_cluster")


def _children() -> dict[int, list[int]]:
    kids: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            kids.setdefault(ppid, []).append(int(entry.name))
    return kids


def _cluster_processes(markers: tuple[str, ...]) -> set[int]:
    """Every process of one cluster: the ones whose command line names its session
    folder or its GCS address (GCS, raylet, dashboard, monitors, client server) and all
    their descendants (workers rename themselves ``ray::...``)."""
    roots = set()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            try:
                cmdline = (entry / "cmdline").read_bytes()
                if any(m.encode() in cmdline for m in markers):
                    roots.add(int(entry.name))
            except OSError:
                continue
    kids, found, todo = _children(), set(), list(roots)
    while todo:
        pid = todo.pop()
        if pid not in found:
            found.add(pid)
            todo.extend(kids.get(pid, ()))
    return found


def _alive(pids: set[int]) -> set[int]:
    out = set()
    for pid in pids:
        try:
            state = (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue
        if state != "Z":
            out.add(pid)
    return out


def _stop_cluster(*markers: str) -> None:
    pids = _cluster_processes(markers)
    # 3 s for SIGTERM: some of a `ray start` cluster's processes outlive it (a 15 s wait was
    # spent in full); SIGKILL then, and nothing may be left.
    for sig, grace_s in ((signal.SIGTERM, 3), (signal.SIGKILL, 15)):
        for pid in _alive(pids):
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + grace_s
        while _alive(pids) and time.monotonic() < deadline:
            time.sleep(0.2)
        pids |= _cluster_processes(markers)  # anything started meanwhile
    assert not _alive(pids), f"cluster processes left: {sorted(_alive(pids))}"


def _node_ip() -> str:
    import ray._private.services

    return ray._private.services.get_node_ip_address()


def _run(args: list[str], env: dict, timeout_s: float) -> subprocess.CompletedProcess:
    return subprocess.run(args, env=env, cwd=REPO, capture_output=True, text=True, timeout=timeout_s)


def _serve_config(model_path: Path, port: int) -> dict:
    config = yaml.safe_load((REPO / "deploy" / "serve.yaml").read_text())
    config["http_options"].update(host="127.0.0.1", port=port)
    app = config["applications"][0]
    llm = app["args"]["llm_configs"][0]
    llm["model_loading_config"] = {"model_id": "tiny", "model_source": str(model_path)}
    llm["engine_kwargs"] = {"block_size": 8, "num_kv_blocks": 128, "max_model_len": 256, "dtype": "float32"}
    app["args"]["ingress"]["data_path"] = "direct"
    return config


@pytest.fixture(scope="module")
def token_cluster():
    """docs/cluster.md's first steps, once for this module: ``ray get-auth-token
    --generate`` (a token file, so that ``ray start`` turns token auth on), then ``ray start
    --head`` on free ports; yields its ports, the client environment (``RAY_AUTH_MODE=token``,
    ``RAY_ADDRESS``) and its temp folder. Afterwards the cluster is stopped through its own
    processes, none left, and /tmp/ray/ray_current_cluster is put back."""
    current_before = CURRENT_CLUSTER.read_text() if CURRENT_CLUSTER.exists() else None
    temp_dir = tempfile.mkdtemp(prefix="kvr", dir="/tmp")  # short: Ray puts sockets under it
    ports = {name: free_port() for name in ("gcs", "dashboard", "http", "client", "agent", "agent_grpc", "metrics", "env_agent")}
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    env |= {"PATH": f"{BIN}{os.pathsep}{env.get('PATH', '')}", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    # docs/cluster.md's three variables for the direct path, set before `ray start`; then
    # HAProxy's side ports on free ones and a short drain (Ray's 30 s default deregistration
    # window would make the application's deletion wait that long)
    env |= FAST_PATH_ENV | {"RAY_SERVE_HAPROXY_STATS_PORT": str(free_port()),
                            "RAY_SERVE_HAPROXY_METRICS_PORT": str(free_port()),
                            "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S": "3"}  # fmt: skip
    token = _run([str(BIN / "ray"), "get-auth-token", "--generate"], env, 60)
    assert token.returncode == 0, token.stderr
    try:
        start = _run(
            [str(BIN / "ray"), "start", "--head", "--port", str(ports["gcs"]), "--dashboard-port", str(ports["dashboard"]),
             "--include-dashboard", "true", "--num-cpus", "4", "--temp-dir", temp_dir, "--disable-usage-stats",
             "--ray-client-server-port", str(ports["client"]), "--dashboard-agent-listen-port", str(ports["agent"]),
             "--dashboard-agent-grpc-port", str(ports["agent_grpc"]), "--metrics-export-port", str(ports["metrics"]),
             "--runtime-env-agent-port", str(ports["env_agent"])],
            env, 120,
        )
        assert start.returncode == 0, start.stdout + start.stderr
        client_env = env | {"RAY_AUTH_MODE": "token", "RAY_ADDRESS": f"127.0.0.1:{ports['gcs']}"}
        yield ports, client_env, Path(temp_dir)
    finally:
        _stop_cluster(temp_dir, f"--address={_node_ip()}:{ports['gcs']}", f"127.0.0.1:{ports['gcs']}")
        shutil.rmtree(temp_dir, ignore_errors=True)
        # `ray start` records its address in /tmp/ray/ray_current_cluster, where a later
        # `ray.init()` would try to join the stopped cluster: put back what was there
        if current_before is None:
            CURRENT_CLUSTER.unlink(missing_ok=True)
        else:
            CURRENT_CLUSTER.write_text(current_before)


def test_ray_start_serve_run_job_submit_and_stop(tmp_path, tiny_llama_path, token_cluster):
    ports, client_env, _ = token_cluster
    assert (Path.home() / ".ray" / "auth_token").exists()  # the token `ray start` turned auth on with
    serve_proc = None
    try:
        config_path = tmp_path / "serve.yaml"
        config_path.write_text(yaml.safe_dump(_serve_config(tiny_llama_path, ports["http"])))
        serve_proc = subprocess.Popen(
            [str(BIN / "serve"), "run", str(config_path)],
            env=client_env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )
        output: list[str] = []
        threading.Thread(target=lambda: output.extend(serve_proc.stdout), daemon=True).start()
        url = f"http://127.0.0.1:{ports['http']}"
        deadline = time.monotonic() + 240
        while True:
            assert serve_proc.poll() is None, "serve run exited:\n" + "".join(output[-50:])
            try:
                if httpx.get(url + "/v1/models", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "the application never answered:\n" + "".join(output[-50:])
            time.sleep(0.5)
        r = httpx.post(url + "/v1/completions", json={"model": "tiny", "prompt": "Hello", "max_tokens": 3}, timeout=60)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3, r.text
        # the config's direct path: HAProxy asks the ingress request router, no OpenAIIngress hop
        status = _run([str(BIN / "serve"), "status", "-a", f"http://127.0.0.1:{ports['dashboard']}"], client_env, 60)
        assert status.returncode == 0 and "IngressRouter" in status.stdout, status.stdout + status.stderr
        assert "OpenAIIngress" not in status.stdout, status.stdout

        result = tmp_path / "job.json"
        job = _run(
            [str(BIN / "ray"), "job", "submit", "--address", f"http://127.0.0.1:{ports['dashboard']}", "--working-dir", ".",
             "--", "python", "-m", "kvroute.benchmarks.serving", "--base-url", url, "--model", "tiny",
             "--gsp-num-groups", "2", "--gsp-prompts-per-group", "2", "--gsp-system-prompt-len", "64",
             "--gsp-question-len", "8", "--gsp-output-len", "4", "--request-rate", "4", "--disable-tqdm",
             "--result-file", str(result)],
            client_env, 300,
        )
        assert job.returncode == 0 and "succeeded" in job.stdout + job.stderr, job.stdout[-3000:] + job.stderr[-3000:]
        summary = json.loads(result.read_text())
        assert summary["completed"] == 4 and summary.get("failed", 0) == 0, summary
    finally:
        if serve_proc is not None and serve_proc.poll() is None:
            serve_proc.send_signal(signal.SIGINT)
            try:
                serve_proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                serve_proc.kill()


def test_ray_job_submit_with_the_checkout_as_working_dir(tmp_path, token_cluster):
    """A source checkout imports without an install (see test_working_dir.py), for real:
    ``ray job submit --working-dir <checkout copy> -- python -S -c "import
    kvroute.benchmarks.fleets"`` on the token-auth cluster: the job's Python has no
    install's finder (``-S``), so the import works only through the facade, from Ray's
    unpacked copy of the working dir."""
    ports, client_env, temp_dir = token_cluster
    checkout = _copy_checkout(tmp_path / "checkout")
    probe = ("import json, os, sys; sys.path.append(sys.argv[1]); import kvroute.benchmarks.fleets as f; "
             "print('PROBE', json.dumps([f.__file__, os.getcwd()]))")  # fmt: skip
    job = subprocess.run([str(BIN / "ray"), "job", "submit", "--address", f"http://127.0.0.1:{ports['dashboard']}",
                          "--working-dir", str(checkout), "--", sys.executable, "-S", "-c", probe, SITE_PACKAGES],
                         env=client_env, cwd=tmp_path, capture_output=True, text=True, timeout=180)  # fmt: skip
    assert job.returncode == 0 and "succeeded" in job.stdout + job.stderr, job.stdout[-3000:] + job.stderr[-3000:]
    (line,) = [ln for ln in job.stdout.splitlines() if ln.startswith("PROBE ")]
    file, cwd = json.loads(line[len("PROBE "):])
    assert Path(cwd) != checkout and Path(cwd).is_relative_to(temp_dir)  # Ray's unpacked copy, not ours
    assert Path(file) == Path(cwd) / "benchmarks" / "fleets.py"
