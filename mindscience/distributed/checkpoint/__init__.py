"""Sharded checkpoints that survive a layout change.

    from mindscience.distributed import checkpoint
    checkpoint.save(train_state, "ckpt/step_100", step=100)     # every rank, at tp2 x dp2
    ...
    checkpoint.load(train_state, "ckpt/step_100")               # every rank, at tp4 (or tp1 x dp4)

* :func:`save` / :func:`load` (:mod:`.cell`, the only MindSpore part): each rank writes
  what it owns as safetensors plus a manifest; ``load`` reads, through memory maps, only
  the slices the current layout gives this rank, verifying the checksums of the 1 MiB
  blocks that hold them (:mod:`.blocks`).
* Parameters are matched by GLOBAL name (their path in ``cell.parameters_and_names()``),
  and split as their sharding marks say (:mod:`mindscience.distributed.sharding`).
  Pipeline stages name their layers by global index: :func:`set_global_layer_names`.
* Optimizer state: pass a cell holding the optimizer too (``nn.CellList([net, opt])``);
  its moments (``nn.Optimizer``s and ``mint.optim`` optimizers alike) are saved and
  resharded like the parameters they belong to, its step counters and learning rate as
  replicated tensors.
* Sharded optimizer state (``DistributedOptimizer`` stages 1-3) and ``fully_shard``
  parameters are saved whole in their tp-local shape and sliced back to this rank's rows
  on load (:mod:`.zero`): a checkpoint loads at any other layout AND stage.
* Offline (no MindSpore, used by ``msdist checkpoint``): :mod:`.offline` ``inspect``,
  ``reshard``, ``merge``; :mod:`.manifest` (the format), :mod:`.schema` (its checks),
  :mod:`.plan` (who holds which slice, stage placement), :mod:`.files` (safetensors byte
  ranges, checksums), :mod:`.blocks` (block checksums), :mod:`.writer`.

Importing this package does not import MindSpore; ``save``/``load`` load it on first use.
"""

import importlib

from .errors import (CheckpointError, CheckpointExpertCountError, CheckpointFormatError,
                     CheckpointIntegrityError)
from .manifest import FORMAT_VERSION, READ_VERSIONS

_LAZY = {"save": "cell", "save_async": "cell", "agree_written": "cell", "load": "cell",
         "set_global_layer_names": "cell",
         "named_parameters": "cell", "inspect": "offline", "reshard": "offline", "merge": "offline"}

__all__ = ["save", "save_async", "agree_written", "load", "set_global_layer_names", "named_parameters",
           "inspect", "reshard",
           "merge", "CheckpointError", "CheckpointIntegrityError", "CheckpointFormatError",
           "CheckpointExpertCountError",
           "FORMAT_VERSION", "READ_VERSIONS"]


def __getattr__(name):
    if name in _LAZY:
        return getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(__all__))
