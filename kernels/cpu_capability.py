"""What the running CPU offers each CPU fast path, each answered by the source that decides
it (ARCHITECTURE.md §6, CPU capabilities):

- ``onednn_bf16_reorder``: oneDNN can hold bf16 Linear weights in its blocked layout.
  torch refuses the reorder unless the CPU has AVX512-BW, -VL and -DQ or AVX-NE-CONVERT
  within oneDNN's ISA limit (``ONEDNN_MAX_CPU_ISA``); torch's own check is asked, after
  the cpuinfo flags (which the forcing below masks).
- ``native_bf16_matmul``: the CPU multiplies bf16 natively (AVX512-BF16 or AMX-BF16 in
  /proc/cpuinfo's flags; on Arm its ``bf16`` feature); ``dtype='auto'`` picks bf16 only
  then.
- ``level`` and ``compile_flags``: the instruction set the native C kernels are compiled
  for (``-march=native`` on the real CPU) and its vector width.

``KVROUTE_CPU_CAPABILITY`` forces the answers down, for tests and measurements on a
bigger CPU: ``avx2`` pretends an AVX2/FMA/F16C CPU without AVX-512, AMX or the AVX-VNNI
and -NE-CONVERT extensions (no oneDNN bf16 reorder; C kernels built for x86-64-v3),
``avx512`` an AVX-512 CPU without bf16 or AMX (x86-64-v4), ``default`` the x86-64
baseline (SSE2). A level can only lower what the CPU has. It is read once, on first use
(``cpu_kernels.reset`` reads it again). torch's own kernels are not affected: they
follow ``ATEN_CPU_CAPABILITY`` and ``ONEDNN_MAX_CPU_ISA``, read once when torch starts.

torch is imported only by ``onednn_bf16_reorder``, so the rest answers without it.
"""

from __future__ import annotations

import functools
import os
import re
from dataclasses import dataclass

ENV = "KVROUTE_CPU_CAPABILITY"
LEVELS = ("default", "avx2", "avx512")  # ordered; torch's names for its dispatch levels
_MARCH = {"default": "x86-64", "avx2": "x86-64-v3", "avx512": "x86-64-v4"}
_VECTOR_BITS = {"default": 128, "avx2": 256, "avx512": 512}
# flags a CPU forced to a level no longer has: those of the levels above it
_ABOVE = {
    "default": re.compile(r"avx|fma|f16c|amx"),
    "avx2": re.compile(r"avx512|avx_|amx"),
    "avx512": re.compile(r"avx512_bf16|avx512_fp16|avx_ne_convert|amx"),
}


@dataclass(frozen=True)
class CpuCapability:
    flags: frozenset[str]  # /proc/cpuinfo's (Arm: its features), less those a forced level removes
    forced: bool  # KVROUTE_CPU_CAPABILITY removed some

    @property
    def x86(self) -> bool:
        return "sse2" in self.flags

    @property
    def level(self) -> str:
        if {"avx512f", "avx512bw", "avx512vl", "avx512dq"} <= self.flags:
            return "avx512"
        return "avx2" if {"avx2", "fma"} <= self.flags else "default"

    @property
    def vector_bits(self) -> int:
        return _VECTOR_BITS[self.level]

    @property
    def compile_flags(self) -> tuple[str, ...]:
        """The C compiler's target flags for the native kernels (only -march=native where
        the flags are not an x86-64 CPU's: unknown, or another architecture)."""
        if not self.x86:
            return ("-march=native",)
        march = _MARCH[self.level] if self.forced else "native"
        return f"-march={march}", f"-mprefer-vector-width={self.vector_bits}"

    @property
    def native_bf16_matmul(self) -> bool:
        return bool({"avx512_bf16", "amx_bf16"} & self.flags) or (not self.x86 and "bf16" in self.flags)

    @property
    def onednn_bf16_reorder(self) -> bool:
        """torch's check, after the x86 rule on the flags (so forcing takes it away)."""
        x86_allows = {"avx512bw", "avx512vl", "avx512dq"} <= self.flags or "avx_ne_convert" in self.flags
        return (x86_allows or not self.x86) and _torch_onednn_bf16()


@functools.lru_cache(maxsize=None)
def current() -> CpuCapability:
    """The capability as ``KVROUTE_CPU_CAPABILITY`` forces it, read once (tests switch it
    with ``cpu_kernels.reset``)."""
    forced_level = os.environ.get(ENV, "")
    flags = machine_flags()
    if not forced_level:
        return CpuCapability(flags, forced=False)
    if forced_level not in LEVELS:
        raise ValueError(f"{ENV} must be one of {LEVELS} (or unset), got {forced_level!r}")
    kept = frozenset(f for f in flags if not _ABOVE[forced_level].match(f))
    return CpuCapability(kept, forced=kept != flags)


@functools.lru_cache(maxsize=None)
def machine_flags() -> frozenset[str]:
    try:
        with open("/proc/cpuinfo") as f:
            line = next((line for line in f if line.startswith(("flags", "Features"))), "")
    except OSError:
        line = ""
    return frozenset(line.partition(":")[2].split())


@functools.lru_cache(maxsize=None)
def _torch_onednn_bf16() -> bool:
    import torch

    try:
        return torch.backends.mkldnn.is_available() and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False
