"""Differentiable communication mappings for tensor and sequence (context) parallelism.

Nine functions move activations between the layouts that parallel layers need, and
define the matching collective for the gradient (Megatron's ``mappings``):

=====================================  ===============================  ==================================
mapping                                forward                          backward
=====================================  ===============================  ==================================
copy_to_all                            identity                         all-reduce
reduce_from_all                        all-reduce                       identity
scatter_to_hidden                      own slice of the last dim        all-gather last dim
gather_from_hidden                     all-gather last dim              own slice of the last dim
scatter_to_sequence                    own slice of the first dim       all-gather first dim
gather_from_sequence                   all-gather first dim             reduce-scatter first dim
                                                                        (own slice if
                                                                        ``tensor_parallel_output_grad``
                                                                        is False)
reduce_scatter_to_sequence             reduce-scatter first dim         all-gather first dim
all_to_all_from_hidden_to_sequence     (S, ..., H/G) -> (S/G, ..., H)   the inverse
all_to_all_from_sequence_to_hidden     (S/G, ..., H) -> (S, ..., H/G)   the inverse
=====================================  ===============================  ==================================

"hidden" is the LAST dim, "sequence" the FIRST dim. Chunks are taken and concatenated
in group-rank order.

Uneven sequences: the five mappings that split or join the sequence take
``split_sizes`` (the sequence length on each group rank, summing to the full length),
e.g. ``split_sizes=even_split_sizes(1003, 4) == [251, 251, 251, 250]``; a rank may hold
zero rows. ``None`` (the default) shards evenly and raises when G does not divide S. ``group`` is a :class:`~mindscience.distributed.group.ParallelGroup`
(from :mod:`mindscience.distributed.manager`) or a backend group name. On a size-1
group every mapping is the identity, forward and backward, and makes no backend call.
A dim that the group size does not divide raises ``ValueError`` before any
communication, so no rank falls out of step.

Execution modes: each mapping is an ``nn.Cell`` with a ``bprop`` (one per mapping,
group, parameters and mode, built on first use and cached), so the functions work in
PyNative, inside ``mindspore.jit`` (decorated functions, ``cell.construct =
ms.jit(cell.construct)``, jit-compiled ``ms.grad`` / ``ms.value_and_grad``) and in
GRAPH_MODE, with the same numbers. Pass the ParallelGroup from the manager inside
compiled code (a backend group name works there once it was resolved eagerly).

Upstream names: ``CopyToAll.apply(x, group)``, ``GatherFromSequence.apply(x, group,
tensor_parallel_output_grad=True)``, ... are the same functions under upstream's
autograd-class spelling.
"""

from __future__ import annotations

import numbers

from mindspore import nn, ops
from mindspore.common import dtype as mstype

from . import collectives as C
from .collectives import GroupLike, compiling

__all__ = [
    "copy_to_all",
    "reduce_from_all",
    "scatter_to_hidden",
    "gather_from_hidden",
    "scatter_to_sequence",
    "gather_from_sequence",
    "reduce_scatter_to_sequence",
    "all_to_all_from_sequence_to_hidden",
    "all_to_all_from_hidden_to_sequence",
    "even_split_sizes",
    "split_offsets",
    # upstream autograd-class spellings
    "CopyToAll",
    "ReduceFromAll",
    "ScatterToHidden",
    "GatherFromHidden",
    "ScatterToSequence",
    "GatherFromSequence",
    "ReduceScatterToSequence",
    "AllToAllFromHiddenToSequence",
    "AllToAllFromSequenceToHidden",
]


# ----------------------------------------------------------------- split sizes
def even_split_sizes(length: int, group_size: int) -> list:
    """The balanced split of ``length`` rows over ``group_size`` ranks.

    The first ``length % group_size`` ranks get one row more:
    ``even_split_sizes(10, 4) == [3, 3, 2, 2]``, ``even_split_sizes(3, 4) == [1, 1, 1, 0]``.

    Raises:
        ValueError: ``length`` < 0 or ``group_size`` < 1, or either is not an int.
    """
    for name, value, low in (("length", length, 0), ("group_size", group_size, 1)):
        if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < low:
            raise ValueError(
                f"even_split_sizes: {name}={value!r} must be an integer >= {low}"
            )
    base, extra = divmod(int(length), int(group_size))
    return [base + 1 if i < extra else base for i in range(int(group_size))]


def split_offsets(split_sizes) -> list:
    """Start row of each shard: ``split_offsets([3, 3, 2, 2]) == [0, 3, 6, 8]``."""
    out = []
    total = 0
    for size in split_sizes:
        out.append(total)
        total += int(size)
    return out


# ----------------------------------------------------------------- validation
# Plain Python on static shapes: it runs before any collective on every rank, eagerly
# and (at trace time) in compiled code.
def _check_rank(mapping: str, x, min_ndim: int) -> None:
    ndim = len(x.shape)
    if ndim < min_ndim:
        raise ValueError(
            f"{mapping}: expected a tensor of rank >= {min_ndim}, got shape {tuple(x.shape)}"
        )


def _check_dim(mapping: str, x, dim: int, group_size: int) -> None:
    size = x.shape[dim]
    if size % group_size:
        if dim == 0:
            raise ValueError(
                f"{mapping}: first dim (size {size}) is not divisible by the group size "
                f"{group_size} (tensor shape {tuple(x.shape)}); make the first dim a "
                f"multiple of {group_size}, or shard it unevenly with "
                f"split_sizes=even_split_sizes({size}, {group_size})"
            )
        raise ValueError(
            f"{mapping}: last dim (size {size}) is not divisible by the group size "
            f"{group_size} (tensor shape {tuple(x.shape)}); make the last dim a multiple "
            f"of {group_size}"
        )


def _split_sizes(mapping: str, x, g, split_sizes, local: bool) -> tuple:
    """The validated sizes as a tuple of ints; the even split when ``split_sizes`` is None.

    ``local``: dim 0 of ``x`` is this rank's shard (it must equal its own size);
    otherwise dim 0 is the full sequence (the sizes must sum to it).
    """
    G = g.size
    dim0 = x.shape[0]
    if split_sizes is None:
        if local:
            return (dim0,) * G
        _check_dim(mapping, x, 0, G)
        return (dim0 // G,) * G
    if not isinstance(split_sizes, (list, tuple)) or len(split_sizes) != G:
        raise ValueError(
            f"{mapping}: split_sizes={split_sizes!r} must be a list of {G} sizes, one per "
            f"rank of the group (size {G}); e.g. split_sizes=even_split_sizes(S, {G})"
        )
    sizes = []
    for s in split_sizes:
        if isinstance(s, bool) or not isinstance(s, numbers.Integral) or s < 0:
            raise ValueError(
                f"{mapping}: split_sizes={list(split_sizes)!r} must hold integers >= 0, "
                f"got {s!r}"
            )
        sizes.append(int(s))
    total = sum(sizes)
    if local:
        if dim0 != sizes[g.rank]:
            raise ValueError(
                f"{mapping}: the input's first dim is {dim0} (shape {tuple(x.shape)}) but "
                f"split_sizes={sizes} gives group rank {g.rank} {sizes[g.rank]} rows; pass "
                "this rank's shard, or the sizes every rank holds"
            )
    elif dim0 != total:
        raise ValueError(
            f"{mapping}: split_sizes={sizes} sum to {total}, but the first dim is {dim0} "
            f"(shape {tuple(x.shape)}); the sizes must sum to the full sequence"
        )
    if total == 0:
        raise ValueError(f"{mapping}: split_sizes={sizes} hold no rows at all")
    return tuple(sizes)


def _fresh(grad):
    """The gradient a bprop returns, as a tensor of its own.

    The backward of a slice of this rank's part (own slice, own rows, the reduce-scatter's
    chunk) is a view into a larger buffer in PyNative. MindSpore 2.10 mis-reads such a
    view when it flows into ``mint.split``'s backward (measured: wrong gradients whenever
    the view has a storage offset or is strided, e.g. ``GatherFromSequence.apply(k, cp)``
    with ``q, k, v = mint.split(qkv, ...)`` on every cp rank but the first). A
    contiguous copy is exact in every mode; compiled code has no views.
    """
    return grad.contiguous()


# ----------------------------------------------------------------- mapping cells
# One Cell per mapping: its construct is the forward, its bprop the backward, both
# calling the kernel cell of the group (eager or compiled flavour, fixed when the cell
# is built). The backward never branches on the execution mode: MindSpore does not
# fold such a branch inside a bprop.
# The sequence mappings' backward starts from ops.depend(dout, out): on a rank holding
# zero rows the incoming gradient does not depend on the forward result, and a compiled
# graph could then run the backward collective before the forward one on that rank
# only, pairing different collectives across ranks (measured: a buffer size mismatch in
# the ring all-reduce under ms.jit with split_sizes [3, 0, 2, 1]).
class _Mapping(nn.Cell):
    def __init__(self, group, params, compiled):
        super().__init__()
        self.k = C.kernels(group, compiled)
        self.sizes = params


class _CopyToAll(_Mapping):
    def construct(self, x):
        return x

    def bprop(self, x, out, dout):
        return (self.k.all_reduce(dout),)


class _ReduceFromAll(_Mapping):
    def construct(self, x):
        return self.k.all_reduce(x)

    def bprop(self, x, out, dout):
        return (dout,)


class _ScatterToHidden(_Mapping):
    def construct(self, x):
        return self.k.own_slice(x, -1)

    def bprop(self, x, out, dout):
        return (self.k.all_gather(dout, -1),)


class _GatherFromHidden(_Mapping):
    def construct(self, x):
        return self.k.all_gather(x, -1)

    def bprop(self, x, out, dout):
        return (_fresh(self.k.own_slice(dout, -1)),)


class _ScatterToSequence(_Mapping):
    def construct(self, x):
        return self.k.own_rows(x, self.sizes)

    def bprop(self, x, out, dout):
        return (self.k.all_gather_v(ops.depend(dout, out), self.sizes),)


class _GatherFromSequence(_Mapping):
    def construct(self, x):
        return self.k.all_gather_v(x, self.sizes)

    def bprop(self, x, out, dout):
        return (_fresh(self.k.reduce_scatter_v(ops.depend(dout, out), self.sizes)),)


class _GatherFromSequenceNoReduce(_GatherFromSequence):
    """``tensor_parallel_output_grad=False``: the gradient is complete on every rank."""

    def bprop(self, x, out, dout):
        return (_fresh(self.k.own_rows(ops.depend(dout, out), self.sizes)),)


class _ReduceScatterToSequence(_Mapping):
    def construct(self, x):
        return self.k.reduce_scatter_v(x, self.sizes)

    def bprop(self, x, out, dout):
        return (self.k.all_gather_v(ops.depend(dout, out), self.sizes),)


class _AllToAllHiddenToSequence(_Mapping):
    def construct(self, x):
        return self.k.hidden_to_sequence_v(x, self.sizes)

    def bprop(self, x, out, dout):
        return (self.k.sequence_to_hidden_v(ops.depend(dout, out), self.sizes),)


class _AllToAllSequenceToHidden(_Mapping):
    def construct(self, x):
        return self.k.sequence_to_hidden_v(x, self.sizes)

    def bprop(self, x, out, dout):
        return (_fresh(self.k.hidden_to_sequence_v(ops.depend(dout, out), self.sizes)),)


_CELLS: dict = {}


class _OwnOutput(nn.Cell):
    """A compiled mapping cell whose output is a tensor of each call site's own graph.

    One cached mapping cell serves every call of a graph. Under ``ms.jit`` a PyNative
    forward kept for a later backward (``set_grad(True)`` on a jit ``construct``, then
    ``GradOperation`` on the same input: the pipeline's kept stages) hands every consumer
    of a Cell with ``bprop`` that ran more than once in the graph the output of its LAST
    call (MindSpore 2.10 CPU, measured without collectives too: two blocks sharing one
    identity cell, the first block's weight gradient wrong, its input gradient right). A
    copy made outside the shared cell, in this bprop-less wrapper, is saved per call
    (measured exact, also tp2 with the real mappings); the copy costs one activation
    copy per mapping in compiled code (bfloat16 through float32: no bfloat16 copy kernel
    in CPU graphs).
    """

    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def construct(self, x):
        out = self.inner(x)
        if out.dtype == mstype.bfloat16:
            # No bfloat16 copy kernel in CPU graphs; the float32 round trip is exact.
            return ops.cast(ops.deepcopy(ops.cast(out, mstype.float32)), mstype.bfloat16)
        return ops.deepcopy(out)


def _cell(cls, g, params):
    """The cached mapping cell; built on first use (eagerly, or once at trace time, then
    wrapped in :class:`_OwnOutput`)."""
    compiled = compiling()
    key = (cls, g, params, compiled)
    cell = _CELLS.get(key)
    if cell is None:
        cell = cls(g, params, compiled)
        if compiled:
            cell = _OwnOutput(cell)
        _CELLS[key] = cell
    return cell


def _trivial(mapping, x, g, split_sizes, local):
    """Size-1 group: validate ``split_sizes`` if given, then the identity."""
    if split_sizes is not None:
        _split_sizes(mapping, x, g, split_sizes, local)
    return x


# ----------------------------------------------------------------- public mappings
def copy_to_all(x, group: GroupLike):
    """Identity forward; all-reduce (sum) of the gradient backward.

    Use it where a replicated tensor enters a tensor-parallel region (e.g. before a
    column-parallel linear): every rank's partial gradient must be summed.

    Args:
        x: Tensor of any shape.
        group: The group (a ParallelGroup or a backend group name).

    Returns:
        ``x`` unchanged.

    Example (2 ranks, group (0, 1)): both ranks hold ``x = [1., 2.]``; the forward
    returns ``[1., 2.]`` on both. If the upstream gradients are ``[1., 0.]`` on rank 0
    and ``[0., 3.]`` on rank 1, both ranks get ``x``-gradient ``[1., 3.]``.
    """
    g = C.resolve_group(group)
    if g.size == 1:
        return x
    return _cell(_CopyToAll, g, None)(x)


def reduce_from_all(x, group: GroupLike):
    """All-reduce (sum) forward; identity backward.

    Use it where partial results leave a tensor-parallel region (e.g. after a
    row-parallel linear).

    Args:
        x: Tensor of any shape, a partial sum on each rank.
        group: The group (a ParallelGroup or a backend group name).

    Returns:
        The sum over the group, same shape as ``x``.

    Example (2 ranks): rank 0 holds ``[1., 2.]``, rank 1 ``[10., 20.]``; both get
    ``[11., 22.]``. The upstream gradient of each rank passes through unchanged.
    """
    g = C.resolve_group(group)
    if g.size == 1:
        return x
    return _cell(_ReduceFromAll, g, None)(x)


def scatter_to_hidden(x, group: GroupLike):
    """Keep this rank's chunk of the last (hidden) dim; all-gather the gradient.

    Args:
        x: Tensor ``(..., H)`` of rank >= 1, the same on every rank.
        group: The group (a ParallelGroup or a backend group name), size G.

    Returns:
        ``(..., H/G)``: chunk ``group.rank`` of the last dim.

    Raises:
        ValueError: H is not divisible by G.

    Example (2 ranks): both hold ``[[1., 2., 3., 4.]]``; rank 0 gets ``[[1., 2.]]``,
    rank 1 ``[[3., 4.]]``. Upstream gradients ``[[1., 1.]]`` (rank 0) and ``[[2., 2.]]``
    (rank 1) give both ranks the gradient ``[[1., 1., 2., 2.]]``.
    """
    g = C.resolve_group(group)
    if g.size == 1:
        return x
    _check_rank("scatter_to_hidden", x, 1)
    _check_dim("scatter_to_hidden", x, -1, g.size)
    return _cell(_ScatterToHidden, g, None)(x)


def gather_from_hidden(x, group: GroupLike):
    """All-gather along the last (hidden) dim; keep this rank's gradient chunk backward.

    Args:
        x: Tensor ``(..., H/G)`` of rank >= 1, this rank's hidden chunk.
        group: The group (a ParallelGroup or a backend group name), size G.

    Returns:
        ``(..., H)``: the chunks of all ranks concatenated in group-rank order.

    Example (2 ranks): rank 0 holds ``[[1., 2.]]``, rank 1 ``[[3., 4.]]``; both get
    ``[[1., 2., 3., 4.]]``. An upstream gradient ``[[5., 6., 7., 8.]]`` on rank 1 gives
    rank 1 the gradient ``[[7., 8.]]``.
    """
    g = C.resolve_group(group)
    if g.size == 1:
        return x
    _check_rank("gather_from_hidden", x, 1)
    return _cell(_GatherFromHidden, g, None)(x)


def scatter_to_sequence(x, group: GroupLike, split_sizes=None):
    """Keep this rank's chunk of the first (sequence) dim; all-gather the gradient.

    Args:
        x: Tensor ``(S, ...)`` of rank >= 1, the same on every rank.
        group: The group (a ParallelGroup or a backend group name), size G.
        split_sizes: Rows of each group rank (summing to S); None splits evenly.

    Returns:
        ``(S/G, ...)`` (or ``(split_sizes[r], ...)``): chunk ``group.rank`` of the first dim.

    Raises:
        ValueError: S is not divisible by G (even split), or bad ``split_sizes``.

    Example (2 ranks): both hold ``[[1.], [2.], [3.], [4.]]``; rank 0 gets
    ``[[1.], [2.]]``, rank 1 ``[[3.], [4.]]``. Upstream gradients ``[[1.], [1.]]`` and
    ``[[2.], [2.]]`` give both ranks ``[[1.], [1.], [2.], [2.]]``. With
    ``split_sizes=[3, 1]`` rank 0 gets ``[[1.], [2.], [3.]]`` and rank 1 ``[[4.]]``.
    """
    g = C.resolve_group(group)
    name = "scatter_to_sequence"
    if g.size == 1:
        return _trivial(name, x, g, split_sizes, False)
    _check_rank(name, x, 1)
    return _cell(_ScatterToSequence, g, _split_sizes(name, x, g, split_sizes, False))(x)


def gather_from_sequence(x, group: GroupLike, tensor_parallel_output_grad: bool = True,
                         split_sizes=None):
    """All-gather along the first (sequence) dim.

    Backward: reduce-scatter of the gradient along the first dim when the consumer of
    the output is tensor-parallel (each rank holds a partial gradient), otherwise
    (``tensor_parallel_output_grad=False``, the gradient is already complete on every
    rank) just this rank's chunk.

    Args:
        x: Tensor ``(S/G, ...)`` (or ``(split_sizes[r], ...)``) of rank >= 1, this
            rank's sequence chunk.
        group: The group (a ParallelGroup or a backend group name), size G.
        tensor_parallel_output_grad: Reduce-scatter (True) or slice (False) backward.
        split_sizes: Rows of each group rank; None means every rank holds as many
            rows as this one.

    Returns:
        ``(S, ...)``: the chunks of all ranks concatenated in group-rank order.

    Raises:
        ValueError: bad ``split_sizes`` (wrong count, negative, or not this rank's rows).

    Example (2 ranks): rank 0 holds ``[[1.]]``, rank 1 ``[[2.]]``; both get
    ``[[1.], [2.]]``. Upstream gradients ``[[1.], [2.]]`` (rank 0) and ``[[10.], [20.]]``
    (rank 1) give rank 0 ``[[11.]]`` and rank 1 ``[[22.]]``; with
    ``tensor_parallel_output_grad=False`` rank 0 gets ``[[1.]]`` and rank 1 ``[[20.]]``.
    """
    g = C.resolve_group(group)
    name = "gather_from_sequence"
    if g.size == 1:
        return _trivial(name, x, g, split_sizes, True)
    _check_rank(name, x, 1)
    cls = _GatherFromSequence if tensor_parallel_output_grad else _GatherFromSequenceNoReduce
    return _cell(cls, g, _split_sizes(name, x, g, split_sizes, True))(x)


def reduce_scatter_to_sequence(x, group: GroupLike, split_sizes=None):
    """Sum over the group and keep this rank's chunk of the first dim; all-gather backward.

    Args:
        x: Tensor ``(S, ...)`` of rank >= 1, a partial sum on each rank.
        group: The group (a ParallelGroup or a backend group name), size G.
        split_sizes: Rows of each group rank (summing to S); None splits evenly.

    Returns:
        ``(S/G, ...)`` (or ``(split_sizes[r], ...)``): chunk ``group.rank`` of the sum.

    Raises:
        ValueError: S is not divisible by G (even split), or bad ``split_sizes``.

    Example (2 ranks): rank 0 holds ``[[1.], [2.]]``, rank 1 ``[[10.], [20.]]``; rank 0
    gets ``[[11.]]``, rank 1 ``[[22.]]``. Upstream gradients ``[[1.]]`` and ``[[2.]]``
    give both ranks ``[[1.], [2.]]``.
    """
    g = C.resolve_group(group)
    name = "reduce_scatter_to_sequence"
    if g.size == 1:
        return _trivial(name, x, g, split_sizes, False)
    _check_rank(name, x, 1)
    return _cell(_ReduceScatterToSequence, g, _split_sizes(name, x, g, split_sizes, False))(x)


def all_to_all_from_hidden_to_sequence(x, group: GroupLike, split_sizes=None):
    """From hidden shards over the full sequence to sequence shards over the full hidden.

    ``(S, ..., H/G) -> (S/G, ..., H)``: rank r receives rows ``r*S/G:(r+1)*S/G`` of every
    rank's hidden chunk, concatenated along the last dim in group-rank order. The
    backward is :func:`all_to_all_from_sequence_to_hidden` of the gradient.

    Args:
        x: Tensor ``(S, ..., H/G)`` of rank >= 2.
        group: The group (a ParallelGroup or a backend group name), size G.
        split_sizes: Rows of each group rank in the output (summing to S); None
            splits evenly.

    Raises:
        ValueError: rank < 2, S is not divisible by G (even split), or bad ``split_sizes``.

    Example (2 ranks, S=2, H=4): rank 0 holds columns 0-1 ``[[a0, a1], [b0, b1]]``,
    rank 1 columns 2-3 ``[[a2, a3], [b2, b3]]``. Rank 0 gets row 0 ``[[a0, a1, a2, a3]]``,
    rank 1 row 1 ``[[b0, b1, b2, b3]]``.
    """
    g = C.resolve_group(group)
    name = "all_to_all_from_hidden_to_sequence"
    if g.size == 1:
        return _trivial(name, x, g, split_sizes, False)
    _check_rank(name, x, 2)
    return _cell(_AllToAllHiddenToSequence, g, _split_sizes(name, x, g, split_sizes, False))(x)


def all_to_all_from_sequence_to_hidden(x, group: GroupLike, split_sizes=None):
    """From sequence shards over the full hidden to hidden shards over the full sequence.

    ``(S/G, ..., H) -> (S, ..., H/G)``: rank r receives columns ``r*H/G:(r+1)*H/G`` of
    every rank's sequence chunk, concatenated along the first dim in group-rank order.
    The backward is :func:`all_to_all_from_hidden_to_sequence` of the gradient.

    Args:
        x: Tensor ``(S/G, ..., H)`` (or ``(split_sizes[r], ..., H)``) of rank >= 2.
        group: The group (a ParallelGroup or a backend group name), size G.
        split_sizes: Rows of each group rank in the input; None means every rank
            holds as many rows as this one.

    Raises:
        ValueError: rank < 2, H is not divisible by G, or bad ``split_sizes``.

    Example (2 ranks, S=2, H=4): rank 0 holds row 0 ``[[a0, a1, a2, a3]]``, rank 1 row 1
    ``[[b0, b1, b2, b3]]``. Rank 0 gets ``[[a0, a1], [b0, b1]]``, rank 1
    ``[[a2, a3], [b2, b3]]``.
    """
    g = C.resolve_group(group)
    name = "all_to_all_from_sequence_to_hidden"
    if g.size == 1:
        return _trivial(name, x, g, split_sizes, True)
    _check_rank(name, x, 2)
    _check_dim(name, x, -1, g.size)
    return _cell(_AllToAllSequenceToHidden, g, _split_sizes(name, x, g, split_sizes, True))(x)


# ----------------------------------------------------------------- upstream names
class _Upstream:
    """Upstream's autograd-class spelling: ``Name.apply(x, group, ...)`` is the function."""

    apply = None


class CopyToAll(_Upstream):
    """``CopyToAll.apply(x, group)`` = :func:`copy_to_all`."""

    apply = staticmethod(copy_to_all)


class ReduceFromAll(_Upstream):
    """``ReduceFromAll.apply(x, group)`` = :func:`reduce_from_all`."""

    apply = staticmethod(reduce_from_all)


class ScatterToHidden(_Upstream):
    """``ScatterToHidden.apply(x, group)`` = :func:`scatter_to_hidden`."""

    apply = staticmethod(scatter_to_hidden)


class GatherFromHidden(_Upstream):
    """``GatherFromHidden.apply(x, group)`` = :func:`gather_from_hidden`."""

    apply = staticmethod(gather_from_hidden)


class ScatterToSequence(_Upstream):
    """``ScatterToSequence.apply(x, group, split_sizes=None)`` = :func:`scatter_to_sequence`."""

    apply = staticmethod(scatter_to_sequence)


class GatherFromSequence(_Upstream):
    """``GatherFromSequence.apply(x, group, tensor_parallel_output_grad=True,
    split_sizes=None)`` = :func:`gather_from_sequence`."""

    apply = staticmethod(gather_from_sequence)


class ReduceScatterToSequence(_Upstream):
    """``ReduceScatterToSequence.apply(x, group, split_sizes=None)`` =
    :func:`reduce_scatter_to_sequence`."""

    apply = staticmethod(reduce_scatter_to_sequence)


class AllToAllFromHiddenToSequence(_Upstream):
    """``AllToAllFromHiddenToSequence.apply(x, group, split_sizes=None)`` =
    :func:`all_to_all_from_hidden_to_sequence`."""

    apply = staticmethod(all_to_all_from_hidden_to_sequence)


class AllToAllFromSequenceToHidden(_Upstream):
    """``AllToAllFromSequenceToHidden.apply(x, group, split_sizes=None)`` =
    :func:`all_to_all_from_sequence_to_hidden`."""

    apply = staticmethod(all_to_all_from_sequence_to_hidden)
