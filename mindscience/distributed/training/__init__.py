"""Training the reference transformer at any layout (``msdist train``).

* :mod:`.options` (pure): :class:`TrainOptions`, micro-batches, checkpoint steps and
  resume directories;
* :mod:`.data` (pure numpy): the tokens of every step, synthetic from a seed or cut from a
  ``.npy`` file, each data-parallel rank reading only its share;
* :mod:`.loop` (MindSpore): :class:`Trainer`, GPTModel with DistributedOptimizer (AdamW);
* :mod:`.report` (pure): the steps, and measured beside the cost model's prediction.

Importing the package does not import MindSpore; ``Trainer`` loads it on first use.
"""

import importlib

from .options import TrainOptionError, TrainOptions

__all__ = ["Trainer", "TrainOptions", "TrainOptionError", "data", "loop", "options", "report"]

_LAZY = {"Trainer": "loop"}


def __getattr__(name):
    if name in _LAZY:
        return getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
    if name in ("data", "loop", "options", "report"):
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
