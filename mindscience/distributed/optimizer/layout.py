"""Shard and bucket arithmetic of the distributed optimizer (pure Python, no MindSpore).

Contract C1: a parameter of local shape ``(r, *rest)`` (after its tp split) is sharded
over a group of size ``d`` along dim 0 in ``c = ceil(r / d)`` rows per rank; rank ``k``
holds rows ``[k*c, min((k+1)*c, r))`` zero-padded to ``c`` rows. A 0-d parameter counts
as shape ``(1,)``. Its optimizer state at stages 1-3 has exactly the shard shape.

A bucket packs several parameters into one flat fp32 buffer so that one reduce-scatter
(or all-gather) serves them all. The order of the buffer makes the reduce-scatter land
exactly on each parameter's shard: each padded gradient ``(d*c, *rest)`` is seen as
``(d, c*prod(rest))`` and the pieces are concatenated along dim 1, so that row ``k`` of
the ``(d, S)`` result, which is what rank ``k`` receives, is rank ``k``'s shard of every
parameter of the bucket one after the other.

Example, d = 2, a bucket of a (3, 2) weight and a (4,) bias: c = 2 and 2 rows, shard
sizes 4 and 2, S = 6, the flat buffer has 12 entries::

    rank 0 receives [w[0,0] w[0,1] w[1,0] w[1,1] | b[0] b[1]]
    rank 1 receives [w[2,0] w[2,1]   0      0    | b[2] b[3]]
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import Sequence

from .overlap_rules import main_weight_bytes

__all__ = [
    "ParamShard", "BucketLayout", "shard_rows", "shard_range", "param_shard", "plan_buckets",
    "bytes_per_element", "state_names", "OPTIMIZERS", "STAGES",
]

OPTIMIZERS = ("adamw", "adam", "sgd")
STAGES = (0, 1, 2, 3)

# Parameter dtypes by name: bytes per element (the model's weights).
ITEMSIZE = {"float16": 2, "bfloat16": 2, "float32": 4, "float64": 8}


def shard_rows(rows: int, d: int) -> int:
    """Rows per rank of a dim of ``rows`` over ``d`` ranks: ``ceil(rows / d)``.

    >>> shard_rows(5, 4)
    2
    """
    return -(-rows // d)


def shard_range(rows: int, d: int, k: int) -> tuple:
    """``(start, stop)`` of the real rows rank ``k`` holds (``stop - start`` may be 0).

    Example, 5 rows over 4 ranks (c = 2): rank 0 (0, 2), 1 (2, 4), 2 (4, 5), 3 (5, 5).
    """
    c = shard_rows(rows, d)
    start = min(k * c, rows)
    return start, min((k + 1) * c, rows)


@dataclass(frozen=True)
class ParamShard:
    """One parameter's shard over a group of size ``d``.

    Attributes:
        shape: The local shape (after the tp split); ``(1,)`` for a 0-d parameter.
        d: The group size.
        rows: Unpadded dim-0 length ``r``.
        shard_rows: ``c = ceil(r / d)``.
        rest: Elements per row (``prod(shape[1:])``).
    """

    shape: tuple
    d: int
    rows: int
    shard_rows: int
    rest: int

    @property
    def numel(self) -> int:
        """Elements of the unsharded parameter."""
        return self.rows * self.rest

    @property
    def shard_numel(self) -> int:
        """Elements of one rank's shard (padding included)."""
        return self.shard_rows * self.rest

    @property
    def padded_numel(self) -> int:
        """Elements of the padded full tensor, ``d * c * rest``."""
        return self.d * self.shard_numel

    @property
    def pad(self) -> int:
        """Padding rows over the whole group, ``d*c - r``."""
        return self.d * self.shard_rows - self.rows

    @property
    def shard_shape(self) -> tuple:
        return (self.shard_rows,) + tuple(self.shape[1:])

    @property
    def padded_shape(self) -> tuple:
        return (self.d * self.shard_rows,) + tuple(self.shape[1:])


def param_shard(shape: Sequence[int], d: int) -> ParamShard:
    """The C1 shard of a parameter of local ``shape`` over ``d`` ranks.

    >>> param_shard((5, 3), 4).shard_shape
    (2, 3)
    """
    shape = tuple(int(s) for s in shape) or (1,)
    rest = math.prod(shape[1:]) if len(shape) > 1 else 1
    return ParamShard(shape=shape, d=d, rows=shape[0], shard_rows=shard_rows(shape[0], d),
                      rest=rest)


@dataclass(frozen=True)
class BucketLayout:
    """One bucket: which parameters, where each sits in this rank's shard of the buffer.

    Attributes:
        members: Parameter indices, in order.
        sections: Elements of each member in a rank's chunk of the buffer (its shard
            size at stages 1-3, its whole size at stage 0).
        chunk: Elements of one rank's chunk, ``sum(sections)`` (stage 0: the buffer).
        d: The group size the buffer is cut into (1 at stage 0).
    """

    members: tuple
    sections: tuple
    chunk: int
    d: int

    @property
    def size(self) -> int:
        """Elements of the whole flat buffer, ``d * chunk``."""
        return self.d * self.chunk


def plan_buckets(shards: Sequence[ParamShard], dtypes: Sequence[str], bucket_bytes: int,
                 sharded: bool) -> tuple:
    """Cut the parameters into buckets of one model dtype and at most ``bucket_bytes``.

    The buffers are fp32 (4 bytes an element) whatever the model dtype; a bucket holds
    parameters of one dtype so that the all-gather of the updated weights moves the
    model's dtype. Parameters keep their order; one larger than the bucket gets its own.
    ``bucket_bytes = 0`` gives one bucket per parameter.

    Args:
        shards: Every parameter's :class:`ParamShard`.
        dtypes: Every parameter's dtype name (e.g. ``"bfloat16"``).
        bucket_bytes: Largest buffer in bytes (of the whole, padded buffer).
        sharded: True for stages 1-3 (sections are shard sizes and the buffer is
            ``d`` chunks); False for stage 0 (sections are whole sizes, one chunk).

    Example: two fp32 parameters (3, 2) and (4,) over d = 2, ``bucket_bytes`` 1 MiB ->
    one bucket, members (0, 1), sections (4, 2), chunk 6, size 12.
    """
    out = []
    open_: dict = {}
    for i, (sh, dt) in enumerate(zip(shards, dtypes)):
        size = 4 * (sh.padded_numel if sharded else sh.numel)
        cur = open_.get(dt)
        if cur is not None and cur[1] + size > bucket_bytes:
            out.append(cur[0])
            cur = None
        if cur is None:
            cur = ([], 0)
        cur[0].append(i)
        open_[dt] = (cur[0], cur[1] + size)
    # Buckets in the order of their first parameter (backprop order is the caller's).
    groups = sorted(out + [members for members, _ in open_.values() if members],
                    key=lambda m: m[0])
    buckets = []
    for members in groups:
        sections = tuple(shards[i].shard_numel if sharded else shards[i].numel for i in members)
        d = shards[members[0]].d if sharded else 1
        buckets.append(BucketLayout(members=tuple(members), sections=sections,
                                    chunk=sum(sections), d=d))
    return tuple(buckets)


def state_names(optimizer: str, momentum: float = 0.0) -> tuple:
    """Suffixes of the per-parameter moment Parameters of ``optimizer``.

    >>> state_names("adamw")
    ('exp_avg', 'exp_avg_sq')
    """
    if optimizer in ("adam", "adamw"):
        return ("exp_avg", "exp_avg_sq")
    return ("momentum",) if momentum else ()


def bytes_per_element(stage: int, d: int, w: int, optimizer: str = "adamw",
                      momentum: float = 0.9) -> dict:
    """Contract C2: bytes a rank holds per local parameter element, by kind.

    Args:
        stage: ZeRO stage 0-3.
        d: Optimizer group size.
        w: Bytes of the model dtype (2 for bf16/fp16, 4 for fp32).
        optimizer: ``"adamw"``, ``"adam"`` or ``"sgd"``.
        momentum: SGD momentum (0: no state).

    Returns:
        ``{"weights", "gradients", "optimizer", "total"}`` (floats, padding not counted).

    Example, bf16 AdamW: stage 0 -> 2 + 4 + 12 = 18; stage 2, d = 4 -> 2 + 1 + 3 = 6;
    fp32 AdamW (no main copy): stage 0 -> 4 + 4 + 8 = 16; stage 1, d = 8 -> 4 + 4 + 1 = 9.
    """
    moments = 4 * len(state_names(optimizer, momentum))
    main = main_weight_bytes(int(w), stage)  # a float32 parameter is its own main weight
    weights = w / d if stage == 3 else float(w)
    gradients = 4.0 if stage < 2 else 4.0 / d
    state = float(moments + main) if stage == 0 else (moments + main) / d
    return {"weights": weights, "gradients": gradients, "optimizer": state,
            "total": weights + gradients + state}


def is_number(value) -> bool:
    """A real number that is not a bool."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool)
