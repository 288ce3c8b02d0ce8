"""Engine configuration: one frozen dataclass, validated on construction."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping

_DTYPES = ("auto", "float32", "bfloat16", "float16")
_DEVICES = ("auto", "cpu", "cuda")


def check_adapter_name(name: object) -> str:
    """Adapter names are non-empty strings without NUL (the block hash ends them with one)."""
    if not isinstance(name, str) or not name or "\x00" in name:
        raise ValueError(f"an adapter name must be a non-empty string without NUL, got {name!r}")
    return name


@dataclass(frozen=True)
class EngineConfig:
    """Everything that shapes one engine.

    The KV cache holds ``num_kv_blocks`` blocks, or ``kv_cache_memory_gb`` GiB; with
    neither (the default) it takes what memory leaves: on CUDA ``gpu_memory_utilization``
    of the device's memory (as vLLM's ``--gpu-memory-utilization``) less the weights and
    the activations' peak, on CPU a modest share of the available RAM
    (``replica/kv_sizing.py`` has the rule). ``hash_seed``
    must be the cluster-wide seed so the router's hashes match the replica's.
    ``dtype='auto'`` is bfloat16 on CUDA and on CPUs with native bf16 (AVX512-BF16/AMX),
    float32 on other CPUs. On CUDA, decode-only steps replay CUDA graphs captured for
    batch sizes up to ``max_num_seqs`` unless ``enforce_eager``.

    ``emulate``: the name of a step-time profile (``replica/profiles.py``); the engine
    then runs no model (``replica/emulated.py``): only the checkpoint's config and
    tokenizer are read, the KV cache defaults to the profile's capacity and the context
    length to the profile's, and every step takes the profile's time × ``time_scale``.

    ``host_kv_blocks``: a host-memory tier of that many blocks behind the device cache
    (``replica/host_tier.py``): evicted prefix blocks are offloaded there and restored
    by a copy instead of a recompute. 0: none. Or ``host_kv_gb``: the tier sized in
    GiB of host memory (from the model's KV bytes per block; an emulated engine's from
    its profile).

    ``step_target_s``: while more than one request is running or waiting, prefill chunks
    are cut so a step takes about this long at the engine's measured step cost (a
    decode batched with a long prompt waits one step per token; ARCHITECTURE.md §4);
    an emulated engine's target is scaled by ``time_scale`` like its steps. A lone
    prompt's chunk may take four targets (``scheduler.LONE_STEPS``). None: tokens only.

    ``enable_lora``: serve LoRA adapters (PEFT folders, ``replica/lora.py``) beside the
    base model: at most ``max_loras`` resident at once (LRU; one step batches at most
    that many), of rank at most ``max_lora_rank``; at most ``max_cpu_loras`` registered
    (None: no limit). ``lora_modules``: ``{name: folder}`` loaded at start.

    ``max_requests``: the most requests the serving layer hands this engine at once
    (Ray Serve's ``max_ongoing_requests``; 0: no cap). The engine only reports it: a
    router sends a request elsewhere before that layer would pass it on by queue length.

    ``generation_config``: whose sampling defaults the HTTP server applies to requests
    that leave a field unset, as vLLM's ``--generation-config``: ``auto`` the model's
    ``generation_config.json``, ``vllm`` none, or another folder's file
    (``deploy/openai/generation_defaults.py``). The engine itself does not read it.
    """

    model: str = "smollm2-135m-instruct"
    block_size: int = 16
    num_kv_blocks: int | None = None
    kv_cache_memory_gb: float | None = None
    gpu_memory_utilization: float = 0.9
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 256
    max_model_len: int | None = None
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    page_aligned: bool = True
    dtype: str = "auto"
    device: str = "auto"
    enforce_eager: bool = False
    seed: int = 0
    hash_seed: int = 0
    replica_id: str = "replica-0"
    emulate: str | None = None
    time_scale: float = 1.0
    host_kv_blocks: int = 0
    host_kv_gb: float = 0.0
    step_target_s: float | None = 0.25
    enable_lora: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None
    lora_modules: Mapping[str, str] = field(default_factory=dict)
    max_requests: int = 0
    generation_config: str = "auto"

    def __post_init__(self) -> None:
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two >= 1, got {self.block_size}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks must be >= 1, got {self.num_kv_blocks}")
        if self.kv_cache_memory_gb is not None and not self.kv_cache_memory_gb > 0:
            raise ValueError(f"kv_cache_memory_gb must be > 0 or None, got {self.kv_cache_memory_gb}")
        if self.num_kv_blocks is not None and self.kv_cache_memory_gb is not None:
            raise ValueError("set num_kv_blocks or kv_cache_memory_gb, not both")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        if self.enable_chunked_prefill and self.page_aligned and self.max_num_batched_tokens < self.block_size:
            # A page-aligned chunk would always round down to 0 tokens: nothing could run.
            raise ValueError(
                f"max_num_batched_tokens={self.max_num_batched_tokens} must be >= block_size={self.block_size} "
                "with page-aligned chunked prefill (or set page_aligned=False)"
            )
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_requests < 0:
            raise ValueError(f"max_requests must be >= 0 (0: no cap), got {self.max_requests}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")
        if self.dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {_DTYPES}, got {self.dtype!r}")
        if self.device not in _DEVICES:
            raise ValueError(f"device must be one of {_DEVICES}, got {self.device!r}")
        if self.emulate is not None:
            from kvroute.replica.profiles import get_profile

            get_profile(self.emulate)  # ValueError naming the known profiles
        if self.host_kv_blocks < 0 or self.host_kv_gb < 0:
            raise ValueError(f"host_kv_blocks and host_kv_gb must be >= 0, got {self.host_kv_blocks}, {self.host_kv_gb}")
        if self.host_kv_blocks and self.host_kv_gb:
            raise ValueError("set host_kv_blocks or host_kv_gb, not both")
        if (self.host_kv_blocks or self.host_kv_gb) and not self.enable_prefix_caching:
            raise ValueError("host_kv_blocks / host_kv_gb need enable_prefix_caching (the host tier holds prefix blocks)")
        if not self.time_scale > 0:
            raise ValueError(f"time_scale must be > 0, got {self.time_scale!r}")
        if self.time_scale != 1.0 and self.emulate is None:
            raise ValueError("time_scale applies to an emulated engine only (set emulate)")
        if self.step_target_s is not None and not self.step_target_s > 0:
            raise ValueError(f"step_target_s must be > 0 or None, got {self.step_target_s!r}")
        if not isinstance(self.generation_config, str) or not self.generation_config:
            raise ValueError(f"generation_config must be 'auto', 'vllm' or a folder, got {self.generation_config!r}")
        if not 0 <= self.hash_seed < 2**64:
            raise ValueError(f"hash_seed must be in [0, 2**64), got {self.hash_seed}")
        self._check_lora()

    def _check_lora(self) -> None:
        if self.max_loras < 1 or self.max_lora_rank < 1:
            raise ValueError(f"max_loras and max_lora_rank must be >= 1, got {self.max_loras}, {self.max_lora_rank}")
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError(f"max_cpu_loras={self.max_cpu_loras} must be >= max_loras={self.max_loras}")
        if not isinstance(self.lora_modules, Mapping):
            raise ValueError(f"lora_modules must map adapter names to folders, got {type(self.lora_modules).__name__}")
        for name, path in self.lora_modules.items():
            check_adapter_name(name)
            if not isinstance(path, str) or not path:
                raise ValueError(f"lora_modules[{name!r}] must be a folder path, got {path!r}")
        if self.lora_modules and not self.enable_lora:
            raise ValueError("lora_modules needs enable_lora=True")

    def host_blocks(self, bytes_per_block: int) -> int:
        """The host tier's size in blocks: ``host_kv_blocks``, or ``host_kv_gb`` over
        ``bytes_per_block`` (ValueError when that is unknown, 0)."""
        if not self.host_kv_gb:
            return self.host_kv_blocks
        if bytes_per_block <= 0:
            raise ValueError("host_kv_gb needs the KV bytes per block (an emulation profile without kv_bytes_per_token)")
        return max(1, int(self.host_kv_gb * 2**30) // bytes_per_block)

    def context_length(self, max_position_embeddings: int) -> int:
        """The context length an engine of this config serves: ``max_model_len``, at
        most the model's own (the profile's when emulated). ValueError past it."""
        if self.emulate is not None:
            from kvroute.replica.profiles import get_profile

            native, what = get_profile(self.emulate).max_model_len, "emulated context length"
        else:
            native, what = max_position_embeddings, "max_position_embeddings"
        if self.max_model_len is not None and self.max_model_len > native:
            raise ValueError(f"max_model_len={self.max_model_len} exceeds the model's {what}={native}")
        return self.max_model_len or native
