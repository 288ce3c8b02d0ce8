"""The benchmarks' tests share Serve fleets: a test module that runs several
comparisons on one fleet shape asks for ``kept_fleet`` (module-scoped), and its
comparisons swap routers on one deployment instead of each starting and deleting its
own engine replicas (``compare_routers.KeptFleet``: a fixed hash seed, the fleet left
up between comparisons, closed when the module ends)."""

from __future__ import annotations

from typing import Any, Iterator

import pytest


@pytest.fixture(scope="module")
def kept_fleet(ray_cluster: str) -> Iterator[Any]:
    from kvroute.benchmarks.compare_routers import KeptFleet

    with KeptFleet(hash_seed=20240607) as kept:
        yield kept
