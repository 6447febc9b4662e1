"""ZeRO-style distributed optimizer: sharded optimizer state, gradients and weights.

``layout`` (shard and bucket arithmetic, contract C1/C2 bytes), ``overlap_rules`` (what
``overlap_grad_reduce`` / ``overlap_param_gather`` overlap in each mode, and the bytes of
main weights, read by the cost model), ``validate`` and ``errors`` import no MindSpore;
:class:`DistributedOptimizer` (module ``distributed``) loads it on first access.
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
