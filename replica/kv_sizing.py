"""How many KV blocks an engine allocates: an explicit size, or what memory leaves.

The rule, in the order it is applied (the first that is set wins):

1. ``num_kv_blocks``: that many blocks.
2. ``kv_cache_memory_gb``: that many GiB of KV (as vLLM-CPU's ``VLLM_CPU_KVCACHE_SPACE``).
3. On CUDA, ``gpu_memory_utilization`` (0.9 by default), as vLLM's
   ``--gpu-memory-utilization``: this engine may use that fraction of the device's total
   memory, weights, activations and KV together. The free memory is read before the
   weights load; after they load, one profile run (a forward pass of
   ``max_num_batched_tokens`` tokens over ``min(max_num_seqs, tokens)`` sequences, then
   the sampler on those rows' logits) gives the activations' peak. The KV cache takes the
   budget less what the engine then holds (weights, the CUDA context's growth) and less
   that peak. What stays outside the budget (the other ``1 - fraction``) covers the CUDA
   graphs captured after the KV cache and the allocator's fragmentation. The fraction is
   per engine: two replicas sharing a card each take their own (0.45 each, say), and a
   budget larger than the memory free at start is a ValueError, as in vLLM.
4. On CPU: ``CPU_KV_SHARE`` of the RAM available when the weights have loaded (Linux's
   ``MemAvailable``, or the cgroup's limit less its usage where that is lower), at most
   ``CPU_KV_MAX_GIB``. Modest on purpose: a CPU box often runs several engines (a test
   suite starts many), each sized when it starts, and CPU throughput rarely needs more;
   set ``kv_cache_memory_gb`` for a larger cache.

Each engine logs one INFO line with the size in blocks, tokens and GiB, and how it was
chosen (``KVSize.describe``). The router's capacity figures are the engine's block count.
The arithmetic is in pure functions (``cpu_kv_bytes``, ``cuda_kv_bytes``); ``KVSizer``
measures and applies them.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvroute.replica.config import EngineConfig
    from kvroute.replica.model_runner import ModelRunner

log = logging.getLogger(__name__)

GIB = 2**30
CPU_KV_SHARE = 0.05  # of MemAvailable, when no size is given on CPU
CPU_KV_MAX_GIB = 4.0  # vLLM-CPU's long-standing VLLM_CPU_KVCACHE_SPACE default


@dataclass(frozen=True)
class KVSize:
    """An engine's KV cache: ``num_blocks`` of ``block_size`` tokens, ``block_bytes`` each
    (every layer's K and V), and how the size was chosen (``source``)."""

    num_blocks: int
    block_size: int
    block_bytes: int
    source: str

    @property
    def tokens(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def gib(self) -> float:
        return self.num_blocks * self.block_bytes / GIB

    def describe(self) -> str:
        """The start-up line: blocks, tokens, GiB and the source."""
        return (f"KV cache: {self.num_blocks} blocks x {self.block_size} tokens = {self.tokens} tokens, "
                f"{self.gib:.2f} GiB ({self.source})")  # fmt: skip


def blocks_for_bytes(kv_bytes: float, block_bytes: int, what: str) -> int:
    """Whole blocks of ``block_bytes`` in ``kv_bytes``; ValueError (naming ``what``, the
    setting to change) when not even one fits."""
    if block_bytes <= 0:
        raise ValueError(f"block_bytes must be > 0, got {block_bytes}")
    blocks = int(kv_bytes) // block_bytes
    if blocks < 1:
        raise ValueError(f"no room for the KV cache: {max(kv_bytes, 0) / GIB:.3f} GiB is left for it, one block "
                         f"takes {block_bytes / GIB:.6f} GiB; {what}")  # fmt: skip
    return blocks


def cpu_kv_bytes(mem_available: int) -> int:
    """The CPU default: ``CPU_KV_SHARE`` of ``mem_available`` bytes, at most ``CPU_KV_MAX_GIB``."""
    if mem_available < 0:
        raise ValueError(f"mem_available must be >= 0, got {mem_available}")
    return int(min(CPU_KV_SHARE * mem_available, CPU_KV_MAX_GIB * GIB))


def cuda_kv_bytes(fraction: float, total: int, free_at_start: int, held: int, peak_activations: int) -> int:
    """The CUDA default: ``fraction * total`` less what the engine ``held`` after its
    weights loaded (the drop in free memory since start) and less ``peak_activations``
    (the profile run's peak above what stayed allocated). ValueError when the budget
    exceeds the memory free at start (other processes hold the rest) or leaves nothing."""
    if not 0 < fraction <= 1:
        raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {fraction}")
    if min(total, free_at_start, held, peak_activations) < 0:
        raise ValueError("memory figures must be >= 0")
    budget = fraction * total
    if budget > free_at_start:
        raise ValueError(f"free device memory at start ({free_at_start / GIB:.2f}/{total / GIB:.2f} GiB) is less "
                         f"than gpu_memory_utilization={fraction} of it ({budget / GIB:.2f} GiB): lower "
                         "gpu_memory_utilization or free the memory other processes hold")  # fmt: skip
    return int(budget - held - peak_activations)


def mem_available() -> int:
    """Bytes of RAM this process may still take: ``MemAvailable`` from /proc/meminfo
    (else the free physical pages), or less where a cgroup (v2 or v1) limits it."""
    avail = _meminfo_available()
    limit = _cgroup_room()
    return avail if limit is None else min(avail, limit)


def _meminfo_available() -> int:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def _cgroup_room() -> int | None:
    """The cgroup's memory limit less its usage; None without a limit."""
    for limit_file, usage_file in (("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
                                   ("/sys/fs/cgroup/memory/memory.limit_in_bytes",
                                    "/sys/fs/cgroup/memory/memory.usage_in_bytes")):  # fmt: skip
        try:
            limit_text = Path(limit_file).read_text().strip()
            if limit_text == "max":
                return None
            limit, usage = int(limit_text), int(Path(usage_file).read_text().strip())
        except (OSError, ValueError):
            continue
        if limit >= 2**60:  # cgroup v1's "no limit"
            return None
        return max(0, limit - usage)
    return None


class KVSizer:
    """Sizes one engine's KV cache (the rule in this module's docstring). Built before
    the weights load (on CUDA it reads the free memory then); the model runner calls it
    once the weights are on the device, and ``size`` is then the result."""

    def __init__(self, config: "EngineConfig", block_bytes: int, device: Any) -> None:
        self.config, self.block_bytes, self.device = config, block_bytes, device
        self.size: KVSize | None = None
        self._free_at_start = self._total = 0
        if self._needs_profile():
            import torch

            torch.cuda.empty_cache()
            self._free_at_start, self._total = torch.cuda.mem_get_info(device)

    def _needs_profile(self) -> bool:
        c = self.config
        return c.num_kv_blocks is None and c.kv_cache_memory_gb is None and self.device.type == "cuda"

    def __call__(self, runner: "ModelRunner") -> int:
        """The KV cache's size in blocks, for ``runner`` with its weights loaded (logged)."""
        c, bb = self.config, self.block_bytes
        if c.num_kv_blocks is not None:
            blocks, source = c.num_kv_blocks, "num_kv_blocks"
        elif c.kv_cache_memory_gb is not None:
            blocks = blocks_for_bytes(c.kv_cache_memory_gb * GIB, bb, "raise kv_cache_memory_gb")
            source = f"kv_cache_memory_gb={c.kv_cache_memory_gb}"
        elif self.device.type == "cuda":
            held, peak = self._profile(runner)
            kv = cuda_kv_bytes(c.gpu_memory_utilization, self._total, self._free_at_start, held, peak)
            blocks = blocks_for_bytes(kv, bb, "raise gpu_memory_utilization, or lower max_num_batched_tokens")
            source = (f"gpu_memory_utilization={c.gpu_memory_utilization} of {self._total / GIB:.1f} GiB, less "
                      f"{held / GIB:.2f} GiB held and {peak / GIB:.2f} GiB of peak activations")  # fmt: skip
        else:
            avail = mem_available()
            blocks = blocks_for_bytes(cpu_kv_bytes(avail), bb, "set kv_cache_memory_gb")
            source = f"{CPU_KV_SHARE:.0%} of {avail / GIB:.1f} GiB available RAM, at most {CPU_KV_MAX_GIB:g} GiB"
        self.size = KVSize(blocks, c.block_size, bb, source)
        log.info("%s", self.size.describe())
        return blocks

    def _profile(self, runner: "ModelRunner") -> tuple[int, int]:
        """``(held, peak activations)`` in bytes: the free memory's drop since start, and
        the peak of a ``max_num_batched_tokens`` forward pass and sampling above what
        stays allocated after it."""
        import torch

        from kvroute.replica.sampler import Sampler
        from kvroute.replica.sampling_params import SampleRequest, SamplingParams

        c = self.config
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        base = torch.cuda.memory_allocated(self.device)
        num_tokens = c.max_num_batched_tokens
        logits = runner.profile_forward(num_tokens, min(c.max_num_seqs, num_tokens))
        # the sampler's widest path: penalties, top-k, top-p and min-p on every row
        params = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, min_p=0.05, repetition_penalty=1.1,
                                frequency_penalty=0.1, logprobs=5)  # fmt: skip
        rows = [SampleRequest(params, [0], [0]) for _ in range(logits.shape[0])]
        Sampler(0)(logits, rows)
        del logits
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device) - base
        torch.cuda.empty_cache()
        free_now, _ = torch.cuda.mem_get_info(self.device)
        return max(0, self._free_at_start - free_now), max(0, peak)
