"""Models and LoRA adapters from ``s3://`` (replica/model_store.py through
``resolve_model`` and ``read_adapter``), against a real S3-compatible server: moto's, on
127.0.0.1, reached through the standard ``AWS_ENDPOINT_URL`` as an operator would point
kvroute at MinIO. The server counts the requests it answers, so "downloaded once" is
measured where it happens.

Covered: an engine loaded from ``s3://`` generates what the local folder's does; two
processes fetching one URI into one cache at once download it once (the node lock);
a complete copy is reused without a GET, a changed object is fetched again, an
incomplete copy is replaced; a missing key, bucket or local folder is an error naming
the source and this node; unsupported schemes say which are; a LoRA adapter from
``s3://`` gives the local folder's output and is listed under its URI.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

boto3 = pytest.importorskip("boto3")
pytest.importorskip("moto.server", reason="needs moto[server] (pip install -e .[test])")

from kvroute.replica import model_store  # noqa: E402
from kvroute.replica.checkpoint import resolve_model  # noqa: E402
from kvroute.replica.model_store import SOURCE_MARKER, SourceNotFoundError, cache_dir, fetch, node_lock  # noqa: E402

MODEL_PREFIX = "models/tiny-llama"
PROMPT = "The quick brown fox jumps over the lazy dog and then"
ENGINE = dict(block_size=8, num_kv_blocks=32, max_model_len=64, dtype="float32")


class S3Server:
    """moto's S3 server on a loopback port (``0``: a free one), in a thread of this
    process, with every request it answers recorded as ``(method, path, query)``."""

    def __init__(self, port: int = 0) -> None:
        from moto.moto_server.werkzeug_app import DomainDispatcherApplication, MotoRequestHandler, create_backend_app
        from werkzeug.serving import make_server

        self.requests: list[tuple[str, str, str]] = []
        app = DomainDispatcherApplication(create_backend_app)

        def counting(environ: dict, start_response: Any) -> Any:
            self.requests.append((environ["REQUEST_METHOD"], environ["PATH_INFO"], environ.get("QUERY_STRING", "")))
            return app(environ, start_response)

        self._server = make_server("127.0.0.1", port, counting, threaded=True, request_handler=MotoRequestHandler)
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        # polled every 50 ms (not 0.5 s): stop() waits for the loop to notice
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
        self._thread.start()

    def env(self) -> dict[str, str]:
        """What a kvroute process needs to reach it (credentials are not checked by moto)."""
        return {"AWS_ENDPOINT_URL": self.url, "AWS_ACCESS_KEY_ID": "test", "AWS_SECRET_ACCESS_KEY": "test",
                "AWS_DEFAULT_REGION": "us-east-1"}  # fmt: skip

    def client(self) -> Any:
        return boto3.client("s3", endpoint_url=self.url, aws_access_key_id="test", aws_secret_access_key="test",
                            region_name="us-east-1")  # fmt: skip

    def upload(self, bucket: str, folder: Path, prefix: str) -> None:
        client = self.client()
        for file in sorted(p for p in folder.rglob("*") if p.is_file()):
            client.upload_file(str(file), bucket, f"{prefix}/{file.relative_to(folder).as_posix()}")

    def gets(self, bucket: str) -> list[str]:
        """The object GETs answered so far for ``bucket`` (not listings)."""
        return [path for method, path, query in self.requests
                if method == "GET" and path.startswith(f"/{bucket}/") and "list-type" not in query]  # fmt: skip

    def lists(self, bucket: str) -> int:
        return sum(1 for method, path, query in self.requests if method == "GET" and "list-type" in query
                   and path.rstrip("/") == f"/{bucket}")  # fmt: skip

    def stop(self) -> None:
        self._server.shutdown()
        self._thread.join()


@pytest.fixture(scope="module")
def s3(tiny_llama_path: Path):
    server = S3Server()
    server.client().create_bucket(Bucket="kvtest")
    server.upload("kvtest", tiny_llama_path, MODEL_PREFIX)
    yield server
    server.stop()


@pytest.fixture
def s3_env(s3: S3Server, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> S3Server:
    """The server's endpoint and credentials in the environment, and a fresh cache."""
    for key, value in s3.env().items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("KVROUTE_CACHE", str(tmp_path / "cache"))
    return s3


def _greedy(llm: Any, lora_name: str | None = None) -> list[int]:
    from kvroute.replica.sampling_params import SamplingParams

    out = llm.generate(PROMPT, SamplingParams(temperature=0.0, max_tokens=12), use_tqdm=False, lora_name=lora_name)
    return out[0].token_ids


def test_engine_from_s3_generates_what_the_local_folder_does(s3_env: S3Server, tiny_llama_path: Path):
    from kvroute.replica.llm import LLM

    remote = LLM(f"s3://kvtest/{MODEL_PREFIX}", **ENGINE)
    copy = remote.model_path
    assert copy == (cache_dir() / "s3" / "kvtest" / "models%2Ftiny-llama").resolve()
    assert sorted(p.name for p in copy.iterdir() if p.name != SOURCE_MARKER) == sorted(
        p.name for p in tiny_llama_path.iterdir())
    assert _greedy(remote) == _greedy(LLM(str(tiny_llama_path), **ENGINE))


def test_a_current_copy_is_reused_and_a_changed_object_fetched_again(s3_env: S3Server, tiny_llama_path: Path):
    uri = f"s3://kvtest/{MODEL_PREFIX}"
    first = resolve_model(uri)
    n = len(s3_env.gets("kvtest"))
    assert n >= len(list(tiny_llama_path.iterdir()))  # every file came from the server
    assert resolve_model(uri) == first and len(s3_env.gets("kvtest")) == n  # reused: listed, nothing downloaded

    client = s3_env.client()
    key = f"{MODEL_PREFIX}/generation_config.json"
    original = client.get_object(Bucket="kvtest", Key=key)["Body"].read()
    n = len(s3_env.gets("kvtest"))
    try:
        client.put_object(Bucket="kvtest", Key=key, Body=json.dumps({"eos_token_id": [2, 7]}).encode())
        assert json.loads((resolve_model(uri) / "generation_config.json").read_text())["eos_token_id"] == [2, 7]
        assert len(s3_env.gets("kvtest")) > n
    finally:
        client.put_object(Bucket="kvtest", Key=key, Body=original)
    assert (resolve_model(uri) / "generation_config.json").read_bytes() == original


def test_an_incomplete_copy_is_replaced(s3_env: S3Server):
    target = cache_dir() / "s3" / "kvtest" / "models%2Ftiny-llama"
    target.mkdir(parents=True)
    (target / "config.json").write_text("half written")  # a crashed download of an old kvroute: no marker
    assert resolve_model(f"s3://kvtest/{MODEL_PREFIX}") == target.resolve()
    assert json.loads((target / "config.json").read_text())["model_type"] == "llama"
    assert [p.name for p in target.parent.iterdir()] == [target.name]  # no temp or stale folder left


def test_two_processes_fetching_at_once_download_once(s3_env: S3Server, tmp_path: Path):
    """The test holds the node lock until both processes have listed the prefix and wait
    on it, so they really contend; then exactly one downloads."""
    uri = f"s3://kvtest/{MODEL_PREFIX}"
    baseline = len(s3_env.gets("kvtest"))
    resolve_model(uri)  # into the test's cache: how many GETs one download takes
    per_download = len(s3_env.gets("kvtest")) - baseline

    shared = tmp_path / "node-cache"
    env = {**os.environ, "KVROUTE_CACHE": str(shared)}
    code = "from kvroute.replica.checkpoint import resolve_model; import sys; print(resolve_model(sys.argv[1]))"
    target = shared / "s3" / "kvtest" / "models%2Ftiny-llama"
    lock = model_store.hashlib.sha256(str(target).encode()).hexdigest()[:24]
    before_gets, before_lists = len(s3_env.gets("kvtest")), s3_env.lists("kvtest")
    with node_lock(shared, lock):
        procs = [subprocess.Popen([sys.executable, "-c", code, uri], env=env, stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True) for _ in range(2)]  # fmt: skip
        deadline = time.monotonic() + 30
        while s3_env.lists("kvtest") < before_lists + 2:
            assert time.monotonic() < deadline and all(p.poll() is None for p in procs), "both processes listed"
            time.sleep(0.02)
        time.sleep(0.2)  # both now wait on the lock (nothing else lies between their listing and it)
        assert len(s3_env.gets("kvtest")) == before_gets
    outs = [p.communicate(timeout=60) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    assert {out.strip() for out, _ in outs} == {str(target.resolve())}
    assert len(s3_env.gets("kvtest")) - before_gets == per_download  # one download between them
    assert sum("fetching s3://kvtest/" in err for _, err in outs) == 1


def test_missing_sources_name_the_source_and_the_node(s3_env: S3Server, tmp_path: Path):
    host = socket.gethostname()
    with pytest.raises(SourceNotFoundError, match=rf"model folder s3://kvtest/models/nope not found on node {host} "
                                                  rf"\(no object under s3://kvtest/models/nope/ at {s3_env.url}\)"):  # fmt: skip
        resolve_model("s3://kvtest/models/nope")
    with pytest.raises(SourceNotFoundError, match=rf"s3://no-such-bucket/m not found on node {host} \(no bucket"):
        resolve_model("s3://no-such-bucket/m")
    missing = tmp_path / "x" / "y"
    with pytest.raises(ValueError, match=rf"nor an existing folder: model folder {missing} not found on node {host} "
                                         r"\(on a cluster it must exist on every node"):  # fmt: skip
        resolve_model(str(missing))
    with pytest.raises(ValueError, match=r"unsupported scheme 'gs://'; supported: local paths and s3://"):
        resolve_model("gs://bucket/model")
    assert not (cache_dir() / "s3" / "kvtest" / "models%2Fnope").exists()


def test_unreachable_store_uses_a_complete_copy(s3_env: S3Server, monkeypatch: pytest.MonkeyPatch):
    uri = f"s3://kvtest/{MODEL_PREFIX}"
    copy = resolve_model(uri)
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}"
    monkeypatch.setenv("AWS_ENDPOINT_URL", dead)
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")
    assert resolve_model(uri) == copy
    with pytest.raises(ValueError, match=rf"cannot list s3://kvtest/other at {dead} from node"):
        fetch("s3://kvtest/other", "model folder")


def test_config_and_tokenizer_only(s3_env: S3Server):
    n = len(s3_env.gets("kvtest"))
    folder = resolve_model(f"s3://kvtest/{MODEL_PREFIX}", weights=False)
    assert folder.name == "models%2Ftiny-llama.no-weights"
    assert (folder / "tokenizer.json").is_file() and not list(folder.glob("*.safetensors"))
    fetched = s3_env.gets("kvtest")[n:]
    assert fetched and not any(path.endswith(".safetensors") for path in fetched)
    full = resolve_model(f"s3://kvtest/{MODEL_PREFIX}")  # a complete copy then serves both
    assert resolve_model(f"s3://kvtest/{MODEL_PREFIX}", weights=False) == full


def test_lora_adapter_from_s3_matches_the_local_folder(s3_env: S3Server, tiny_llama_path: Path, tmp_path: Path):
    from kvroute.benchmarks.lora_adapters import save_random_adapter
    from kvroute.replica.llm import LLM

    llm = LLM(str(tiny_llama_path), **ENGINE, enable_lora=True, max_loras=2, max_lora_rank=8)
    local = save_random_adapter(tmp_path / "ad", llm.engine.arch, rank=4, seed=5)
    s3_env.upload("kvtest", local, "loras/ad")
    llm.load_lora("local", local)
    llm.load_lora("remote", "s3://kvtest/loras/ad")
    assert llm.engine.lora.adapters["remote"].path == "s3://kvtest/loras/ad"  # listed as named, not as the cache copy
    remote, base = _greedy(llm, "remote"), _greedy(llm)
    assert remote == _greedy(llm, "local") and remote != base
    with pytest.raises(SourceNotFoundError, match=rf"LoRA adapter 'gone': folder s3://kvtest/loras/gone not found on node "
                                                  rf"{socket.gethostname()}"):  # fmt: skip
        llm.load_lora("gone", "s3://kvtest/loras/gone")
    assert sorted(llm.engine.list_loras()) == ["local", "remote"]
