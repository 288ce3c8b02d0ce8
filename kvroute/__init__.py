"""kvroute: multi-replica LLM serving with a prefix-cache-aware router.

The public facade is resolved lazily so that ``import kvroute.router`` never pulls in
torch (ARCHITECTURE.md §1).

An installed kvroute (wheel or editable) maps ``kvroute.replica`` to the checkout's
``replica/`` folder and so on through pyproject.toml's ``[tool.setuptools.package-dir]``.
A source checkout that is imported without that install, e.g. as the working directory
of ``ray job submit --working-dir .`` (Ray makes it the cwd and puts it first on
``sys.path``), finds this folder first and would see no subpackage at all, shadowing
an installed kvroute too. So when this file sits in a source checkout, the checkout's
root joins ``__path__`` and ``kvroute.replica`` resolves to ``<root>/replica``: the
working directory's code, whole, rather than none of it.
"""

from __future__ import annotations

import importlib
import os
from typing import Any, Optional

__version__ = "0.1.0"

_LAZY = {
    "LLM": "kvroute.replica.llm",
    "RequestOutput": "kvroute.replica.outputs",
    "SamplingParams": "kvroute.replica.sampling_params",
    "EngineConfig": "kvroute.replica.config",
    "Engine": "kvroute.replica.engine",
    "AsyncEngine": "kvroute.replica.async_engine",
}

__all__ = sorted(_LAZY)


def _source_checkout_root() -> Optional[str]:
    """The checkout's root when this package is ``<root>/kvroute`` beside the root's
    pyproject.toml and ``replica/`` (a source checkout or a copy of one); None when it
    is installed (site-packages holds neither)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    if os.path.isfile(os.path.join(root, "pyproject.toml")) and os.path.isfile(os.path.join(root, "replica", "__init__.py")):
        return root
    return None


_ROOT = _source_checkout_root()
if _ROOT is not None and _ROOT not in __path__:
    __path__.append(_ROOT)  # after this folder: kvroute.replica -> <root>/replica, etc.


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'kvroute' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
