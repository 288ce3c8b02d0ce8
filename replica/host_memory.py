"""Process-wide allocator tuning for CPU inference."""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

log = logging.getLogger(__name__)

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_done = False


def keep_freed_memory() -> bool:
    """Ask glibc to keep freed buffers (up to 32 MiB each) instead of unmapping them.

    A forward pass allocates and frees the same activation-sized buffers every layer;
    with glibc's defaults each one is a fresh mmap whose pages fault in on first touch,
    which can cost more than the copy itself (figures: benchmarks/RESULTS.md).
    Idempotent; returns False where glibc is not available.
    """
    global _done
    if _done:
        return True
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name or "libc.so.6")
        ok = libc.mallopt(_M_MMAP_THRESHOLD, 32 * 2**20) == 1 and libc.mallopt(_M_TRIM_THRESHOLD, 2**30) == 1
    except (OSError, AttributeError):
        ok = False
    if not ok:
        log.info("mallopt unavailable; CPU activations will use the allocator's defaults")
    _done = ok
    return ok
