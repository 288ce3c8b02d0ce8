"""The token bitmask kernel (Triton, interpreted on CPU) against the torch reference."""

from __future__ import annotations

import pytest
import torch

from kvroute.kernels.token_bitmask import (
    apply_token_bitmask_reference_,
    apply_token_bitmask_triton_,
    bitmask_words,
    unpack_bitmask,
)
from tests.kernels.batches import DEVICE


def _random_bitmask(rows: int, vocab: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-(2**31), 2**31 - 1, (rows, bitmask_words(vocab)), generator=g, dtype=torch.int64).to(torch.int32)


def test_unpack_bitmask_bit_order():
    mask = torch.zeros(1, 2, dtype=torch.int32)
    mask[0, 0] = 1 << 3  # token 3
    mask[0, 1] = -(2**31)  # bit 31 of word 1: token 63
    allowed = unpack_bitmask(mask, 64)[0].nonzero().flatten().tolist()
    assert allowed == [3, 63]


@pytest.mark.usefixtures("triton_available")
@pytest.mark.parametrize("dtype,vocab", [(torch.float32, 1000), (torch.bfloat16, 4099), (torch.float32, 96)])
def test_triton_bitmask_matches_reference(dtype, vocab):
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(5, vocab, generator=g).to(DEVICE, dtype)
    indices = torch.tensor([4, 0, 2])
    bitmask = _random_bitmask(3, vocab, seed=vocab)
    want = logits.clone()
    apply_token_bitmask_reference_(want, bitmask, indices)
    got = logits.clone()
    apply_token_bitmask_triton_(got, bitmask.to(DEVICE), indices.to(DEVICE))
    assert torch.equal(got.isinf(), want.isinf())
    assert want[4].isinf().any() and not want[1].isinf().any()  # masked rows only
    torch.testing.assert_close(got, want, atol=0, rtol=0)


@pytest.mark.usefixtures("triton_available")
def test_triton_bitmask_padded_vocab_leaves_ids_past_words():
    # logits wider than the mask's words (a model whose vocab is padded past the mask)
    logits = torch.zeros(1, 70, device=DEVICE)
    bitmask = torch.zeros(1, 2, dtype=torch.int32)  # 64 ids, all blocked
    apply_token_bitmask_triton_(logits, bitmask.to(DEVICE), torch.tensor([0], device=DEVICE))
    ref = torch.zeros(1, 70)
    apply_token_bitmask_reference_(ref, bitmask, torch.tensor([0]))
    assert logits[0, :64].isinf().all() and not logits[0, 64:].isinf().any()
    torch.testing.assert_close(logits.cpu(), ref, atol=0, rtol=0)
