"""Parallel layers built on the mappings: tensor-parallel linear layers and their init.

    from mindscience.distributed.modules import (
        ColumnParallelLinear, RowParallelLinear, initialize_affine_weight,
    )

Without ``initialize_parallel`` the layers run as ordinary dense layers (tp = 1).
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
