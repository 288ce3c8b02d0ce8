"""The step's adapter layout, shared by every wrapped Linear (``layers.py``): which runs
of token rows use which device slot (``LoRASegments``, ``kernels/lora.py``), set once per
step before the forward pass."""

from __future__ import annotations

from typing import Mapping, Sequence

import torch

from kvroute.kernels.lora import LoRASegments


class LoRABatch:
    """``segments``: the current step's layout (None: no row uses an adapter)."""

    def __init__(self) -> None:
        self.segments: LoRASegments | None = None

    def lay_out(self, rows: Sequence[tuple[int, int, str | None]], slots: Mapping[str, int],
                device: torch.device) -> LoRASegments | None:  # fmt: skip
        """Set the layout of ``rows`` (``(start, length, adapter or None)``), each
        adapter in its slot of ``slots`` (resident ones: name -> slot)."""
        self.segments = LoRASegments.from_rows([(s, n, slots[a] if a is not None else -1) for s, n, a in rows], device)
        return self.segments
