"""``fully_shard``: check everything, then shard the parameters and install the gathers."""

from __future__ import annotations

import numpy as np

from .gather import gather_class, install, runtime, sharded_class
from .layout import FsdpParamInfo, FullyShardError, shard_range, shard_rows
from .rules import unit_reshards
from .unit import FsdpUnit

__all__ = ["fully_shard", "is_fully_sharded", "gather_in_calls"]


def is_fully_sharded(obj) -> bool:
    """True for a Parameter sharded by :func:`fully_shard` or a cell it was applied to."""
    return getattr(obj, "fsdp", None) is not None or bool(getattr(obj, "_fsdp_root", False))


def gather_in_calls(cell):
    """Make a call of ``cell`` count as a call of a fully sharded cell (eagerly).

    Eager reads of a sharded parameter gather it only while a fully sharded cell is being
    called; a model that runs its parameters through cells that are not its children
    (GPTModel's pipeline chunks, whose head reads the output layer's or the tied
    embedding's weight without calling its owner) marks those cells, so that every read
    inside them gets the full tensor, gathered once per parameter and outermost call.
    Compiled code always gathers and is unchanged. Idempotent; returns ``cell``.
    """
    if not hasattr(type(cell), "_fsdp_attrs"):
        cell.__class__ = sharded_class(type(cell), ())
    return cell


def _resolve_group(group):
    _, _, _, _, C = runtime()
    from ..group import ParallelGroup

    if group is None:
        from .. import manager

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
    from .. import manager

    if not manager._communication_initialized():
        return None
    return manager._world()[0]


def _plan(cell):
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
            elif getattr(param, "expert_parallel", False):
                # MoE experts: already split by ep; DistributedOptimizer shards their state
                # over the expert data-parallel group instead.
                continue
            elif not param.requires_grad and getattr(param, "unsharded_buffer", False):
                continue  # a buffer its model keeps consistent itself (MoE statistics, expert bias)
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


def fully_shard(cell, group=None, *, reshard_after_forward: bool = True, prefetch: bool = True):
    """Shard every parameter of ``cell`` along dim 0 over ``group`` (ZeRO-3 / FSDP2).

    Each call makes one unit of the parameters it shards: call it on the blocks first
    (each transformer layer) and then on the whole model (the root unit: what is left,
    such as the embeddings and the head), or once on the whole model (one unit). A
    sub-cell already passed to ``fully_shard`` is skipped. Build the optimizer afterwards:
    it then steps the shards.

    In PyNative a unit is gathered with one bucketed all-gather (per dtype of its
    parameters) at its first parameter read and reduce-scattered once as its backward
    ends. Compiled code (ms.jit, GRAPH_MODE) gathers each parameter in the graph and runs
    as ``reshard_after_forward=False, prefetch=False`` (:func:`.rules.fsdp_runtime` says so).

    Args:
        cell: The ``nn.Cell`` (a model, a pipeline stage, a layer). Sharded in place.
        group: The group to shard over; default the manager's dp-cp group. A
            ParallelGroup of this rank or a backend group name.
        reshard_after_forward: Free the unit's gathered weights when its forward ends
            and gather them again for its backward (2 gathers per micro-batch; PyNative).
            Ignored by a unit that contains other units (the root), whose backward
            follows its forward at once. False keeps them from the forward to the backward.
        prefetch: When this unit gathers, launch the next unit's gather asynchronously
            (the order of the last forward; in the backward the unit before it), so that
            it overlaps this unit's compute (PyNative).

    Returns:
        ``cell``.

    Raises:
        FullyShardError: a parameter already sharded, a DistributedOptimizer already built
            over one (``param.msdist_optimizer_built``), a group this rank is not in, an
            unsupported cell (non-trainable parameters, its own ``bprop``) or a flag that is
            not a bool. Raised before any change and without any communication.

    Example, 4 ranks as dp4, ``model = nn.Dense(64, 10)``: after ``fully_shard(model)``
    each rank holds ``model.weight`` as a ``[3, 64]`` shard (rank 3: row 9 + two zero
    rows), ``model.weight.fsdp.full_shape == (10, 64)``; ``model(x)`` computes with the
    full ``[10, 64]`` weight, and ``ms.grad`` gives each rank its ``[3, 64]`` rows of the
    mean over the 4 ranks of the full weight gradient.
    """
    ms, nn, ops, mstype, C = runtime()
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
    for name, value in (("reshard_after_forward", reshard_after_forward), ("prefetch", prefetch)):
        if not isinstance(value, bool):
            raise FullyShardError(f"fully_shard: {name}={value!r} must be True or False")
    g = _resolve_group(group)
    todo, problems = _plan(cell)
    if problems:
        raise FullyShardError("fully_shard: nothing was sharded: " + "; ".join(problems))

    has_sub_units = any(sub is not cell and getattr(sub, "_fsdp_root", False)
                        for _, sub in cell.cells_and_names())
    reshard = unit_reshards(reshard_after_forward, has_sub_units)
    # Replace every Parameter once (a tied parameter may be owned by several cells).
    new_of, order = {}, []
    for _, _, param in todo:
        if id(param) not in new_of:
            new_of[id(param)] = _shard_param(param, g, reshard, ms, mstype, C)
            order.append(new_of[id(param)])
    owners = {}
    for sub, attr, param in todo:
        owners.setdefault(id(sub), (sub, []))[1].append((attr, new_of[id(param)]))
    for sub, attrs in owners.values():
        install(sub, attrs, g)
    gather_in_calls(cell)
    if g.size > 1 and order:
        unit = FsdpUnit(cell, order, g, reshard, prefetch)
        for p in order:
            object.__setattr__(p, "_fsdp_unit", unit)
        object.__setattr__(cell, "_fsdp_unit", unit)
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
        gather = gather_class()
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
