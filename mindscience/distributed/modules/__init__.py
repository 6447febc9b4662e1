"""Parallel layers built on the mappings: tensor-parallel linear layers and their init.

    from mindscience.distributed.modules import (
        ColumnParallelLinear, RowParallelLinear, initialize_affine_weight,
    )

Without ``initialize_parallel`` the layers run as ordinary dense layers (tp = 1).
"""

from .init import initialize_affine_weight
from .linear import ColumnParallelLinear, RowParallelLinear

__all__ = ["ColumnParallelLinear", "RowParallelLinear", "initialize_affine_weight"]
