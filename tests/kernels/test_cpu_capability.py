"""kernels/cpu_capability.py: its rules on given flag sets, and forcing the running CPU's
capability down with KVROUTE_CPU_CAPABILITY."""

from __future__ import annotations

import subprocess
import sys

import pytest

from kvroute.kernels import cpu_capability
from kvroute.kernels.cpu_capability import CpuCapability
from tests.conftest import cpu_env

AVX2 = frozenset({"sse2", "avx", "avx2", "fma", "f16c"})
AVX512 = AVX2 | {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512cd"}


@pytest.mark.parametrize(
    "flags,level,bits,bf16",
    [
        (frozenset({"sse2"}), "default", 128, False),
        (AVX2, "avx2", 256, False),
        (AVX2 | {"avx512f"}, "avx2", 256, False),  # AVX-512 without BW/VL/DQ is not the level
        (AVX512, "avx512", 512, False),
        (AVX512 | {"avx512_bf16"}, "avx512", 512, True),
        (AVX512 | {"amx_bf16", "amx_tile"}, "avx512", 512, True),
    ],
)
def test_rules_on_flag_sets(flags, level, bits, bf16):
    cap = CpuCapability(flags, forced=False)
    assert (cap.level, cap.vector_bits, cap.native_bf16_matmul) == (level, bits, bf16)
    assert cap.compile_flags == ("-march=native", f"-mprefer-vector-width={bits}")
    assert CpuCapability(flags, forced=True).compile_flags[0] == {
        "default": "-march=x86-64", "avx2": "-march=x86-64-v3", "avx512": "-march=x86-64-v4"
    }[level]


def test_other_architectures_compile_for_themselves_and_ask_torch():
    assert CpuCapability(frozenset(), forced=False).compile_flags == ("-march=native",)
    arm = CpuCapability(frozenset({"fp", "asimd", "bf16"}), forced=False)  # an Arm CPU's features
    assert arm.compile_flags == ("-march=native",) and arm.native_bf16_matmul
    assert arm.onednn_bf16_reorder == cpu_capability._torch_onednn_bf16()


def test_onednn_bf16_reorder_needs_avx512_bw_vl_dq_or_avx_ne_convert():
    assert not CpuCapability(AVX2, forced=False).onednn_bf16_reorder
    assert not CpuCapability(AVX2 | {"avx512f", "avx512bw"}, forced=False).onednn_bf16_reorder
    torch_says = cpu_capability._torch_onednn_bf16()  # the machine's answer, within ONEDNN_MAX_CPU_ISA
    assert CpuCapability(AVX512, forced=False).onednn_bf16_reorder == torch_says
    assert CpuCapability(AVX2 | {"avx_ne_convert"}, forced=False).onednn_bf16_reorder == torch_says


@pytest.mark.parametrize("level", cpu_capability.LEVELS)
def test_forcing_only_lowers(level):
    machine = cpu_capability.machine_flags()
    with cpu_env({cpu_capability.ENV: level}):
        cap = cpu_capability.current()
    assert cap.flags <= machine and cap.forced == (cap.flags != machine)
    assert cpu_capability.LEVELS.index(cap.level) <= cpu_capability.LEVELS.index(level)
    assert not cap.native_bf16_matmul
    if level != "avx512":
        assert not any(f.startswith(("avx512", "amx", "avx_")) for f in cap.flags)
        assert not cap.onednn_bf16_reorder


def test_unset_is_the_machine_and_a_bad_level_is_refused():
    with cpu_env({cpu_capability.ENV: None}):
        assert cpu_capability.current() == CpuCapability(cpu_capability.machine_flags(), forced=False)
    with cpu_env({cpu_capability.ENV: "avx1024"}):
        with pytest.raises(ValueError, match=r"KVROUTE_CPU_CAPABILITY must be one of \('default', 'avx2', 'avx512'\)"):
            cpu_capability.current()


def test_imports_without_torch():
    code = "import sys; from kvroute.kernels import cpu_capability as c; c.current().compile_flags; " \
        "c.current().native_bf16_matmul; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)
