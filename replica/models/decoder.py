"""One decoder-only transformer for Llama, Mistral (no sliding window), Qwen2 and Qwen3,
written against the paged KV cache. Parameter names follow Hugging Face's, so
checkpoints load by name."""

from __future__ import annotations

import torch
from torch import nn

from kvroute.kernels import cpu_capability, ops
from kvroute.kernels.attention_metadata import AttentionMetadata
from kvroute.replica.models.arch import ModelArch
from kvroute.replica.models.rope import RotaryEmbedding


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.rms_norm(x, self.weight, self.eps)

    def add_and_norm(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(norm(x + residual), x + residual)`` in one kernel on the GPU."""
        return ops.fused_add_rms_norm(x, residual, self.weight, self.eps)


class Attention(nn.Module):
    def __init__(self, arch: ModelArch) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = arch.num_heads, arch.num_kv_heads, arch.head_dim
        h = arch.hidden_size
        self.q_proj = nn.Linear(h, self.num_heads * self.head_dim, bias=arch.qkv_bias)
        self.k_proj = nn.Linear(h, self.num_kv_heads * self.head_dim, bias=arch.qkv_bias)
        self.v_proj = nn.Linear(h, self.num_kv_heads * self.head_dim, bias=arch.qkv_bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, h, bias=arch.o_bias)
        if arch.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, arch.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, arch.rms_norm_eps)
        self.qk_norm = arch.qk_norm
        self.scale = self.head_dim**-0.5

    def fuse_projections(self) -> None:
        """Replace q/k/v_proj by one ``qkv_proj`` (their weights stacked): one GEMM
        instead of three. Done once, after loading the checkpoint by name."""
        self.qkv_proj = _stack(self.q_proj, self.k_proj, self.v_proj)
        del self.q_proj, self.k_proj, self.v_proj

    def forward(
        self,
        x: torch.Tensor,  # [T, hidden]
        rope: tuple[torch.Tensor, torch.Tensor],  # cos, sin: [T, 1, head_dim]
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        t = x.shape[0]
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        q, k, v = self.qkv_proj(x).split((q_size, kv_size, kv_size), dim=-1)
        q = q.reshape(t, self.num_heads, self.head_dim)  # views of the QKV output
        k = k.reshape(t, self.num_kv_heads, self.head_dim)
        v = v.reshape(t, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        ops.rotary_(q, k, *rope)
        ops.store_kv(k, v, kv_cache[0], kv_cache[1], meta)
        o = ops.paged_attention(q, kv_cache[0], kv_cache[1], meta, self.scale, k, v)  # [T, H, D]
        return self.o_proj(o.reshape(t, self.num_heads * self.head_dim))


class MLP(nn.Module):
    def __init__(self, arch: ModelArch) -> None:
        super().__init__()
        h, i = arch.hidden_size, arch.intermediate_size
        self.gate_proj = nn.Linear(h, i, bias=arch.mlp_bias)
        self.up_proj = nn.Linear(h, i, bias=arch.mlp_bias)
        self.down_proj = nn.Linear(i, h, bias=arch.mlp_bias)

    def fuse_projections(self) -> None:
        """One ``gate_up_proj`` instead of gate_proj and up_proj."""
        self.gate_up_proj = _stack(self.gate_proj, self.up_proj)
        del self.gate_proj, self.up_proj

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(ops.silu_and_mul(self.gate_up_proj(x)))


def _stack(*linears: nn.Linear) -> nn.Linear:
    """One Linear whose output is the given Linears' outputs side by side."""
    first = linears[0]
    out = sum(lin.out_features for lin in linears)
    with torch.device("meta"):
        fused = nn.Linear(first.in_features, out, bias=first.bias is not None)
    fused.weight = nn.Parameter(torch.cat([lin.weight.detach() for lin in linears]), requires_grad=False)
    if first.bias is not None:
        fused.bias = nn.Parameter(torch.cat([lin.bias.detach() for lin in linears]), requires_grad=False)
    return fused


def _packable(weight: torch.Tensor) -> bool:
    return (
        weight.device.type == "cpu"
        and weight.dtype in (torch.bfloat16, torch.float32)
        and torch.backends.mkldnn.is_available()
    )


class PackedLinear(nn.Module):
    """A Linear whose weight is held in oneDNN's blocked layout (reordered once, not on
    every call).

    A bf16 Linear on a CPU where oneDNN cannot reorder bf16 (``cpu_capability``: no
    AVX512-BW/VL/DQ nor AVX-NE-CONVERT, e.g. AVX2-only) is packed in fp32 instead: the
    input widened (exact), the products summed in fp32 as a bf16 GEMM sums them, the
    output rounded to bf16 once. On AVX2 that beats F.linear in bf16 from a few rows up
    and loses at one row, where it reads twice the weight bytes against torch's fast bf16
    matrix-vector product (figures: benchmarks/RESULTS.md)."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        weight, bias = linear.weight.detach(), linear.bias
        self.widen = weight.dtype == torch.bfloat16 and not cpu_capability.current().onednn_bf16_reorder
        if self.widen:
            weight, bias = weight.float(), None if bias is None else bias.detach().float()
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight)
        self.bias = bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.widen:
            return self._matmul(x.float()).to(torch.bfloat16)
        return self._matmul(x)

    def _matmul(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")


class DecoderLayer(nn.Module):
    def __init__(self, arch: ModelArch) -> None:
        super().__init__()
        self.self_attn = Attention(arch)
        self.mlp = MLP(arch)
        self.input_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)

    def forward(
        self,
        x: torch.Tensor,  # [T, hidden], the previous layer's output (embeddings for layer 0)
        residual: torch.Tensor | None,  # [T, hidden], the residual stream before adding x; None for layer 0
        rope: tuple[torch.Tensor, torch.Tensor],
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (this layer's MLP output, residual stream before adding it), so every
        residual add is fused into the RMSNorm that follows it. The same values as
        ``x = x + attn(norm(x)); x = x + mlp(norm(x))``, rounded at the same points."""
        if residual is None:
            residual, h = x, self.input_layernorm(x)
        else:
            h, residual = self.input_layernorm.add_and_norm(x, residual)
        h = self.self_attn(h, rope, kv_cache, meta)
        h, residual = self.post_attention_layernorm.add_and_norm(h, residual)
        return self.mlp(h), residual


class DecoderBody(nn.Module):
    def __init__(self, arch: ModelArch) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(arch.vocab_size, arch.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(arch) for _ in range(arch.num_layers))
        self.norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)


class DecoderForCausalLM(nn.Module):
    """``forward`` returns final hidden states; ``compute_logits`` projects the rows
    that need sampling (so a prefill chunk never pays for a full-vocab matmul per token)."""

    def __init__(self, arch: ModelArch) -> None:
        super().__init__()
        self.arch = arch
        self.model = DecoderBody(arch)
        self.lm_head = nn.Linear(arch.hidden_size, arch.vocab_size, bias=False)
        self.rope = RotaryEmbedding(arch.head_dim, arch.max_position_embeddings, arch.rope_theta, arch.rope_scaling)

    def tie_weights(self) -> None:
        self.lm_head.weight = self.model.embed_tokens.weight

    def fuse_projections(self) -> None:
        for layer in self.model.layers:
            layer.self_attn.fuse_projections()
            layer.mlp.fuse_projections()

    def pack_linears_for_cpu(self) -> None:
        """On CPU (bf16 and fp32) every Linear multiplies with its weight prepacked once for
        oneDNN. bf16: the same results as F.linear (bit for bit without a bias, within one
        ulp with one), faster at decode batch sizes; without oneDNN's bf16 reorder, packed
        in fp32 (``PackedLinear``). fp32: F.linear goes to MKL, which on AMD CPUs takes a
        path at half the AVX-512 rate; oneDNN's is faster there (the same values up to the
        summation order; figures: benchmarks/RESULTS.md)."""
        for name, module in list(self.named_modules()):
            if isinstance(module, nn.Linear) and _packable(module.weight):
                parent, _, child = name.rpartition(".")
                setattr(self.get_submodule(parent) if parent else self, child, PackedLinear(module))

    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        kv_cache: torch.Tensor,  # [layers, 2, num_blocks, block_size, num_kv_heads, head_dim]
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # [T, hidden]
        x = self.model.embed_tokens(input_ids)  # [T, hidden]
        rope = self.rope.tables(positions, x.dtype)
        residual: torch.Tensor | None = None
        for i, layer in enumerate(self.model.layers):
            x, residual = layer(x, residual, rope, kv_cache[i], meta)
        if residual is None:  # a model without layers
            return self.model.norm(x)
        return self.model.norm.add_and_norm(x, residual)[0]

    def compute_logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:  # [N, vocab]
        """The rows' logits in the model's dtype, into ``out`` when given (the decode
        graphs' shared buffer: the product writes it directly, no copy)."""
        weight = getattr(self.lm_head, "weight", None)  # None: the CPU's prepacked Linear
        if out is None or weight is None:
            logits = self.lm_head(hidden)
            return logits if out is None else out.copy_(logits)
        return torch.matmul(hidden, weight.t(), out=out)
