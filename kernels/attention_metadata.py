"""The layout every attention path (torch reference, Triton) agrees on for one step."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch


@dataclass
class AttentionMetadata:
    """Describes a mixed batch of sequences, each with ``q_len`` new tokens.

    Sequence *s* owns query rows ``query_start_loc[s] : query_start_loc[s + 1]``; its new
    tokens sit at positions ``context_lens[s] .. seq_lens[s] - 1`` and attend causally to
    every earlier position, all of which are in the paged cache once the step's K/V are
    stored. ``slot_mapping[t] = block_id * block_size + offset`` says where token *t*'s
    K/V go; a negative slot (padding) writes nothing. The ``*_cpu`` lists mirror the
    tensors for host-side loops.
    """

    query_start_loc: torch.Tensor  # [num_seqs + 1] int32
    seq_lens: torch.Tensor  # [num_seqs] int32, context + new tokens
    context_lens: torch.Tensor  # [num_seqs] int32, tokens already in the cache
    block_tables: torch.Tensor  # [num_seqs, max_blocks_per_seq] int32, padded with 0
    slot_mapping: torch.Tensor  # [num_tokens] int64
    query_start_loc_cpu: list[int]
    seq_lens_cpu: list[int]
    context_lens_cpu: list[int]

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_cpu)

    @cached_property
    def max_query_len(self) -> int:
        q = self.query_start_loc_cpu
        return max((q[i + 1] - q[i] for i in range(len(q) - 1)), default=0)
