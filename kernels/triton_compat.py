"""Triton if it is installed, a stand-in if not: kernel modules must import on machines
without Triton (the CPU engine only ever calls the torch references).

Kernels are declared with :func:`kernel` instead of ``@triton.jit``: Triton decides
between compiling and interpreting when ``triton.jit`` runs, and :func:`kernel` defers
that to the first launch, so ``TRITON_INTERPRET=1`` (set by tests/kernels/conftest.py
when CUDA is absent) works even if a kernel module was imported earlier. Helpers that
kernels call are declared with :func:`kernel` too: jitting a kernel first jits the lazy
helpers its module refers to and puts them in the module's namespace.
"""

from __future__ import annotations

import os
from typing import Any, Callable

try:
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # pragma: no cover - exercised only where Triton is missing
    HAS_TRITON = False

    class _MissingTriton:
        """Enough of ``triton`` / ``triton.language`` for module-level decorators and
        ``tl.constexpr`` annotations; launching anything raises."""

        constexpr = Any

        @staticmethod
        def jit(fn: Callable[..., Any] | None = None, **_: Any) -> Any:
            def wrap(f: Callable[..., Any]) -> Any:
                return _Unavailable(f.__name__)

            return wrap(fn) if fn is not None else wrap

        @staticmethod
        def next_power_of_2(n: int) -> int:
            return 1 << max(0, int(n) - 1).bit_length()

        @staticmethod
        def cdiv(a: int, b: int) -> int:
            return -(-a // b)

    class _Unavailable:
        def __init__(self, name: str) -> None:
            self.name = name

        def __getitem__(self, grid: Any) -> Callable[..., None]:
            raise RuntimeError(f"Triton kernel {self.name} needs the 'triton' package, which is not installed")

    triton = _MissingTriton()  # type: ignore[assignment]
    tl = _MissingTriton()  # type: ignore[assignment]


class LazyKernel:
    """``triton.jit(fn)``, created on first use; ``kernel[grid](...)`` launches it."""

    def __init__(self, fn: Callable[..., Any], jit_kwargs: dict[str, Any]) -> None:
        self.fn = fn
        self.jit_kwargs = jit_kwargs
        self._jit: Any = None
        self.__name__ = fn.__name__
        self.__doc__ = fn.__doc__

    @property
    def jit(self) -> Any:
        """The Triton JIT (or interpreted) function."""
        if self._jit is None:
            names = self.fn.__globals__
            for name in self.fn.__code__.co_names:
                obj = names.get(name)
                if isinstance(obj, LazyKernel) and obj is not self:
                    names[name] = obj.jit  # Triton resolves called helpers by global name
            self._jit = triton.jit(self.fn, **self.jit_kwargs)
        return self._jit

    def __getitem__(self, grid: Any) -> Any:
        return self.jit[grid]


def kernel(fn: Callable[..., Any] | None = None, **jit_kwargs: Any) -> Any:
    """Decorator: a Triton kernel jitted lazily (see the module docstring)."""

    def wrap(f: Callable[..., Any]) -> LazyKernel:
        return LazyKernel(f, jit_kwargs)

    return wrap(fn) if fn is not None else wrap


@kernel
def round_to(x, DTYPE: tl.constexpr):
    """fp32 ``x`` rounded to nearest-even at ``DTYPE``'s precision, still fp32, so that a
    kernel rounds where the eager torch ops round. The bf16 case is done on the bits
    because the interpreter's fp32 -> bf16 cast truncates."""
    if DTYPE == tl.bfloat16:
        bits = x.to(tl.int32, bitcast=True)
        bits = (bits + (0x7FFF + ((bits >> 16) & 1))) & -65536
        y = bits.to(tl.float32, bitcast=True)
    elif DTYPE == tl.float16:
        y = x.to(tl.float16).to(tl.float32)
    else:
        y = x
    return y


def interpreting() -> bool:
    """True when kernels run on the CPU under Triton's interpreter."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


__all__ = ["HAS_TRITON", "LazyKernel", "interpreting", "kernel", "round_to", "tl", "triton"]
