"""Kernel tests run the Triton kernels under the interpreter when there is no GPU.

Kernels are jitted lazily (``kvroute.kernels.triton_compat.kernel``), so setting
``TRITON_INTERPRET`` here works even if another test module imported a kernel module
first. Nothing else in the suite launches Triton on the CPU (ops picks the torch
references there), so the variable does not change other tests.
"""

from __future__ import annotations

import os

import pytest


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


if not _cuda_available():
    os.environ["TRITON_INTERPRET"] = "1"


@pytest.fixture(scope="session")
def triton_available() -> None:
    """Fail (not skip) without Triton: CI installs it through the ``test`` extra."""
    from kvroute.kernels.triton_compat import HAS_TRITON

    assert HAS_TRITON, "the 'triton' package is required for the kernel tests (pip install -e '.[test]')"
