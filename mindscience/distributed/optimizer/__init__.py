"""ZeRO-style distributed optimizer: sharded optimizer state, gradients and weights.

``layout`` (shard and bucket arithmetic, contract C1/C2 bytes), ``validate`` and
``errors`` import no MindSpore; :class:`DistributedOptimizer` (module ``distributed``)
loads it on first access.
"""

import importlib

from .errors import DistributedOptimizerError
from .layout import bytes_per_element, param_shard, plan_buckets, shard_range, shard_rows

__all__ = ["DistributedOptimizer", "DistributedOptimizerError", "bytes_per_element",
           "param_shard", "plan_buckets", "shard_range", "shard_rows"]


def __getattr__(name):
    if name == "DistributedOptimizer":
        return importlib.import_module(f"{__name__}.distributed").DistributedOptimizer
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
