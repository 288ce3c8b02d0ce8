"""LoRA adapters registered on the host and the device slots holding the resident ones,
least recently used evicted (stdlib only; ARCHITECTURE.md §4, LoRA adapters).

``AdapterSlots`` is the bookkeeping every engine shares: the real one
(``layers.py``'s ``LayerSlots`` copies the weights into the wrapped Linears' slot and
times it), the emulated one (``EmulatedSlots``: a slot load takes the profile's bytes ÷
host → device bandwidth, charged to the step) and the simulator's replicas (the same).
``acquire`` makes a step's adapters resident (the scheduler never puts more than
``max_loras`` adapters in one step, so a slot is always free or evictable) and returns
the seconds its loads took; ``state`` is what the load report carries.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable

from kvroute.replica.config import check_adapter_name
from kvroute.replica.lora.peft import CONFIG_FILE, adapter_folder, read_config

_EMA = 0.2  # weight of the newest slot load in ``load_s``


@dataclass(frozen=True)
class AdapterInfo:
    """An adapter as the emulated engine and the simulator know it: a name, its folder
    (None: a simulator's adapter) and its rank."""

    name: str
    path: Path | None
    rank: int


class AdapterSlots:
    """Registered adapters (``adapters``, at most ``max_cpu_loras``) and ``max_loras``
    device slots (``resident``: name -> slot, least recently used first). One caller."""

    def __init__(self, max_loras: int, max_rank: int, max_cpu_loras: int | None) -> None:
        self.max_loras, self.max_rank, self.max_cpu_loras = max_loras, max_rank, max_cpu_loras
        self.adapters: dict[str, Any] = {}  # name -> adapter (``.name``, ``.path``, ``.rank``)
        self.resident: OrderedDict[str, int] = OrderedDict()
        self.num_slot_loads = 0  # adapters copied into a device slot
        self.load_s = 0.0  # seconds a slot load takes (moving average; what the router prices a cold adapter at)
        self.last_load_s = 0.0

    def read(self, name: str, path: str | Path) -> Any:
        """An adapter from a PEFT folder: here its config alone (an engine without weights)."""
        name = check_adapter_name(name)
        folder = adapter_folder(name, path)  # a folder of this node, or its copy of an s3:// URI
        rank, _, _ = read_config(folder / CONFIG_FILE, self.max_rank)
        return AdapterInfo(name, folder, rank)

    def register(self, adapter: Any) -> None:
        """Register an adapter ``read`` returned (ValueError, nothing kept, if the name is
        taken, ``max_cpu_loras`` are registered, or its rank is above ``max_rank``)."""
        if adapter.name in self.adapters:
            raise ValueError(f"LoRA adapter {adapter.name!r} is already loaded (unload it first)")
        if self.max_cpu_loras is not None and len(self.adapters) >= self.max_cpu_loras:
            raise ValueError(f"max_cpu_loras={self.max_cpu_loras} adapters are loaded; unload one first")
        if adapter.rank > self.max_rank:
            raise ValueError(f"LoRA adapter {adapter.name!r} has rank {adapter.rank} > max_lora_rank={self.max_rank}")
        self.adapters[adapter.name] = adapter

    def unregister(self, name: str) -> None:
        self.require(name)
        del self.adapters[name]
        self.resident.pop(name, None)  # its slot is simply reused later

    def evict_all(self) -> None:
        """Empty every slot (the adapters stay registered); the caller runs no step now."""
        self.resident.clear()

    def require(self, name: str) -> None:
        if name not in self.adapters:
            known = ", ".join(sorted(self.adapters)) or "none"
            raise ValueError(f"unknown LoRA adapter {name!r} (loaded: {known})")

    def acquire(self, names: Iterable[str]) -> float:
        """Make ``names`` resident (``resident[name]`` is then its slot); the seconds the
        slot loads took."""
        pinned = set(names)
        seconds = 0.0
        for name in sorted(pinned):  # (a set's order follows the process' string hashing: runs would differ)
            if name in self.resident:
                self.resident.move_to_end(name)
            else:
                self._fill_slot(name, pinned)
                seconds += self.last_load_s
        return seconds

    def _fill_slot(self, name: str, pinned: set[str]) -> None:
        used = set(self.resident.values())
        free = [s for s in range(self.max_loras) if s not in used]
        if free:
            slot = free[0]
        else:
            victim = next(n for n in self.resident if n not in pinned)
            slot = self.resident.pop(victim)
        self.last_load_s = self._load_slot(slot, self.adapters[name])
        self.load_s = self.last_load_s if not self.num_slot_loads else (1 - _EMA) * self.load_s + _EMA * self.last_load_s
        self.resident[name] = slot
        self.num_slot_loads += 1

    def _load_slot(self, slot: int, adapter: Any) -> float:
        """Put ``adapter`` in ``slot``; the seconds it took (here: nothing to copy)."""
        return 0.0

    def state(self) -> tuple[tuple[str, ...], float]:
        """(the resident adapters, the seconds a slot load takes): the load report's."""
        return tuple(self.resident), self.load_s


class EmulatedSlots(AdapterSlots):
    """Slots whose loads take ``load_time(rank)`` seconds (the emulation profile's bytes ÷
    host → device bandwidth), charged by the caller to the step that needs them."""

    def __init__(self, max_loras: int, max_rank: int, max_cpu_loras: int | None, load_time: Callable[[int], float]) -> None:
        super().__init__(max_loras, max_rank, max_cpu_loras)
        self.load_time = load_time

    def _load_slot(self, slot: int, adapter: Any) -> float:
        return self.load_time(adapter.rank)
