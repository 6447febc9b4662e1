"""Differentiable collectives of the MoE layer (Cells with a ``bprop``, like
:mod:`mindscience.distributed.mappings`, so they run in PyNative, ``ms.jit`` and GRAPH_MODE).

=====================  ===============================  ==================================
function               forward                          backward
=====================  ===============================  ==================================
all_to_all_experts     even all-to-all of dim 0 (chunk  the same all-to-all (it is its own
                       j to group rank j, received       inverse)
                       chunks stacked in group-rank
                       order)
all_to_all_v           uneven all-to-all of dim 0        the all-to-all of the transposed
                       (``split_sizes[i][j]`` rows i->j; size matrix
                       composed CPU backend, PyNative:
                       an all-gather, no chunk padding)
reduce_for_loss        all-reduce (sum)                 all-reduce (sum) x ``grad_scale``
=====================  ===============================  ==================================

``reduce_for_loss`` sums the router's loss statistics over ranks that hold different
tokens of the same loss. Its backward sums the incoming gradients too: every rank adds the
(identical) aux loss to its own loss, and the gradient finalizer later averages over
dp-cp, so each rank must carry the whole gradient of the shared term. Over the tp group,
whose ranks hold ONE loss (the same value on each), ``grad_scale = 1/tp`` undoes the tp
copies.
"""

from __future__ import annotations

from mindspore import nn, ops

from .. import collectives as C
from ..collectives import compiling
from ..mappings import _cell  # the mappings' cache of Cells per (class, group, params, mode)

__all__ = ["all_to_all_experts", "all_to_all_v", "all_to_all_v_rows", "reduce_for_loss"]


class _Comm(nn.Cell):
    def __init__(self, group, scale, compiled):
        super().__init__()
        self.k = C.kernels(group, compiled)
        self.scale = scale


class _AllToAll0(_Comm):
    def construct(self, x):
        return self.k.all_to_all(x, 0, 0)

    def bprop(self, x, out, dout):
        return (self.k.all_to_all(ops.depend(dout, out), 0, 0),)


class _AllToAllV(_Comm):
    # self.scale holds (send, recv, m) of the forward; the backward swaps send and recv.
    def construct(self, x):
        send, recv, m = self.scale
        return self.k.all_to_all_v(x, send, recv, m)

    def bprop(self, x, out, dout):
        send, recv, m = self.scale
        return (self.k.all_to_all_v(ops.depend(dout, out), recv, send, m),)


class _ReduceForLoss(_Comm):
    def construct(self, x):
        return self.k.all_reduce(x)

    def bprop(self, x, out, dout):
        g = self.k.all_reduce(ops.depend(dout, out))
        if self.scale != 1.0:
            g = g * self.scale
        return (g,)


def all_to_all_experts(x, group):
    """``x`` (G*n, ...): chunk j of dim 0 goes to group rank j; returns (G*n, ...) with the
    chunk from rank i at position i. Identity on a size-1 group.

    Raises:
        ValueError: dim 0 not divisible by the group size.
    """
    g = C.resolve_group(group)
    if g.size == 1:
        return x
    if x.shape[0] % g.size:
        raise ValueError(f"all_to_all_experts: dim 0 (size {x.shape[0]}) is not divisible by "
                         f"the group size {g.size}")
    return _cell(_AllToAll0, g, 1.0)(x)


class _GatheredAllToAllV(nn.Cell):
    """The composed CPU backend in PyNative: its all-to-all is an all-gather, so an uneven
    one needs no per-chunk padding. Every rank gathers the others' whole buffers (each
    padded only to the largest buffer of the group: no padding when every rank sends as
    many rows) and keeps the rows bound for it. Built per call (the size matrix changes
    with every routing), so the backward reads the matrix of its own forward."""

    def __init__(self, k, rows, rank):
        super().__init__()
        self.k = k
        self.rows = rows
        self.cols = tuple(tuple(r[j] for r in rows) for j in range(len(rows)))
        self.rank = rank

    def exchange(self, x, rows):
        me = self.rank
        total = max(max(sum(r) for r in rows), 1)
        parts = self.k._gather_parts(self.k._pad_rows(x, total))
        kept = [self.k._rows(parts[i], sum(rows[i][:me]), rows[i][me])
                for i in range(len(rows)) if rows[i][me]]
        if not kept:
            return ops.depend(ops.zeros((0,) + tuple(x.shape[1:]), x.dtype), parts[0])
        return kept[0] if len(kept) == 1 else ops.cat(kept, 0)

    def construct(self, x):
        return self.exchange(x, self.rows)

    def bprop(self, x, out, dout):
        return (self.exchange(ops.depend(dout, out), self.cols),)


def _gathered() -> bool:
    """True where :func:`all_to_all_v` runs as an all-gather (composed backend, PyNative)."""
    return not compiling() and C.is_composed("all_to_all")


def all_to_all_v(x, group, split_sizes):
    """Differentiable :func:`mindscience.distributed.collectives.all_to_all_v` (the
    gradient goes back by the transposed size matrix). The sizes are Python ints (known
    when the graph is built).

    On the composed CPU backend in PyNative the exchange is an all-gather of each rank's
    buffer, padded only to the largest buffer (:func:`all_to_all_v_rows`), not each chunk
    to the largest chunk. The MoE layer's PyNative dropless dispatch uses it
    (:mod:`.layer`)."""
    g = C.resolve_group(group)
    rows = C.check_split_matrix("all_to_all_v", x, g, split_sizes)
    if g.size == 1:
        return x
    if not compiling():
        # Nested, so that compiled code never parses the backend query (constant branch).
        if C.is_composed("all_to_all"):
            return _GatheredAllToAllV(C.kernels(g, False), rows, g.rank)(x)
    m = max(max(max(r) for r in rows), 1)
    send = rows[g.rank]
    recv = tuple(rows[i][g.rank] for i in range(g.size))
    return _cell(_AllToAllV, g, (send, recv, m))(x)


def all_to_all_v_rows(group, split_sizes) -> int:
    """Rows of the buffer each rank hands to :func:`all_to_all_v` for this size matrix:
    the largest row sum where it is gathered (composed backend, PyNative), else G chunks
    of the largest entry (every chunk padded to it). 0 on a size-1 group."""
    g = C.resolve_group(group)
    if g.size == 1:
        return 0
    if _gathered():
        return max(max(sum(r) for r in split_sizes), 1)
    return g.size * max(max(max(r) for r in split_sizes), 1)


def reduce_for_loss(x, group, grad_scale: float = 1.0):
    """Sum ``x`` over ``group``; the backward sums the gradient and multiplies by
    ``grad_scale``. Identity on a size-1 group."""
    g = C.resolve_group(group)
    if g.size == 1:
        return x
    return _cell(_ReduceForLoss, g, float(grad_scale))(x)
