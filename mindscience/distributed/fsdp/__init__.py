"""``fully_shard(cell)``: ZeRO-3 / FSDP parameter sharding over the dp-cp group.

Every parameter of ``cell`` (after its tensor-parallel split, if any) is kept as a
``1/d`` shard along dim 0 over a group of ``d`` ranks (contract C1): a local shape
``(r, *rest)`` becomes ``(c, *rest)`` with ``c = ceil(r / d)``, group rank ``k`` holding
rows ``[k*c, min((k+1)*c, r))``, zero-padded to ``c`` rows. Where the model reads the
parameter (``self.weight`` in a layer's ``construct``) it gets the full tensor, gathered
over the group; the gradient that autodiff returns for the shard is the reduce-scatter
of the full gradient divided by ``d``: the MEAN over the group of this shard's rows
(contract C3). Padding rows are cut off after the gather, so the model never sees them
and their gradient is 0.

Example, dp-cp group of 4 ranks, a ``ColumnParallelLinear(64, 10)`` at tp1:

=========  =============  ===========================================
group rank weight shard   rows of the full ``[10, 64]`` weight
=========  =============  ===========================================
0          ``[3, 64]``    0-2
1          ``[3, 64]``    3-5
2          ``[3, 64]``    6-8
3          ``[3, 64]``    9 and two zero rows of padding
=========  =============  ===========================================

Mechanism (the same in PyNative, ``ms.jit`` and GRAPH_MODE): each cell that owns
parameters gets a subclass of its own class whose parameter attributes are properties.
The Parameter object stays in the cell's parameter table under its attribute name, so
``parameters_and_names()``, ``trainable_params()`` and every ``param.name`` are
unchanged, and its data is the shard. Reading ``self.weight`` returns:

* in compiled code, always the gathered tensor: an ``nn.Cell`` whose ``construct`` is the
  all-gather and whose ``bprop`` the reduce-scatter (as the mappings are built), so the
  layer's unmodified ``construct`` compiles;
* eagerly, while a fully sharded cell is being called (its ``__call__``), the gathered
  tensor, gathered once per parameter and outermost call;
* eagerly otherwise (user code, ``repr``, optimizers, checkpoints), the shard Parameter
  itself, with no communication: a rank that prints its model does not start a
  collective that the other ranks never join.

What is kept alive, and when: the shards always. By default autodiff keeps each gathered
tensor that the forward used (e.g. ``W`` of ``y = x W^T``, needed by ``dx = dy W``)
until its backward has run, so the full weights of every layer are alive between forward
and backward, as without sharding (only the stored parameters, gradients and optimizer
state are ``1/d``). With ``reshard_after_forward=True`` (torch FSDP2's name) every cell
that owns sharded parameters is recomputed (PyNative's ``Cell.recompute()`` machinery):
the forward keeps only the cell's inputs, and the backward gathers the weights again
just before the cell's backward, holding one layer's full weights at a time at the price
of a second all-gather per layer. PyNative only: under ``ms.jit`` / GRAPH_MODE the
recomputed all-gathers and the reduce-scatters of a group were scheduled in different
orders on different ranks (measured: wrong gradients at dp4), so compiled code raises a
``ValueError`` at trace time for such parameters.

Collectives and ordering: one all-gather per parameter read in the forward, one
reduce-scatter per parameter in the backward (a read is gathered once per call
eagerly; compiled code may gather a parameter read twice twice). Compiled, they follow
the layer chain; independent collectives of one group in one graph may run in
different orders on different ranks (docs/COMPILED_MODE.md), which the recompute of
``reshard_after_forward`` provoked and the plain forward/backward did not (measured at
dp4, tp2 x dp2 and pp2 x dp2).

Optimizers: :class:`mindscience.distributed.optimizer.DistributedOptimizer` with
``zero_stage=3`` steps the shards as they are; :class:`GradientFinalizer` skips the dp-cp
mean of fully sharded parameters (their gradient already is that mean) and still sums
sequence-parallel and tied-embedding gradients.
"""

from .api import fully_shard, gather_in_calls, is_fully_sharded
from .layout import (FsdpParamInfo, FullyShardError, full_param_numpy, shard_range, shard_rows,
                     shard_shape)
from .rules import fsdp_runtime
from .unit import FsdpUnit, gathered_bytes, peak_gathered_bytes, reset_gathered_bytes, units_of

__all__ = [
    "FullyShardError",
    "FsdpParamInfo",
    "FsdpUnit",
    "fsdp_runtime",
    "fully_shard",
    "gathered_bytes",
    "peak_gathered_bytes",
    "reset_gathered_bytes",
    "units_of",
    "gather_in_calls",
    "is_fully_sharded",
    "shard_rows",
    "shard_range",
    "shard_shape",
    "full_param_numpy",
]
