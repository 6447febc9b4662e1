"""Shard arithmetic of fully_shard (contract C1) and its metadata and error types.

Pure Python and numpy: no MindSpore import, so plans and tests can use it anywhere.
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass

import numpy as np

__all__ = ["FullyShardError", "FsdpParamInfo", "shard_rows", "shard_range", "shard_shape",
           "full_param_numpy"]


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
        reshard_after_forward: Its unit frees the gathered parameter after the forward and
            gathers it again for the backward (PyNative; see rules.fsdp_runtime).
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
