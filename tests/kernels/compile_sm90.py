"""Compile every Triton kernel for an H100 (sm_90) without a GPU: Triton's own frontend,
optimizer, LLVM and the bundled ptxas run on the CPU. Catches what the interpreter cannot
(unsupported ops, type errors in compiled control flow, shared-memory overruns).

Run as a script in a process without ``TRITON_INTERPRET`` (the test does that).
"""

from __future__ import annotations

import os
import sys

os.environ.pop("TRITON_INTERPRET", None)

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from kvroute.kernels import activation, kv_store, lora, paged_attention, rms_norm, rotary, token_bitmask  # noqa: E402

I32 = "i32"
H100_SHARED_BYTES = 227 * 1024


def compile_one(lazy, signature: dict[str, str], constexprs: dict) -> None:
    fn = lazy.jit
    full = {name: "constexpr" if name in constexprs else signature[name] for name in fn.arg_names}
    compiled = triton.compile(ASTSource(fn, full, constexprs), target=GPUTarget("cuda", 90, 32))
    assert "cubin" in compiled.asm, lazy.__name__
    assert compiled.metadata.shared <= H100_SHARED_BYTES, (lazy.__name__, compiled.metadata.shared)
    print(f"ok {lazy.__name__} shared={compiled.metadata.shared}")


def main() -> None:
    attn = dict(
        out_ptr="*bf16", lse_ptr="*fp32", q_ptr="*bf16", k_cache_ptr="*bf16", v_cache_ptr="*bf16",
        block_tables_ptr="*i32", query_start_loc_ptr="*i32", seq_lens_ptr="*i32", scale_log2e="fp32",
        num_seqs=I32, num_heads=I32, stride_qt=I32, stride_qh=I32, stride_ot=I32, stride_oh=I32,
        stride_cb=I32, stride_cs=I32, stride_ch=I32, stride_bt=I32,
    )  # fmt: skip
    base = dict(GROUP=4, GROUP_PAD=4, BLOCK_N=64, HEAD_DIM=64, PAGE=16, UPCAST=False, DOT_PRECISION="tf32")
    # mixed batch (varlen search), and decode with split-K (fp32 partials)
    compile_one(paged_attention._paged_attention_kernel, attn,
                dict(base, BLOCK_Q=16, BLOCK_M=64, NUM_SPLITS=1, DECODE=False))  # fmt: skip
    compile_one(paged_attention._paged_attention_kernel, dict(attn, out_ptr="*fp32"),
                dict(base, BLOCK_Q=1, BLOCK_M=16, NUM_SPLITS=4, DECODE=True))  # fmt: skip
    compile_one(paged_attention._merge_splits_kernel,
                dict(out_ptr="*bf16", part_ptr="*fp32", lse_ptr="*fp32", num_heads=I32, stride_ot=I32, stride_oh=I32),
                dict(NUM_SPLITS=3, SPLITS_PAD=4, HEAD_DIM=128))  # fmt: skip
    cache = dict(key_ptr="*bf16", value_ptr="*bf16", key_cache_ptr="*bf16", value_cache_ptr="*bf16")
    compile_one(kv_store._store_slots_kernel,
                dict(cache, slot_mapping_ptr="*i64", stride_kt=I32, stride_vt=I32),
                dict(ROW=512, BLOCK=512))  # fmt: skip
    compile_one(rms_norm._rms_norm_kernel,
                dict(out_ptr="*bf16", res_out_ptr="*bf16", x_ptr="*bf16", res_ptr="*bf16", w_ptr="*bf16",
                     num_rows=I32, eps="fp32"),
                dict(DIM=2048, BLOCK=2048, ROWS=2, HAS_RESIDUAL=True))  # fmt: skip
    compile_one(rotary._rotary_kernel,
                dict(q_ptr="*bf16", k_ptr="*bf16", cos_ptr="*bf16", sin_ptr="*bf16", stride_qt=I32, stride_qh=I32,
                     stride_kt=I32, stride_kh=I32, stride_ct=I32, num_heads=I32, num_kv_heads=I32),
                dict(HEADS_PAD=32, HALF=32, HALF_PAD=32))  # fmt: skip
    compile_one(activation._silu_and_mul_kernel, dict(out_ptr="*bf16", in_ptr="*bf16", width=I32), dict(BLOCK=1024))
    compile_one(token_bitmask._apply_bitmask_kernel,
                dict(logits_ptr="*fp32", bitmask_ptr="*i32", indices_ptr="*i32", vocab=I32, logits_stride=I32, words=I32),
                dict(BLOCK=4096))  # fmt: skip
    # LoRA at the 1B shape's qkv (rank 16 x 3 slices): a decode layout through a row order
    # with a split input, and a prefill's consecutive rows with one split
    segs = dict(starts_ptr="*i32", lens_ptr="*i32", slots_ptr="*i32", order_ptr="*i32", T=I32)
    for has_order, split, block_m in ((True, 512, 32), (False, 2048, 32)):
        compile_one(lora._lora_shrink_kernel, dict(segs, part_ptr="*fp32", x_ptr="*bf16", a_ptr="*bf16"),
                    dict(IN=2048, NR=48, NR_PAD=64, SPLIT=split, BLOCK_M=block_m, BLOCK_K=64, HAS_ORDER=has_order))  # fmt: skip
        compile_one(lora._lora_expand_kernel, dict(segs, y_ptr="*bf16", part_ptr="*fp32", b_ptr="*bf16"),
                    dict(OUT=3072, NR=48, NR_PAD=64, SPLITS=2048 // split, BLOCK_M=block_m, BLOCK_N=64,
                         HAS_ORDER=has_order))  # fmt: skip
    sys.stdout.flush()


if __name__ == "__main__":
    main()
