"""Cross-entropy over logits whose vocabulary is split across the tensor-parallel group.

``vocab_parallel_cross_entropy(logits, target)`` takes this rank's columns of the
logits, ``(..., V/G)`` (e.g. the output of a ``ColumnParallelLinear(gather_output=False)``
language-model head) and the targets ``(...)`` as ids of the FULL vocabulary, and returns
the per-token loss ``(...)`` without ever gathering the logits (Megatron's
``vocab_parallel_cross_entropy``). Per token, with ``z`` the logits:

1. ``m = max_j z_j`` over the whole vocabulary: each rank's row maxima, gathered (a
   ``(..., G)`` tensor; CPU compiled code has only a SUM all-reduce, so no MAX) and
   reduced locally. Subtracting ``m`` keeps ``exp`` finite for any logits.
2. One all-reduce (sum) of three numbers per token: the target's shifted logit (only
   the rank that owns the target id contributes), ``sum_j exp(z_j - m)`` and
   ``sum_j (z_j - m)`` (for label smoothing).
3. ``loss = (1 - eps) * (lse - z_t) + eps * (lse - mean_j z_j)`` with
   ``lse = log sum_j exp(z_j - m)`` (shifted), which is ``ops.cross_entropy(full_logits,
   target, reduction="none", label_smoothing=eps)``.

Backward needs no communication: ``d loss / d z_j = softmax_j - (1 - eps) [j = t] -
eps / V``, from this rank's logits and the log-sum-exp kept from the forward. The math is
float32 for float16/bfloat16 logits; the loss is float32 and the logits' gradient has
the logits' dtype.

Example, tp = 2, V = 4: rank 0 holds columns 0-1 of the logits, rank 1 columns 2-3; a
token with target 3 takes its target logit from rank 1, and both ranks return the same
loss for it. Runs in PyNative, under ``ms.jit`` and in GRAPH_MODE (a Cell with a bprop).
"""

from __future__ import annotations

import numbers

import mindspore as ms
from mindspore import nn, ops

from .. import collectives as C
from .. import manager
from ..group import ParallelGroup
from ..collectives import compiling
from .embedding import check_ids

__all__ = ["vocab_parallel_cross_entropy"]

_NAME = "vocab_parallel_cross_entropy"


class _VocabParallelCrossEntropy(nn.Cell):
    """construct -> (loss, lse of the unshifted logits); bprop from the kept lse."""

    def __init__(self, group, compiled: bool, per_rank: int, label_smoothing: float):
        super().__init__()
        self.parallel = group.size > 1
        self.k = C.kernels(group, compiled) if self.parallel else None
        self.per_rank = per_rank
        self.vocab_size = per_rank * group.size
        self.start = group.rank * per_rank
        self.smoothing = float(label_smoothing)

    def _local_target(self, target):
        """This rank's column of each target (0 where another rank owns it), the mask."""
        owned = ops.logical_and(target >= self.start, target < self.start + self.per_rank)
        owned_i = owned.astype(target.dtype)
        return ((target - self.start) * owned_i).astype(ms.int32), owned.astype(ms.float32)

    def construct(self, logits, target):
        z = ops.cast(logits, ms.float32)
        local_max = ops.amax(z, -1, True)
        if self.parallel:
            # (..., 1) per rank -> (..., G): the max of maxima, no MAX reduction needed.
            local_max = ops.amax(self.k.all_gather(local_max, -1), -1, True)
        z = z - local_max
        column, owned = self._local_target(target)
        z_t = ops.gather_elements(z, -1, ops.expand_dims(column, -1)) * ops.expand_dims(owned, -1)
        sum_exp = ops.exp(z).sum(-1, keepdims=True)
        sum_z = z.sum(-1, keepdims=True)
        stats = ops.cat((z_t, sum_exp, sum_z), -1)
        if self.parallel:
            stats = self.k.all_reduce(stats)
        lse = ops.log(stats[..., 1])
        loss = lse - stats[..., 0]
        if self.smoothing > 0.0:
            loss = (1.0 - self.smoothing) * loss + self.smoothing * (
                lse - stats[..., 2] / self.vocab_size)
        return loss, lse + local_max[..., 0]

    def bprop(self, logits, target, out, dout):
        z = ops.cast(logits, ms.float32)
        probs = ops.exp(z - ops.expand_dims(out[1], -1))
        column, owned = self._local_target(target)
        hit = ops.one_hot(column, self.per_rank, ops.ones((), ms.float32),
                          ops.zeros((), ms.float32)) * ops.expand_dims(owned, -1)
        grad = probs - (1.0 - self.smoothing) * hit
        if self.smoothing > 0.0:
            grad = grad - self.smoothing / self.vocab_size
        grad = grad * ops.expand_dims(ops.cast(dout[0], ms.float32), -1)
        return ops.cast(grad, logits.dtype), ops.zeros_like(target)


_CELLS: dict = {}


def _group_of(group):
    """``group`` resolved, else the manager's tp group, else a size-1 group (no import
    statement here: compiled code calls it)."""
    if group is not None:
        return C.resolve_group(group)
    if manager.is_initialized():
        return manager.get_tensor_parallel_group()
    return _TRIVIAL


_TRIVIAL = ParallelGroup.trivial("tp")


def _check(logits, target, label_smoothing, group) -> None:
    lshape, tshape = tuple(logits.shape), tuple(target.shape)
    if len(lshape) < 1 or lshape[:-1] != tshape:
        raise ValueError(
            f"{_NAME}: vocab_parallel_logits has shape {lshape} and target {tshape}; expected "
            "logits (..., V/tp) and target (...) with the same leading dims (one target id "
            "per row of logits).")
    if logits.dtype not in (ms.float32, ms.float16, ms.bfloat16):
        raise ValueError(f"{_NAME}: vocab_parallel_logits must be float32/float16/bfloat16, "
                         f"got {logits.dtype}.")
    if target.dtype not in (ms.int32, ms.int64):
        raise ValueError(f"{_NAME}: target must hold int32/int64 ids, got {target.dtype}.")
    if isinstance(label_smoothing, bool) or not isinstance(label_smoothing, numbers.Real) \
            or not 0.0 <= float(label_smoothing) < 1.0:
        raise ValueError(f"{_NAME}: label_smoothing={label_smoothing!r} must be a number in "
                         "[0, 1).")
    if lshape[-1] < 1:
        raise ValueError(f"{_NAME}: vocab_parallel_logits has no columns (shape {lshape}).")


def vocab_parallel_cross_entropy(vocab_parallel_logits, target, label_smoothing=0.0,
                                 *, group=None):
    """Per-token cross-entropy of logits split over the vocabulary across tp.

    Args:
        vocab_parallel_logits: ``(..., V/tp)``, this tp rank's columns (group rank r holds
            vocabulary ids ``r*V/tp .. (r+1)*V/tp - 1``); float32, float16 or bfloat16.
        target: ``(...)`` int32/int64 ids of the full vocabulary, the same on every tp rank.
        label_smoothing: In ``[0, 1)``, as ``ops.cross_entropy``'s.
        group: Override the tp group (a ParallelGroup or a backend group name). Default:
            the manager's tp group, or a size-1 group if not initialized.

    Returns:
        ``(...)`` float32: the loss of each token, the same on every tp rank; equal
        (forward and backward) to ``ops.cross_entropy(full_logits, target,
        reduction="none", label_smoothing=label_smoothing)`` on the gathered logits.

    Raises:
        ValueError: mismatched shapes, wrong dtypes, ``label_smoothing`` outside
            ``[0, 1)``; in PyNative also a target outside ``[0, V)``. All before any
            collective.

    Example (tp = 2, V = 4, one token with target 2): rank 0 passes logits ``[[1., 2.]]``,
    rank 1 ``[[3., 4.]]``; both get ``[log(e^1 + e^2 + e^3 + e^4) - 3] = [1.4402]``.
    """
    g = _group_of(group)
    _check(vocab_parallel_logits, target, label_smoothing, g)
    per_rank = int(vocab_parallel_logits.shape[-1])
    if not compiling():
        check_ids(_NAME, target, per_rank * g.size, what="target ids")
    compiled = compiling()
    key = (g, per_rank, float(label_smoothing), compiled)
    cell = _CELLS.get(key)
    if cell is None:
        cell = _VocabParallelCrossEntropy(g, compiled, per_rank, label_smoothing)
        _CELLS[key] = cell
    return cell(vocab_parallel_logits, target)[0]
