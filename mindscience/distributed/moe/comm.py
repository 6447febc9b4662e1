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
                       (``split_sizes[i][j]`` rows i->j) size matrix
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
from ..mappings import _cell  # the mappings' cache of Cells per (class, group, params, mode)

__all__ = ["all_to_all_experts", "all_to_all_v", "reduce_for_loss"]


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


def all_to_all_v(x, group, split_sizes):
    """Differentiable :func:`mindscience.distributed.collectives.all_to_all_v` (the
    gradient goes back by the transposed size matrix). The sizes are Python ints (known
    when the graph is built). The MoE layer uses equal slots instead (sized from the real
    per-expert counts in PyNative, static when compiled: :mod:`.layer`)."""
    g = C.resolve_group(group)
    rows = C.check_split_matrix("all_to_all_v", x, g, split_sizes)
    if g.size == 1:
        return x
    m = max(max(max(r) for r in rows), 1)
    send = rows[g.rank]
    recv = tuple(rows[i][g.rank] for i in range(g.size))
    return _cell(_AllToAllV, g, (send, recv, m))(x)


def reduce_for_loss(x, group, grad_scale: float = 1.0):
    """Sum ``x`` over ``group``; the backward sums the gradient and multiplies by
    ``grad_scale``. Identity on a size-1 group."""
    g = C.resolve_group(group)
    if g.size == 1:
        return x
    return _cell(_ReduceForLoss, g, float(grad_scale))(x)
