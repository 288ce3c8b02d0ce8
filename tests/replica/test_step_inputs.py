"""The runner's persistent block tables (``BlockTables``) against tables built from
scratch, over random step sequences: requests join, decode (a block every few steps),
skip steps, finish, are preempted and resumed on other blocks, and new requests take
freed rows (stale ids past a shorter table must read as zeros)."""

from __future__ import annotations

import random
from types import SimpleNamespace

import numpy as np
import pytest

from kvroute.replica.model_runner import BlockTables


def _scratch(rows) -> np.ndarray:
    out = np.zeros((len(rows), max(len(r.block_ids) for r in rows)), dtype=np.int32)
    for i, r in enumerate(rows):
        out[i, : len(r.block_ids)] = r.block_ids
    return out


@pytest.mark.parametrize("seed", range(8))
def test_gathered_tables_equal_tables_built_from_scratch(seed):
    rng = random.Random(seed)
    tables = BlockTables(width=64, rows=2)  # small, so it grows
    live: dict[int, tuple[SimpleNamespace, list[int]]] = {}
    next_id, next_block = 0, 1
    for _ in range(300):
        if len(live) < 12 and rng.random() < 0.3:  # a new request (sometimes the same object again)
            req = SimpleNamespace(name=next_id)
            live[next_id] = (req, [next_block + i for i in range(rng.randint(1, 40))])
            next_block += 64
            next_id += 1
        for key in list(live):
            req, ids = live[key]
            r = rng.random()
            if r < 0.05:
                del live[key]  # finished
            elif r < 0.1:
                live[key] = (req, [next_block + i for i in range(rng.randint(1, 30))])  # preempted, resumed elsewhere
                next_block += 64
            elif r < 0.4 and len(ids) < 64:
                ids.append(next_block)  # a decode step crossed a block boundary
                next_block += 1
        if not live:
            continue
        step = [SimpleNamespace(request=req, block_ids=tuple(ids)) for req, ids in live.values() if rng.random() < 0.9]
        rng.shuffle(step)
        if step:
            got = tables.gather(step)
            assert got.dtype == np.int32 and np.array_equal(got, _scratch(step))


def test_a_new_request_on_a_freed_row_reads_zeros_past_its_ids():
    tables = BlockTables(width=8, rows=1)
    a, b = SimpleNamespace(), SimpleNamespace()
    assert tables.gather([SimpleNamespace(request=a, block_ids=(5, 6, 7, 8))]).tolist() == [[5, 6, 7, 8]]
    # a is gone from this step: its row goes to b, whose table is shorter
    step = [SimpleNamespace(request=b, block_ids=(9,)), SimpleNamespace(request=SimpleNamespace(), block_ids=(1, 2))]
    assert tables.gather(step).tolist() == [[9, 0], [1, 2]]
    # a's row is free now: c takes it, beside b grown to three ids
    c = SimpleNamespace()
    step = [SimpleNamespace(request=c, block_ids=(3,)), SimpleNamespace(request=b, block_ids=(9, 10, 11))]
    assert tables.gather(step).tolist() == [[3, 0, 0], [9, 10, 11]]
    assert tables._table[0].tolist()[:4] == [3, 0, 0, 0]  # c on a's old row, its stale ids cleared
