"""Group resolution, THE backend selection point, and forward-only collectives.

The collectives themselves are methods of the kernel cells in
:mod:`mindscience.distributed.kernels`; :func:`kernels` picks and caches the one for a
group, a backend and an execution mode (eager or compiled). The mappings
(:mod:`mindscience.distributed.mappings`, which add autograd) hold such a kernel.

The module-level functions below (``all_reduce``, ``all_gather``, ...) are the same
collectives for eager code (checks, examples, benchmarks). Every function takes
``(x, group)`` and returns a new tensor; ``x`` is never modified. A size-1 group is the
identity and makes no backend call at all.

=================  ==========================================  ==========================
op                 ``composed`` backend (CPU default)           ``native`` backend
=================  ==========================================  ==========================
all_reduce (sum)   eager: ``mint.distributed.all_reduce`` on a  ``ops.AllReduce(SUM)``
                   copy; compiled: ``ops.AllReduce(SUM)``
all_gather (dim)   eager: ``mint.distributed.all_gather`` into  ``ops.AllGather`` (dim 0,
                   a list + ``cat``; compiled: all-reduce of a  other dims moved to 0)
                   zero-padded buffer
reduce_scatter     COMPOSED: all-reduce + own slice of dim 0    ``ops.ReduceScatter(SUM)``
all_to_all         COMPOSED: all-gather + own slice of          ``ops.AlltoAll``
                   ``split_dim`` of each piece + ``cat``
all_to_all_v       each chunk padded to the largest of the size matrix, the even all-to-all,
                   trim (both backends)
uneven (``_v``)    pad to the largest shard, the even collective, trim (both backends)
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
Compiled code (``ms.jit``, GRAPH_MODE) cannot use ``mint.distributed`` on CPU (no graph
kernel, measured), which is why the composed backend has an eager and a compiled
kernel; :func:`compiling` tells them apart at trace time.

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

import mindspore
from mindspore.communication import get_group_size, get_rank, get_world_rank_from_group_rank
from mindspore.ops.primitive import constexpr

from . import kernels as K
from .counters import call_count
from .group import CommGroupBase, ParallelGroup

__all__ = [
    "all_reduce", "all_gather", "reduce_scatter", "all_to_all", "all_to_all_v",
    "check_split_matrix", "own_slice",
    "backend_info", "call_count", "compiling", "get_backend", "is_composed", "kernels",
    "resolve_group",
]

ENV_VAR = "MSDIST_COLLECTIVES"
BACKEND_CHOICES = ("composed", "native")
OPS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all")

GroupLike = Union[ParallelGroup, CommGroupBase, str]


# ------------------------------------------------------------------- mode
def _probe():
    return 0


@constexpr(check=False)
def _is_none(fn):
    # Eagerly this receives the function itself; while MindSpore compiles, a function
    # passed to a constexpr arrives as None. (MindSpore's own private _run_in_jit works
    # the same way but imports inside its body, which compiled code rejects.)
    return fn is None


def compiling() -> bool:
    """True while ``mindspore.jit`` / GRAPH_MODE traces the caller, False when it runs eagerly.

    Usable in compiled code; in a ``construct`` the branch it guards is folded away.
    It is NOT folded inside a ``bprop``, so backward code must not branch on it.
    """
    return _is_none(_probe)


# ------------------------------------------------------------------- groups
_STRING_GROUPS: dict = {}
_COMM_GROUPS: dict = {}


_COMPILED_LOOKUP = (
    " cannot be looked up inside compiled code (ms.jit / GRAPH_MODE): finding its size "
    "and rank asks the backend at run time. Pass the ParallelGroup from "
    "mindscience.distributed.manager (e.g. manager.get_tensor_parallel_group()), or call "
    "mindscience.distributed.collectives.resolve_group(...) on it once before compiling "
    "(PyNative runs it as is)."
)


def _group_from_backend(key: str, name: str) -> ParallelGroup:
    size = get_group_size(name)
    rank = get_rank(name)
    try:
        ranks = tuple(get_world_rank_from_group_rank(name, i) for i in range(size))
    except Exception:  # noqa: BLE001 - e.g. the world group: ranks are 0..size-1
        ranks = tuple(range(size))
    return ParallelGroup(key=key, ranks=ranks, rank=rank, backend_name=name if size > 1 else None)


def resolve_group(group: GroupLike) -> ParallelGroup:
    """Return ``group`` as a :class:`ParallelGroup`.

    Accepts a ParallelGroup (returned as is), a backend group name (e.g. one made by
    ``mindspore.communication.create_group``), or an upstream-style ``CommGroup`` /
    ``CommGroupBase``. Names and upstream groups are looked up once (their size and
    this process's rank come from ``mindspore.communication``) and cached; inside
    compiled code only cached ones can be resolved.

    Raises:
        TypeError: ``group`` is none of these.
        RuntimeError: an uncached name or upstream group inside compiled code.
    """
    if isinstance(group, ParallelGroup):
        return group
    if isinstance(group, str):
        cached = _STRING_GROUPS.get(group)
        if cached is not None:
            return cached
        if compiling():
            # A plain RuntimeError: compiled code raises only built-in exception types.
            raise RuntimeError("the backend group name " + repr(group) + _COMPILED_LOOKUP)
        cached = _group_from_backend(group, group)
        _STRING_GROUPS[group] = cached
        return cached
    if isinstance(group, CommGroupBase):
        key = (group.name, group.size, group.rank, group._group_name)
        cached = _COMM_GROUPS.get(key)
        if cached is not None:
            return cached
        if group.size == 1:
            cached = ParallelGroup.trivial(group.name, 0)
        else:
            if compiling():
                raise RuntimeError("the CommGroup " + repr(group.name) + _COMPILED_LOOKUP)
            cached = _group_from_backend(group.name, group.group_name)
        _COMM_GROUPS[key] = cached
        return cached
    raise TypeError(
        f"group must be a ParallelGroup (from mindscience.distributed.manager), a "
        f"CommGroup or a backend group name, got {type(group).__name__}"
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


_COMPOSED = _Backend(
    name="composed",
    composed={"all_reduce": False, "all_gather": False, "reduce_scatter": True, "all_to_all": True},
    impl={
        "all_reduce": "mindspore.mint.distributed.all_reduce on a copy "
                      "(compiled: ops.AllReduce(SUM))",
        "all_gather": "mindspore.mint.distributed.all_gather into a list + cat "
                      "(compiled: all-reduce of a zero-padded buffer)",
        "reduce_scatter": "composed: all-reduce + own slice of dim 0",
        "all_to_all": "composed: all-gather + own slice of split_dim of each piece + cat",
    },
)
_NATIVE = _Backend(
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
    Eager code only (kernels are chosen when they are built, which is always eager).

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
    target = str(mindspore.get_context("device_target")).upper()
    return _COMPOSED if target == "CPU" else _NATIVE


def backend_info() -> dict:
    """What each collective runs on here, e.g. for ``msdist verify``.

    Example on CPU::

        {"backend": "composed", "device_target": "CPU",
         "ops": {"reduce_scatter": {"composed": True,
                                    "impl": "composed: all-reduce + own slice of dim 0"}, ...}}
    """
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


_KERNELS: dict = {}


def kernels(group: ParallelGroup, compiled: bool):
    """The kernel cell for ``group`` (size > 1) in eager (False) or compiled (True) code.

    Built once per (group, backend, mode) and cached. Call it eagerly (e.g. from a
    Cell's ``__init__``): it reads the environment and the device target.
    """
    backend = get_backend().name
    key = (group.backend_name, group.size, group.rank, backend, bool(compiled))
    k = _KERNELS.get(key)
    if k is None:
        if backend == "native":
            cls = K.Native
        else:
            cls = K.GraphComposed if compiled else K.EagerComposed
        k = cls(group.group_name, group.size, group.rank)
        _KERNELS[key] = k
    return k


# ------------------------------------------------------------------- eager ops
def all_reduce(x, group: GroupLike):
    """Sum ``x`` over the group; every rank gets the sum. Shape unchanged."""
    g = resolve_group(group)
    if g.size == 1:
        return x
    return kernels(g, False).all_reduce(x)


def all_gather(x, group: GroupLike, dim: int = 0):
    """Concatenate every rank's ``x`` along ``dim`` in group-rank order.

    ``(..., n, ...) -> (..., G*n, ...)`` with ``n = x.shape[dim]``.
    """
    g = resolve_group(group)
    dim = _norm_dim(dim, len(x.shape), "all_gather")
    if g.size == 1:
        return x
    return kernels(g, False).all_gather(x, dim)


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
    return kernels(g, False).reduce_scatter(x).contiguous()


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
    return kernels(g, False).all_to_all(x, split_dim, concat_dim)


def check_split_matrix(op: str, x, g: ParallelGroup, split_sizes) -> tuple:
    """``split_sizes`` as a G x G tuple of ints (row i: what rank i sends to each rank),
    checked against this rank's ``x``.

    Raises:
        ValueError: not G rows of G integers >= 0, or row ``g.rank`` does not sum to dim 0.
    """
    G = g.size
    rows = []
    ok = isinstance(split_sizes, (list, tuple)) and len(split_sizes) == G
    if ok:
        for row in split_sizes:
            if not isinstance(row, (list, tuple)) or len(row) != G:
                ok = False
                break
            for v in row:
                if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                    ok = False
            rows.append(tuple(int(v) for v in row) if ok else ())
    if not ok:
        raise ValueError(
            f"{op}: split_sizes={split_sizes!r} must be a {G} x {G} matrix of integers >= 0: "
            f"row i lists the rows group rank i sends to each rank (the same matrix on every "
            "rank)")
    if sum(rows[g.rank]) != x.shape[0]:
        raise ValueError(
            f"{op}: this rank (group rank {g.rank}) sends {sum(rows[g.rank])} rows by "
            f"split_sizes row {list(rows[g.rank])}, but x has {x.shape[0]} rows (shape "
            f"{tuple(x.shape)})")
    return tuple(rows)


def all_to_all_v(x, group: GroupLike, split_sizes):
    """Uneven all-to-all of dim 0 (MPI's alltoallv, torch's ``all_to_all_single`` with
    split sizes).

    Args:
        x: ``(sum(split_sizes[rank]), ...)``: the rows for rank 0 first, then rank 1, ...
        group: The group, size G.
        split_sizes: G x G nested lists, the SAME on every rank: ``split_sizes[i][j]`` rows
            go from group rank i to group rank j (an entry may be 0).

    Returns:
        ``(sum_i split_sizes[i][rank], ...)``: the rows from rank 0 first, then rank 1, ...

    Every chunk is padded to the largest entry of the matrix so the even all-to-all of the
    backend (``ops.AlltoAll`` natively, a gather on CPU) lines up; the padding is trimmed.

    Example (2 ranks): ``split_sizes=[[1, 2], [3, 0]]``; rank 0 sends ``[a]`` to itself
    and ``[b, c]`` to rank 1, rank 1 sends ``[d, e, f]`` to rank 0: rank 0 gets
    ``[a, d, e, f]``, rank 1 ``[b, c]``.

    Raises:
        ValueError: a malformed matrix or one that does not match ``x``.
    """
    g = resolve_group(group)
    if len(x.shape) < 1:
        raise ValueError("all_to_all_v: expected a tensor of rank >= 1, got a scalar")
    rows = check_split_matrix("all_to_all_v", x, g, split_sizes)
    if g.size == 1:
        return x
    m = max(max(r) for r in rows)
    send = rows[g.rank]
    recv = tuple(rows[i][g.rank] for i in range(g.size))
    return kernels(g, False).all_to_all_v(x, send, recv, max(m, 1))


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
    return kernels(g, False).own_slice(x, dim).contiguous()
