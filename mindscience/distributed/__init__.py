"""Parallel layouts, communication groups, mappings and parallel layers for MindSpore.

Submodules load lazily so that the pure parts (``topology``, ``group``) never pull
MindSpore in: ``msdist plan`` starts in a fraction of a second.

    from mindscience.distributed import manager, mappings, modules
"""

import importlib

_SUBMODULES = ("topology", "group", "manager", "collectives", "mappings", "modules", "harness")

__all__ = list(_SUBMODULES)


def __getattr__(name):
    if name in _SUBMODULES:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
