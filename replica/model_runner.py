"""Turns a scheduler step into one forward pass over the paged KV cache."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np
import torch

from kvroute.kernels import cpu_capability, ops
from kvroute.kernels.attention_metadata import AttentionMetadata
from kvroute.replica.cuda_graphs import DecodeGraphs
from kvroute.replica.host_copies import HostCopies
from kvroute.replica.models.arch import ModelArch
from kvroute.replica.models.decoder import DecoderForCausalLM
from kvroute.replica.host_memory import keep_freed_memory
from kvroute.replica.lora.layers import LayerSlots
from kvroute.replica.models.rope import RotaryEmbedding
from kvroute.replica.scheduler import SchedulerOutput
from kvroute.replica.weights import load_weights_into

_TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("device='cuda' was requested but CUDA is not available")
    return torch.device(name)


def pick_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        # bf16 wherever the hardware multiplies it natively (CUDA; CPUs with AVX512-BF16
        # or AMX, where bf16 matmuls are much faster than fp32); fp32 elsewhere.
        native = device.type == "cuda" or cpu_capability.current().native_bf16_matmul
        return torch.bfloat16 if native else torch.float32
    return _TORCH_DTYPES[name]


def kv_bytes_per_block(arch: ModelArch, block_size: int, dtype: torch.dtype) -> int:
    elem = torch.empty((), dtype=dtype).element_size()
    return arch.num_layers * 2 * block_size * arch.num_kv_heads * arch.head_dim * elem


class ModelRunner:
    """Owns the model weights and the KV cache tensor
    ``[layers, 2, num_blocks, block_size, num_kv_heads, head_dim]``.

    Kernels come from ``kvroute.kernels.ops`` (Triton on CUDA, torch references on CPU).
    On CUDA with Triton, decode-only steps of up to ``max(cuda_graph_sizes)`` sequences
    replay a captured CUDA graph (``cuda_graph_sizes=()`` keeps every step eager).
    ``lora_slots=(max_loras, max_rank, max_cpu_loras)`` wraps the fused Linears for
    LoRA: ``lora`` is then their ``LayerSlots`` (``replica/lora/``), where the engine
    registers adapters. Decode steps replay the base model's graph when no row uses an
    adapter and a graph with the adapters' products otherwise (``cuda_graphs.py``);
    other steps with adapter rows run eager. ``num_blocks``: the KV cache's size, or a
    function that gives it from this runner once its weights are loaded
    (``replica/kv_sizing.py``'s ``KVSizer``, which may run ``profile_forward`` first).
    """

    def __init__(
        self,
        arch: ModelArch,
        model_path: Path,
        num_blocks: int | Callable[["ModelRunner"], int],
        block_size: int,
        device: torch.device,
        dtype: torch.dtype,
        max_model_len: int,
        cuda_graph_sizes: Sequence[int] = (),
        host_blocks: int = 0,
        lora_slots: tuple[int, int, int | None] | None = None,
    ) -> None:
        self.arch, self.device, self.dtype = arch, device, dtype
        if device.type == "cpu":
            keep_freed_memory()
        self.block_size = block_size
        with torch.device("meta"):
            model = DecoderForCausalLM(arch)
        model = model.to_empty(device=device).to(dtype)
        load_weights_into(model, model_path, dtype)
        if arch.tie_word_embeddings:
            model.tie_weights()
        model.fuse_projections()
        if device.type == "cpu":
            model.pack_linears_for_cpu()
        # Non-persistent buffers do not survive to_empty(): rebuild the rope tables.
        model.rope = RotaryEmbedding(
            arch.head_dim, max_model_len, arch.rope_theta, arch.rope_scaling
        ).to(device)
        self.lora = LayerSlots(model, arch, *lora_slots, dtype, device) if lora_slots is not None else None
        self.model = model.eval()
        self.max_model_len = max_model_len
        if callable(num_blocks):
            num_blocks = num_blocks(self)
        self.kv_cache = torch.zeros(
            (arch.num_layers, 2, num_blocks, block_size, arch.num_kv_heads, arch.head_dim),
            dtype=dtype,
            device=device,
        )
        # the host tier's bytes, block-major (one block's layers together); pinned on CUDA
        self.host_kv = None
        self.host_copies: HostCopies | None = None
        if host_blocks:
            shape = (host_blocks, arch.num_layers, 2, block_size, arch.num_kv_heads, arch.head_dim)
            self.host_kv = torch.zeros(shape, dtype=dtype, pin_memory=device.type == "cuda")
            self.host_copies = HostCopies(self.kv_cache, self.host_kv)
        self.max_blocks_per_seq = -(-max_model_len // block_size)
        self.block_tables = BlockTables(self.max_blocks_per_seq)  # the steps' tables, kept between steps
        self.graphs: DecodeGraphs | None = None
        if cuda_graph_sizes and device.type == "cuda" and ops.uses_triton(device):
            self.use_decode_graphs(cuda_graph_sizes, capture=True)

    def use_decode_graphs(self, sizes: Sequence[int], capture: bool) -> None:
        """Decode-only steps of up to ``max(sizes)`` rows run through ``DecodeGraphs``
        (captured, or with ``capture=False`` eager on the same padded buffers). The
        graphs end with the logits, written into one buffer all batch sizes share."""
        self._graph_logits = torch.empty((max(sizes), self.arch.vocab_size), dtype=self.dtype, device=self.device)
        with torch.inference_mode():
            lora = (self.lora.batch, self.lora.max_loras) if self.lora is not None else None
            self.graphs = DecodeGraphs(self._decode_logits, sizes, self.max_blocks_per_seq, self.device, capture, lora)

    def _forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        return self.model(input_ids, positions, self.kv_cache, meta)  # [T, hidden]

    def _decode_logits(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """A decode graph's body: every row's logits ``[b, vocab]``."""
        hidden = self._forward(input_ids, positions, meta)
        return self.model.compute_logits(hidden, out=self._graph_logits[: hidden.shape[0]])

    @torch.inference_mode()
    def profile_forward(self, num_tokens: int, num_seqs: int) -> torch.Tensor:
        """A forward pass of ``num_tokens`` dummy prompt tokens over ``num_seqs``
        sequences (as even as the tokens allow, each within the context length), on a
        cache of their own; returns each sequence's last logits ``[num_seqs, vocab]``.
        Run before the KV cache exists, to measure the activations' peak memory."""
        if not 1 <= num_seqs <= num_tokens:
            raise ValueError(f"profile_forward needs 1 <= num_seqs <= num_tokens, got {num_seqs}, {num_tokens}")
        num_seqs = max(num_seqs, -(-num_tokens // self.max_model_len))
        lens = [num_tokens // num_seqs + (i < num_tokens % num_seqs) for i in range(num_seqs)]
        bs, dev, arch = self.block_size, self.device, self.arch
        per_seq = [-(-n // bs) for n in lens]
        cache = torch.zeros((arch.num_layers, 2, sum(per_seq), bs, arch.num_kv_heads, arch.head_dim),
                            dtype=self.dtype, device=dev)  # fmt: skip
        tables = np.zeros((num_seqs, max(per_seq)), dtype=np.int32)
        qsl, slots, positions, first = [0], [], [], 0
        for i, (n, blocks) in enumerate(zip(lens, per_seq)):
            tables[i, :blocks] = range(first, first + blocks)
            slots.extend(first * bs + p for p in range(n))
            positions.extend(range(n))
            qsl.append(qsl[-1] + n)
            first += blocks
        meta = AttentionMetadata(
            query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=dev),
            seq_lens=torch.tensor(lens, dtype=torch.int32, device=dev),
            context_lens=torch.zeros(num_seqs, dtype=torch.int32, device=dev),
            block_tables=torch.from_numpy(tables).to(dev),
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=dev),
            query_start_loc_cpu=qsl,
            seq_lens_cpu=lens,
            context_lens_cpu=[0] * num_seqs,
        )
        if self.lora is not None:
            self.lora.lay_out([(qsl[i], n, None) for i, n in enumerate(lens)], dev)
        ids = torch.zeros(num_tokens, dtype=torch.int64, device=dev)
        hidden = self.model(ids, torch.tensor(positions, dtype=torch.int64, device=dev), cache, meta)  # [T, hidden]
        return self.model.compute_logits(hidden[torch.tensor(qsl[1:], device=dev) - 1])

    def take_restore_timings(self) -> list[tuple[int, float]]:
        """``(tokens, seconds)`` of each host-tier restore that finished since the last
        call (on CUDA they are timed on the GPU and may finish a step later)."""
        if self.host_copies is None:
            return []
        return [(n * self.block_size, s) for n, s in self.host_copies.take_restore_timings()]

    @torch.inference_mode()
    def execute(self, step: SchedulerOutput) -> torch.Tensor:
        """Run one step; returns the logits ``[num_sampling_rows, vocab]`` (the model's
        dtype) of the rows whose chunk reaches their last known token, in row order,
        followed by those of the positions whose next token is a prompt token of a
        request that wants prompt logprobs (``_StepInputs.prompt_rows`` order).

        The step's host-tier copies start first (``replica/host_copies.py``: on CUDA
        they run on their own streams) and the forward pass waits for them only after
        its inputs are on the device."""
        copies = self.host_copies if step.copies else None
        if copies is not None:
            copies.start(step.copies)
        inputs = _StepInputs(step.rows, self.block_size, self.block_tables)
        dev = self.device
        graphs = self.graphs
        use_graph = (graphs is not None and inputs.decode_only and not inputs.prompt_rows
                     and len(step.rows) <= graphs.max_batch)  # fmt: skip
        lora_slots = None  # the graph's adapter slot per row (None: no row uses one)
        if self.lora is not None:
            if use_graph:
                lora_slots = self.lora.row_slots([row.request.lora_name for row in step.rows])
            else:
                qsl = inputs.query_start_loc
                self.lora.lay_out([(qsl[i], row.num_new, row.request.lora_name) for i, row in enumerate(step.rows)], dev)
        if use_graph:
            assert graphs is not None
            if lora_slots is None:
                b = graphs.load(inputs.input_ids, inputs.positions, inputs.slots, inputs.tables, inputs.seq_lens)
            else:
                b = graphs.load(inputs.input_ids, inputs.positions, inputs.slots, inputs.tables, inputs.seq_lens, lora_slots)
            if copies is not None:
                copies.join()
            # [n, vocab], every row's
            logits = graphs.replay(b, len(step.rows)) if lora_slots is None else graphs.replay(b, len(step.rows), True)
            rows = inputs.logit_rows
            return logits if len(rows) == len(step.rows) else logits[torch.tensor(rows, dtype=torch.int64, device=dev)]
        qsl = inputs.query_start_loc
        meta = AttentionMetadata(
            query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=dev),
            seq_lens=torch.tensor(inputs.seq_lens, dtype=torch.int32, device=dev),
            context_lens=torch.tensor(inputs.context_lens, dtype=torch.int32, device=dev),
            block_tables=torch.from_numpy(inputs.tables).to(dev),
            slot_mapping=torch.tensor(inputs.slots, dtype=torch.int64, device=dev),
            query_start_loc_cpu=qsl,
            seq_lens_cpu=inputs.seq_lens,
            context_lens_cpu=inputs.context_lens,
        )
        ids = torch.tensor(inputs.input_ids, dtype=torch.int64, device=dev)
        pos = torch.tensor(inputs.positions, dtype=torch.int64, device=dev)
        if copies is not None:
            copies.join()
        hidden = self._forward(ids, pos, meta)  # [T, hidden]
        prompt = [first + j for _, first, count in inputs.prompt_rows for j in range(count)]
        return self._logits(hidden, inputs.logit_rows, prompt)

    def _logits(self, hidden: torch.Tensor, logit_rows: list[int], prompt_rows: list[int] = ()) -> torch.Tensor:
        """``[len(logit_rows) + len(prompt_rows), vocab]``: those positions' logits."""
        logit_rows = logit_rows + list(prompt_rows)
        if not logit_rows:
            return torch.empty((0, self.arch.vocab_size), dtype=self.dtype, device=self.device)
        if len(logit_rows) == hidden.shape[0] and not prompt_rows:  # decode: every row samples, in order
            return self.model.compute_logits(hidden)
        return self.model.compute_logits(hidden[torch.tensor(logit_rows, device=self.device)])


class BlockTables:
    """The steps' block tables, gathered from one persistent host array in which each
    running request keeps a row, so a decode step converts only new block ids (one per
    ``block_size`` tokens), not every row's whole table (~1.5 us a row, most of a large
    decode step's input building).

    A row is reused only when the step's ids equal the ids it holds, or extend them
    (compared in full: the scheduler's tuple holds the same int objects, so the
    comparison is a pointer scan); anything else (a new request, one resumed after
    preemption, a table rewritten) is written whole. Rows are zero past their ids, as a
    freshly padded table is. A request missing from a step gives its row back.
    """

    def __init__(self, width: int, rows: int = 16) -> None:
        self._table = np.zeros((rows, width), dtype=np.int32)
        self._len = [0] * rows  # ids held per row (zero past them)
        self._free = list(range(rows - 1, -1, -1))
        self._held: dict[int, tuple[Any, int, tuple[int, ...]]] = {}  # id(request) -> (request, row, ids)

    def gather(self, rows: Sequence) -> np.ndarray:
        """``[len(rows), widest]`` int32: each scheduled row's block ids, zero-padded."""
        held, index, widest, seen = self._held, [], 1, set()
        for row in rows:
            req, ids = row.request, tuple(row.block_ids)
            key = id(req)
            entry = held.get(key)
            if entry is None or entry[0] is not req:  # (held requests stay alive, so ids are not reused)
                r = self._take() if entry is None else entry[1]
                self._write(r, ids, 0)
                held[key] = (req, r, ids)
            else:
                r, old = entry[1], entry[2]
                if ids != old:
                    n = len(old)
                    self._write(r, ids, n if len(ids) > n and ids[:n] == old else 0)
                    held[key] = (req, r, ids)
            seen.add(key)
            index.append(r)
            widest = max(widest, len(ids))
        if len(held) > len(seen):
            for key in held.keys() - seen:
                self._free.append(held.pop(key)[1])
        return self._table[index, :widest]

    def _write(self, r: int, ids: tuple[int, ...], keep: int) -> None:
        """Row ``r`` := ``ids``, its first ``keep`` already there."""
        n, old = len(ids), self._len[r]
        if n > keep:
            self._table[r, keep:n] = ids[keep:]
        if old > n:
            self._table[r, n:old] = 0
        self._len[r] = n

    def _take(self) -> int:
        if not self._free:
            rows, width = self._table.shape
            self._table = np.concatenate([self._table, np.zeros((rows, width), dtype=np.int32)])
            self._len += [0] * rows
            self._free = list(range(2 * rows - 1, rows - 1, -1))
        return self._free.pop()


class _StepInputs:
    """A step's forward inputs as host lists, built in one pass over its rows; block
    tables as one zero-padded ``int32`` array (from ``tables``, the runner's persistent
    ``BlockTables``, or else filled row by row)."""

    def __init__(self, rows: Sequence, block_size: int, tables: BlockTables | None = None) -> None:
        self.input_ids: list[int] = []
        self.positions: list[int] = []
        self.slots: list[int] = []
        self.query_start_loc = [0]
        self.seq_lens: list[int] = []
        self.context_lens: list[int] = []
        self.logit_rows: list[int] = []
        # (row, first position in the step, count): positions predicting a prompt token
        self.prompt_rows: list[tuple[int, int, int]] = []
        if tables is not None:
            self.tables = tables.gather(rows)
        else:
            self.tables = np.zeros((len(rows), max(len(r.block_ids) for r in rows)), dtype=np.int32)
            for i, row in enumerate(rows):
                self.tables[i, : len(row.block_ids)] = row.block_ids
        bs = block_size
        for i, row in enumerate(rows):
            start, end = row.num_computed, row.num_computed + row.num_new
            table = row.block_ids
            if end - start == 1:
                self.input_ids.append(row.request.token_ids[start])
                self.positions.append(start)
                self.slots.append(table[start // bs] * bs + start % bs)
            else:
                self.input_ids.extend(row.request.token_ids[start:end])
                self.positions.extend(range(start, end))
                self.slots.extend(table[p // bs] * bs + p % bs for p in range(start, end))
            self.query_start_loc.append(self.query_start_loc[-1] + end - start)
            self.seq_lens.append(end)
            self.context_lens.append(start)
            if row.request.params.prompt_logprobs is not None:
                count = min(end, row.request.num_prompt_tokens - 1) - start
                if count > 0:
                    self.prompt_rows.append((i, self.query_start_loc[-2], count))
            if row.samples:
                self.logit_rows.append(self.query_start_loc[-1] - 1)

    @property
    def decode_only(self) -> bool:
        return self.query_start_loc[-1] == len(self.seq_lens)
