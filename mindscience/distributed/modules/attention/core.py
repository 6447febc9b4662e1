"""Shared pieces of the context-parallel attentions: argument checks, the sequence plan
(which global positions each rank's rows hold) and the local attention math.

Layouts. The public tensors are ``(S, B, heads, D)`` with the sequence first. The math
runs in an internal layout that serves grouped-query attention without repeating K/V:
with ``g = N / N_kv`` query heads per K/V head, queries are ``(B, N_kv, g*L, D)``
(the ``g`` query heads of one K/V head stacked along the rows) and K/V ``(B, N_kv, L, D)``,
so one batched matmul per K/V head covers its whole query group and the K/V gradients
come out already summed over the group.

Masking uses a large finite negative number (``-1e30``), not ``-inf``: a row of a block
whose keys are all masked then gives a finite block log-sum-exp of about ``-1e30`` and
weight ``exp(-1e30 - lse) == 0`` in the merge, never ``0/0``.
"""

from __future__ import annotations

import math
import numbers

import numpy as np

import mindspore as ms
from mindspore import mint, nn, ops

NEG = -1e30
METHODS = ("ring", "ulysses", "allgather_kv")


# ----------------------------------------------------------------- validation (plain Python)
def check_inputs(q, k, v, group, method, causal, softmax_scale, split_sizes, load_balance):
    """Validate everything static; return ``(sizes tuple, scale float)``. Raises ValueError
    before any collective (at trace time in compiled code)."""
    name = "context_parallel_attention"
    if method not in METHODS:
        raise ValueError(f"{name}: method={method!r} is invalid: expected one of "
                         f"{', '.join(repr(m) for m in METHODS)}.")
    qs, ks, vs = tuple(q.shape), tuple(k.shape), tuple(v.shape)
    if len(qs) != 4 or len(ks) != 4 or ks != vs:
        raise ValueError(f"{name}: expected q (S_local, B, N, D) and k, v (S_local, B, N_kv, D) "
                         f"of equal shapes, got q {qs}, k {ks}, v {vs}.")
    if qs[0] != ks[0] or qs[1] != ks[1] or qs[3] != ks[3]:
        raise ValueError(f"{name}: q {qs} and k/v {ks} must agree on S_local, B and D.")
    n, n_kv = qs[2], ks[2]
    if n_kv < 1 or n % n_kv:
        raise ValueError(f"{name}: N={n} query heads are not a multiple of N_kv={n_kv} key/value "
                         "heads (grouped-query attention needs N % N_kv == 0).")
    G = group.size
    if method == "ulysses" and (n % G or n_kv % G):
        raise ValueError(
            f"{name}: method='ulysses' hands each of the {G} ranks of the group whole heads, "
            f"but N={n} / N_kv={n_kv} are not both divisible by {G}. Use method='ring' or "
            "'allgather_kv', or a head count that is a multiple of the group size.")
    if softmax_scale is None:
        scale = 1.0 / math.sqrt(qs[3])
    elif isinstance(softmax_scale, bool) or not isinstance(softmax_scale, numbers.Real) \
            or not softmax_scale > 0:
        raise ValueError(f"{name}: softmax_scale={softmax_scale!r} must be a positive number.")
    else:
        scale = float(softmax_scale)
    sizes = local_sizes(name, qs[0], group, split_sizes)
    if load_balance:
        if method != "ring" or not causal:
            raise ValueError(f"{name}: load_balance=True is the zigzag layout of the causal ring: "
                             f"it needs method='ring' and causal=True (got method={method!r}, "
                             f"causal={causal}).")
        if split_sizes is not None:
            raise ValueError(f"{name}: load_balance=True cuts the sequence into 2*{G} equal "
                             f"chunks and takes no split_sizes (got {split_sizes!r}); pad the "
                             f"sequence to a multiple of {2 * G}.")
        if qs[0] % 2:
            raise ValueError(f"{name}: load_balance=True: each rank holds 2 equal chunks, but "
                             f"S_local={qs[0]} is odd; pad the sequence to a multiple of {2 * G}.")
    return sizes, scale


def local_sizes(name, dim0, group, split_sizes) -> tuple:
    """The rows of every group rank (validated); this rank must hold ``dim0`` of them."""
    G = group.size
    if split_sizes is None:
        return (int(dim0),) * G
    if not isinstance(split_sizes, (list, tuple)) or len(split_sizes) != G:
        raise ValueError(f"{name}: split_sizes={split_sizes!r} must be a list of {G} sizes, one "
                         f"per rank of the group; e.g. mappings.even_split_sizes(S, {G}).")
    sizes = []
    for s in split_sizes:
        if isinstance(s, bool) or not isinstance(s, numbers.Integral) or s < 0:
            raise ValueError(f"{name}: split_sizes={list(split_sizes)!r} must hold integers >= 0, "
                             f"got {s!r}.")
        sizes.append(int(s))
    if sum(sizes) == 0:
        raise ValueError(f"{name}: split_sizes={sizes} hold no rows at all.")
    if sizes[group.rank] != dim0:
        raise ValueError(f"{name}: this rank's q/k/v hold {dim0} rows but split_sizes={sizes} "
                         f"gives group rank {group.rank} {sizes[group.rank]}; pass this rank's "
                         "shard, and the same sizes on every rank.")
    return tuple(sizes)


# ----------------------------------------------------------------- sequence plan
def segments_of(rank, sizes, load_balance) -> tuple:
    """``((row_start, length, global_start), ...)``: the contiguous global ranges held by
    ``rank``'s rows. Zigzag: rank r of n holds chunks r and 2n-1-r of 2n."""
    n = len(sizes)
    if load_balance:
        c = sizes[rank] // 2
        return ((0, c, rank * c), (c, c, (2 * n - 1 - rank) * c))
    if sizes[rank] == 0:
        return ()
    return ((0, sizes[rank], sum(sizes[:rank])),)


def visibility(q_seg, k_seg, causal) -> str:
    """"full", "none" or "partial": how much of ``k_seg`` the queries of ``q_seg`` see."""
    if not causal:
        return "full"
    q_first, q_last = q_seg[2], q_seg[2] + q_seg[1] - 1
    k_first, k_last = k_seg[2], k_seg[2] + k_seg[1] - 1
    if k_first > q_last:
        return "none"
    if k_last <= q_first:
        return "full"
    return "partial"


def positions(segs, tile=1):
    """Global positions of the rows of ``segs`` (int32), repeated ``tile`` times."""
    pos = np.concatenate([np.arange(s[2], s[2] + s[1]) for s in segs]).astype(np.int32)
    return ms.Tensor(np.tile(pos, tile))


# ----------------------------------------------------------------- the math
class AttentionMath(nn.Cell):
    """Layout changes and block attention; methods of a Cell so that a construct and a
    bprop may both call them in every mode (see docs/COMPILED_MODE.md)."""

    def __init__(self, n_heads, n_kv, scale):
        super().__init__()
        self.n, self.n_kv, self.g = n_heads, n_kv, n_heads // n_kv
        self.scale = scale
        self.strided_slice = ops.StridedSlice()

    def rows(self, x, start, length):
        """Rows ``start:start+length`` of dim 0."""
        if start == 0 and length == x.shape[0]:
            return x
        begin = (start,) + (0,) * (len(x.shape) - 1)
        end = (start + length,) + tuple(x.shape[1:])
        return self.strided_slice(x, begin, end, (1,) * len(x.shape))

    def lastdim(self, x, start, length):
        nd = len(x.shape)
        begin = (0,) * (nd - 1) + (start,)
        end = tuple(x.shape[:-1]) + (start + length,)
        return self.strided_slice(x, begin, end, (1,) * nd)

    def to_q(self, x):
        """``(L, B, N, D) -> (B, N_kv, g*L, D)``."""
        L, B, _, D = x.shape
        t = x.reshape(L, B, self.n_kv, self.g, D).transpose(1, 2, 3, 0, 4)
        return t.reshape(B, self.n_kv, self.g * L, D)

    def from_q(self, y):
        """``(B, N_kv, g*L, D) -> (L, B, N, D)``."""
        B, _, gl, D = y.shape
        L = gl // self.g
        t = y.reshape(B, self.n_kv, self.g, L, D).transpose(3, 0, 1, 2, 4)
        return t.reshape(L, B, self.n, D)

    def to_kv(self, x):
        """``(L, B, N_kv, D) -> (B, N_kv, L, D)``."""
        return x.transpose(1, 2, 0, 3)

    def from_kv(self, y):
        return y.transpose(2, 0, 1, 3)

    def scores(self, q, k, qpos, kpos):
        """``q k^T * scale`` with the causal mask of the positions (None: no mask)."""
        s = mint.matmul(q, k.transpose(0, 1, 3, 2)) * self.scale
        if qpos is not None:
            hidden = ops.expand_dims(kpos, 0) > ops.expand_dims(qpos, 1)
            s = s + hidden.astype(ms.float32) * NEG
        return s

    def block(self, q, k, v, qpos, kpos):
        """Attention of ``q`` over one block of keys: ``(out, lse)``, out normalized."""
        s = self.scores(q, k, qpos, kpos)
        m = ops.stop_gradient(ops.amax(s, -1, True))
        p = ops.exp(s - m)
        denom = p.sum(-1, keepdims=True)
        out = mint.matmul(p, v) / denom
        return out, (m + ops.log(denom))[..., 0]

    def merge(self, out, lse, out_b, lse_b):
        """Online softmax: combine two normalized partial results by their log-sum-exp."""
        mx = ops.maximum(lse, lse_b)
        a, b = ops.exp(lse - mx), ops.exp(lse_b - mx)
        total = a + b
        new_lse = mx + ops.log(total)
        wa, wb = ops.expand_dims(a / total, -1), ops.expand_dims(b / total, -1)
        return out * wa + out_b * wb, new_lse

    def dense(self, q, k, v, qpos, kpos):
        """Plain softmax attention in the internal layout (autodiff methods)."""
        out, _ = self.block(q, k, v, qpos, kpos)
        return out


def to_f32(x):
    return x if x.dtype == ms.float32 else ops.cast(x, ms.float32)
