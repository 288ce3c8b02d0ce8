"""CUDA graphs for decode-only steps: one graph per batch size, replayed on padded inputs.

Every graph reads the same static input buffers (its first ``b`` rows). Before each
replay :meth:`DecodeGraphs.load` rewrites *all* ``b`` rows of every buffer (the block
tables up to the step's widest row; attention never reads a row's table past its
length), so a replay never sees a previous step's block tables, slots or lengths. Padding rows get slot -1 (the KV store writes nothing) and
seq_len 0 (attention reads nothing and returns zeros); their outputs are dropped.

With LoRA (``lora=(batch, max_loras)``) every size has a second graph whose wrapped
Linears add the adapters' products (``kernels/lora.py``) over a layout held in the same
buffers: the rows grouped by slot and each slot's start and length, loaded with the
step's inputs. A step without adapter rows replays the base graph (the kernels of a
model without LoRA, none added); a step with them replays the LoRA graph instead of
running eager.

With ``capture=False`` the same padded buffers run eagerly: that is how CPU tests check
the padding logic (under the Triton interpreter) without a GPU.
"""

from __future__ import annotations

import bisect
from typing import Any, Callable, Sequence

import numpy as np
import torch

from kvroute.kernels.attention_metadata import AttentionMetadata
from kvroute.kernels.lora import LoRASegments, group_rows

Forward = Callable[[torch.Tensor, torch.Tensor, AttentionMetadata], torch.Tensor]


def default_graph_sizes(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, then every multiple of 16 up to ``max_num_seqs`` (and it)."""
    sizes = [b for b in (1, 2, 4, 8) if b < max_num_seqs] + list(range(16, max_num_seqs, 16))
    return sorted(set(sizes + [max_num_seqs]))


class DecodeGraphs:
    """Graph-captured ``forward(input_ids, positions, meta) -> hidden [b, hidden]`` for
    decode batches of up to ``max(sizes)`` sequences."""

    def __init__(
        self,
        forward: Forward,
        sizes: Sequence[int],
        max_blocks_per_seq: int,
        device: torch.device,
        capture: bool,
        lora: tuple[Any, int] | None = None,
    ) -> None:
        if not sizes or min(sizes) < 1:
            raise ValueError(f"CUDA graph batch sizes must be >= 1, got {list(sizes)}")
        self.forward = forward
        self.sizes = sorted(set(sizes))
        self.max_blocks_per_seq = max_blocks_per_seq
        self.device = device
        n = self.sizes[-1]
        # ``lora``: (the LoRABatch the wrapped Linears read, the number of adapter slots)
        self._lora_batch, num_slots = lora if lora is not None else (None, 0)
        self.num_lora_slots = num_slots
        # One byte buffer holds every per-row input, so one host-to-device copy loads a step:
        # ids, positions, slots (int64), seq_lens, context_lens (int32), with LoRA the rows
        # grouped by adapter slot and each slot's start and length (int32), then the step's
        # block tables packed [b, width] (scattered into ``block_tables`` by one device copy).
        pinned = device.type == "cuda"
        self._head = 32 * n + 4 * (n + 2 * num_slots)  # bytes before the packed tables
        nbytes = self._head + 4 * n * max_blocks_per_seq
        self._buf = torch.zeros(nbytes, dtype=torch.uint8, device=device)
        self._stage = torch.zeros(nbytes, dtype=torch.uint8, pin_memory=pinned)  # host staging for load()
        self.input_ids, self.positions, self.slot_mapping = self._buf[: 24 * n].view(torch.int64).view(3, n)  # [n] each
        self.seq_lens, self.context_lens = self._buf[24 * n : 32 * n].view(torch.int32).view(2, n)  # [n] each
        lora_in = self._buf[32 * n : self._head].view(torch.int32)
        self.lora_order, self.lora_starts, self.lora_lens = lora_in[:n], lora_in[n : n + num_slots], lora_in[n + num_slots :]
        self._lora_slot_ids = torch.arange(num_slots, dtype=torch.int32, device=device)
        self._tables_in = self._buf[self._head :].view(torch.int32)  # [b * width] of the current step
        self.slot_mapping.fill_(-1)
        self.block_tables = torch.zeros((n, max_blocks_per_seq), dtype=torch.int32, device=device)  # [n, max_blocks]
        self.query_start_loc = torch.arange(n + 1, dtype=torch.int32, device=device)  # [n + 1], one token each
        stage = self._stage.numpy()
        self._stage_i64 = stage[: 24 * n].view(np.int64).reshape(3, n)
        self._stage_i32 = stage[24 * n : 32 * n].view(np.int32).reshape(2, n)
        self._stage_lora = stage[32 * n : self._head].view(np.int32)
        self._stage_tables = stage[self._head :].view(np.int32)
        self._staged: torch.cuda.Event | None = None  # recorded after the last copy out of it
        self.graphs: dict[tuple[int, bool], torch.cuda.CUDAGraph] = {}  # (batch size, with LoRA)
        self.outputs: dict[tuple[int, bool], torch.Tensor] = {}
        if capture:
            self._capture()

    @property
    def max_batch(self) -> int:
        return self.sizes[-1]

    def padded_size(self, n: int) -> int:
        """The smallest graph batch size >= n."""
        assert 1 <= n <= self.max_batch
        return self.sizes[bisect.bisect_left(self.sizes, n)]

    def _meta(self, b: int) -> AttentionMetadata:
        # Host lists only carry what the Triton path reads on the host (max_query_len = 1);
        # real lengths live in the device buffers.
        return AttentionMetadata(
            query_start_loc=self.query_start_loc[: b + 1],
            seq_lens=self.seq_lens[:b],
            context_lens=self.context_lens[:b],
            block_tables=self.block_tables[:b],
            slot_mapping=self.slot_mapping[:b],
            query_start_loc_cpu=list(range(b + 1)),
            seq_lens_cpu=[1] * b,
            context_lens_cpu=[0] * b,
        )

    @property
    def has_lora(self) -> bool:
        return self._lora_batch is not None

    def _run_eager(self, b: int, lora: bool = False) -> torch.Tensor:
        batch = self._lora_batch
        if batch is None:
            return self.forward(self.input_ids[:b], self.positions[:b], self._meta(b))
        # the wrapped Linears read the layout in the buffers (its grid sized by b, not by the lengths)
        batch.segments = (LoRASegments.static(self.lora_order, self.lora_starts, self.lora_lens, self._lora_slot_ids, b)
                          if lora else None)  # fmt: skip
        try:
            return self.forward(self.input_ids[:b], self.positions[:b], self._meta(b))
        finally:
            batch.segments = None

    def _capture(self) -> None:
        pool = None
        variants = (False, True) if self.has_lora else (False,)
        for b in reversed(self.sizes):  # largest first, so smaller graphs reuse its pool
            for lora in variants:
                self._run_eager(b, lora)  # compiles kernels and warms the allocator outside the graph
                torch.cuda.synchronize(self.device)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    self.outputs[b, lora] = self._run_eager(b, lora)
                pool = graph.pool()
                self.graphs[b, lora] = graph
        torch.cuda.synchronize(self.device)

    def load(
        self,
        input_ids: Sequence[int],
        positions: Sequence[int],
        slots: Sequence[int],
        block_tables: np.ndarray,  # [n, width] int32, zero-padded rows
        seq_lens: Sequence[int],
        lora_slots: Sequence[int] | None = None,
    ) -> int:
        """Write a decode step's inputs (``n = len(input_ids)`` sequences, one new token
        each) into the static buffers; returns the graph batch size to :meth:`replay`.
        ``lora_slots``: each row's adapter slot (-1: the base model), for a replay with
        ``lora=True``.

        Two device operations: one host-to-device copy from the (pinned) staging buffer,
        one copy of the packed block tables into their rows. Rows ``n..b`` are padding;
        the block tables' columns past ``width`` keep a previous step's entries, which no
        row reads (attention reads a row's table only below its length)."""
        n = len(input_ids)
        b = self.padded_size(n)
        width = block_tables.shape[1]
        assert block_tables.shape[0] == n and width <= self.max_blocks_per_seq, "block table wider than max_model_len"
        if self._staged is not None:
            self._staged.synchronize()  # the previous step's copy has read the staging buffer
        i64, i32 = self._stage_i64, self._stage_i32
        i64[:, n:b] = ((0,), (0,), (-1,))  # padding: no KV written, nothing attended
        i32[:, n:b] = 0
        i64[0, :n], i64[1, :n], i64[2, :n] = input_ids, positions, slots
        i32[0, :n] = seq_lens
        np.maximum(i32[0, :n] - 1, 0, out=i32[1, :n])
        if lora_slots is not None:
            order, starts, lens = group_rows(lora_slots, self.num_lora_slots)
            m, s = self.max_batch, self.num_lora_slots
            self._stage_lora[: len(order)] = order
            self._stage_lora[m : m + s] = starts
            self._stage_lora[m + s :] = lens
        tables = self._stage_tables[: b * width].reshape(b, width)
        tables[:n] = block_tables
        tables[n:] = 0
        used = self._head + 4 * b * width
        self._buf[:used].copy_(self._stage[:used], non_blocking=True)
        if self.device.type == "cuda":
            self._staged = torch.cuda.Event()
            self._staged.record()
        self.block_tables[:b, :width].copy_(self._tables_in[: b * width].view(b, width))
        return b

    def replay(self, b: int, n: int, lora: bool = False) -> torch.Tensor:  # [n, hidden]
        """Run the loaded batch (padded to ``b``; with ``lora``, the adapters of the
        loaded layout); the first ``n`` rows' outputs."""
        assert self.has_lora or not lora, "a LoRA replay on graphs built without LoRA"
        if (b, lora) in self.graphs:
            self.graphs[b, lora].replay()
            return self.outputs[b, lora][:n]
        return self._run_eager(b, lora)[:n]
