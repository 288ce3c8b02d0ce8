"""Token bitmask applied to logits: the one step where constrained sampling (a grammar's
allowed tokens, ``allowed_token_ids``, ``bad_words``) touches the logits.

The bitmask is int32 ``[rows, ceil(vocab / 32)]``: bit ``j % 32`` of word ``j // 32`` is
set when token ``j`` is allowed (the layout grammar engines such as xgrammar fill).
``logits[indices[r], j]`` becomes ``-inf`` where bit ``j`` of ``bitmask[r]`` is clear;
ids at or past ``32 * words`` are left alone, and so are rows not in ``indices``.

Torch reference for the CPU (and for the tests) and one Triton kernel for CUDA: a program
per (row, block of vocab), which reads the row's words once and writes only masked
entries' ``-inf``.
"""

from __future__ import annotations

import torch

from kvroute.kernels.triton_compat import kernel, tl, triton

_BITS = 32


def bitmask_words(vocab_size: int) -> int:
    """int32 words per bitmask row for ``vocab_size`` tokens."""
    return -(-vocab_size // _BITS)


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """bool ``[rows, vocab_size]``: True where the token is allowed (ids past the words: True)."""
    shifts = torch.arange(_BITS, dtype=torch.int32, device=bitmask.device)
    bits = ((bitmask.unsqueeze(-1) >> shifts) & 1).bool().reshape(bitmask.shape[0], -1)
    if bits.shape[1] >= vocab_size:
        return bits[:, :vocab_size]
    pad = torch.ones(bitmask.shape[0], vocab_size - bits.shape[1], dtype=torch.bool, device=bitmask.device)
    return torch.cat([bits, pad], dim=1)


def apply_token_bitmask_reference_(logits: torch.Tensor, bitmask: torch.Tensor, indices: torch.Tensor) -> None:
    """Set ``logits[indices[r], j] = -inf`` where bit ``j`` of ``bitmask[r]`` is clear (in place)."""
    if indices.numel() == 0:
        return
    allowed = unpack_bitmask(bitmask.to(logits.device), logits.shape[1])
    idx = indices.to(logits.device, torch.long)
    logits[idx] = logits[idx].masked_fill(~allowed, float("-inf"))


@kernel
def _apply_bitmask_kernel(logits_ptr, bitmask_ptr, indices_ptr, vocab, logits_stride, words, BLOCK: tl.constexpr):
    r = tl.program_id(0)
    row = tl.load(indices_ptr + r).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = (cols < vocab) & (cols < words * 32)
    word = tl.load(bitmask_ptr + r * words + cols // 32, mask=ok, other=-1)
    blocked = ((word >> (cols % 32)) & 1) == 0
    neg = tl.full([BLOCK], float("-inf"), tl.float32)
    tl.store(logits_ptr + row * logits_stride + cols, neg.to(logits_ptr.dtype.element_ty), mask=ok & blocked)


def apply_token_bitmask_triton_(logits: torch.Tensor, bitmask: torch.Tensor, indices: torch.Tensor) -> None:
    """The Triton version of :func:`apply_token_bitmask_reference_` (logits rows contiguous)."""
    assert logits.dim() == 2 and logits.stride(1) == 1, "logits must be [rows, vocab] with contiguous rows"
    assert bitmask.dtype == torch.int32 and bitmask.dim() == 2 and bitmask.shape[0] == indices.numel()
    n = indices.numel()
    if n == 0:
        return
    bitmask = bitmask.to(logits.device).contiguous()
    indices = indices.to(logits.device, torch.int32).contiguous()
    vocab = logits.shape[1]
    block = min(4096, triton.next_power_of_2(vocab))
    _apply_bitmask_kernel[(n, triton.cdiv(vocab, block))](
        logits, bitmask, indices, vocab, logits.stride(0), bitmask.shape[1], BLOCK=block
    )
