"""Context-parallel attention: Ulysses, all-gather KV and ring, and a layer around them.

    from mindscience.distributed.modules import (
        context_parallel_attention, ContextParallelAttention, zigzag_shard, zigzag_unshard)
"""

from .layer import ContextParallelAttention
from .methods import context_parallel_attention, zigzag_shard, zigzag_unshard

__all__ = ["ContextParallelAttention", "context_parallel_attention", "zigzag_shard",
           "zigzag_unshard"]
