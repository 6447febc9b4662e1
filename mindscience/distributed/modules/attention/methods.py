"""``context_parallel_attention`` and its three methods; the zigzag helpers.

==============  =====================================================  ====================
method          what moves                                             memory per rank
==============  =====================================================  ====================
``ulysses``     two all-to-alls: (my rows, all heads) <-> (all rows,   O(S) for N/cp heads
                my heads); dense attention over the whole sequence     (scores S x S)
``allgather_kv`` K and V all-gathered; my queries attend to all keys;   O(S) K/V, scores
                the K/V gradients reduce-scattered back                 S/cp x S
``ring``        K/V blocks around the ring (:mod:`.ring`)               O(S/cp)
==============  =====================================================  ====================

Ulysses and all-gather KV are compositions of the mappings (autodiff through their
cells); ring is one Cell with its own backward.

Selective recompute (``recompute=True``, Korthikanti et al. 2022): what the backward of
the attention core needs, the scores and probabilities (``N x S x S`` per rank for
ulysses, ``N x S/cp x S`` for all-gather KV), is not kept; the core (``softmax(q k^T) v``
on the rows and heads this rank holds after its collectives) runs again in the backward,
from the q, k, v it started from. The collectives are not re-run. The ring keeps only
q, k, v, its output and the log-sum-exp whatever ``recompute`` says: its backward
already recomputes every block's probabilities (as flash attention), so there is nothing
more to drop.
"""

from __future__ import annotations

import numpy as np

import mindspore as ms
from mindspore import nn, ops

from ... import collectives as C
from ... import mappings
from ...collectives import compiling
from .core import AttentionMath, check_inputs, positions, to_f32
from .ring import RingAttention

__all__ = ["context_parallel_attention", "zigzag_shard", "zigzag_unshard"]


class _Core(nn.Cell):
    """``softmax(q k^T * scale) v`` in the internal layout; marked for recompute or not.

    The causal positions are attributes (constants of a compiled graph), so the cell's
    inputs are only the tensors its backward would otherwise keep intermediates of.
    """

    def __init__(self, math, qpos, kpos, recompute):
        super().__init__()
        self.math, self.qpos, self.kpos = math, qpos, kpos
        if recompute:
            self.recompute()

    def construct(self, q, k, v):
        return self.math.dense(q, k, v, self.qpos, self.kpos)


class _Ulysses(nn.Cell):
    def __init__(self, group, sizes, causal, n, n_kv, d, scale, recompute=False):
        super().__init__()
        self.group, self.causal, self.d = group, causal, d
        self.sizes = None if len(set(sizes)) == 1 else list(sizes)
        G = group.size
        self.math = AttentionMath(n // G, n_kv // G, scale)
        total = sum(sizes)
        seg = ((0, total, 0),)
        self.qpos = positions(seg, tile=n // n_kv) if causal else None
        self.kpos = positions(seg) if causal else None
        self.core = _Core(self.math, self.qpos, self.kpos, recompute)

    def heads(self, x):
        s, b, h, d = x.shape
        y = mappings.all_to_all_from_sequence_to_hidden(x.reshape(s, b, h * d), self.group,
                                                        self.sizes)
        return y.reshape(y.shape[0], b, h // self.group.size, d)

    def construct(self, q, k, v):
        dtype = q.dtype
        q, k, v = self.heads(to_f32(q)), self.heads(to_f32(k)), self.heads(to_f32(v))
        m = self.math
        out = m.from_q(self.core(m.to_q(q), m.to_kv(k), m.to_kv(v)))
        S, B, n, D = out.shape
        out = mappings.all_to_all_from_hidden_to_sequence(out.reshape(S, B, n * D), self.group,
                                                          self.sizes)
        return ops.cast(out.reshape(out.shape[0], B, n * self.group.size, D), dtype)


class _AllGatherKV(nn.Cell):
    def __init__(self, group, sizes, causal, n, n_kv, d, scale, recompute=False):
        super().__init__()
        self.group, self.causal = group, causal
        self.sizes = None if len(set(sizes)) == 1 else list(sizes)
        self.math = AttentionMath(n, n_kv, scale)
        r = group.rank
        self.local = sizes[r]
        mine = ((0, sizes[r], sum(sizes[:r])),)
        self.qpos = positions(mine, tile=n // n_kv) if causal and sizes[r] else None
        self.kpos = positions(((0, sum(sizes), 0),)) if causal else None
        self.core = _Core(self.math, self.qpos if causal else None,
                          self.kpos if causal else None, recompute)

    def construct(self, q, k, v):
        # Positional arguments only: a keyword call packs (tensor, group) into one tuple,
        # and once this shared cell is not inlined (measured: 4 layers of tiny-gpt under
        # ms.jit) autodiff takes zeros_like of that tuple and fails on the group.
        dtype = q.dtype
        k = mappings.gather_from_sequence(to_f32(k), self.group, True, self.sizes)
        v = mappings.gather_from_sequence(to_f32(v), self.group, True, self.sizes)
        if self.local == 0:
            # No queries here; the gathers still ran (every rank takes part), and the
            # output depends on them so that a compiled graph keeps them.
            zero = (k.sum() + v.sum()) * 0.0
            return ops.cast(ops.zeros(q.shape, ms.float32) + zero, dtype)
        m = self.math
        out = m.from_q(self.core(m.to_q(to_f32(q)), m.to_kv(k), m.to_kv(v)))
        return ops.cast(out, dtype)


class _RingOutput(nn.Cell):
    """The ring's output without its log-sum-exp."""

    def __init__(self, *args):
        super().__init__()
        self.ring = RingAttention(*args)

    def construct(self, q, k, v):
        return self.ring(q, k, v)[0]


_CELLS: dict = {}


def _cell(method, g, sizes, causal, load_balance, n, n_kv, d, scale, recompute=False):
    compiled = compiling()
    # The ring's backward recomputes its blocks already: one cell serves both settings.
    recompute = bool(recompute) and method != "ring"
    key = (method, g, sizes, causal, load_balance, n, n_kv, d, scale, compiled, recompute)
    cell = _CELLS.get(key)
    if cell is None:
        if method == "ring":
            cell = _RingOutput(g, sizes, causal, load_balance, n, n_kv, d, scale, compiled)
        elif method == "ulysses":
            cell = _Ulysses(g, sizes, causal, n, n_kv, d, scale, recompute)
        else:
            cell = _AllGatherKV(g, sizes, causal, n, n_kv, d, scale, recompute)
        _CELLS[key] = cell
    return cell


def context_parallel_attention(q, k, v, group, *, method="ring", causal=False, softmax_scale=None,
                               split_sizes=None, load_balance=False, recompute=False):
    """Softmax attention over a sequence split across the ranks of ``group`` (cp).

    Args:
        q: ``(S_local, B, N, D)``, this rank's rows of the queries.
        k: ``(S_local, B, N_kv, D)`` with ``N % N_kv == 0`` (grouped-query attention:
            query head ``h`` uses key/value head ``h // (N / N_kv)``).
        v: ``(S_local, B, N_kv, D)``, like ``k``.
        group: The context-parallel group (a ParallelGroup or a backend group name).
        method: ``"ring"`` (default), ``"ulysses"`` or ``"allgather_kv"``.
        causal: Query at global position ``i`` sees keys ``0 .. i``.
        softmax_scale: Default ``1/sqrt(D)``.
        split_sizes: Rows of every group rank for an uneven sequence (as the mappings);
            None: every rank holds ``S_local`` rows.
        load_balance: Causal ring with the zigzag layout: the sequence cut in
            ``2*cp`` chunks, group rank r holding chunks ``r`` and ``2*cp-1-r`` (see
            :func:`zigzag_shard`); the output rows are in the same layout.
        recompute: Selective recompute: the attention core's scores and probabilities
            are not kept for the backward but computed again there (ulysses,
            all-gather KV; the ring's backward always recomputes them). The gradients
            are the same; the collectives run once.

    Returns:
        ``(S_local, B, N, D)`` in q's dtype: this rank's rows of the full attention.
        float16/bfloat16 inputs are computed in float32.

    Raises:
        ValueError: bad shapes, ``N % N_kv``, heads not divisible by the group size for
            ``ulysses``, bad ``split_sizes``, ``load_balance`` without causal ring or
            with ``split_sizes``; before any collective.

    Example (cp = 2, S = 8, each rank 4 rows): rank 0 passes rows 0-3 of q, k, v and
    gets rows 0-3 of ``softmax(q k^T / sqrt(D)) v`` over all 8 keys; rank 1 rows 4-7.
    """
    g = C.resolve_group(group)
    sizes, scale = check_inputs(q, k, v, g, method, causal, softmax_scale, split_sizes,
                                load_balance)
    if not isinstance(recompute, bool):
        raise ValueError(f"context_parallel_attention: recompute={recompute!r} must be True or "
                         "False (True: the attention core is recomputed in the backward).")
    n, n_kv, d = int(q.shape[2]), int(k.shape[2]), int(q.shape[3])
    if g.size == 1:
        method, load_balance = "allgather_kv", False  # one rank: plain attention
    return _cell(method, g, sizes, bool(causal), bool(load_balance), n, n_kv, d, scale,
                 recompute)(q, k, v)


# ----------------------------------------------------------------- zigzag layout
def _zigzag_rows(total, n, rank):
    if total % (2 * n):
        raise ValueError(f"zigzag: the sequence has {total} rows, not divisible by 2*{n} = "
                         f"{2 * n} chunks; pad it to a multiple of {2 * n}.")
    c = total // (2 * n)
    return np.concatenate([np.arange(rank * c, (rank + 1) * c),
                           np.arange((2 * n - 1 - rank) * c, (2 * n - rank) * c)]).astype(np.int32)


def zigzag_shard(x, group):
    """This rank's rows of the full sequence ``x`` ``(S, ...)`` in the zigzag layout.

    Group rank r of n gets chunks ``r`` and ``2n-1-r`` of ``2n`` equal chunks, in that
    order. Example, n = 2, S = 8: rank 0 gets rows 0, 1, 6, 7; rank 1 rows 2, 3, 4, 5.
    Differentiable (the gradient is scattered back into a zero full-sequence tensor).

    Raises:
        ValueError: S is not divisible by ``2n``.
    """
    g = C.resolve_group(group)
    index = ms.Tensor(_zigzag_rows(int(x.shape[0]), g.size, g.rank))
    return ops.gather(x, index, 0)


def zigzag_unshard(x, group):
    """The full sequence in natural order from every rank's zigzag rows ``x`` ``(S/n, ...)``.

    The inverse of :func:`zigzag_shard` (an all-gather over the group, then the rows put
    back in order). Example, n = 2: rank 0 holds rows 0, 1, 6, 7 and rank 1 rows 2-5; both
    get rows 0-7.
    """
    g = C.resolve_group(group)
    if g.size == 1:
        return x
    local = int(x.shape[0])
    full = mappings.gather_from_sequence(x, g, tensor_parallel_output_grad=False)
    order = np.concatenate([_zigzag_rows(local * g.size, g.size, r) for r in range(g.size)])
    inverse = np.empty_like(order)
    inverse[order] = np.arange(order.size, dtype=np.int32)
    return ops.gather(full, ms.Tensor(inverse), 0)
