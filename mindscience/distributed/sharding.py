"""Sharding metadata: how a parameter is split over the parallel layout.

Every parallel layer marks its parameters, and checkpoints
(:mod:`mindscience.distributed.checkpoint`) read the marks to know which slice of the
global tensor a rank holds. The attributes follow Megatron's names:

=====================  ==============================================================
attribute              meaning
=====================  ==============================================================
``parallel_axis``      the layout axis the parameter is split over (``"tp"``), or
                       None: replicated (every rank of the axis holds all of it)
``tensor_model_parallel``  ``parallel_axis == "tp"`` (Megatron's flag)
``partition_dim``      the dim that is split (None when replicated)
``partition_stride``   interleaving: the split dim is cut into ``size * stride``
                       equal blocks and rank ``r`` holds blocks ``r, r + size, ...,
                       r + (stride-1)*size`` concatenated (1 = one contiguous slice)
``sequence_parallel``  the gradient is a per-sequence-chunk share that must be
                       all-reduced over tp (a sequence-parallel bias or norm weight)
=====================  ==============================================================

Example, tp = 2, a fused ``[q; k; v]`` weight of shape ``[3*H, H]`` split over dim 0
with ``partition_stride=3``: the 6 blocks of ``H/2`` rows are ``q0 q1 k0 k1 v0 v1``;
tp rank 0 holds ``[q0; k0; v0]`` and rank 1 ``[q1; k1; v1]``, so each rank's local
weight is its own fused qkv. A plain column split (stride 1) would give rank 0
``[q; k0]`` instead.

A parameter that was never marked is replicated. This module imports no MindSpore: any
object that takes attributes can be marked, so pure code and tests use it too.
"""

from __future__ import annotations

import numbers

__all__ = ["mark_sharding", "get_sharding", "is_sharded", "is_expert", "local_slices", "SHARD_AXES"]

# The layout axes a parameter can be split over (pp places whole parameters on stages
# and is not a split; dp/cp keep replicas unless a layer says otherwise).
SHARD_AXES = ("tp", "cp", "dp", "etp", "ep")


def _check_int(name, value, minimum, fix):
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < minimum:
        raise ValueError(f"mark_sharding: {name}={value!r} is invalid: expected an integer "
                         f">= {minimum}. {fix}")


def mark_sharding(param, axis="tp", partition_dim=None, partition_stride=1, *,
                  sequence_parallel=None):
    """Record how ``param`` is split (sets the attributes in the module docstring).

    Args:
        param: A ``mindspore.Parameter`` (or any object that takes attributes).
        axis: The layout axis it is split over (``"tp"``, ``"cp"``, ``"dp"``), or None:
            replicated.
        partition_dim: The split dim (required unless ``axis`` is None); negative counts
            from the end when the parameter has a ``shape``.
        partition_stride: Interleaved blocks per rank (see the module docstring).
        sequence_parallel: Set the ``sequence_parallel`` flag (None leaves it as is).

    Returns:
        ``param``, so a layer can write ``self.w = mark_sharding(Parameter(...), ...)``.

    Raises:
        ValueError: an unknown axis, a missing or out-of-range dim, a stride below 1.

    Example, a user layer whose weight ``[vocab/tp, hidden]`` is split by rows over tp::

        mark_sharding(self.weight, axis="tp", partition_dim=0)
        get_sharding(self.weight)
        # {'axis': 'tp', 'partition_dim': 0, 'partition_stride': 1, 'sequence_parallel': False}
    """
    if axis is not None and axis not in SHARD_AXES:
        raise ValueError(f"mark_sharding: axis={axis!r} is invalid: expected one of "
                         f"{', '.join(SHARD_AXES)} or None (replicated).")
    if axis is None:
        if partition_dim is not None:
            raise ValueError(f"mark_sharding: partition_dim={partition_dim!r} with axis=None: "
                             "a replicated parameter has no split dim. Pass axis='tp' (or "
                             "another axis) or partition_dim=None.")
        partition_stride = 1
    else:
        if partition_dim is None:
            raise ValueError(f"mark_sharding: axis={axis!r} needs partition_dim, the dim that "
                             "is split (0 for rows, 1 for columns of a [out, in] weight).")
        _check_int("partition_dim", partition_dim, -64, "Pass the split dim.")
        shape = getattr(param, "shape", None)
        if shape is not None:
            ndim = len(tuple(shape))
            if not -ndim <= partition_dim < ndim:
                raise ValueError(f"mark_sharding: partition_dim={partition_dim} is out of range "
                                 f"for a parameter of shape {tuple(shape)}.")
            partition_dim %= ndim
    _check_int("partition_stride", partition_stride, 1, "Use 1 for one contiguous slice.")
    param.parallel_axis = axis
    param.tensor_model_parallel = axis == "tp"
    param.partition_dim = None if axis is None else int(partition_dim)
    param.partition_stride = int(partition_stride)
    if sequence_parallel is not None:
        param.sequence_parallel = bool(sequence_parallel)
    elif not hasattr(param, "sequence_parallel"):
        param.sequence_parallel = False
    return param


def get_sharding(param) -> dict:
    """The sharding of ``param``: ``{"axis", "partition_dim", "partition_stride",
    "sequence_parallel"}``; an unmarked parameter is replicated (axis None)."""
    axis = getattr(param, "parallel_axis", None)
    if axis is None and getattr(param, "tensor_model_parallel", False):
        axis = "tp"  # marked the Megatron way, by the flag alone
    return {
        "axis": axis,
        "partition_dim": getattr(param, "partition_dim", None) if axis is not None else None,
        "partition_stride": int(getattr(param, "partition_stride", 1) or 1) if axis else 1,
        "sequence_parallel": bool(getattr(param, "sequence_parallel", False)),
    }


def is_sharded(param) -> bool:
    """Whether ``param`` is split over some axis (False: replicated)."""
    return get_sharding(param)["axis"] is not None


def is_expert(param) -> bool:
    """Whether ``param`` is an MoE expert weight (``param.expert_parallel``): dim 0 holds
    this ep rank's experts, its gradient is reduced over the expert data-parallel group."""
    return bool(getattr(param, "expert_parallel", False))


def local_slices(global_size: int, size: int, rank: int, stride: int = 1):
    """The ``(start, stop)`` ranges of the split dim that ``rank`` of ``size`` holds, in
    the order they are concatenated locally.

    Example: ``local_slices(12, 2, 1, stride=3)`` -> ``[(2, 4), (6, 8), (10, 12)]``.

    Raises:
        ValueError: ``global_size`` not divisible by ``size * stride``.
    """
    blocks = size * stride
    if global_size % blocks:
        raise ValueError(f"a dim of size {global_size} cannot be split into {size} ranks x "
                         f"{stride} interleaved blocks: {global_size} is not divisible by "
                         f"{blocks}.")
    block = global_size // blocks
    return [((rank + k * size) * block, (rank + k * size + 1) * block) for k in range(stride)]
