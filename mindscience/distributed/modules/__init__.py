"""Parallel layers built on the mappings.

    from mindscience.distributed.modules import (
        ColumnParallelLinear, RowParallelLinear, initialize_affine_weight,   # tensor-parallel linear
        VocabParallelEmbedding, vocab_parallel_cross_entropy,                # vocabulary over tp
        context_parallel_attention, ContextParallelAttention,                # attention over cp
        zigzag_shard, zigzag_unshard,                                        # the causal ring's layout
    )

Without ``initialize_parallel`` the layers run as ordinary dense layers (every group of
size 1). Each layer marks how its parameters are split (:mod:`..sharding`), which
:mod:`..checkpoint` uses to save and load them at any layout.
"""

from .init import initialize_affine_weight
from .linear import ColumnParallelLinear, RowParallelLinear
from .embedding import VocabParallelEmbedding
from .cross_entropy import vocab_parallel_cross_entropy
from .attention import (
    ContextParallelAttention, context_parallel_attention, zigzag_shard, zigzag_unshard,
)

__all__ = ["ColumnParallelLinear", "RowParallelLinear", "initialize_affine_weight",
           "VocabParallelEmbedding", "vocab_parallel_cross_entropy",
           "ContextParallelAttention", "context_parallel_attention", "zigzag_shard",
           "zigzag_unshard"]
