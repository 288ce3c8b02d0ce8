"""Export and import of a run of cached KV blocks: one engine's prefix moved into another
engine's prefix cache instead of being recomputed there (payloads: ``kv_payload.py``).

Export (``lease`` → ``copy`` → ``release``): the longest run of device-cached blocks
from a chain's start, named by a token prefix (hashed here, each hit verified against
the block's stored token ids, as a prefix lookup is) or by block hashes (each block's
hash recomputed from its stored token ids and its parent's hash, from the root its salt
and adapter give). The lease takes a reference on every block, so nothing evicts or
reuses them while ``copy`` reads their K/V; a referenced, full, cached block is never
written by a step, so the copy may run while steps go on (``AsyncEngine`` runs it in a
worker thread). ``release`` drops the references, tail first, as a finished request does.

Import (``reserve`` → ``write`` → ``commit``, or ``abort``): ``reserve`` refuses a
payload whose header differs from this engine (hash spec, model, dtype, block size,
layout, an adapter not loaded here), is malformed, or holds a block whose hash,
recomputed from its token ids under this engine's spec, is not the claimed one
(``ValueError``, nothing changed). It then references the blocks already cached here
and takes a fresh device block for each other one (a take may evict: with a host tier
the evicted blocks' offloads are done at once, before anything overwrites them). A
payload longer than the free blocks allow is imported as its longest leading run that
fits. ``write`` copies the KV into the fresh blocks, which only the import holds.
``commit`` registers each fresh block under its hash (parent, salt, adapter: as the host
tier's restore does, ``kv_cache_manager.py``) and releases the run tail first: the blocks
are then cached blocks a request with that prefix hits. ``abort`` releases them
unregistered: a failed or cancelled import leaves nothing cached.

Every step of both runs between engine steps except ``copy`` and ``write``, which touch
only blocks the transfer references. On CUDA the copy gathers on a side stream and,
unless asked to stay on the device (``on_device``: the seam for a device-to-device
transport), lands in pinned host memory. An emulated engine moves no bytes: its
payload's ``nbytes`` is what its profile's model would move, and its import's write
takes the profile's pull time for them (``StepProfile.pull_time``: setup + bytes over
the device-to-device or through-the-host bandwidth), scaled as its steps are.

``pull_figures`` is what a host that acts on a router's pulls reports in its load
(``LoadFigures.kv_bytes_per_token``, ``pull_bytes_per_s``, ``pull_setup_s``).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Any, Sequence

from kvroute.replica.block_hash import BlockHash, hash_block, hash_blocks, root_hash
from kvroute.replica.block_pool import Block
from kvroute.replica.kv_payload import KVHeader, KVIdentity, KVPayload, hash_mismatch, refusal, shape_problem
from kvroute.replica.kv_transfer_metrics import TransferMetrics


@dataclass(eq=False)
class ExportLease:
    """Blocks an export references until ``release``, and the header naming them."""

    blocks: list[Block]
    header: KVHeader
    released: bool = False


@dataclass(eq=False)
class ImportReservation:
    """An import between ``reserve`` and ``commit``/``abort``: ``chain`` holds one
    referenced block per imported position; ``fresh`` the positions to write."""

    payload: KVPayload
    chain: list[Block]
    fresh: list[int] = field(default_factory=list)
    done: bool = False


@dataclass(frozen=True)
class ImportResult:
    """``blocks`` leading blocks of the payload are cached here now (``tokens`` tokens):
    ``imported`` written and registered by this import, the rest found already cached;
    ``nbytes``: the payload's bytes for the imported blocks."""

    blocks: int
    tokens: int
    imported: int
    nbytes: int


class KVTransfer:
    """Exports from and imports into one engine's block pool; not thread-safe beyond
    what the module docstring says (``copy``/``write`` may run beside steps)."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.metrics = TransferMetrics()
        config = engine.config
        if config.emulate is not None:
            dtype, layout = f"emulated:{config.emulate}", ()
            self._emulated_block_bytes = engine.runner.profile.kv_bytes_per_token * config.block_size
        else:
            arch = engine.arch
            dtype = str(engine.runner.dtype).removeprefix("torch.")
            layout = (arch.num_layers, arch.num_kv_heads, arch.head_dim)
        self.identity = KVIdentity(engine.hash_spec, engine.model_id, dtype, config.block_size, layout)

    @property
    def emulated(self) -> bool:
        return not self.identity.layout

    def pull_figures(self) -> tuple[int, float, float]:
        """(KV bytes per token, pull bytes/s, pull setup s) for a router to price a pull
        into this engine: the rate its pulls measured, else its emulation profile's
        (scaled as its steps; 0.0: unknown, the router assumes one), and the profile's setup."""
        bs = self.identity.block_size
        if not self.emulated:
            return self.identity.block_bytes // bs, self.metrics.pull_bytes_per_s, 0.0
        runner = self.engine.runner
        nominal = runner.profile.pull_bytes_per_s() / runner.time_scale
        return self._emulated_block_bytes // bs, self.metrics.pull_bytes_per_s or nominal, \
            runner.profile.pull_setup_s * runner.time_scale

    # ------------------------------------------------------------------ export
    def find_run(
        self, token_ids: Sequence[int], cache_salt: str | None = None, lora_name: str | None = None,
        max_blocks: int | None = None,
    ) -> list[Block]:
        """The longest run of device-cached blocks from the start of ``token_ids``'s full
        blocks, each verified against its stored token ids."""
        spec, pool, bs = self.identity.spec, self.engine.kv.pool, self.identity.block_size
        hashes = hash_blocks(spec, [int(t) for t in token_ids], cache_salt, lora_name=lora_name)
        run: list[Block] = []
        for i, h in enumerate(hashes[:max_blocks]):
            block = pool.lookup(h, token_ids[i * bs : (i + 1) * bs])
            if block is None:
                break
            run.append(block)
        return run

    def chain_of(self, block_hashes: Sequence[BlockHash]) -> list[Block]:
        """The longest leading run of ``block_hashes`` (a chain from its first block) cached
        on the device, each block's hash recomputed from its stored token ids."""
        spec, pool = self.identity.spec, self.engine.kv.pool
        run: list[Block] = []
        for i, h in enumerate(block_hashes):
            block = pool.cached_block(h)
            if block is None:
                break
            if i == 0:
                if block.parent_hash is not None:
                    raise ValueError("block_hashes must start at a chain's first block")
                parent = root_hash(spec, block.salt, block.lora_name)
            else:
                parent = block_hashes[i - 1]
                if block.parent_hash != parent or block.lora_name != run[0].lora_name:
                    break
            if hash_block(spec, parent, block.token_ids) != h:
                break
            run.append(block)
        return run

    def lease(
        self, token_ids: Sequence[int] | None = None, block_hashes: Sequence[BlockHash] | None = None,
        cache_salt: str | None = None, lora_name: str | None = None, max_blocks: int | None = None,
    ) -> ExportLease:
        """Reference the run to export (by a token prefix, or by block hashes whose first
        block's salt and adapter then come from the cache) and name it in a header."""
        if (token_ids is None) == (block_hashes is None):
            raise ValueError("export needs either token_ids or block_hashes")
        if token_ids is not None:
            blocks = self.find_run(token_ids, cache_salt, lora_name, max_blocks)
        else:
            blocks = self.chain_of(list(block_hashes)[:max_blocks])  # type: ignore[arg-type]
            if blocks:
                cache_salt, lora_name = blocks[0].salt, blocks[0].lora_name
        self.engine.kv.pool.touch(blocks)
        header = KVHeader(self.identity, lora_name, cache_salt, tuple(b.block_hash for b in blocks),  # type: ignore[misc]
                          tuple(b.token_ids for b in blocks), self.engine.config.replica_id)  # fmt: skip
        return ExportLease(blocks, header)

    def copy(self, lease: ExportLease, on_device: bool = False) -> KVPayload:
        """The leased blocks' K/V as a payload (see ``KVPayload.kv`` for its forms); counts the export."""
        assert not lease.released, "copy after release"
        payload = self._copy(lease, on_device)
        self.metrics.on_export(payload.num_blocks, payload.nbytes)
        return payload

    def _copy(self, lease: ExportLease, on_device: bool) -> KVPayload:
        n = len(lease.blocks)
        if self.emulated:
            return KVPayload(lease.header, None, n * self._emulated_block_bytes)
        import torch

        rows = self._rows()  # [layers * 2, num_blocks, block_size * kv_heads * head_dim]
        ids = torch.tensor([b.block_id for b in lease.blocks], dtype=torch.int64, device=rows.device)
        if rows.device.type == "cuda":
            stream = torch.cuda.Stream(rows.device)
            stream.wait_stream(torch.cuda.current_stream(rows.device))  # the steps that wrote them
            with torch.cuda.stream(stream):
                staged = rows.index_select(1, ids)
                if on_device:
                    stream.synchronize()
                    return KVPayload(lease.header, staged, staged.numel() * staged.element_size())
                host = torch.empty(staged.shape, dtype=staged.dtype, pin_memory=True)
                host.copy_(staged, non_blocking=True)
            stream.synchronize()
        else:
            host = rows.index_select(1, ids)
        kv = host.view(torch.uint8).numpy()  # [layers * 2, n, row_bytes]
        return KVPayload(lease.header, kv, kv.nbytes)

    def _rows(self) -> Any:
        """The KV cache as ``[layers * 2, num_blocks, block_size * kv_heads * head_dim]`` (a view)."""
        cache = self.engine.runner.kv_cache  # [layers, 2, num_blocks, block_size, kv_heads, head_dim]
        return cache.view(cache.shape[0] * 2, cache.shape[2], -1)

    def release(self, lease: ExportLease) -> None:
        """Drop the lease's references, tail first."""
        if not lease.released:
            lease.released = True
            self.engine.kv.pool.free(reversed(lease.blocks))

    def export(self, token_ids: Sequence[int] | None = None, **kwargs: Any) -> KVPayload:
        """``lease``, ``copy`` and ``release`` in one go (between steps);
        ``on_device`` goes to ``copy``, the rest to ``lease``."""
        on_device = kwargs.pop("on_device", False)
        lease = self.lease(token_ids, **kwargs)
        try:
            return self.copy(lease, on_device)
        finally:
            self.release(lease)

    # ------------------------------------------------------------------ import
    def check(self, payload: KVPayload) -> None:
        """Refuse (``ValueError``, counted) a payload this engine must not serve."""
        why = self._problem(payload)
        if why is not None:
            self.metrics.import_refusals += 1
            raise ValueError(f"KV payload from {payload.header.source or 'a replica'!r} refused: {why}")

    def _problem(self, payload: KVPayload) -> str | None:
        header = payload.header
        why = refusal(header, self.identity) or shape_problem(header, self.engine.arch.vocab_size)
        if why is not None:
            return why
        lora = header.lora_name
        if lora is not None and (self.engine.lora is None or lora not in self.engine.lora.adapters):
            return f"its LoRA adapter {lora!r} is not loaded here"
        bad = hash_mismatch(header, self.identity.spec)
        if bad is not None:
            return f"block {bad}'s hash does not match its token ids under this engine's hash spec"
        n, kv = header.num_blocks, payload.kv
        if self.emulated:
            return None if kv is None else "an emulated engine takes no KV bytes"
        if kv is None:
            return "it carries no KV bytes (an emulated engine's)"
        if hasattr(kv, "dtype") and str(kv.dtype) == "uint8":  # host form
            expected = self.identity.host_shape(n)
            return None if tuple(kv.shape) == expected else f"KV of shape {tuple(kv.shape)}, expected {expected}"
        rows = self._rows()
        expected = (rows.shape[0], n, rows.shape[2])
        if tuple(getattr(kv, "shape", ())) != expected or getattr(kv, "dtype", None) != rows.dtype:
            return f"device KV of shape {tuple(getattr(kv, 'shape', ()))}, expected {expected} in {rows.dtype}"
        return None

    def reserve(self, payload: KVPayload) -> ImportReservation:
        """Check the payload, reference the blocks already cached here, take fresh blocks
        for the rest of the longest leading run that fits (between steps)."""
        self.check(payload)
        pool, header = self.engine.kv.pool, payload.header
        if not pool.enable_caching:
            raise ValueError("importing KV needs prefix caching on")
        found: list[Block | None] = []
        need = revived = 0
        for h, tokens in zip(header.block_hashes, header.token_ids):
            block = pool.cached_block(h)
            if block is not None and block.token_ids != tokens:
                break  # another prefix's block under this hash: the run stops here
            more, back = (0, int(block.ref_cnt == 0)) if block is not None else (1, 0)
            if need + more + revived + back > pool.num_free_blocks:
                break  # the pool cannot hold more of the run
            need, revived = need + more, revived + back
            found.append(block)
        present = [b for b in found if b is not None]
        pool.touch(present)  # before any take: a take may evict them
        fresh_blocks = pool.take_new_blocks(need)
        assert fresh_blocks is not None
        self._flush_offloads()
        taken = iter(fresh_blocks)
        chain = [b if b is not None else next(taken) for b in found]
        return ImportReservation(payload, chain, [i for i, b in enumerate(found) if b is None])

    def _flush_offloads(self) -> None:
        """Do now the host-tier offloads of blocks a take just evicted: they must leave
        before the import overwrites them (a step does them at its start)."""
        copies = None if self.emulated else self.engine.runner.host_copies
        if copies is None or not self.engine.kv.pool.offloads:
            return
        plan = self.engine.kv.take_copies()
        copies.start(plan)
        copies.join()

    def write(self, res: ImportReservation) -> None:
        """Copy the payload's KV into the reservation's fresh blocks (an emulated engine
        takes its profile's time for the bytes instead)."""
        if not res.fresh:
            return
        if self.emulated:
            self.engine.runner.pull(res.payload.nbytes * len(res.fresh) // max(1, res.payload.header.num_blocks))
            return
        import torch

        rows, kv = self._rows(), res.payload.kv
        if not isinstance(kv, torch.Tensor):
            with warnings.catch_warnings():  # read only: Ray hands back read-only arrays
                warnings.simplefilter("ignore", UserWarning)
                kv = torch.from_numpy(kv)
            kv = kv.view(rows.dtype)  # [layers * 2, n, block_size * kv_heads * head_dim]
        if len(res.fresh) < kv.shape[1]:  # some blocks were cached here already
            kv = kv.index_select(1, torch.tensor(res.fresh, dtype=torch.int64, device=kv.device))
        kv = kv.to(rows.device)
        ids = torch.tensor([res.chain[i].block_id for i in res.fresh], dtype=torch.int64, device=rows.device)
        self._write_rows(ids, kv)

    def _write_rows(self, block_ids: Any, kv: Any) -> None:
        """``kv`` (``[layers * 2, blocks, ...]``) into blocks ``block_ids``: one copy (a
        copy per layer took four times as long on CPU)."""
        self._rows().index_copy_(1, block_ids, kv)

    def commit(self, res: ImportReservation) -> ImportResult:
        """Register the written blocks and release the run, tail first (between steps)."""
        assert not res.done
        res.done = True
        pool, header = self.engine.kv.pool, res.payload.header
        for i in res.fresh:
            parent = header.block_hashes[i - 1] if i else None
            salt = None if i else header.cache_salt
            pool.cache_block(res.chain[i], header.block_hashes[i], header.token_ids[i], parent, salt, header.lora_name)
        if header.lora_name is not None:
            self.engine.note_lora_served(header.lora_name)  # a reload under this name drops this KV
        pool.free(reversed(res.chain))
        n = len(res.chain)
        nbytes = res.payload.nbytes * len(res.fresh) // max(1, header.num_blocks)
        self.metrics.on_import(len(res.fresh), nbytes)
        return ImportResult(n, n * self.identity.block_size, len(res.fresh), nbytes)

    def abort(self, res: ImportReservation) -> None:
        """Release the reservation with nothing registered."""
        if not res.done:
            res.done = True
            self.engine.kv.pool.free(reversed(res.chain))

    def import_(self, payload: KVPayload) -> ImportResult:
        """``reserve``, ``write`` and ``commit`` in one go (between steps); a failing
        write aborts: nothing is imported."""
        res = self.reserve(payload)
        try:
            self.write(res)
        except BaseException:
            self.abort(res)
            raise
        return self.commit(res)
