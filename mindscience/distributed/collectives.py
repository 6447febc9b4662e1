"""Forward-only collectives over a :class:`~mindscience.distributed.group.ParallelGroup`.

Internal building blocks of :mod:`mindscience.distributed.mappings` (which adds
autograd). Every function takes ``(x, group)`` and returns a new tensor; ``x`` is never
modified. A size-1 group is the identity and makes no backend call at all.

=================  ==========================================  ==========================
op                 ``composed`` backend (CPU default)           ``native`` backend
=================  ==========================================  ==========================
all_reduce (sum)   ``mint.distributed.all_reduce`` on a copy   ``ops.AllReduce(SUM)``
all_gather (dim)   ``mint.distributed.all_gather`` into a       ``ops.AllGather`` (dim 0,
                   list + ``cat`` along ``dim``                 other dims moved to 0)
reduce_scatter     COMPOSED: all-reduce + own slice of dim 0    ``ops.ReduceScatter(SUM)``
all_to_all         COMPOSED: all-gather along ``concat_dim``    ``ops.AlltoAll``
                   + own slice of ``split_dim``
=================  ==========================================  ==========================

Why (measured with MindSpore 2.10 on CPU/MCCL, see the project's CPU reference):
the CPU build has no reduce-scatter and no all-to-all kernel in any API family;
``ops.AllGather`` works on the world group only and ``ops.AllReduce`` /
``ops.AllGather`` reject bfloat16, while ``mint.distributed.all_reduce`` and
``mint.distributed.all_gather`` work on groups made by
``mindspore.communication.create_group`` (the manager's groups) for float32, float16
and bfloat16. The compositions move ``G`` times the data of the real collective, the
only price of running on CPU.

The backend is chosen in ONE place, :func:`get_backend`: ``MSDIST_COLLECTIVES=composed``
or ``=native`` forces one; otherwise ``native`` on Ascend/GPU and ``composed`` on CPU.
The native backend is kept simple and is UNTESTED on this project's hardware (CPU only).

Example (2 ranks, group ``tp`` = ranks (0, 1); rank r holds ``x = [[r, r]]``)::

    all_reduce(x, tp)                      # [[1., 1.]] on both ranks
    all_gather(x, tp, dim=0)               # [[0., 0.], [1., 1.]]
    all_gather(x, tp, dim=-1)              # [[0., 0., 1., 1.]]
    reduce_scatter(ones((2, 2)) * r, tp)   # rank 0: [[1., 1.]], rank 1: [[1., 1.]]
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Union

from .group import ParallelGroup

ENV_VAR = "MSDIST_COLLECTIVES"
BACKEND_CHOICES = ("composed", "native")
OPS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all")

GroupLike = Union[ParallelGroup, str]

# Number of backend collective calls made by this process (every op of every
# backend counts 1, compositions count their inner calls). Checks use it to prove
# that size-1 groups and argument errors never reach the backend.
_CALL_COUNT = 0


def call_count() -> int:
    """How many backend collectives this process has launched so far."""
    return _CALL_COUNT


def _count() -> None:
    global _CALL_COUNT
    _CALL_COUNT += 1


# ------------------------------------------------------------------- groups
_STRING_GROUPS: dict = {}


def resolve_group(group: GroupLike) -> ParallelGroup:
    """Return ``group`` as a :class:`ParallelGroup`.

    A plain backend group name (e.g. one made by ``mindspore.communication.create_group``)
    is looked up once: its size and this process's rank come from
    ``mindspore.communication.get_group_size/get_rank(name)``.

    Raises:
        TypeError: ``group`` is neither a ParallelGroup nor a string.
    """
    if isinstance(group, ParallelGroup):
        return group
    if isinstance(group, str):
        cached = _STRING_GROUPS.get(group)
        if cached is None:
            from mindspore.communication import (
                get_group_size,
                get_rank,
                get_world_rank_from_group_rank,
            )

            size = get_group_size(group)
            rank = get_rank(group)
            try:
                ranks = tuple(get_world_rank_from_group_rank(group, i) for i in range(size))
            except Exception:  # noqa: BLE001 - e.g. the world group: ranks are 0..size-1
                ranks = tuple(range(size))
            cached = ParallelGroup(
                key=group, ranks=ranks, rank=rank, backend_name=group if size > 1 else None
            )
            _STRING_GROUPS[group] = cached
        return cached
    raise TypeError(
        f"group must be a ParallelGroup (from mindscience.distributed.manager) or a "
        f"backend group name, got {type(group).__name__}"
    )


def _norm_dim(dim: int, ndim: int, op: str) -> int:
    if not -ndim <= dim < ndim:
        raise ValueError(f"{op}: dim {dim} is out of range for a tensor of rank {ndim}")
    return dim % ndim


def _check_divisible(op: str, what: str, size: int, group_size: int) -> None:
    if size % group_size:
        raise ValueError(
            f"{op}: {what} (size {size}) is not divisible by the group size {group_size}"
        )


def _narrow(x, dim: int, index: int, parts: int):
    """The ``index``-th of ``parts`` equal chunks of ``x`` along ``dim``."""
    from mindspore import ops

    n = x.shape[dim] // parts
    return ops.narrow(x, dim, index * n, n)


# ------------------------------------------------------------------- backends
@dataclass(frozen=True)
class _Backend:
    """How each collective is implemented; ``composed[op]`` says if it is a composition."""

    name: str
    composed: dict
    impl: dict

    def describe(self) -> dict:
        return {
            op: {"composed": self.composed[op], "impl": self.impl[op]} for op in OPS
        }


class _ComposedBackend(_Backend):
    """mint.distributed all-reduce / all-gather, and compositions of them (CPU)."""

    def all_reduce(self, x, g: ParallelGroup):
        from mindspore import mint
        from mindspore.mint import distributed as md

        # mint all_reduce works in place, so reduce a private buffer. Tensor.copy()
        # runs three kernels on CPU (cast, divide, cast back): 5-80x slower than one copy_.
        y = mint.empty(x.shape, dtype=x.dtype).copy_(x.contiguous())
        _count()
        md.all_reduce(y, "sum", g.group_name)
        return y

    def _gather_parts(self, x, g: ParallelGroup) -> list:
        """Every rank's ``x``, in group-rank order."""
        from mindspore import mint
        from mindspore.mint import distributed as md

        # Uninitialised buffers: the gather overwrites them, and zero-filling G copies
        # of x cost ~20 % of a 16 MiB gather on CPU (bench/bench_mappings.py, section c).
        parts = [mint.empty(x.shape, dtype=x.dtype) for _ in range(g.size)]
        _count()
        md.all_gather(parts, x.contiguous(), g.group_name)
        return parts

    def all_gather(self, x, g: ParallelGroup, dim: int):
        from mindspore import ops

        return ops.cat(self._gather_parts(x, g), dim)

    def reduce_scatter(self, x, g: ParallelGroup):
        return _narrow(self.all_reduce(x, g), 0, g.rank, g.size).contiguous()

    def all_to_all(self, x, g: ParallelGroup, split_dim: int, concat_dim: int):
        from mindspore import ops

        # Rank r receives chunk r (along split_dim) of every rank's x, concatenated
        # along concat_dim. Slicing before the concatenation copies |x| bytes instead of
        # G*|x| (~10 % of the call at 16 MiB on CPU).
        parts = self._gather_parts(x, g)
        return ops.cat([_narrow(p, split_dim, g.rank, g.size) for p in parts], concat_dim)


class _NativeBackend(_Backend):
    """MindSpore collective primitives (Ascend/GPU). UNTESTED on this project's CPUs."""

    def _prim(self, kind: str, g: ParallelGroup, *args):
        from mindspore import ops

        key = (kind, g.group_name, args)
        prim = _PRIMS.get(key)
        if prim is None:
            if kind == "all_reduce":
                prim = ops.AllReduce(ops.ReduceOp.SUM, g.group_name)
            elif kind == "all_gather":
                prim = ops.AllGather(g.group_name)
            elif kind == "reduce_scatter":
                prim = ops.ReduceScatter(ops.ReduceOp.SUM, g.group_name)
            else:
                split_dim, concat_dim = args
                prim = ops.AlltoAll(g.size, split_dim, concat_dim, g.group_name)
            _PRIMS[key] = prim
        return prim

    def all_reduce(self, x, g: ParallelGroup):
        _count()
        return self._prim("all_reduce", g)(x.contiguous())

    def all_gather(self, x, g: ParallelGroup, dim: int):
        from mindspore import ops

        if dim == 0:
            _count()
            return self._prim("all_gather", g)(x.contiguous())
        moved = ops.moveaxis(x, dim, 0).contiguous()
        _count()
        gathered = self._prim("all_gather", g)(moved)
        return ops.moveaxis(gathered, 0, dim).contiguous()

    def reduce_scatter(self, x, g: ParallelGroup):
        _count()
        return self._prim("reduce_scatter", g)(x.contiguous())

    def all_to_all(self, x, g: ParallelGroup, split_dim: int, concat_dim: int):
        _count()
        return self._prim("all_to_all", g, split_dim, concat_dim)(x.contiguous())


_PRIMS: dict = {}

_COMPOSED = _ComposedBackend(
    name="composed",
    composed={"all_reduce": False, "all_gather": False, "reduce_scatter": True, "all_to_all": True},
    impl={
        "all_reduce": "mindspore.mint.distributed.all_reduce on a copy",
        "all_gather": "mindspore.mint.distributed.all_gather into a list + cat",
        "reduce_scatter": "composed: all-reduce + own slice of dim 0",
        "all_to_all": "composed: all-gather + own slice of split_dim of each piece + cat",
    },
)
_NATIVE = _NativeBackend(
    name="native",
    composed={op: False for op in OPS},
    impl={
        "all_reduce": "mindspore.ops.AllReduce(SUM)",
        "all_gather": "mindspore.ops.AllGather (dim 0; other dims moved to 0)",
        "reduce_scatter": "mindspore.ops.ReduceScatter(SUM)",
        "all_to_all": "mindspore.ops.AlltoAll",
    },
)


def get_backend() -> _Backend:
    """The backend in force: THE one place where composed vs native is decided.

    ``MSDIST_COLLECTIVES=composed|native`` overrides; otherwise ``composed`` when
    ``mindspore.get_context("device_target")`` is CPU, ``native`` on Ascend and GPU.

    Raises:
        ValueError: the environment variable holds another value.
    """
    choice = os.environ.get(ENV_VAR, "").strip().lower()
    if choice:
        if choice not in BACKEND_CHOICES:
            raise ValueError(
                f"{ENV_VAR}={choice!r} is invalid: expected one of {', '.join(BACKEND_CHOICES)} "
                "(or unset to choose from the device target)."
            )
        return _COMPOSED if choice == "composed" else _NATIVE
    import mindspore

    target = str(mindspore.get_context("device_target")).upper()
    return _COMPOSED if target == "CPU" else _NATIVE


def backend_info() -> dict:
    """What each collective runs on here, e.g. for ``msdist verify``.

    Example on CPU::

        {"backend": "composed", "device_target": "CPU",
         "ops": {"reduce_scatter": {"composed": True,
                                    "impl": "composed: all-reduce + own slice of dim 0"}, ...}}
    """
    import mindspore

    backend = get_backend()
    return {
        "backend": backend.name,
        "device_target": str(mindspore.get_context("device_target")),
        "ops": backend.describe(),
    }


def is_composed(op: str) -> bool:
    """True when ``op`` (one of :data:`OPS`) is a composition on the backend in force."""
    if op not in OPS:
        raise ValueError(f"unknown collective {op!r}: expected one of {', '.join(OPS)}")
    return get_backend().composed[op]


# ------------------------------------------------------------------- public ops
def all_reduce(x, group: GroupLike):
    """Sum ``x`` over the group; every rank gets the sum. Shape unchanged."""
    g = resolve_group(group)
    if g.size == 1:
        return x
    return get_backend().all_reduce(x, g)


def all_gather(x, group: GroupLike, dim: int = 0):
    """Concatenate every rank's ``x`` along ``dim`` in group-rank order.

    ``(..., n, ...) -> (..., G*n, ...)`` with ``n = x.shape[dim]``.
    """
    g = resolve_group(group)
    dim = _norm_dim(dim, len(x.shape), "all_gather")
    if g.size == 1:
        return x
    return get_backend().all_gather(x, g, dim)


def reduce_scatter(x, group: GroupLike):
    """Sum ``x`` over the group and keep this rank's chunk of dim 0.

    ``(G*n, ...) -> (n, ...)``.

    Raises:
        ValueError: dim 0 is not divisible by the group size.
    """
    g = resolve_group(group)
    if g.size == 1:
        return x
    if len(x.shape) < 1:
        raise ValueError("reduce_scatter: expected a tensor of rank >= 1, got a scalar")
    _check_divisible("reduce_scatter", "dim 0", x.shape[0], g.size)
    return get_backend().reduce_scatter(x, g)


def all_to_all(x, group: GroupLike, split_dim: int, concat_dim: int):
    """Split ``x`` along ``split_dim`` into G chunks, send chunk j to group rank j, and
    concatenate what arrives along ``concat_dim`` in group-rank order.

    With ``split_dim=-1, concat_dim=0``: ``(S/G, ..., H) -> (S, ..., H/G)``;
    with ``split_dim=0, concat_dim=-1``: ``(S, ..., H/G) -> (S/G, ..., H)``.

    Raises:
        ValueError: ``split_dim`` not divisible by the group size, or both dims equal.
    """
    g = resolve_group(group)
    ndim = len(x.shape)
    split_dim = _norm_dim(split_dim, ndim, "all_to_all")
    concat_dim = _norm_dim(concat_dim, ndim, "all_to_all")
    if split_dim == concat_dim:
        raise ValueError(
            f"all_to_all: split_dim and concat_dim are both {split_dim}: expected two "
            "different dims (a tensor of rank >= 2)"
        )
    if g.size == 1:
        return x
    _check_divisible("all_to_all", f"split dim {split_dim}", x.shape[split_dim], g.size)
    return get_backend().all_to_all(x, g, split_dim, concat_dim)


def own_slice(x, group: GroupLike, dim: int):
    """This rank's chunk of ``x`` along ``dim`` (no communication).

    Raises:
        ValueError: the dim is not divisible by the group size.
    """
    g = resolve_group(group)
    if g.size == 1:
        return x
    dim = _norm_dim(dim, len(x.shape), "own_slice")
    _check_divisible("own_slice", f"dim {dim}", x.shape[dim], g.size)
    return _narrow(x, dim, g.rank, g.size).contiguous()
