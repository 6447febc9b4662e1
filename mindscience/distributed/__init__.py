"""Parallel layouts, communication groups, mappings and parallel layers for MindSpore.

Submodules load lazily so that the pure parts (``topology``, ``group``) never pull
MindSpore in: ``msdist plan`` starts in a fraction of a second.

    from mindscience.distributed import manager, mappings, modules
    from mindscience.distributed import initialize_parallel, ColumnParallelLinear
"""

import importlib

_SUBMODULES = ("topology", "group", "manager", "collectives", "mappings", "modules", "finalize",
               "harness", "sharding", "checkpoint", "p2p", "pipeline", "random",
               "optimizer", "fsdp", "parallelize", "models", "training", "moe")

# Names re-exported at the package level (upstream exports initialize_parallel here),
# each loaded from its module on first access.
_EXPORTS = {
    "initialize_parallel": "manager",
    "destroy_parallel": "manager",
    "is_initialized": "manager",
    "ColumnParallelLinear": "modules",
    "RowParallelLinear": "modules",
    "initialize_affine_weight": "modules",
    "GradientFinalizer": "finalize",
    "forward_backward": "pipeline",
    "ring_shift": "p2p",
    "finalize_gradients": "finalize",
    "mark_sharding": "sharding",
    "get_sharding": "sharding",
    "DistributedOptimizer": "optimizer",
    "fully_shard": "fsdp",
    "parallelize_module": "parallelize",
    "MoELayer": "moe",
    "MoEConfig": "moe",
    "TopKRouter": "moe",
}

__all__ = list(_SUBMODULES) + list(_EXPORTS)


def __getattr__(name):
    if name in _SUBMODULES:
        return importlib.import_module(f"{__name__}.{name}")
    if name in _EXPORTS:
        return getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(__all__))
