"""Block copies between the device KV cache and the host tier's tensor: one step's
``CopyPlan`` at a time (offloads of evicted blocks, restores of host hits).

On CPU both directions are synchronous copies. On CUDA the host thread never waits
for a copy, and a step waits (on the GPU) only for what its forward pass reads or
overwrites:

- Offloads: one gather of the evicted blocks into a device staging buffer, on a
  stream of its own, then asynchronous copies into the pinned host tensor, on another.
  The step's forward may write the evicted blocks, so it waits for the gather (a
  device-local copy) and for nothing else; the transfer over PCIe overlaps the forward
  and the steps after it, and a later step's gather never queues behind it.
- Restores run on a third stream, so the two directions' copy engines work at once:
  asynchronous copies from the pinned host tensor into a device staging buffer, then
  one scatter into their device blocks. The forward reads them, so it waits for them.

Ordering across streams and steps, with events:
- The gather and the restores first wait for the compute stream's earlier work (the
  blocks an earlier forward wrote or read).
- A restore waits for the gather of the same step (its fresh device block may be one
  the step evicted) and for every pending offload into a host block it reads (a block
  evicted and offloaded this step or shortly before, then hit again).
- An offload waits for the earlier restores (the host block it overwrites may be one a
  restore still reads).

Each run of consecutive host block ids is one copy (the host tier hands out ids in
order, so a prefix evicted together mostly lands in one run). Staging buffers are
allocated on the stream that fills them; the offload's is also recorded on the stream
that copies it out, so the caching allocator reuses neither before both are done.
"""

from __future__ import annotations

import time
from typing import Sequence

import torch

from kvroute.replica.kv_cache_manager import CopyPlan


def host_runs(host_ids: Sequence[int]) -> list[tuple[int, int, int]]:
    """``(index, first host id, length)`` of each run of consecutive ids in the sorted
    ``host_ids``."""
    runs: list[tuple[int, int, int]] = []
    for i, h in enumerate(host_ids):
        if runs and runs[-1][1] + runs[-1][2] == h:
            start, first, n = runs[-1]
            runs[-1] = (start, first, n + 1)
        else:
            runs.append((i, h, 1))
    return runs


class HostCopies:
    """Performs each step's host-tier copies for a model runner.

    ``kv_cache``: ``[layers, 2, num_blocks, block_size, kv_heads, head_dim]`` on the
    device; ``host_kv``: ``[host_blocks, layers, 2, block_size, kv_heads, head_dim]``
    (pinned on CUDA).
    """

    def __init__(self, kv_cache: torch.Tensor, host_kv: torch.Tensor) -> None:
        self.kv_cache, self.host_kv = kv_cache, host_kv
        self.device = kv_cache.device
        self.asynchronous = self.device.type == "cuda"
        self._timings: list[tuple[int, float]] = []  # (blocks restored, seconds), CPU
        if self.asynchronous:
            self._gather_stream = torch.cuda.Stream(self.device)
            self._offload_stream = torch.cuda.Stream(self.device)
            self._restore_stream = torch.cuda.Stream(self.device)
            self._restored: torch.cuda.Event | None = None  # the last restore's end
            self._writes: list[tuple[torch.cuda.Event, frozenset[int]]] = []  # offloads maybe in flight
            self._timed: list[tuple[int, torch.cuda.Event, torch.cuda.Event]] = []
            self._forward_waits: list[torch.cuda.Event] = []

    def start(self, plan: CopyPlan) -> None:
        """Begin the step's copies: offloads, then restores."""
        offloads = sorted(plan.offloads, key=lambda p: p[1])
        restores = sorted(plan.restores)
        if not self.asynchronous:
            if offloads:
                dev, host = self._ids(d for d, _ in offloads), self._ids(h for _, h in offloads)
                self.host_kv.index_copy_(0, host, self.kv_cache.index_select(2, dev).movedim(2, 0))
            if restores:
                t0 = time.perf_counter()
                host, dev = self._ids(h for h, _ in restores), self._ids(d for _, d in restores)
                self.kv_cache.index_copy_(2, dev, self.host_kv.index_select(0, host).movedim(0, 2))
                self._timings.append((len(restores), time.perf_counter() - t0))
            return
        compute = torch.cuda.current_stream(self.device)
        gathered = self._start_offloads(offloads, compute) if offloads else None
        if restores:
            self._start_restores(restores, compute, gathered)

    def join(self) -> None:
        """Make the compute stream wait (on the GPU) for what this step's forward pass
        touches: the gather of the evicted blocks and the restored blocks."""
        if self.asynchronous:
            compute = torch.cuda.current_stream(self.device)
            for event in self._forward_waits:
                compute.wait_event(event)
            self._forward_waits = []

    def take_restore_timings(self) -> list[tuple[int, float]]:
        """``(blocks, seconds)`` of every restore that finished since the last call."""
        if self.asynchronous:
            while self._timed and self._timed[0][2].query():  # one stream: they end in order
                n, start, end = self._timed.pop(0)
                self._timings.append((n, start.elapsed_time(end) / 1e3))
        out, self._timings = self._timings, []
        return out

    def synchronize(self) -> None:
        """Wait until every copy started so far has landed (tests, shutdown)."""
        if self.asynchronous:
            for stream in (self._gather_stream, self._offload_stream, self._restore_stream):
                stream.synchronize()

    # ------------------------------------------------------------------ CUDA
    def _ids(self, ids) -> torch.Tensor:
        """Block ids as an int64 tensor on the device; on CUDA through pinned memory,
        so the upload does not wait for the stream it is queued on."""
        t = torch.tensor(list(ids), dtype=torch.int64)
        if not self.asynchronous:
            return t
        return t.pin_memory().to(self.device, non_blocking=True)

    def _start_offloads(self, offloads: list[tuple[int, int]], compute: torch.cuda.Stream) -> torch.cuda.Event:
        gather, stream = self._gather_stream, self._offload_stream
        gather.wait_stream(compute)
        with torch.cuda.stream(gather):
            staged = self.kv_cache.index_select(2, self._ids(d for d, _ in offloads)).movedim(2, 0).contiguous()
            gathered = torch.cuda.Event()
            gathered.record(gather)
        stream.wait_event(gathered)
        if self._restored is not None:
            stream.wait_event(self._restored)
        host = [h for _, h in offloads]
        with torch.cuda.stream(stream):
            staged.record_stream(stream)  # not reused until this stream's copies are done
            for i, first, n in host_runs(host):
                self.host_kv[first : first + n].copy_(staged[i : i + n], non_blocking=True)
            written = torch.cuda.Event()
            written.record(stream)
        self._writes = [w for w in self._writes if not w[0].query()] + [(written, frozenset(host))]
        self._forward_waits.append(gathered)
        return gathered

    def _start_restores(
        self, restores: list[tuple[int, int]], compute: torch.cuda.Stream, gathered: torch.cuda.Event | None
    ) -> None:
        stream = self._restore_stream
        stream.wait_stream(compute)
        if gathered is not None:
            stream.wait_event(gathered)
        host = [h for h, _ in restores]
        read = frozenset(host)
        for event, ids in self._writes:
            if ids & read:
                stream.wait_event(event)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(stream):
            start.record(stream)
            staged = torch.empty((len(restores), *self.host_kv.shape[1:]), dtype=self.host_kv.dtype, device=self.device)
            for i, first, n in host_runs(host):
                staged[i : i + n].copy_(self.host_kv[first : first + n], non_blocking=True)
            self.kv_cache.index_copy_(2, self._ids(d for _, d in restores), staged.movedim(0, 2))
            end.record(stream)
        self._restored = end
        self._timed.append((len(restores), start, end))
        self._forward_waits.append(end)
