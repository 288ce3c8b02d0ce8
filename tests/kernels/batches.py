"""Random paged batches and a dense attention oracle, shared by the kernel tests."""

from __future__ import annotations

import torch

from kvroute.kernels.attention_metadata import AttentionMetadata

# Where the kernel tests put their tensors: the GPU when there is one (Triton compiles the
# kernels), else the CPU (tests/kernels/conftest.py turns Triton's interpreter on).
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def build_batch(ctx_lens, q_lens, block_size, num_kv_heads, head_dim, dtype, seed=0, device=DEVICE, spare_blocks=3):
    """Random K/V for every position; each sequence's cached context is pre-stored in
    shuffled blocks. Returns ``(key_cache, value_cache, meta, full_k, full_v, new_k, new_v)``
    where ``full_*[s]`` is ``[ctx + q_len, KVH, D]`` and ``new_*`` the step's K/V rows."""
    g = torch.Generator().manual_seed(seed)
    num_blocks = sum(-(-(c + q) // block_size) for c, q in zip(ctx_lens, q_lens)) + spare_blocks
    kc = torch.zeros(num_blocks, block_size, num_kv_heads, head_dim, dtype=dtype)
    vc = torch.zeros_like(kc)
    perm = torch.randperm(num_blocks, generator=g).tolist()
    tables, full_k, full_v, slots = [], [], [], []
    for c, q in zip(ctx_lens, q_lens):
        n = -(-(c + q) // block_size)
        table = [perm.pop() for _ in range(n)]
        tables.append(table)
        k = torch.randn(c + q, num_kv_heads, head_dim, generator=g).to(dtype)
        v = torch.randn(c + q, num_kv_heads, head_dim, generator=g).to(dtype)
        full_k.append(k)
        full_v.append(v)
        for p in range(c):  # the cached prefix is already in the cache
            kc[table[p // block_size], p % block_size] = k[p]
            vc[table[p // block_size], p % block_size] = v[p]
        slots += [table[p // block_size] * block_size + p % block_size for p in range(c, c + q)]
    width = max(map(len, tables))
    bt = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    qsl = [0]
    for q in q_lens:
        qsl.append(qsl[-1] + q)
    seq_lens = [c + q for c, q in zip(ctx_lens, q_lens)]
    meta = AttentionMetadata(
        torch.tensor(qsl, dtype=torch.int32, device=device),
        torch.tensor(seq_lens, dtype=torch.int32, device=device),
        torch.tensor(ctx_lens, dtype=torch.int32, device=device),
        bt.to(device),
        torch.tensor(slots, dtype=torch.int64, device=device),
        qsl,
        seq_lens,
        list(ctx_lens),
    )
    new_k = torch.cat([k[c:] for k, c in zip(full_k, ctx_lens)]).to(device)
    new_v = torch.cat([v[c:] for v, c in zip(full_v, ctx_lens)]).to(device)
    return kc.to(device), vc.to(device), meta, full_k, full_v, new_k, new_v


def dense_attention(q, k, v, ctx, scale):
    """q: [q_len, H, D]; k, v: [ctx + q_len, KVH, D]; explicit causal softmax in fp32."""
    h, kvh = q.shape[1], k.shape[1]
    k = k.float().to(q.device).repeat_interleave(h // kvh, dim=1)
    v = v.float().to(q.device).repeat_interleave(h // kvh, dim=1)
    s = torch.einsum("qhd,khd->hqk", q.float(), k) * scale
    q_pos = torch.arange(ctx, ctx + q.shape[0], device=q.device)[:, None]
    k_pos = torch.arange(k.shape[0], device=q.device)[None, :]
    s = s.masked_fill(k_pos > q_pos, float("-inf"))
    return torch.einsum("hqk,khd->qhd", s.softmax(-1), v)


def assert_attention_matches(out, q, kc, vc, meta, full_k, full_v, ctx_lens, q_lens, scale, tol):
    """``out`` equals dense causal attention per sequence and the paged reference, within ``tol``."""
    import torch

    from kvroute.kernels.paged_attention import paged_attention_reference

    for s, (c, n) in enumerate(zip(ctx_lens, q_lens)):
        q0 = meta.query_start_loc_cpu[s]
        want = dense_attention(q[q0 : q0 + n], full_k[s], full_v[s], c, scale)
        torch.testing.assert_close(out[q0 : q0 + n].float(), want, atol=tol, rtol=tol)
    ref = paged_attention_reference(q, kc, vc, meta, scale)
    torch.testing.assert_close(out.float(), ref.float(), atol=tol, rtol=tol)
