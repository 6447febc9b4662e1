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

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import Optional

import numpy as np

__all__ = [
    "FullyShardError",
    "FsdpParamInfo",
    "fully_shard",
    "is_fully_sharded",
    "shard_rows",
    "shard_range",
    "shard_shape",
    "full_param_numpy",
]

_SHARD_PREFIX = "_fsdp_shard_"
_EAGER_PREFIX = "_fsdp_eager_"
_GRAPH_PREFIX = "_fsdp_graph_"


class FullyShardError(ValueError):
    """``fully_shard`` was given something it cannot shard; nothing was changed."""


@dataclass(frozen=True)
class FsdpParamInfo:
    """What ``fully_shard`` records on a sharded Parameter as ``param.fsdp`` (contract C3).

    Attributes:
        group: The ParallelGroup the parameter is sharded over (size d).
        full_shape: The local shape before sharding (after the tp split), a tuple.
        rows: The unpadded dim-0 length r (1 for a 0-d parameter).
        shard_rows: Rows per rank c = ceil(r / d).
        pad: d * c - r, the zero rows of padding (all on the last ranks).
        reshard_after_forward: The backward gathers the parameter again.
    """

    group: object
    full_shape: tuple
    rows: int
    shard_rows: int
    pad: int
    reshard_after_forward: bool = False

    @property
    def shard_shape(self) -> tuple:
        return shard_shape(self.full_shape, self.group.size)


# --------------------------------------------------------------------------- runtime
# Imported lazily by fully_shard: this module's arithmetic stays importable without MindSpore.
def _runtime():
    import mindspore as ms
    from mindspore import nn, ops
    from mindspore import dtype as mstype

    from . import collectives as C
    return ms, nn, ops, mstype, C


_GATHER_CLASS = None


def _gather_class():
    """The all-gather Cell class (built once, on first use, so MindSpore loads lazily)."""
    global _GATHER_CLASS
    if _GATHER_CLASS is not None:
        return _GATHER_CLASS
    _, nn, ops, mstype, _ = _runtime()

    class _GatherParam(nn.Cell):
        """Forward: all-gather the shard, cut the padding, give the local shape.
        Backward: the gradient padded, reduce-scattered and divided by d (the group mean).

        The reshape and the row cut run in float32 for bfloat16 parameters (the CPU graph
        kernels of Reshape and StridedSlice have no bfloat16; the round trip is exact), and
        the reduce-scatter sums float32.
        """

        def __init__(self, kernels, info: FsdpParamInfo, dtype):
            super().__init__()
            self.k = kernels
            self.full_shape = tuple(info.full_shape)
            self.rest = tuple(shard_shape(info.full_shape, info.group.size)[1:])
            self.rows = info.rows
            self.pad = info.pad
            self.scale = 1.0 / info.group.size
            self.dtype = dtype
            self.low = dtype == mstype.bfloat16
            self.slice = ops.StridedSlice()
            self.reshard = bool(info.reshard_after_forward)

        def _first_rows(self, x):
            if self.pad == 0:
                return x
            begin = [0] * len(x.shape)
            end = list(x.shape)
            end[0] = self.rows
            return self.slice(x, tuple(begin), tuple(end), (1,) * len(x.shape))

        def _padded(self, g):
            if self.pad == 0:
                return g
            return ops.cat((g, ops.zeros((self.pad,) + self.rest, g.dtype)), 0)

        def construct(self, shard):
            full = self.k.all_gather(shard, 0)
            if self.low:
                full = ops.cast(full, mstype.float32)
            full = self._first_rows(full).reshape(self.full_shape)
            if self.low:
                full = ops.cast(full, self.dtype)
            return full

        def bprop(self, shard, out, dout):
            g = ops.cast(dout, mstype.float32).reshape((self.rows,) + self.rest)
            g = self.k.reduce_scatter(self._padded(g)) * self.scale
            # A contiguous tensor of its own: the eager reduce-scatter's chunk is a view
            # (see mappings._fresh for what a view gradient breaks in PyNative).
            return (ops.cast(g, self.dtype).contiguous(),)

    _GATHER_CLASS = _GatherParam
    return _GATHER_CLASS


class _EagerState:
    """How many fully sharded cells are being called eagerly, and what they gathered."""

    depth = 0
    cache: dict = {}


def _enter():
    _EagerState.depth += 1


def _leave():
    _EagerState.depth -= 1
    if _EagerState.depth == 0:
        _EagerState.cache = {}


def _eager_value(cell, attr):
    shard = cell.__dict__[_SHARD_PREFIX + attr]
    if _EagerState.depth == 0:
        return shard
    gather = cell.__dict__[_EAGER_PREFIX + attr]
    if shard.fsdp.reshard_after_forward:
        # Not shared through the cache: under recompute this forward runs without
        # autodiff, and another reader must not get that untracked tensor.
        return gather(shard)
    key = id(shard)
    full = _EagerState.cache.get(key)
    if full is None:
        full = gather(shard)
        _EagerState.cache[key] = full
    return full


def _make_property(attr):
    _, _, _, _, C = _runtime()
    compiling = C.compiling
    shard_key = _SHARD_PREFIX + attr
    graph_key = _GRAPH_PREFIX + attr

    def get(self):
        if compiling():
            gather = getattr(self, graph_key)
            if gather.reshard:
                raise ValueError(
                    "fully_shard(reshard_after_forward=True) runs in PyNative only: in ms.jit "
                    "and GRAPH_MODE the recomputed all-gathers of a group are not ordered "
                    "alike on every rank. Shard with reshard_after_forward=False for compiled code."
                )
            return gather(getattr(self, shard_key))
        return _eager_value(self, attr)

    get.__name__ = attr
    return property(get, doc=f"The full {attr!r} while the cell runs; its shard otherwise.")


class _Active:
    """Calls ``fn`` as if a fully sharded cell were being called (eager reads gather)."""

    def __init__(self, fn):
        self.fn = fn

    def __call__(self, *args, **kwargs):
        _enter()
        try:
            return self.fn(*args, **kwargs)
        finally:
            _leave()


_CLASSES: dict = {}


def _sharded_class(cls, attrs: tuple):
    """``cls`` with the attributes ``attrs`` read through gathering properties."""
    key = (cls, attrs)
    sub = _CLASSES.get(key)
    if sub is not None:
        return sub
    base_call = cls.__call__

    def __call__(self, *args, **kwargs):
        _enter()
        try:
            return base_call(self, *args, **kwargs)
        finally:
            _leave()

    namespace = {"__call__": __call__, "_fsdp_attrs": attrs, "__module__": cls.__module__,
                 "__doc__": cls.__doc__}
    for attr in attrs:
        namespace[attr] = _make_property(attr)
    sub = type(f"FullyShard{cls.__name__}", (cls,), namespace)
    _CLASSES[key] = sub
    return sub


def is_fully_sharded(obj) -> bool:
    """True for a Parameter sharded by :func:`fully_shard` or a cell it was applied to."""
    return getattr(obj, "fsdp", None) is not None or bool(getattr(obj, "_fsdp_root", False))


def _resolve_group(group):
    _, _, _, _, C = _runtime()
    from .group import ParallelGroup

    if group is None:
        from . import manager

        if not manager.is_initialized():
            raise FullyShardError(
                "fully_shard: group=None means the manager's dp-cp group, but the parallel "
                "groups are not initialized; call mindscience.distributed.initialize_parallel(...) "
                "first, or pass group=<a ParallelGroup>"
            )
        return manager.get_data_context_parallel_group()
    if isinstance(group, ParallelGroup):
        g = group
    elif isinstance(group, str):
        g = C.resolve_group(group)
    else:
        raise FullyShardError(
            f"fully_shard: group={group!r} is a {type(group).__name__}; expected a ParallelGroup "
            "(e.g. manager.get_data_context_parallel_group()), a backend group name or None "
            "(the dp-cp group)"
        )
    world = _world_rank()
    if not 0 <= g.rank < g.size or (world is not None and g.ranks[g.rank] != world):
        raise FullyShardError(
            f"fully_shard: group {g.key!r} with ranks {list(g.ranks)} and group rank {g.rank} "
            f"is not a group of this process (global rank {world}); pass a group this rank "
            "belongs to, such as the manager's dp-cp group of this rank"
        )
    return g


def _world_rank():
    from . import manager

    if not manager._communication_initialized():
        return None
    return manager._world()[0]


def _plan(cell, nn):
    """``[(owner cell, attribute, Parameter)]`` to shard, and the problems found (no change)."""
    todo, problems = [], []
    seen_roots = set()
    for path, sub in cell.cells_and_names():
        if sub is not cell and getattr(sub, "_fsdp_root", False):
            seen_roots.add(path)
        if any(path == r or path.startswith(r + ".") for r in seen_roots):
            continue  # sharded by an earlier fully_shard of this sub-cell
        for attr, param in list(sub._params.items()):
            if param is None:
                continue
            where = f"{param.name!r} ({type(sub).__name__} {path or '<root>'}.{attr})"
            if getattr(param, "fsdp", None) is not None:
                problems.append(f"parameter {where} is already fully sharded; call "
                                "fully_shard once per cell (sub-cells first, then the parent)")
            elif getattr(param, "msdist_optimizer_built", False):
                problems.append(f"a DistributedOptimizer was already built over parameter {where}; "
                                "call fully_shard before building the optimizer")
            elif not param.requires_grad:
                problems.append(f"parameter {where} has requires_grad=False (a buffer such as "
                                "BatchNorm statistics, updated in place): fully_shard supports "
                                "trainable parameters only; leave this cell out (shard its "
                                "siblings) or make the parameter trainable")
            elif getattr(sub, "has_bprop", False) or "bprop" in type(sub).__dict__:
                problems.append(f"parameter {where}: {type(sub).__name__} defines its own bprop, "
                                "whose gradients would bypass the reduce-scatter; leave this cell "
                                "out of fully_shard")
            elif int(np.prod(tuple(param.shape), dtype=np.int64)) == 0:
                problems.append(f"parameter {where} is empty (shape {tuple(param.shape)}); "
                                "nothing to shard")
            elif attr in type(sub).__dict__ and not hasattr(type(sub), "_fsdp_attrs"):
                problems.append(f"parameter {where}: {type(sub).__name__} defines a class "
                                f"attribute {attr!r} that shadows the parameter; unsupported")
            else:
                todo.append((sub, attr, param))
    return todo, problems


def fully_shard(cell, group=None, *, reshard_after_forward: bool = False):
    """Shard every parameter of ``cell`` along dim 0 over ``group`` (ZeRO-3 / FSDP).

    Call it on the blocks first and then on the whole model, or once on the whole model;
    each call shards the parameters not yet sharded (a sub-cell already passed to
    ``fully_shard`` is skipped). Build the optimizer afterwards: it then steps the shards.

    Args:
        cell: The ``nn.Cell`` (a model, a pipeline stage, a layer). Sharded in place.
        group: The group to shard over; default the manager's dp-cp group. A
            ParallelGroup of this rank or a backend group name.
        reshard_after_forward: Recompute every cell that owns sharded parameters, so that
            the backward gathers its weights again instead of keeping the forward's
            gathered weights alive until the backward (see the module docstring).

    Returns:
        ``cell``.

    Raises:
        FullyShardError: a parameter already sharded, a DistributedOptimizer already built
            over one (``param.msdist_optimizer_built``), a group this rank is not in, or an
            unsupported cell (non-trainable parameters, its own ``bprop``). Raised before
            any change and without any communication.

    Example, 4 ranks as dp4, ``model = nn.Dense(64, 10)``: after ``fully_shard(model)``
    each rank holds ``model.weight`` as a ``[3, 64]`` shard (rank 3: row 9 + two zero
    rows), ``model.weight.fsdp.full_shape == (10, 64)``; ``model(x)`` computes with the
    full ``[10, 64]`` weight, and ``ms.grad`` gives each rank its ``[3, 64]`` rows of the
    mean over the 4 ranks of the full weight gradient.
    """
    ms, nn, ops, mstype, C = _runtime()
    if not isinstance(cell, nn.Cell):
        raise FullyShardError(
            f"fully_shard: cell={cell!r} is a {type(cell).__name__}; expected a "
            "mindspore.nn.Cell (a model, a pipeline stage or a layer)"
        )
    if getattr(cell, "_fsdp_root", False):
        raise FullyShardError(
            f"fully_shard: this {type(cell).__name__} was already passed to fully_shard; "
            "call it once per cell"
        )
    if not isinstance(reshard_after_forward, bool):
        raise FullyShardError(
            f"fully_shard: reshard_after_forward={reshard_after_forward!r} must be True or False"
        )
    g = _resolve_group(group)
    todo, problems = _plan(cell, nn)
    if problems:
        raise FullyShardError("fully_shard: nothing was sharded: " + "; ".join(problems))

    # Replace every Parameter once (a tied parameter may be owned by several cells).
    new_of = {}
    for _, _, param in todo:
        if id(param) not in new_of:
            new_of[id(param)] = _shard_param(param, g, reshard_after_forward, ms, mstype, C)
    owners = {}
    for sub, attr, param in todo:
        owners.setdefault(id(sub), (sub, []))[1].append((attr, new_of[id(param)]))
    for sub, attrs in owners.values():
        _install(sub, attrs, g)
        if reshard_after_forward and g.size > 1:
            _recompute(sub)
    if not hasattr(type(cell), "_fsdp_attrs"):
        cell.__class__ = _sharded_class(type(cell), ())
    object.__setattr__(cell, "_fsdp_root", True)
    return cell


def _shard_param(param, g, reshard, ms, mstype, C):
    """A new Parameter (same name, flags and marks) holding this rank's padded shard."""
    full = param.asnumpy()
    full_shape = tuple(int(d) for d in param.shape)
    info = _info(full_shape, g, reshard)
    start, stop = shard_range(info.rows, g.size, g.rank)
    rows = full.reshape((info.rows,) + info.shard_shape[1:])[start:stop]
    shard = np.zeros(info.shard_shape, dtype=rows.dtype)
    shard[: stop - start] = rows
    new = ms.Parameter(ms.Tensor(shard, dtype=param.dtype), name=param.name,
                       requires_grad=param.requires_grad)
    fresh = set(vars(new))
    for key, value in vars(param).items():
        if key not in fresh:  # sharding marks, sequence_parallel, shared_embedding, ...
            setattr(new, key, value)
    new.fsdp = info
    if g.size > 1:
        gather = _gather_class()
        object.__setattr__(new, "_fsdp_gathers", (
            gather(C.kernels(g, False), info, param.dtype),
            gather(C.kernels(g, True), info, param.dtype),
        ))
    return new


def _info(full_shape, g, reshard):
    rows = full_shape[0] if full_shape else 1
    c = shard_rows(rows, g.size)
    return FsdpParamInfo(group=g, full_shape=full_shape, rows=rows, shard_rows=c,
                         pad=g.size * c - rows, reshard_after_forward=reshard)


def _install(sub, attrs, g):
    """Put the shards in ``sub``'s parameter table; on d > 1 read them through properties."""
    for attr, new in attrs:
        sub._params[attr] = new
    if g.size == 1:
        return  # the shard is the whole parameter: nothing to gather
    names = tuple(sorted(set(getattr(type(sub), "_fsdp_attrs", ())) | {a for a, _ in attrs}))
    base = type(sub).__mro__[1] if hasattr(type(sub), "_fsdp_attrs") else type(sub)
    sub.__class__ = _sharded_class(base, names)
    for attr, new in attrs:
        eager, graph = new._fsdp_gathers
        object.__setattr__(sub, _SHARD_PREFIX + attr, new)
        object.__setattr__(sub, _EAGER_PREFIX + attr, eager)
        object.__setattr__(sub, _GRAPH_PREFIX + attr, graph)


def _recompute(sub):
    """PyNative recompute of ``sub`` (what ``Cell.recompute()`` sets up for PyNative).

    Not ``Cell.recompute()`` itself: its graph flag also recomputes the cell under ms.jit
    and GRAPH_MODE, where the re-run all-gathers and the reduce-scatters of a group were
    scheduled in a different order on different ranks (measured: wrong gradients at dp4,
    every parameter). Compiled code refuses reshard_after_forward instead (see the getter).
    """
    from mindspore.common._register_for_recompute import recompute_registry

    rc = recompute_registry.get()(sub.construct, True, False, True, None)
    # The recompute re-runs construct from the backward, outside any __call__: make that
    # run read the gathered weights too.
    rc.wrap_cell.function = _Active(rc.wrap_cell.function)
    sub._recompute_cell = rc


# --------------------------------------------------------------------------- arithmetic
def _check_int(name, value, low):
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < low:
        raise FullyShardError(f"{name}={value!r} must be an integer >= {low}")


def shard_rows(rows: int, size: int) -> int:
    """Rows per rank, ``ceil(rows / size)`` (contract C1): ``shard_rows(10, 4) == 3``."""
    _check_int("rows", rows, 0)
    _check_int("size", size, 1)
    return -(-int(rows) // int(size))


def shard_range(rows: int, size: int, rank: int) -> tuple:
    """Unpadded rows ``[start, stop)`` of group rank ``rank``.

    ``shard_range(10, 4, r)`` for r = 0..3: ``(0, 3), (3, 6), (6, 9), (9, 10)``; a rank
    past the end holds none: ``shard_range(2, 4, 3) == (2, 2)``.
    """
    c = shard_rows(rows, size)
    _check_int("rank", rank, 0)
    if rank >= size:
        raise FullyShardError(f"rank={rank} must be < size={size}")
    start = min(rank * c, rows)
    return start, min(start + c, rows)


def shard_shape(full_shape, size: int) -> tuple:
    """The shard of a local shape: ``(ceil(r / size), *rest)``; a 0-d parameter is ``(1,)``.

    ``shard_shape((10, 64), 4) == (3, 64)``, ``shard_shape((), 4) == (1,)``.
    """
    full_shape = tuple(int(d) for d in full_shape)
    if not full_shape:
        return (shard_rows(1, size),)
    return (shard_rows(full_shape[0], size),) + full_shape[1:]


def full_param_numpy(shards, full_shape) -> np.ndarray:
    """The local parameter re-assembled from every group rank's padded shard (numpy).

    ``shards`` are the ``(c, *rest)`` arrays in group-rank order; the padding is dropped.
    """
    full_shape = tuple(int(d) for d in full_shape)
    rows = full_shape[0] if full_shape else 1
    stacked = np.concatenate([np.asarray(s) for s in shards], 0)[:rows]
    return stacked.reshape(full_shape)


def param_bytes(shape, itemsize: int) -> int:
    """Bytes of a parameter of ``shape``: ``math.prod(shape) * itemsize``."""
    return int(math.prod(int(d) for d in shape)) * int(itemsize)
