"""Gradient finalization for data + tensor + context parallel training.

After ``value_and_grad`` each rank holds the gradients of ITS loss: its data-parallel
replica's micro-batch and its context-parallel chunk of the sequence. Before the
optimizer step two reductions make them the gradients of the global loss:

1. parameters marked ``param.sequence_parallel = True`` (layernorm weights, the bias of
   a sequence-parallel ``RowParallelLinear``) only saw this tp rank's chunk of the
   sequence: their gradients are SUMMED over the tp group (as Megatron does);
2. every gradient is AVERAGED over the dp-cp group (the replicas that saw different
   tokens), which is right when each rank's loss is the mean over its own tokens and
   every rank holds as many tokens.
3. MoE expert parameters (``param.expert_parallel``, see :mod:`mindscience.distributed.moe`)
   already hold the gradient of every token their experts received from the ranks of the
   dispatch group; they are SUMMED over the expert data-parallel group (edp, the ranks
   holding the same experts) and divided by the dp-cp size, which gives the dp-cp mean of
   the ranks' losses, as for the dense parameters. They take no part in step 2.
4. with pipeline parallelism, gradients stay per stage; parameters marked
   ``param.shared_embedding = True`` (an embedding tied between the first and the last
   stage, Megatron's name) are SUMMED over the embedding group (first + last stage,
   ``manager.get_embedding_group()``) first, so both copies take the same step.

Small gradients are packed into flat buffers ("buckets", ``bucket_size_mb`` each) so
that a model with hundreds of parameters pays a few collective latencies, not hundreds
(bench/bench_finalize.py measures it).

Example, 8 ranks as tp2 x cp2 x dp2: the dp-cp group of rank 0 is ranks {0, 2, 4, 6};
a layernorm weight's gradient on rank 0 becomes ``(g0 + g1)`` summed over its tp group
{0, 1}, then the mean of that over {0, 2, 4, 6}.

Use :class:`GradientFinalizer` (a Cell: build it once, call it in PyNative, under
``mindspore.jit`` or in GRAPH_MODE) or :func:`finalize_gradients` (PyNative and jit;
it builds and caches the Cell for the parameter list).
"""

from __future__ import annotations

import math
import numbers
from typing import Optional, Sequence

import mindspore as ms
from mindspore import nn, ops
from mindspore import dtype as mstype

from . import collectives as C
from . import manager
from .collectives import GroupLike, compiling
from .group import ParallelGroup

__all__ = ["GradientFinalizer", "finalize_gradients", "plan_buckets"]

DEFAULT_BUCKET_MB = 32.0

_ITEMSIZE = {
    mstype.float16: 2, mstype.bfloat16: 2, mstype.float32: 4, mstype.float64: 8,
}


def plan_buckets(indices: Sequence[int], numels: Sequence[int], dtypes: Sequence,
                 bucket_bytes: int) -> tuple:
    """Group parameter ``indices`` into buckets of one dtype and at most ``bucket_bytes``.

    Parameters keep their order inside a bucket; a parameter larger than the bucket
    gets one of its own. ``bucket_bytes = 0`` gives one bucket per parameter.

    Example: numels (10, 10, 30) in float32 with ``bucket_bytes=80`` ->
    ``((0, 1), (2,))``.
    """
    buckets = []
    open_ = {}  # dtype -> (indices, bytes)
    for i in indices:
        dt = dtypes[i]
        size = numels[i] * _ITEMSIZE.get(dt, 4)
        cur = open_.get(dt)
        if cur is not None and cur[1] + size > bucket_bytes:
            buckets.append(tuple(cur[0]))
            cur = None
        if cur is None:
            cur = ([], 0)
        cur[0].append(i)
        open_[dt] = (cur[0], cur[1] + size)
    for members, _ in open_.values():
        if members:
            buckets.append(tuple(members))
    return tuple(buckets)


def _where(buckets, count: int) -> tuple:
    """For each parameter, ``(bucket, position)`` in ``buckets``, or None."""
    where = [None] * count
    for b, bucket in enumerate(buckets):
        for pos, i in enumerate(bucket):
            where[i] = (b, pos)
    return tuple(where)


def _group(group: Optional[GroupLike], getter: str, key: str) -> ParallelGroup:
    if group is not None:
        return C.resolve_group(group)
    if manager.is_initialized():
        return getattr(manager, getter)()
    return ParallelGroup.trivial(key)


def _expert_group(group: Optional[GroupLike]) -> ParallelGroup:
    if group is not None:
        return C.resolve_group(group)
    if manager.is_initialized() and hasattr(manager, "get_expert_data_parallel_group"):
        return manager.get_expert_data_parallel_group()
    return ParallelGroup.trivial("edp")


class GradientFinalizer(nn.Cell):
    """The gradients a tp/cp/dp job needs before the optimizer step (see the module doc).

    Build it once, outside compiled code, from the trainable parameters (their order is
    the order of the gradients), then call it on the gradient tuple, e.g. inside a
    ``mindspore.jit`` train step::

        grad_fn = ms.value_and_grad(loss_fn, None, optimizer.parameters)
        finalize = GradientFinalizer(optimizer.parameters)

        @ms.jit
        def train_step(x, y):
            loss, grads = grad_fn(x, y)
            optimizer(finalize(grads))
            return loss

    Args:
        params: The parameters, in the order of the gradients.
        tp_group: Group of the sequence-parallel sum; default the manager's tp group
            (size 1 when the manager is not initialized).
        dp_cp_group: Group of the average; default the manager's dp-cp group.
        embedding_group: Group of the tied-parameter sum; default the manager's
            embedding group (size 1 off the first/last stage and when pp == 1).
        bucket_size_mb: Largest flat buffer in MiB; 0 reduces each gradient on its own.
        expert_dp_group: Group of the expert parameters' sum; default the manager's
            expert data-parallel group (edp).

    Inputs:
        grads: Tuple of gradients, one per parameter, shaped like it.

    Outputs:
        Tuple of the finalized gradients (same shapes and dtypes).

    Raises:
        ValueError: ``bucket_size_mb`` negative or not a number; (call) a gradient count
            that does not match the parameters.
    """

    def __init__(self, params, tp_group: Optional[GroupLike] = None,
                 dp_cp_group: Optional[GroupLike] = None,
                 bucket_size_mb: float = DEFAULT_BUCKET_MB,
                 embedding_group: Optional[GroupLike] = None,
                 expert_dp_group: Optional[GroupLike] = None):
        super().__init__()
        if (isinstance(bucket_size_mb, bool) or not isinstance(bucket_size_mb, numbers.Real)
                or bucket_size_mb < 0):
            raise ValueError(
                f"GradientFinalizer: bucket_size_mb={bucket_size_mb!r} must be a number >= 0 "
                "(MiB per flat buffer; 0 reduces each gradient on its own)"
            )
        params = list(params)
        self.num_params = len(params)
        # Compiling the per-parameter loops nests a few calls per parameter: MindSpore's
        # default limit (1000) failed at 120 parameters under ms.jit (measured).
        need = 1000 + 16 * len(params)
        if ms.get_context("max_call_depth") < need:
            ms.set_context(max_call_depth=need)
        self.shapes = tuple(tuple(p.shape) for p in params)
        numels = [math.prod(int(d) for d in shape) for shape in self.shapes]
        self.numels = tuple(numels)
        dtypes = [p.dtype for p in params]
        bucket_bytes = int(bucket_size_mb * (1 << 20))

        tp = _group(tp_group, "get_tensor_parallel_group", "tp")
        dpcp = _group(dp_cp_group, "get_data_context_parallel_group", "dp-cp")
        self.tp_size = tp.size
        self.dp_cp_size = dpcp.size
        sp = [i for i, p in enumerate(params) if getattr(p, "sequence_parallel", False)]
        self.tp_buckets = plan_buckets(sp, numels, dtypes, bucket_bytes) if tp.size > 1 else ()
        # A fully sharded parameter's gradient already is the dp-cp mean of its rows
        # (fsdp.py, contract C3): only the tp and embedding sums apply to it.
        replicated = [i for i, p in enumerate(params)
                      if getattr(p, "fsdp", None) is None and not getattr(p, "expert_parallel", False)]
        experts = [i for i, p in enumerate(params) if getattr(p, "expert_parallel", False)
                   and getattr(p, "fsdp", None) is None]
        edp = _expert_group(expert_dp_group) if experts else ParallelGroup.trivial("edp")
        self.edp_size = edp.size
        self.expert_scale = 1.0 / dpcp.size
        self.expert_buckets = (plan_buckets(experts, numels, dtypes, bucket_bytes)
                               if (edp.size > 1 or dpcp.size > 1) else ())
        self.expert_where = _where(self.expert_buckets, len(params))
        if edp.size > 1:
            self.edp_eager = C.kernels(edp, False)
            self.edp_graph = C.kernels(edp, True)
        for p in params:
            info = getattr(p, "fsdp", None)
            if info is not None and info.group.size > 1 and info.group.ranks != dpcp.ranks:
                raise ValueError(
                    f"GradientFinalizer: parameter {p.name!r} is fully sharded over the group "
                    f"{list(info.group.ranks)}, but the dp-cp group here is {list(dpcp.ranks)}; "
                    "its gradient is the mean over its own group only. Shard it over the dp-cp "
                    "group (fully_shard's default), or pass dp_cp_group=<that group>"
                )
        self.dp_buckets = (plan_buckets(replicated, numels, dtypes, bucket_bytes)
                           if dpcp.size > 1 else ())
        self.scale = 1.0 / dpcp.size
        emb = _group(embedding_group, "get_embedding_group", "embedding")
        tied = [i for i, p in enumerate(params) if getattr(p, "shared_embedding", False)]
        self.emb_buckets = plan_buckets(tied, numels, dtypes, bucket_bytes) if emb.size > 1 else ()
        self.emb_where = _where(self.emb_buckets, len(params))
        if emb.size > 1:
            self.emb_eager = C.kernels(emb, False)
            self.emb_graph = C.kernels(emb, True)
        self.tp_where = _where(self.tp_buckets, len(params))
        self.dp_where = _where(self.dp_buckets, len(params))
        # Both flavours of each group's kernel: the construct picks by mode (a folded
        # branch), because the Cell may be called eagerly and compiled.
        if tp.size > 1:
            self.tp_eager = C.kernels(tp, False)
            self.tp_graph = C.kernels(tp, True)
        if dpcp.size > 1:
            self.dp_eager = C.kernels(dpcp, False)
            self.dp_graph = C.kernels(dpcp, True)

    # ------------------------------------------------------------------ helpers
    def _flat(self, grads, bucket):
        """The bucket's gradients as one flat buffer (float32 for bfloat16 ones)."""
        parts = []
        for i in bucket:
            g = grads[i]
            if g.dtype == mstype.bfloat16:
                # CPU graph kernels of Reshape/StridedSlice lack bfloat16; float32 also
                # keeps the sum exact where bfloat16 would round.
                g = ops.cast(g, mstype.float32)
            parts.append(g.reshape((self.numels[i],)))
        if len(parts) == 1:
            return parts[0]
        return ops.cat(parts, 0)

    def _unflat(self, flat, grads, bucket):
        """The bucket's flat buffer cut back into its gradients' shapes and dtypes."""
        if len(bucket) == 1:
            flats = (flat,)
        else:
            sections = []
            for i in bucket:
                sections.append(self.numels[i])
            flats = ops.split(flat, tuple(sections), 0)
        pieces = []
        for j in range(len(bucket)):
            i = bucket[j]
            piece = flats[j].reshape(self.shapes[i])
            if grads[i].dtype != piece.dtype:
                piece = ops.cast(piece, grads[i].dtype)
            pieces.append(piece)
        return pieces

    def _tp_reduce(self, x):
        if compiling():
            return self.tp_graph.all_reduce(x)
        return self.tp_eager.all_reduce(x)

    def _emb_reduce(self, x):
        if compiling():
            return self.emb_graph.all_reduce(x)
        return self.emb_eager.all_reduce(x)

    def _edp_reduce(self, x):
        if compiling():
            return self.edp_graph.all_reduce(x)
        return self.edp_eager.all_reduce(x)

    def _dp_reduce(self, x):
        if compiling():
            return self.dp_graph.all_reduce(x)
        return self.dp_eager.all_reduce(x)

    # ------------------------------------------------------------------ forward
    def construct(self, grads):
        if len(grads) != self.num_params:
            raise ValueError(
                "GradientFinalizer: got " + str(len(grads)) + " gradients for "
                + str(self.num_params) + " parameters; pass the gradients of exactly the "
                "parameters the finalizer was built with, in the same order"
            )
        if self.emb_buckets:
            reduced = []
            for bucket in self.emb_buckets:
                reduced.append(self._unflat(self._emb_reduce(self._flat(grads, bucket)), grads, bucket))
            grads = self._replace(grads, self.emb_where, reduced)
        if self.tp_buckets:
            reduced = []
            for bucket in self.tp_buckets:
                reduced.append(self._unflat(self._tp_reduce(self._flat(grads, bucket)), grads, bucket))
            grads = self._replace(grads, self.tp_where, reduced)
        if self.dp_buckets:
            reduced = []
            for bucket in self.dp_buckets:
                flat = self._dp_reduce(self._flat(grads, bucket)) * self.scale
                reduced.append(self._unflat(flat, grads, bucket))
            grads = self._replace(grads, self.dp_where, reduced)
        if self.expert_buckets:
            reduced = []
            for bucket in self.expert_buckets:
                flat = self._flat(grads, bucket)
                if self.edp_size > 1:
                    flat = self._edp_reduce(flat)
                reduced.append(self._unflat(flat * self.expert_scale, grads, bucket))
            grads = self._replace(grads, self.expert_where, reduced)
        return grads

    def _replace(self, grads, where, reduced):
        # A new tuple rather than item assignment: compiled code passes lists by value,
        # so a list filled in a helper would come back unchanged (measured under ms.jit).
        out = []
        for i in range(self.num_params):
            w = where[i]
            if w is None:
                out.append(grads[i])
            else:
                out.append(reduced[w[0]][w[1]])
        return tuple(out)


_FINALIZERS: dict = {}


def finalize_gradients(grads, params, bucket_size_mb: float = DEFAULT_BUCKET_MB):
    """Function form of :class:`GradientFinalizer` with the manager's groups (PyNative).

    ``finalize_gradients(grads, params)`` returns the finalized gradient tuple. The
    Cell is built on the first call for these parameters (and the groups in force) and
    cached. In compiled code (``ms.jit``, GRAPH_MODE) build a :class:`GradientFinalizer`
    once outside and call it inside: looking the Cell up by its parameters needs Python
    that compiled code does not run (a ``RuntimeError`` says so).
    """
    if compiling():
        raise RuntimeError(
            "finalize_gradients cannot run inside compiled code (ms.jit / GRAPH_MODE): build "
            "finalize = mindscience.distributed.GradientFinalizer(params) outside the compiled "
            "function and call finalize(grads) inside it (PyNative runs finalize_gradients as is)"
        )
    return _cached_finalizer(params, bucket_size_mb)(grads)


def _cached_finalizer(params, bucket_size_mb):
    groups = ()
    if manager.is_initialized():
        groups = (manager.get_tensor_parallel_group(), manager.get_data_context_parallel_group(),
                  manager.get_embedding_group(), _expert_group(None))
    key = (tuple(p.name for p in params), groups, float(bucket_size_mb))
    cell = _FINALIZERS.get(key)
    if cell is None:
        cell = GradientFinalizer(params, bucket_size_mb=bucket_size_mb)
        _FINALIZERS[key] = cell
    return cell
