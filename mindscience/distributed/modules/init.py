"""Seed-exact initialization of tensor-parallel weights.

Every rank draws the *full* master tensor from MindSpore's global RNG (the one
``mindspore.set_seed`` seeds) and keeps only its own slice. Because all ranks draw the
same master under the same seed, the slices put back together are bit-for-bit the
tensor a dense layer would have drawn, for any tensor-parallel size. The price is
memory: the master is materialized once per rank during initialization (see
:func:`initialize_affine_weight`).
"""

from __future__ import annotations

import math
import numbers
from typing import Optional, Sequence, Union

import numpy as np

import mindspore as ms
from mindspore import Parameter, Tensor
from mindspore.common.initializer import HeUniform, Initializer, Uniform, initializer

InitMethod = Union[Initializer, str, numbers.Number, Tensor]


def default_weight_init() -> Initializer:
    """``mint.nn.Linear``'s weight init: ``HeUniform(negative_slope=sqrt(5))`` over [out, in]."""
    return HeUniform(math.sqrt(5))


def default_bias_init(in_features: int) -> Initializer:
    """``mint.nn.Linear``'s bias init: ``Uniform(1 / sqrt(in_features))`` over [out]."""
    return Uniform(scale=1 / math.sqrt(in_features))


def _resolve_tp_rank(tp_world_size: int, tp_rank: Optional[int]) -> int:
    if tp_rank is not None:
        if not 0 <= tp_rank < tp_world_size:
            raise ValueError(
                f"initialize_affine_weight: tp_rank={tp_rank} is outside [0, {tp_world_size}) "
                f"for tp_world_size={tp_world_size}. Pass this rank's index in its "
                "tensor-parallel group."
            )
        return tp_rank
    from .. import manager

    if not manager.is_initialized():
        raise RuntimeError(
            f"initialize_affine_weight: tp_world_size={tp_world_size} needs this rank's "
            "tensor-parallel rank, but parallel groups are not initialized. Call "
            "manager.initialize_parallel(tensor_parallel_size=...) first, or pass tp_rank=."
        )
    group = manager.get_tensor_parallel_group()
    if group.size != tp_world_size:
        raise ValueError(
            f"initialize_affine_weight: tp_world_size={tp_world_size} but the initialized "
            f"tensor-parallel group has {group.size} rank(s) {list(group.ranks)}. Pass "
            f"tp_world_size={group.size}, or pass tp_rank= explicitly for another group."
        )
    return group.rank


def initialize_affine_weight(
    init_shape: Sequence[int],
    tp_world_size: int,
    partition_dim: int,
    init_method: InitMethod = "XavierUniform",
    init_dtype=ms.float32,
    *,
    tp_rank: Optional[int] = None,
    name: Optional[str] = None,
) -> Parameter:
    """Draw a weight for the whole layer and keep this rank's slice of it.

    The master tensor of shape ``init_shape`` is drawn exactly as
    ``Parameter(initializer(init_method, init_shape, init_dtype))`` would draw it (same
    global-RNG consumption), so under the same ``mindspore.set_seed`` the slices of all
    ranks re-assemble to the dense layer's tensor, whatever ``tp_world_size`` is.

    Example, ``init_shape=(8, 4)``, ``tp_world_size=2``, ``partition_dim=0``: rank 0 gets
    rows 0-3 of the master, rank 1 rows 4-7; with ``partition_dim=1`` rank 0 gets
    columns 0-1 and rank 1 columns 2-3.

    Memory: every rank materializes the full master once (``prod(init_shape)``
    elements of ``init_dtype``, e.g. 64 MiB for a float32 4096 x 4096 weight), copies
    its slice out, and frees the master before returning. Peak host memory during the
    call is ``master + slice``, i.e. ``(1 + 1/tp) x`` the full tensor (measured for a
    float32 4096 x 4096 weight: 64 MiB at tp=1, 96 MiB at tp=2, 80 MiB at tp=4); only
    the slice stays alive. At tp=1 the parameter is drawn straight into its own buffer
    (no copy). MindSpore's initializers fill a whole array from one seed drawn from the
    global RNG, so the master cannot be drawn piecewise without changing the values.
    (Drawing only the shard from a per-rank seed would save that memory but lose the
    equality with the dense layer; it is not offered. Pre-sharded checkpoints avoid it.)

    Args:
        init_shape: Shape of the full (unsharded) tensor.
        tp_world_size: Number of slices (the tensor-parallel size). 1 returns the full tensor.
        partition_dim: Dimension of ``init_shape`` to slice (negative counts from the end).
        init_method: An ``Initializer``, its alias (``"XavierUniform"``, ``"zeros"``...),
            a number (constant), or a full-shape ``Tensor`` to slice as is.
        init_dtype: Dtype of the parameter (the master is drawn in this dtype, as a
            dense layer would draw it).
        tp_rank: Which slice to keep. Default: this process's rank in the manager's
            tensor-parallel group (the group must then have ``tp_world_size`` ranks).
        name: Parameter name. Default: MindSpore's default name.

    Returns:
        A ``Parameter`` of shape ``init_shape`` with ``init_shape[partition_dim]`` divided
        by ``tp_world_size``.

    Raises:
        ValueError: bad shape, partition_dim out of range, the partitioned size not
            divisible by ``tp_world_size``, or a tp group of another size.
        RuntimeError: ``tp_world_size > 1`` without ``tp_rank`` and without
            ``initialize_parallel``.
    """
    shape = tuple(int(s) for s in init_shape)
    if not shape or any(s <= 0 for s in shape):
        raise ValueError(
            f"initialize_affine_weight: init_shape={tuple(init_shape)} must be a non-empty "
            "shape of positive sizes."
        )
    if not isinstance(tp_world_size, numbers.Integral) or tp_world_size < 1:
        raise ValueError(
            f"initialize_affine_weight: tp_world_size={tp_world_size!r} must be an integer >= 1."
        )
    ndim = len(shape)
    if not -ndim <= partition_dim < ndim:
        raise ValueError(
            f"initialize_affine_weight: partition_dim={partition_dim} is out of range for a "
            f"{ndim}-d shape {shape}; expected a value in [{-ndim}, {ndim - 1}]."
        )
    dim = partition_dim % ndim
    if shape[dim] % tp_world_size:
        raise ValueError(
            f"initialize_affine_weight: dim {dim} of {shape} has size {shape[dim]}, which is "
            f"not divisible by tp_world_size={tp_world_size}. Choose sizes that are "
            f"multiples of {tp_world_size}, or another tensor-parallel size."
        )
    rank = 0 if tp_world_size == 1 else _resolve_tp_rank(tp_world_size, tp_rank)

    # Draw the full master exactly as Parameter(initializer(...)) does: one call into the
    # global RNG, in init_dtype.
    master = initializer(init_method, shape, init_dtype)
    if not master.has_init and master.dtype != init_dtype:  # a user-given full tensor
        master = master.astype(init_dtype)
    if tp_world_size == 1:
        # Parameter draws the values itself, straight into its own buffer (no copy).
        return Parameter(master, name=name)

    if master.has_init:
        master = master.init_data()
    full = master.asnumpy()  # shares the master's buffer (no copy)
    del master
    per_rank = shape[dim] // tp_world_size
    index = [slice(None)] * ndim
    index[dim] = slice(rank * per_rank, (rank + 1) * per_rank)
    # Copy the slice out, then drop the master: only the slice stays alive.
    shard = np.array(full[tuple(index)], copy=True, order="C")
    del full
    return Parameter(Tensor.from_numpy(shard), name=name)
