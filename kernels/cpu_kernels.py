"""Native CPU kernels (``cpu_kernels.c``): compiled on first use with the system C
compiler into a per-machine cache, loaded with ctypes (no Python headers, no build
step at install time; compiling takes about a second).

Each wrapper returns False/None when the native kernel does not apply (no compiler or a
failed build, logged once; a dtype, layout or size it does not cover), and the caller
uses the torch reference. ``KVROUTE_NATIVE=0`` turns the native kernels off. The
compiler targets what ``cpu_capability`` says (``-march=native``, or a lower level when
``KVROUTE_CPU_CAPABILITY`` forces one); each target is built and cached on its own. Both
variables are read once, on first use; ``reset`` reads them again.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import warnings
from pathlib import Path

import torch

from kvroute.kernels import cpu_capability

log = logging.getLogger(__name__)

_SOURCE = Path(__file__).with_name("cpu_kernels.c")
# Not -ffast-math: linked into a shared library it sets flush-to-zero for the whole
# process when loaded (crtfastmath.o), changing every other library's float results.
# The target (-march, vector width) comes from cpu_capability.
_FLAGS = [
    "-O3", "-fopenmp", "-shared", "-fPIC",
    "-fno-math-errno", "-fno-trapping-math", "-fassociative-math", "-fno-signed-zeros", "-ffinite-math-only",
]
_FUNCS = {torch.float32: "paged_decode_attention_f32", torch.bfloat16: "paged_decode_attention_bf16"}
_PREFILL_FUNCS = {torch.float32: "paged_prefill_attention_f32", torch.bfloat16: "paged_prefill_attention_bf16"}
_MAX_GROUP, _MAX_HEAD_DIM, _MAX_PAGE, _MAX_HEADS = 16, 256, 256, 128  # the C file's limits


def _cache_dir() -> Path:
    """``<kvroute cache>/kernels``: the cache root is ``$KVROUTE_CACHE`` (default
    ``~/.cache/kvroute``), the one ``replica/model_store.cache_dir`` reads (kernels/ may
    not import replica/, hence the copy); ``KVROUTE_CACHE_DIR`` is its deprecated alias,
    honoured only when ``KVROUTE_CACHE`` is unset."""
    root = os.environ.get("KVROUTE_CACHE") or os.environ.get("KVROUTE_CACHE_DIR")
    if not os.environ.get("KVROUTE_CACHE") and root:
        warnings.warn("KVROUTE_CACHE_DIR is deprecated; set KVROUTE_CACHE", DeprecationWarning, stacklevel=2)
    return Path(root or os.path.join(os.path.expanduser("~"), ".cache", "kvroute")).expanduser() / "kernels"


def reset() -> None:
    """Read ``KVROUTE_NATIVE`` and ``KVROUTE_CPU_CAPABILITY`` again (tests switch them);
    a target built before is not built again."""
    cpu_capability.current.cache_clear()
    _library.cache_clear()


@functools.lru_cache(maxsize=None)
def _library() -> ctypes.CDLL | None:
    if os.environ.get("KVROUTE_NATIVE", "1") == "0":
        return None
    return _build(cpu_capability.current().compile_flags)


@functools.lru_cache(maxsize=None)
def _build(target_flags: tuple[str, ...]) -> ctypes.CDLL | None:
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        log.warning("kvroute: no C compiler found; CPU kernels use the torch path")
        return None
    flags = [*_FLAGS, *target_flags]
    cpu = " ".join(sorted(cpu_capability.machine_flags())) or platform.processor()  # -march=native is per CPU
    try:
        version = subprocess.run([cc, "--version"], capture_output=True, text=True, check=True).stdout
        key = hashlib.sha256(
            "\0".join([_SOURCE.read_text(), " ".join(flags), version, cpu]).encode()
        ).hexdigest()[:16]
        target = _cache_dir() / f"cpu_kernels-{key}.so"
        if not target.exists():
            target.parent.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
                built = Path(tmp) / target.name
                subprocess.run([cc, *flags, str(_SOURCE), "-o", str(built), "-lm"], capture_output=True, text=True, check=True)
                os.replace(built, target)  # atomic: concurrent builders each publish a whole file
        lib = ctypes.CDLL(str(target))
    except (OSError, subprocess.CalledProcessError) as e:
        detail = getattr(e, "stderr", "") or str(e)
        log.warning("kvroute: building the CPU kernels failed; using the torch path: %s", detail.strip()[:500])
        return None
    p, i64, i32, f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float
    for name in _FUNCS.values():
        getattr(lib, name).argtypes = [p, i64, p, p, p, i64, p, p, p, i64, i32, i32, i32, i32, i32, f32, i32]
        getattr(lib, name).restype = ctypes.c_int
    for name in _PREFILL_FUNCS.values():
        getattr(lib, name).argtypes = [p, i64, p, p, p, i64, p, p, p, p, i64, i32, i32, i32, i32, i32, f32, i32]
        getattr(lib, name).restype = ctypes.c_int
    lib.add_rms_norm_bf16.argtypes = [p, p, p, p, p, i64, i32, f32, i32]
    lib.add_rms_norm_bf16.restype = ctypes.c_int
    lib.rotary_bf16.argtypes = [p, i64, i64, i32, i32, p, p, i32]
    lib.rotary_bf16.restype = None
    lib.silu_and_mul_bf16.argtypes = [p, p, i64, i32, i32]
    lib.silu_and_mul_bf16.restype = None
    lib.argmax_rows_bf16.argtypes = [p, i64, i64, i64, p, i32]
    lib.argmax_rows_bf16.restype = None
    return lib


def available() -> bool:
    return _library() is not None


def decode_attention(
    query: torch.Tensor,  # [T, H, D]
    key_cache: torch.Tensor,  # [num_blocks, page, KVH, D]
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [num_seqs, max_blocks] int32
    seq_lens: torch.Tensor,  # [num_seqs] int32
    rows: torch.Tensor,  # [num_seqs] int64: each sequence's query row
    out: torch.Tensor,  # [T, H, D], written at ``rows``
    scale: float,
) -> bool:
    """Single-token attention of the given sequences, in place into ``out``. Returns
    False (nothing written) when the native kernel is unavailable or does not cover these
    tensors (dtype, layout, sizes), so the caller falls back."""
    return _attention(_FUNCS, query, key_cache, value_cache, block_tables, seq_lens, rows, None, out, scale)


def prefill_attention(
    query: torch.Tensor,  # [T, H, D]
    key_cache: torch.Tensor,  # [num_blocks, page, KVH, D]
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [num_seqs, max_blocks] int32
    seq_lens: torch.Tensor,  # [num_seqs] int32: cached context + new tokens
    rows: torch.Tensor,  # [num_seqs] int64: each sequence's first query row
    q_lens: torch.Tensor,  # [num_seqs] int32: its new tokens (rows rows[s] .. + q_lens[s] - 1)
    out: torch.Tensor,  # [T, H, D], written at those rows
    scale: float,
) -> bool:
    """Causal attention of the given sequences' new tokens over their whole prefix (their
    own K/V already stored), in place into ``out``; False (nothing written) when not
    covered, as decode_attention."""
    if query.shape[2] % 16:
        return False
    return _attention(_PREFILL_FUNCS, query, key_cache, value_cache, block_tables, seq_lens, rows, q_lens, out, scale)


def _attention(funcs, query, key_cache, value_cache, block_tables, seq_lens, rows, q_lens, out, scale) -> bool:
    fn_name = funcs.get(query.dtype)
    if fn_name is None or query.device.type != "cpu" or key_cache.dtype != query.dtype:
        return False
    num_heads, head_dim = query.shape[1:]
    page, num_kv_heads = key_cache.shape[1:3]
    if (
        num_heads % num_kv_heads
        or num_heads // num_kv_heads > _MAX_GROUP
        or num_heads > _MAX_HEADS
        or head_dim > _MAX_HEAD_DIM
        or page > _MAX_PAGE
        or not (key_cache.is_contiguous() and value_cache.is_contiguous())
        or query.stride(2) != 1 or query.stride(1) != head_dim
        or out.stride(2) != 1 or out.stride(1) != head_dim
    ):
        return False
    lib = _library()
    if lib is None:
        return False
    block_tables = block_tables.to(torch.int32).contiguous()
    seq_lens = seq_lens.to(torch.int32).contiguous()
    rows = rows.to(torch.int64).contiguous()
    extra = [] if q_lens is None else [q_lens.to(torch.int32).contiguous()]
    rc = getattr(lib, fn_name)(
        query.data_ptr(), query.stride(0), key_cache.data_ptr(), value_cache.data_ptr(),
        block_tables.data_ptr(), block_tables.stride(0), seq_lens.data_ptr(), rows.data_ptr(),
        *[t.data_ptr() for t in extra], out.data_ptr(), out.stride(0), rows.numel(), num_heads, num_kv_heads,
        head_dim, page, scale, torch.get_num_threads(),
    )  # fmt: skip
    return rc == 0


def _bf16_cpu(*tensors: torch.Tensor) -> bool:
    return all(t.dtype == torch.bfloat16 and t.device.type == "cpu" for t in tensors)


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``(rms_norm(x + residual), x + residual)`` (``residual=None``: of x, and x) for
    contiguous bf16 rows; None when not covered."""
    dim = x.shape[-1]
    if (
        not _bf16_cpu(x, weight)
        or (residual is not None and (not _bf16_cpu(residual) or not residual.is_contiguous() or residual.shape != x.shape))
        or not x.is_contiguous() or not weight.is_contiguous() or dim > 16384
    ):
        return None
    lib = _library()
    if lib is None:
        return None
    out = torch.empty_like(x)
    h = torch.empty_like(x) if residual is not None else x
    rc = lib.add_rms_norm_bf16(
        x.data_ptr(), residual.data_ptr() if residual is not None else None, weight.data_ptr(), out.data_ptr(),
        h.data_ptr() if residual is not None else None, x.numel() // dim, dim, eps, torch.get_num_threads(),
    )  # fmt: skip
    return (out, h) if rc == 0 else None


def rotary_(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> bool:
    """Rotate-half RoPE in place on q [T, H, D] and k [T, KVH, D] (rows may be strided
    views of one QKV output, heads contiguous); cos/sin [T, 1, D] or [T, D]."""
    if not _bf16_cpu(q, k, cos, sin) or not (cos.is_contiguous() and sin.is_contiguous()):
        return False
    head_dim = q.shape[-1]
    if any(x.stride(-1) != 1 or x.stride(-2) != head_dim for x in (q, k)) or head_dim % 2:
        return False
    lib = _library()
    if lib is None:
        return False
    threads = torch.get_num_threads()
    for x in (q, k):
        lib.rotary_bf16(x.data_ptr(), x.stride(0), x.shape[0], x.shape[1], head_dim, cos.data_ptr(), sin.data_ptr(), threads)
    return True


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor | None:
    """``silu(gate) * up`` of contiguous bf16 rows ``[gate | up]``; None when not covered."""
    if not _bf16_cpu(gate_up) or not gate_up.is_contiguous():
        return None
    lib = _library()
    if lib is None:
        return None
    width = gate_up.shape[-1] // 2
    out = gate_up.new_empty((*gate_up.shape[:-1], width))
    lib.silu_and_mul_bf16(gate_up.data_ptr(), out.data_ptr(), out.numel() // width, width, torch.get_num_threads())
    return out


def argmax_rows(x: torch.Tensor) -> torch.Tensor | None:
    """``x.argmax(dim=1)`` of a 2-D bf16 tensor with contiguous rows (torch's bf16 argmax on
    CPU is slower than widening to float32 first); None when not covered. Rows are
    assumed free of NaN."""
    if not _bf16_cpu(x) or x.dim() != 2 or x.stride(1) != 1 or x.shape[1] == 0:
        return None
    lib = _library()
    if lib is None:
        return None
    out = torch.empty(x.shape[0], dtype=torch.int64)
    lib.argmax_rows_bf16(x.data_ptr(), x.shape[0], x.shape[1], x.stride(0), out.data_ptr(), torch.get_num_threads())
    return out
