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

Units (torch FSDP2's design): each ``fully_shard`` call makes one unit of the parameters it
shards. Call it on each block (a transformer layer) first and then on the model (the root
unit: the embeddings, the head, whatever no block holds), or once on the model (one unit)::

    for layer in model.layers:
        fully_shard(layer)
    fully_shard(model)

In PyNative a unit is gathered with ONE all-gather of its shards flattened into one buffer
(one per dtype of its parameters), at the first read of one of its parameters inside a
fully sharded call, then split into the full tensors; its backward is ONE reduce-scatter of
the unit's flat gradient, divided by d, as the unit's backward ends (:mod:`.unit`).

* ``reshard_after_forward=True`` (the default): the unit's gathered weights are dropped when
  its forward ends (a ``saved_tensors_hooks`` pack hook keeps a key instead of each saved
  gathered weight) and gathered again by the first unpack of its backward: 2 all-gathers per
  unit and micro-batch, no forward re-run. A unit that contains other units (the root) keeps
  its weights from its forward to its backward, which follows at once. ``False`` keeps every
  unit's gathered weights until its backward, as an unsharded model keeps its weights.
* ``prefetch=True`` (the default): when a unit gathers in the forward, the next unit's gather
  (in the order of the previous forward, the same on every rank) is launched asynchronously
  (``mint.distributed.all_gather(..., async_op=True)``, measured to work on CPU); in the
  backward the first unpack of a unit launches the gather of the unit before it. With both,
  at most the root and two neighbouring blocks are gathered at once.
* Counters: :func:`gathered_bytes` (full bytes of gathered weights alive: added when a unit's
  gather is issued, subtracted when it is dropped), :func:`peak_gathered_bytes` and
  :func:`reset_gathered_bytes`; ``FsdpUnit.counts`` per unit (forward and backward gathers,
  prefetched ones, reduce-scatters); :func:`units_of`. ``rules.peak_gathered_bytes`` is the
  figure they reach; :func:`fsdp_runtime` (:mod:`.rules`, pure) says what runs per mode and is
  what the cost model reads.

Compiled code (``ms.jit``, GRAPH_MODE) runs as ``reshard_after_forward=False, prefetch=False``
whatever was asked (``fsdp_runtime("jit")["reason"]`` says why): reading ``self.weight`` in a
traced ``construct`` is an all-gather Cell per parameter (``construct`` the gather, ``bprop``
the reduce-scatter), kept from the forward to the backward. Recomputed gathers of a group were
ordered differently on different ranks there (measured: wrong gradients at dp4).

Mechanism: each cell that owns parameters gets a subclass of its own class whose parameter
attributes are properties. The Parameter object stays in the cell's parameter table under
its attribute name, so ``parameters_and_names()``, ``trainable_params()`` and every
``param.name`` are unchanged, and its data is the shard. Reading ``self.weight`` returns the
gathered tensor in compiled code and, eagerly, while a fully sharded cell is being called
(its ``__call__``; a read outside the unit's own call, such as a tied head reading the
embedding, gathers that unit once per outermost call); eagerly otherwise (user code,
``repr``, optimizers, checkpoints) the shard Parameter itself, with no communication: a rank
that prints its model does not start a collective that the other ranks never join.

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
