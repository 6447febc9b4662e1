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
in group-rank order. ``group`` is a :class:`~mindscience.distributed.group.ParallelGroup`
(from :mod:`mindscience.distributed.manager`) or a backend group name. On a size-1
group every mapping is the identity, forward and backward, and makes no backend call.
A dim that the group size does not divide raises ``ValueError`` before any
communication, so no rank falls out of step.

Gradients work with ``mindspore.grad`` / ``mindspore.value_and_grad`` in PyNative mode
(the mappings are ``mindspore._Function`` subclasses; ``_Function`` does not work under
``mindspore.jit``).
"""

from __future__ import annotations

import mindspore as ms

from . import collectives as C
from .collectives import GroupLike

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
]


# ----------------------------------------------------------------- validation
def _check_rank(mapping: str, x, min_ndim: int) -> None:
    ndim = len(x.shape)
    if ndim < min_ndim:
        raise ValueError(
            f"{mapping}: expected a tensor of rank >= {min_ndim}, got shape {tuple(x.shape)}"
        )


def _check_dim(mapping: str, x, dim: int, group_size: int) -> None:
    what = "first dim" if dim == 0 else "last dim"
    size = x.shape[dim]
    if size % group_size:
        raise ValueError(
            f"{mapping}: {what} (size {size}) is not divisible by the group size "
            f"{group_size} (tensor shape {tuple(x.shape)}); make the {what} a multiple of "
            f"{group_size}"
        )


# ----------------------------------------------------------------- autograd functions
# Every backward returns one gradient per apply() argument: None for the group (and flags).
class _CopyToAll(ms._Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, dy):
        return C.all_reduce(dy, ctx.group), None


class _ReduceFromAll(ms._Function):
    @staticmethod
    def forward(ctx, x, group):
        return C.all_reduce(x, group)

    @staticmethod
    def backward(ctx, dy):
        return dy, None


class _ScatterToHidden(ms._Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return C.own_slice(x, group, -1)

    @staticmethod
    def backward(ctx, dy):
        return C.all_gather(dy, ctx.group, -1), None


class _GatherFromHidden(ms._Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return C.all_gather(x, group, -1)

    @staticmethod
    def backward(ctx, dy):
        return C.own_slice(dy, ctx.group, -1), None


class _ScatterToSequence(ms._Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return C.own_slice(x, group, 0)

    @staticmethod
    def backward(ctx, dy):
        return C.all_gather(dy, ctx.group, 0), None


class _GatherFromSequence(ms._Function):
    @staticmethod
    def forward(ctx, x, group, tensor_parallel_output_grad):
        ctx.group = group
        ctx.reduce_grad = bool(tensor_parallel_output_grad)
        return C.all_gather(x, group, 0)

    @staticmethod
    def backward(ctx, dy):
        if ctx.reduce_grad:
            return C.reduce_scatter(dy, ctx.group), None, None
        return C.own_slice(dy, ctx.group, 0), None, None


class _ReduceScatterToSequence(ms._Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return C.reduce_scatter(x, group)

    @staticmethod
    def backward(ctx, dy):
        return C.all_gather(dy, ctx.group, 0), None


class _AllToAllHiddenToSequence(ms._Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return C.all_to_all(x, group, split_dim=0, concat_dim=-1)

    @staticmethod
    def backward(ctx, dy):
        return C.all_to_all(dy, ctx.group, split_dim=-1, concat_dim=0), None


class _AllToAllSequenceToHidden(ms._Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return C.all_to_all(x, group, split_dim=-1, concat_dim=0)

    @staticmethod
    def backward(ctx, dy):
        return C.all_to_all(dy, ctx.group, split_dim=0, concat_dim=-1), None


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
    return _CopyToAll.apply(x, g)


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
    return _ReduceFromAll.apply(x, g)


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
    return _ScatterToHidden.apply(x, g)


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
    return _GatherFromHidden.apply(x, g)


def scatter_to_sequence(x, group: GroupLike):
    """Keep this rank's chunk of the first (sequence) dim; all-gather the gradient.

    Args:
        x: Tensor ``(S, ...)`` of rank >= 1, the same on every rank.
        group: The group (a ParallelGroup or a backend group name), size G.

    Returns:
        ``(S/G, ...)``: chunk ``group.rank`` of the first dim.

    Raises:
        ValueError: S is not divisible by G.

    Example (2 ranks): both hold ``[[1.], [2.], [3.], [4.]]``; rank 0 gets
    ``[[1.], [2.]]``, rank 1 ``[[3.], [4.]]``. Upstream gradients ``[[1.], [1.]]`` and
    ``[[2.], [2.]]`` give both ranks ``[[1.], [1.], [2.], [2.]]``.
    """
    g = C.resolve_group(group)
    if g.size == 1:
        return x
    _check_rank("scatter_to_sequence", x, 1)
    _check_dim("scatter_to_sequence", x, 0, g.size)
    return _ScatterToSequence.apply(x, g)


def gather_from_sequence(x, group: GroupLike, tensor_parallel_output_grad: bool = True):
    """All-gather along the first (sequence) dim.

    Backward: reduce-scatter of the gradient along the first dim when the consumer of
    the output is tensor-parallel (each rank holds a partial gradient), otherwise
    (``tensor_parallel_output_grad=False``, the gradient is already complete on every
    rank) just this rank's chunk.

    Args:
        x: Tensor ``(S/G, ...)`` of rank >= 1, this rank's sequence chunk.
        group: The group (a ParallelGroup or a backend group name), size G.
        tensor_parallel_output_grad: Reduce-scatter (True) or slice (False) backward.

    Returns:
        ``(S, ...)``: the chunks of all ranks concatenated in group-rank order.

    Example (2 ranks): rank 0 holds ``[[1.]]``, rank 1 ``[[2.]]``; both get
    ``[[1.], [2.]]``. Upstream gradients ``[[1.], [2.]]`` (rank 0) and ``[[10.], [20.]]``
    (rank 1) give rank 0 ``[[11.]]`` and rank 1 ``[[22.]]``; with
    ``tensor_parallel_output_grad=False`` rank 0 gets ``[[1.]]`` and rank 1 ``[[20.]]``.
    """
    g = C.resolve_group(group)
    if g.size == 1:
        return x
    _check_rank("gather_from_sequence", x, 1)
    return _GatherFromSequence.apply(x, g, bool(tensor_parallel_output_grad))


def reduce_scatter_to_sequence(x, group: GroupLike):
    """Sum over the group and keep this rank's chunk of the first dim; all-gather backward.

    Args:
        x: Tensor ``(S, ...)`` of rank >= 1, a partial sum on each rank.
        group: The group (a ParallelGroup or a backend group name), size G.

    Returns:
        ``(S/G, ...)``: chunk ``group.rank`` of the sum.

    Raises:
        ValueError: S is not divisible by G.

    Example (2 ranks): rank 0 holds ``[[1.], [2.]]``, rank 1 ``[[10.], [20.]]``; rank 0
    gets ``[[11.]]``, rank 1 ``[[22.]]``. Upstream gradients ``[[1.]]`` and ``[[2.]]``
    give both ranks ``[[1.], [2.]]``.
    """
    g = C.resolve_group(group)
    if g.size == 1:
        return x
    _check_rank("reduce_scatter_to_sequence", x, 1)
    _check_dim("reduce_scatter_to_sequence", x, 0, g.size)
    return _ReduceScatterToSequence.apply(x, g)


def all_to_all_from_hidden_to_sequence(x, group: GroupLike):
    """From hidden shards over the full sequence to sequence shards over the full hidden.

    ``(S, ..., H/G) -> (S/G, ..., H)``: rank r receives rows ``r*S/G:(r+1)*S/G`` of every
    rank's hidden chunk, concatenated along the last dim in group-rank order. The
    backward is :func:`all_to_all_from_sequence_to_hidden` of the gradient.

    Args:
        x: Tensor ``(S, ..., H/G)`` of rank >= 2.
        group: The group (a ParallelGroup or a backend group name), size G.

    Raises:
        ValueError: rank < 2, or S is not divisible by G.

    Example (2 ranks, S=2, H=4): rank 0 holds columns 0-1 ``[[a0, a1], [b0, b1]]``,
    rank 1 columns 2-3 ``[[a2, a3], [b2, b3]]``. Rank 0 gets row 0 ``[[a0, a1, a2, a3]]``,
    rank 1 row 1 ``[[b0, b1, b2, b3]]``.
    """
    g = C.resolve_group(group)
    if g.size == 1:
        return x
    _check_rank("all_to_all_from_hidden_to_sequence", x, 2)
    _check_dim("all_to_all_from_hidden_to_sequence", x, 0, g.size)
    return _AllToAllHiddenToSequence.apply(x, g)


def all_to_all_from_sequence_to_hidden(x, group: GroupLike):
    """From sequence shards over the full hidden to hidden shards over the full sequence.

    ``(S/G, ..., H) -> (S, ..., H/G)``: rank r receives columns ``r*H/G:(r+1)*H/G`` of
    every rank's sequence chunk, concatenated along the first dim in group-rank order.
    The backward is :func:`all_to_all_from_hidden_to_sequence` of the gradient.

    Args:
        x: Tensor ``(S/G, ..., H)`` of rank >= 2.
        group: The group (a ParallelGroup or a backend group name), size G.

    Raises:
        ValueError: rank < 2, or H is not divisible by G.

    Example (2 ranks, S=2, H=4): rank 0 holds row 0 ``[[a0, a1, a2, a3]]``, rank 1 row 1
    ``[[b0, b1, b2, b3]]``. Rank 0 gets ``[[a0, a1], [b0, b1]]``, rank 1
    ``[[a2, a3], [b2, b3]]``.
    """
    g = C.resolve_group(group)
    if g.size == 1:
        return x
    _check_rank("all_to_all_from_sequence_to_hidden", x, 2)
    _check_dim("all_to_all_from_sequence_to_hidden", x, -1, g.size)
    return _AllToAllSequenceToHidden.apply(x, g)
