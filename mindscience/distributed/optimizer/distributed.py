"""The distributed optimizer Cell: ZeRO stages 0-3 in one step call.

``opt(grads)`` takes the raw per-rank gradients (from ``value_and_grad`` or
``pipeline.forward_backward``) and does the whole step:

1. sequence-parallel gradients summed over tp and tied ``shared_embedding`` ones over the
   embedding group (what :class:`~mindscience.distributed.finalize.GradientFinalizer`
   does, reused with a size-1 dp-cp group);
2. the dp-cp mean as bucketed collectives on fp32 flat buffers: an all-reduce at stage 0,
   a reduce-scatter at stages 1-2 that lands on each parameter's C1 shard (see
   :mod:`.layout`), nothing at stage 3 (``fully_shard``'s backward already did it);
3. optionally the global gradient norm (over shards, tp and pp) and clipping;
4. the update of this rank's shard on fp32 main weights (AdamW, Adam or SGD);
5. bucketed all-gathers of the updated weights into the model's parameters, in the
   model's dtype (stages 1-2); at stage 0 each rank updates the whole parameter, at
   stage 3 the shard Parameter in place.

With ``overlap_grad_reduce=True`` step 2's collectives are launched during the backward
(see :mod:`.overlap_rules` for what overlaps in which mode and :meth:`DistributedOptimizer.
overlap_backward`); the step waits on them and the result is the same bit for bit.

Main weights: a float32 parameter is its own fp32 main weight (stages 1-2: the rank's
rows of the full parameter are read, updated and all-gathered back; stage 3: the shard
Parameter is updated in place); a bf16 / fp16 parameter keeps an fp32 copy.

What a rank holds (contract C2), per local parameter element, d the group size, w the
model dtype's bytes: weights w (stage 3: w/d); the fp32 gradient buffer 4 (stages 0-1)
or 4/d (2-3); main weights 4 when w != 4 (:func:`.overlap_rules.main_weight_bytes`) and
moments 8 (Adam) or 4 (SGD with momentum), both divided by d at stages 1-3.
:meth:`DistributedOptimizer.memory_bytes` counts them from the Parameters.

Example, 4 ranks as dp4, stage 1, a (6, 4) weight: c = ceil(6/4) = 2, so rank 0 holds
rows 0-1 of the main weight and moments, rank 2 rows 4-5, rank 3 two zero rows; every
rank gets the whole updated (6, 4) weight back from the all-gather.
"""

from __future__ import annotations

import contextlib
import math
from typing import Mapping, Optional

import numpy as np

import mindspore as ms
from mindspore import Parameter, ParameterTuple, Tensor, nn, ops
from mindspore import dtype as mstype

from .. import collectives as C
from .. import manager
from ..collectives import GroupLike, compiling
from ..finalize import DEFAULT_BUCKET_MB, GradientFinalizer
from ..group import ParallelGroup
from . import overlap_rules, rules
from .errors import DistributedOptimizerError
from .layout import param_shard, plan_buckets, shard_range, state_names
from .validate import (check_fsdp, check_grads, check_group, check_options, check_overlap,
                       check_params)

__all__ = ["DistributedOptimizer"]

_DTYPE_NAMES = {mstype.float16: "float16", mstype.bfloat16: "bfloat16",
                mstype.float32: "float32", mstype.float64: "float64"}
_ITEMSIZE = {mstype.float16: 2, mstype.bfloat16: 2, mstype.float32: 4, mstype.float64: 8,
             mstype.int32: 4}


def _dtype_name(dtype) -> str:
    return _DTYPE_NAMES.get(dtype, str(dtype))


def _group(group: Optional[GroupLike], getter: str, key: str) -> ParallelGroup:
    if group is not None:
        return C.resolve_group(group)
    if manager.is_initialized():
        return getattr(manager, getter)()
    return ParallelGroup.trivial(key)


def _expert_dp_group(group: Optional[GroupLike]) -> ParallelGroup:
    if group is not None:
        return C.resolve_group(group)
    if manager.is_initialized() and hasattr(manager, "get_expert_data_parallel_group"):
        return manager.get_expert_data_parallel_group()
    return ParallelGroup.trivial("edp")


def _expert_model_group(group: Optional[GroupLike]) -> ParallelGroup:
    """The etp x ep group (the experts' distinct shards): given, or the manager's."""
    if group is not None:
        return C.resolve_group(group)
    if manager.is_initialized():
        return manager.get_group("etp-ep")
    return ParallelGroup.trivial("etp-ep")


def _world_rank() -> int:
    if manager.is_initialized():
        return manager._state().rank
    from mindspore.communication import get_rank

    return get_rank()


def _nbytes(p) -> int:
    return int(np.prod(p.shape, dtype=np.int64)) * _ITEMSIZE[p.dtype]


class DistributedOptimizer(nn.Cell):
    """A ZeRO stage 0-3 optimizer whose call does the whole distributed step.

    Build it once, eagerly, from the trainable parameters (their order is the gradients'
    order); call it with the raw per-rank gradients in PyNative, inside ``mindspore.jit``
    or in GRAPH_MODE::

        opt = DistributedOptimizer(net.trainable_params(), lr=1e-3, zero_stage=1)
        grad_fn = ms.value_and_grad(net, None, opt.parameters)

        @ms.jit
        def train_step(x, y):
            loss, grads = grad_fn(x, y)
            return loss, opt(grads)

    Args:
        params: The parameters, in the order of the gradients.
        optimizer: ``"adamw"`` (decoupled weight decay), ``"adam"`` (L2 decay added to the
            gradient) or ``"sgd"`` (with ``momentum``, L2 decay).
        lr: Learning rate, a float or a ``LearningRateSchedule`` evaluated at the number of
            steps done before this one (0 at the first call).
        betas: Adam's ``(beta1, beta2)``.
        eps: Adam's epsilon (added to the bias-corrected ``sqrt(v)``).
        weight_decay: Decay factor (see ``optimizer``).
        zero_stage: 0 replicated state (all-reduce), 1 sharded optimizer state, 2 also a
            sharded gradient buffer, 3 parameters already sharded by ``fully_shard``.
        group: The group the state is sharded over and gradients averaged over; default
            the manager's dp-cp group (size 1 when the manager is not initialized).
        bucket_size_mb: Largest fp32 flat buffer in MiB; None for the default (32 MiB, as
            GradientFinalizer), 0 for one buffer per parameter.
        main_params_dtype: Dtype of the main weights and moments; float32 only.
        max_grad_norm: Clip the global gradient norm to this value (None: no clipping).
        momentum: SGD momentum (keyword-only; 0 gives plain SGD without state).
        tp_group: Group of the sequence-parallel sum and of the norm; default the
            manager's tp group.
        pipeline_group: Group of the norm over stages; default the manager's pp group.
        embedding_group: Group of the tied-embedding sum; default the manager's.
        expert_dp_group: MoE expert weights (``param.expert_parallel``): the group their
            gradients are summed over and their state is sharded over (stages 1-3; stage
            3 shards them as stage 2); default the manager's expert data-parallel group.
            Their reduced gradient is that sum divided by the dp-cp size. They live in a
            second optimizer, ``self.expert_optimizer``.
        expert_tensor_and_model_group: The etp x ep group, over which the experts' distinct
            shards are summed into the norm (``max_grad_norm``); default the manager's
            ``"etp-ep"`` group.
        overlap_grad_reduce: Launch each bucket's dp-cp reduction (stage 0 all-reduce,
            stages 1-2 reduce-scatter) asynchronously as soon as its gradients are final,
            during the backward, and wait on it in the step (keyword-only). It takes
            effect when the backward tells the optimizer: ``GPTModel.forward_backward(...,
            optimizer=opt)``, or :meth:`overlap_backward` around a ``grad_fn`` call in
            PyNative; a plain ``opt(grads)`` reduces in the step as without it.
            :meth:`grad_reduce_overlap` says what overlaps in a mode. Same results bit
            for bit. Not with MoE expert weights (reduced in the step).
        overlap_param_gather: Overlap the all-gather of the updated weights (stages 1-2)
            with the next forward (keyword-only): in PyNative, once a model is attached
            (:meth:`attach_param_gather`; ``GPTModel.forward_backward(...,
            optimizer=opt)`` attaches itself), the step launches each bucket's all-gather
            and returns, and the next forward waits on each bucket as the first layer using
            it starts. Same weights bit for bit. Compiled steps and MoE expert weights
            gather in the step (:meth:`param_gather_overlap` says what overlaps).

    Inputs:
        grads: Tuple of gradients, one per parameter, shaped like it, in its dtype or
            float32.

    Outputs:
        With ``max_grad_norm``: the global gradient norm BEFORE clipping (float32 scalar,
        the same on every rank; tp-replicated parameters and the second copy of a tied
        embedding counted once, shard padding 0; MoE expert weights summed over their ep and
        etp shards and their edp ZeRO shards, each once: the one-rank model's norm). Both
        optimizers (dense and expert) clip with the same factor. Without: a bool scalar ``True`` (as
        ``mindspore.nn.Optimizer``), which the caller may ``ops.depend`` on.

    Raises:
        DistributedOptimizerError: bad options, parameters or group (at construction);
            gradients of the wrong count, shape or dtype (at the call, before any
            collective). Inside compiled code the call raises a plain ValueError.
    """

    def __init__(self, params, optimizer: str = "adamw", lr=1e-3, betas=(0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0.0, zero_stage: int = 1,
                 group: Optional[GroupLike] = None, bucket_size_mb: Optional[float] = None,
                 main_params_dtype=mstype.float32, max_grad_norm: Optional[float] = None, *,
                 momentum: float = 0.9, tp_group: Optional[GroupLike] = None,
                 pipeline_group: Optional[GroupLike] = None,
                 embedding_group: Optional[GroupLike] = None,
                 expert_dp_group: Optional[GroupLike] = None,
                 expert_tensor_and_model_group: Optional[GroupLike] = None,
                 overlap_grad_reduce: bool = False, overlap_param_gather: bool = False,
                 _expert_grad_scale: Optional[float] = None, _expert_norm_groups=None):
        super().__init__(auto_prefix=False)
        params = list(params)
        all_params = params
        self.expert_optimizer = None
        self.dense_index = ()
        self.expert_index = ()
        self.num_all_params = len(params)
        expert_idx = tuple(i for i, p in enumerate(params) if getattr(p, "expert_parallel", False))
        if expert_idx and _expert_grad_scale is None:
            # MoE expert weights (moe.MoELayer): their gradients are summed over the expert
            # data-parallel group (edp) and divided by the dp-cp size; their state is
            # sharded over edp (stage 3: as stage 2, fully_shard leaves them whole).
            # With max_grad_norm this optimizer adds their squared norm (over edp, etp x ep
            # and pp) to the dense one and clips both with one factor (construct).
            dense_idx = tuple(i for i in range(len(params)) if i not in expert_idx)
            if not dense_idx:
                raise DistributedOptimizerError(
                    "DistributedOptimizer: every parameter is an MoE expert weight; pass the "
                    "model's parameters (the router and the dense layers too).")
            self.dense_index = dense_idx
            self.expert_index = expert_idx
            dpcp = _group(group, "get_data_context_parallel_group", "dp-cp")
            edp = _expert_dp_group(expert_dp_group)
            norm_groups = None
            if max_grad_norm is not None:
                norm_groups = (_expert_model_group(expert_tensor_and_model_group),
                               _group(pipeline_group, "get_pipeline_parallel_group", "pp"))
            self.expert_optimizer = DistributedOptimizer(
                [params[i] for i in expert_idx], optimizer, lr, betas, eps, weight_decay,
                min(int(zero_stage), 2) if isinstance(zero_stage, int) else zero_stage, edp,
                bucket_size_mb, main_params_dtype, None, momentum=momentum,
                tp_group=ParallelGroup.trivial("tp"), pipeline_group=ParallelGroup.trivial("pp"),
                embedding_group=ParallelGroup.trivial("embedding"),
                _expert_grad_scale=1.0 / dpcp.size, _expert_norm_groups=norm_groups)
            params = [params[i] for i in dense_idx]
        schedule = isinstance(lr, nn.learning_rate_schedule.LearningRateSchedule)
        check_overlap(overlap_grad_reduce, overlap_param_gather)
        beta1, beta2 = check_options(optimizer, zero_stage, betas, eps, weight_decay,
                                     bucket_size_mb, max_grad_norm, momentum, schedule, lr)
        if main_params_dtype != mstype.float32:
            raise DistributedOptimizerError(
                f"DistributedOptimizer: main_params_dtype={main_params_dtype} is invalid: "
                "expected mindspore.float32 (the main weights and moments are fp32; the model "
                "may be bf16/fp16).")
        dtype_names = [_dtype_name(getattr(p, "dtype", None)) for p in params]
        check_params(params, dtype_names)
        if _expert_grad_scale is not None:
            grp = C.resolve_group(group)  # the expert data-parallel group
        else:
            grp = _group(group, "get_data_context_parallel_group", "dp-cp")
            dp_cp = None
            if manager.is_initialized():
                dp_cp = manager.get_layout().group_of(_world_rank(), "dp-cp")
            check_group(grp, _world_rank() if grp.size > 1 or dp_cp is not None
                        else grp.global_rank, dp_cp)
        shapes = [tuple(p.shape) for p in params]
        check_fsdp(params, shapes, zero_stage, grp)
        # Compiling the per-parameter loops nests a few calls per parameter (see finalize).
        need = 1000 + 24 * len(params)
        if ms.get_context("max_call_depth") < need:
            ms.set_context(max_call_depth=need)

        self.stage = int(zero_stage)
        self.kind = optimizer
        self.d = grp.size
        self.group = grp
        self.num_params = len(params)
        self.shapes = tuple(shapes)
        self.dtype_names = tuple(dtype_names)
        self.model_params = ParameterTuple(params)
        # Dtypes as constants: reading them off the tuple's items failed in GRAPH_MODE.
        self.param_dtypes = tuple(p.dtype for p in params)
        full = [tuple(p.fsdp.full_shape) if self.stage == 3 else s for p, s in zip(params, shapes)]
        self.shards = tuple(param_shard(s, self.d) for s in full)
        sharded = self.stage > 0
        mb = DEFAULT_BUCKET_MB if bucket_size_mb is None else bucket_size_mb
        self.buckets = plan_buckets(self.shards, dtype_names, int(mb * (1 << 20)), sharded)
        # Per parameter: the shape of its state and of its gradient inside the update.
        self.state_shapes = tuple(sh.shard_shape if sharded else sh.shape for sh in self.shards)
        self.comm = self.d > 1 and self.stage < 3
        if self.comm:
            self.k_eager = C.kernels(grp, False)
            self.k_graph = C.kernels(grp, True)
        # Experts: the sum over edp divided by the dp-cp size (GradientFinalizer's rule).
        # Stage 3: fully_shard's reduce-scatter already gave the dp-cp mean (no second 1/d).
        if _expert_grad_scale is not None:
            self.scale = float(_expert_grad_scale)
        else:
            self.scale = 1.0 if self.stage == 3 else 1.0 / self.d

        # tp / embedding sums: GradientFinalizer with a size-1 dp-cp group.
        tp = _group(tp_group, "get_tensor_parallel_group", "tp")
        emb = _group(embedding_group, "get_embedding_group", "embedding")
        pp = _group(pipeline_group, "get_pipeline_parallel_group", "pp")
        needs_pre = (
            (tp.size > 1 and any(getattr(p, "sequence_parallel", False) for p in params))
            or (emb.size > 1 and any(getattr(p, "shared_embedding", False) for p in params)))
        self.pre = None
        if needs_pre:
            # No dp-cp mean in it: a size-1 group, or at stage 3 the fully_shard group, whose
            # parameters GradientFinalizer leaves to fully_shard's reduce-scatter.
            none = grp if self.stage == 3 else ParallelGroup.trivial("dp-cp")
            self.pre = GradientFinalizer(params, tp_group=tp, dp_cp_group=none,
                                         embedding_group=emb, bucket_size_mb=mb)

        self.max_grad_norm = None if max_grad_norm is None else float(max_grad_norm)
        self._setup_norm(params, tp, pp, _expert_norm_groups)
        self._setup_hyper(lr, schedule, beta1, beta2, eps, weight_decay, momentum)
        self._setup_state(params)
        self._setup_overlap(params, tp, emb, overlap_grad_reduce, overlap_param_gather)
        for p in all_params:
            p.msdist_optimizer_built = True

    # ------------------------------------------------------------------ construction
    def _setup_norm(self, params, tp, pp, expert_groups=None):
        """Which parameters the norm counts on this rank, and the groups it sums over.

        ``expert_groups``: (etp x ep, pp) of an expert optimizer whose squared norm the
        dense one adds (every expert shard is distinct over them; tp is size 1 here)."""
        counted = []
        for p in params:
            tp_split = (getattr(p, "tensor_model_parallel", False)
                        or getattr(p, "parallel_axis", None) == "tp")
            # A tp-replicated parameter's gradient is the same on every tp rank; a tied
            # embedding lives on the first and the last stage: count each once.
            keep = tp_split or tp.rank == 0
            tied_copy = getattr(p, "shared_embedding", False) and pp.size > 1 and pp.rank > 0
            keep = keep and not tied_copy
            counted.append(bool(keep))
        self.counted = tuple(counted)
        groups = []
        if expert_groups is not None:
            # Stage 0: every edp rank holds the whole reduced gradient (no sum over edp).
            groups = [g for g in ((self.group if self.stage > 0 else None),) + tuple(expert_groups)
                      if g is not None and g.size > 1]
        elif self.max_grad_norm is not None:
            # Stage 0: every dp-cp rank holds the whole reduced gradient (no sum over it).
            groups = [g for g in ((self.group if self.stage > 0 else None), tp, pp)
                      if g is not None and g.size > 1]
        self.num_norm_groups = len(groups)
        self.norm_eager = nn.CellList([C.kernels(g, False) for g in groups])
        self.norm_graph = nn.CellList([C.kernels(g, True) for g in groups])

    def _setup_hyper(self, lr, schedule, beta1, beta2, eps, weight_decay, momentum):
        self.lr_schedule = lr if schedule else None
        self.lr = 0.0 if schedule else float(lr)
        self.beta1, self.beta2 = beta1, beta2
        self.eps = float(eps)
        self.wd = float(weight_decay)
        self.momentum = float(momentum)
        self.has_momentum = self.kind == "sgd" and self.momentum > 0
        self.log_beta1 = math.log(beta1) if beta1 > 0 else -1e30
        self.log_beta2 = math.log(beta2) if beta2 > 0 else -1e30

    def _setup_state(self, params):
        """fp32 main weights (this rank's shard), moments and the gradient buffers."""
        names = state_names(self.kind, self.momentum)
        self.state_names = names
        rank = self.group.rank
        mains, moments = [], {n: [] for n in names}
        # Float32 parameters are their own main weights (issue 37, part 4): only the
        # others keep an fp32 copy. main_slot[i]: parameter i's index in mains, or -1.
        self.main_members = tuple(i for i, dt in enumerate(self.dtype_names) if dt != "float32")
        self.main_slot = tuple(self.main_members.index(i) if i in self.main_members else -1
                               for i in range(len(params)))
        self.has_main = bool(self.main_members)
        # Stages 1-2: the (start, stop) rows of each parameter this rank updates.
        self.own_rows = tuple(shard_range(sh.rows, self.d, rank) for sh in self.shards)
        for i, (p, sh, shape) in enumerate(zip(params, self.shards, self.state_shapes)):
            for n in names:
                moments[n].append(Parameter(Tensor(np.zeros(shape, np.float32)), name=f"{p.name}.{n}",
                                            requires_grad=False))
            if self.main_slot[i] < 0:
                continue
            data = p.asnumpy() if p.dtype != mstype.bfloat16 else p.astype(mstype.float32).asnumpy()
            data = np.asarray(data, np.float32).reshape(shape if self.stage == 3 else sh.shape)
            if self.stage in (1, 2):
                start, stop = shard_range(sh.rows, self.d, rank)
                shard = np.zeros(sh.shard_shape, np.float32)
                shard[: stop - start] = data[start:stop]
                data = shard
            mains.append(Parameter(Tensor(data), name=f"{p.name}.main", requires_grad=False))
        self.mains = ParameterTuple(mains)
        self.moments = tuple(ParameterTuple(moments[n]) for n in names)
        self.m1 = self.moments[0] if names else ParameterTuple([])
        self.m2 = self.moments[1] if len(names) > 1 else ParameterTuple([])
        # Stages 0-1 keep the whole fp32 gradient (stage 1: padded, cut into d chunks);
        # stages 2-3 only this rank's reduced chunk.
        bufs = []
        for b in self.buckets:
            size = b.size if self.stage == 1 else b.chunk
            first = params[b.members[0]].name
            bufs.append(Parameter(Tensor(np.zeros((size,), np.float32)), name=f"{first}.grad_buffer",
                                  requires_grad=False))
        self.grad_buffers = ParameterTuple(bufs)
        self.step = Parameter(Tensor(0, mstype.int32), name=f"{params[0].name}.optimizer_step",
                              requires_grad=False)

    def _setup_overlap(self, params, tp, emb, grad_reduce, param_gather):
        """The launch state of ``overlap_grad_reduce`` (None when nothing can be launched)."""
        self.overlap_grad_reduce = bool(grad_reduce)
        self.overlap_param_gather = bool(param_gather)
        self._use_launched = False  # True only inside an eager step with launched buckets
        self._overlap = None
        self._param_gather = None
        self._defer_gather = False  # True only inside an eager step whose gathers are deferred
        if (self.overlap_param_gather and self.stage in (1, 2) and self.d > 1 and self.comm
                and self.expert_optimizer is None):
            from .overlap import ParamGather

            self._param_gather = ParamGather(self)
        if not (self.overlap_grad_reduce and self.comm and self.expert_optimizer is None):
            return
        from .overlap import GradOverlap

        # Gradients summed over tp (sequence-parallel) or the embedding group first: their
        # buckets are reduced in the step, after that sum.
        skip = {i for i, p in enumerate(params)
                if (tp.size > 1 and getattr(p, "sequence_parallel", False))
                or (emb.size > 1 and getattr(p, "shared_embedding", False))}
        self._overlap = GradOverlap(self, skip)

    # ------------------------------------------------------------------ overlap
    def grad_reduce_overlap(self, mode: str, pp: int = 1) -> tuple:
        """``(overlapped, sentence)``: does this optimizer's dp-cp reduction run during the
        backward of a ``forward_backward(mode=mode, optimizer=self)`` at pipeline size
        ``pp``? :func:`.overlap_rules.grad_reduce_overlap`, or why this optimizer does not
        (the option off, a group of one rank, MoE expert weights)."""
        if not self.overlap_grad_reduce:
            return False, "overlap_grad_reduce=False: the dp-cp reduction runs in the step."
        if self.expert_optimizer is not None:
            return False, ("MoE expert weights: the optimizer reduces the dense and expert "
                           "gradients in the step.")
        if self.stage < 3 and not self.comm:
            return False, "the dp-cp group has one rank: there is no reduction to overlap."
        return overlap_rules.grad_reduce_overlap(mode, self.stage, pp)

    def param_gather_overlap(self, mode: str) -> tuple:
        """``(overlapped, sentence)``: does this optimizer's all-gather of the updated weights
        overlap the next forward in ``mode``? :func:`.overlap_rules.param_gather_overlap`, or
        why this optimizer does not (the option off, a group of one rank, MoE expert weights)."""
        if not self.overlap_param_gather:
            return False, "overlap_param_gather=False: the weights are gathered in the step."
        if self.expert_optimizer is not None:
            return False, "MoE expert weights: the optimizer gathers the weights in the step."
        if self.stage in (1, 2) and not (self.comm and self.d > 1):
            return False, "the dp-cp group has one rank: there is no all-gather to overlap."
        return overlap_rules.param_gather_overlap(mode, self.stage)

    def attach_param_gather(self, cell) -> int:
        """Let the next forward of ``cell`` wait for the updated weights bucket by bucket.

        With ``overlap_param_gather`` at stages 1-2 (PyNative), the step launches each
        bucket's all-gather and returns; a forward pre-hook on every sub-cell of ``cell``
        that owns one of this optimizer's parameters waits on its bucket and writes the
        weights just before the sub-cell runs (a sub-cell that reads another cell's weight
        without calling it lists that cell in its ``reads_parameters_of`` attribute, as
        GPTModel's output head does). Without an attached cell the step gathers
        before it returns, as without the option. ``GPTModel.forward_backward(...,
        optimizer=opt)`` attaches the model itself. Until that forward, the parameters
        hold the previous step's weights: call :meth:`finish_param_gather` before reading
        them in any other way (the next step and ``checkpoint.save``/``load`` do; a
        compiled forward does not run the hooks, so finish before one)::

            opt.attach_param_gather(net)
            for x, y in batches:
                loss, grads = grad_fn(x, y)     # waits on each bucket as its layer starts
                opt(grads)                      # launches the gathers and returns
            opt.finish_param_gather()           # the last step's weights, written

        Args:
            cell: The model (or stage) whose forward uses the parameters.

        Returns:
            How many sub-cells are hooked (0 when nothing is deferred: the option off, stage
            0 or 3, one rank).
        """
        if self._param_gather is None:
            return 0
        return self._param_gather.attach(cell)

    def finish_param_gather(self) -> None:
        """Wait on every launched weight all-gather and write the weights (a no-op when
        none is in flight; see :meth:`attach_param_gather`)."""
        if self._param_gather is not None:
            self._param_gather.finish()

    def param_gather_waits(self) -> dict:
        """``{"hook": n, "finish": n}``: buckets of launched weight gathers written so far by
        a forward pre-hook and by :meth:`finish_param_gather` (all zero without deferral)."""
        return dict(self._param_gather.waited) if self._param_gather is not None else {"hook": 0, "finish": 0}

    @contextlib.contextmanager
    def overlap_backward(self, accumulated: Optional[Mapping] = None):
        """Launch the reduction of each bucket during the backward run inside (PyNative).

        Arms a ``Parameter.register_hook`` hook on each parameter (removed on exit); call
        the optimizer with that backward's gradients next. Does nothing without
        ``overlap_grad_reduce``, in compiled code, or where :meth:`grad_reduce_overlap`
        says nothing overlaps::

            with opt.overlap_backward():
                loss, grads = grad_fn(x, y)
            opt(grads)          # waits on the launched buckets

        Args:
            accumulated: ``{parameter name: gradient summed over the earlier
                micro-batches}`` when the gradients passed to the step are that sum plus
                this backward's (as ``GPTModel.forward_backward`` accumulates); None when
                this backward's gradients are the whole.

        Yields:
            None.
        """
        if self._overlap is None or compiling() or ms.get_context("mode") != ms.PYNATIVE_MODE:
            yield
            return
        self._overlap.arm(accumulated)
        try:
            yield
        finally:
            self._overlap.disarm()

    def grads_ready(self, grads: Mapping) -> None:
        """Launch the reduction of every bucket whose gradients are all final now.

        The pipeline calls it after a stage chunk's last backward. Does nothing without
        ``overlap_grad_reduce``.

        Args:
            grads: ``{parameter name: final gradient}`` (names of other parameters are
                ignored).
        """
        if self._overlap is not None and not compiling():
            self._overlap.grads_ready(grads)

    def start_step(self) -> None:
        """Forget gradients marked since the last step (a backward whose step never ran);
        ``GPTModel.forward_backward(optimizer=...)`` calls it first."""
        if self._overlap is not None:
            self._overlap.finish()

    def overlap_timeline(self) -> list:
        """The last step's launched buckets: ``[{"bucket", "launched_s", "waited_s",
        "done_s"}]`` (``time.perf_counter()`` seconds), in launch order; empty without
        overlap."""
        return [] if self._overlap is None else [dict(r) for r in self._overlap.timeline]

    # ------------------------------------------------------------------ accounting
    def memory_bytes(self) -> dict:
        """Bytes this rank holds (contract C2), counted from the Parameters, padding included.

        Returns:
            ``{"weights", "gradients", "optimizer"}``: the model's parameters (stage 3: the
            shards), the fp32 gradient buffers, the main weights and moments (not the step
            counter).
        """
        state = list(self.mains)
        for group in self.moments:
            state.extend(group)
        out = {"weights": sum(_nbytes(p) for p in self.model_params),
               "gradients": sum(_nbytes(b) for b in self.grad_buffers),
               "optimizer": sum(_nbytes(p) for p in state)}
        if self.expert_optimizer is not None:
            for k, v in self.expert_optimizer.memory_bytes().items():
                out[k] += v
        return out

    def state_elements(self) -> int:
        """Elements of the optimizer state (main weights + moments) on this rank."""
        n = sum(int(np.prod(p.shape)) for p in self.mains)
        for group in self.moments:
            n += sum(int(np.prod(p.shape)) for p in group)
        if self.expert_optimizer is not None:
            n += self.expert_optimizer.state_elements()
        return n

    def tensors_of(self, param) -> list:
        """``param`` and what this optimizer (or its ``expert_optimizer``, for an MoE expert
        weight) holds for it: its fp32 main weight (if any) and its moments, in order.

        Raises:
            DistributedOptimizerError: ``param`` is not one of the optimizer's parameters.
        """
        for k, p in enumerate(self.model_params):
            if p is param:
                slot = self.main_slot[k]
                return ([param] + ([self.mains[slot]] if slot >= 0 else [])
                        + [m[k] for m in self.moments])
        if self.expert_optimizer is not None:
            return self.expert_optimizer.tensors_of(param)
        raise DistributedOptimizerError(
            f"DistributedOptimizer.tensors_of: {getattr(param, 'name', param)!r} is not one of "
            "the parameters this optimizer was built with.")

    # ------------------------------------------------------------------ step
    def __call__(self, *args, **kwargs):
        # PyNative: check the gradients with the typed error before any collective.
        # (Compiled code checks in construct with built-in errors.)
        if (args and self.expert_optimizer is not None and not compiling()
                and isinstance(args[0], (tuple, list)) and len(args[0]) != self.num_all_params):
            raise DistributedOptimizerError(
                f"DistributedOptimizer: got {len(args[0])} gradients for {self.num_all_params} "
                "parameters; pass the gradients of exactly the parameters the optimizer was "
                "built with, in the same order.")
        if (args and self.expert_optimizer is None and not compiling()
                and ms.get_context("mode") == ms.PYNATIVE_MODE):
            grads = args[0]
            check_grads(grads, self.shapes, self.dtype_names,
                        [_dtype_name(getattr(g, "dtype", None)) for g in grads]
                        if isinstance(grads, (tuple, list)) else ())
            if self._param_gather is not None:
                # The last step's weights first (a step without a forward between); then
                # this step's gathers are launched, not waited on, when a forward will.
                self._param_gather.finish()
                self._defer_gather = self._param_gather.attached
            try:
                if self._overlap is None:
                    return super().__call__(*args, **kwargs)
                # Eager step after a backward that launched buckets: take their results.
                self._use_launched = self._overlap.pending()
                try:
                    return super().__call__(*args, **kwargs)
                finally:
                    self._use_launched = False
                    self._overlap.finish()
            finally:
                self._defer_gather = False
        return super().__call__(*args, **kwargs)

    def construct(self, grads):
        if self.expert_optimizer is None:
            return self._step(grads)
        dense = []
        for i in self.dense_index:
            dense.append(grads[i])
        experts = []
        for i in self.expert_index:
            experts.append(grads[i])
        if self.max_grad_norm is None:
            done = self.expert_optimizer(tuple(experts))
            return ops.depend(self._step(tuple(dense)), done)
        # One global norm: the dense squares (dp-cp, tp, pp) plus the experts' (edp,
        # etp x ep, pp), then the same clipping factor for both optimizers.
        eo = self.expert_optimizer
        e_shards, e_step, e_lr = eo._prepare(tuple(experts))
        shards, step, lr = self._prepare(tuple(dense))
        norm = ops.sqrt(self._sum_squares(shards) + eo._sum_squares(e_shards))
        coef = ops.minimum(self.max_grad_norm / (norm + 1e-6), 1.0)
        e_done = eo._write_back(eo._update(_scaled(e_shards, coef), e_step, e_lr))
        done = self._write_back(self._update(_scaled(shards, coef), step, lr))
        return ops.depend(ops.depend(norm, done), e_done)

    def _prepare(self, grads):
        """Count the step; the reduced gradients (state shapes), the step and the lr."""
        self._check_compiled(grads)
        step = self.step + 1
        step = ops.depend(step, ops.assign(self.step, step))
        lr = self._lr(step)
        if self.pre is not None:
            grads = self.pre(grads)
        return self._reduce(grads), step, lr

    def _step(self, grads):
        shards, step, lr = self._prepare(grads)
        norm = None
        if self.max_grad_norm is not None:
            norm = self._norm(shards)
            shards = _scaled(shards, ops.minimum(self.max_grad_norm / (norm + 1e-6), 1.0))
        new = self._update(shards, step, lr)
        done = self._write_back(new)
        if norm is None:
            return ops.depend(Tensor(True, mstype.bool_), done)
        return ops.depend(norm, done)

    def _check_compiled(self, grads):
        if len(grads) != self.num_params:
            raise ValueError("DistributedOptimizer: got " + str(len(grads)) + " gradients for "
                             + str(self.num_params) + " parameters; pass the gradients of "
                             "exactly the parameters the optimizer was built with")
        for i in range(self.num_params):
            if grads[i].shape != self.shapes[i]:
                raise ValueError("DistributedOptimizer: grads[" + str(i) + "] has the wrong "
                                 "shape; pass the gradients in the parameters' order")

    def _lr(self, step):
        if self.lr_schedule is None:
            return self.lr
        return self.lr_schedule(step - 1)

    def _kernel(self):
        if compiling():
            return self.k_graph
        return self.k_eager

    def _flat(self, grads, bucket):
        """The bucket's fp32 flat buffer (stages 1-2: ``d`` chunks, one per rank)."""
        parts = []
        for j in range(len(bucket.members)):
            i = bucket.members[j]
            sh = self.shards[i]
            g = ops.cast(grads[i], mstype.float32)
            if self.stage in (1, 2) and self.d > 1:
                g = g.reshape((sh.rows, sh.rest))
                if sh.pad:
                    g = ops.cat((g, ops.zeros((sh.pad, sh.rest), mstype.float32)), 0)
                g = g.reshape((self.d, sh.shard_numel))
            else:
                g = g.reshape((1, bucket.sections[j]))
            parts.append(g)
        flat = parts[0] if len(parts) == 1 else ops.cat(parts, 1)
        return flat.reshape((-1,))

    def _reduce(self, grads):
        """Every parameter's reduced (mean) gradient, in its state shape (fp32)."""
        out = [None] * self.num_params
        for b in range(len(self.buckets)):
            bucket = self.buckets[b]
            launched = None
            if self._use_launched:
                # Launched during the backward (overlap.py); stage 1's buffer written then.
                launched = self._overlap.take(b)
            if launched is not None:
                chunk = launched * self.scale
            else:
                chunk = self._reduce_bucket(grads, b, bucket)
            if self.stage != 1:
                chunk = ops.depend(chunk, ops.assign(self.grad_buffers[b], chunk))
            pieces = (chunk,) if len(bucket.members) == 1 else ops.split(chunk, bucket.sections, 0)
            for j in range(len(bucket.members)):
                i = bucket.members[j]
                out[i] = pieces[j].reshape(self.state_shapes[i])
        return out

    def _reduce_bucket(self, grads, b, bucket):
        """Bucket ``b``'s reduced (mean) gradient in the step (not launched before)."""
        flat = self._flat(grads, bucket)
        if self.stage == 1:
            flat = ops.depend(flat, ops.assign(self.grad_buffers[b], flat))
        if self.comm:
            if self.stage == 0:
                return self._kernel().all_reduce(flat) * self.scale
            return self._kernel().reduce_scatter(flat) * self.scale
        if self.scale != 1.0:
            return flat * self.scale
        return flat

    def _norm(self, shards):
        """The global L2 norm of the reduced gradients (see Outputs)."""
        return ops.sqrt(self._sum_squares(shards))

    def _sum_squares(self, shards):
        """The squared global norm of this optimizer's reduced gradients (summed over its
        norm groups: the same on every rank)."""
        total = ops.zeros((), mstype.float32)
        for i in range(self.num_params):
            if self.counted[i]:
                total = total + ops.sum(shards[i] * shards[i])
        total = total.reshape((1,))
        for k in range(self.num_norm_groups):
            if compiling():
                total = self.norm_graph[k].all_reduce(total)
            else:
                total = self.norm_eager[k].all_reduce(total)
        return total.reshape(())

    def _update(self, shards, step, lr):
        """The updated fp32 weights (this rank's shards at stages 1-3)."""
        t = ops.cast(step, mstype.float32)
        # 1 - beta^t as -expm1(t log beta): 1 - exp(...) in fp32 cancels to a relative
        # error of ~6e-5 at t = 1 for beta2 = 0.999 (and fp32's 0.999 itself is 1.3e-5
        # off), which showed as 5e-6 weight differences after 5 steps (measured).
        bc1 = -ops.expm1(t * self.log_beta1)
        bc2_sqrt = ops.sqrt(-ops.expm1(t * self.log_beta2))
        new = []
        for i in range(self.num_params):
            slot = self.main_slot[i]
            if slot >= 0:
                w = self.mains[slot]
            else:
                w = self._own_weight(i)
            if self.kind == "sgd":
                buf = self.m1[i] if self.has_momentum else None
                value = rules.sgd(w, shards[i], buf, lr, self.momentum, self.wd, self.has_momentum)
            else:
                value = rules.adam(w, shards[i], self.m1[i], self.m2[i], lr, self.beta1, self.beta2,
                                   self.eps, self.wd, bc1, bc2_sqrt, self.kind == "adamw")
            if slot >= 0:
                value = ops.depend(value, ops.assign(self.mains[slot], value))
            new.append(value)
        return new

    def _own_weight(self, i):
        """A float32 parameter as its own main weight, in its state shape: stages 1-2 this
        rank's rows, zero-padded (the padding stays 0, as a copy's did); stage 3 the shard."""
        p = self.model_params[i]
        if self.stage == 0:
            return p
        sh = self.shards[i]
        if self.stage == 3 or self.d == 1:
            if tuple(p.shape) == self.state_shapes[i]:
                return p
            return p.reshape(self.state_shapes[i])
        start, stop = self.own_rows[i]
        if stop == start:
            return ops.zeros(self.state_shapes[i], mstype.float32)
        rows = p.reshape((sh.rows, sh.rest))[start:stop]
        if stop - start < sh.shard_rows:
            pad = ops.zeros((sh.shard_rows - (stop - start), sh.rest), mstype.float32)
            rows = ops.cat((rows, pad), 0)
        return rows.reshape(self.state_shapes[i])

    def _write_back(self, new):
        """Write the updated weights into the model's parameters; returns a dependency."""
        done = []
        if self.stage in (1, 2) and self.d > 1:
            for b in range(len(self.buckets)):
                if self._defer_gather and not compiling():
                    # overlap_param_gather: launched here, written by the next forward.
                    flat = self._bucket_flat(new, self.buckets[b])
                    self._param_gather.launch(b, flat)
                    done.append(flat)
                else:
                    done.append(self._gather(new, self.buckets[b]))
        else:
            for i in range(self.num_params):
                done.append(self._assign(i, new[i]))
        return done

    def _assign(self, i, value):
        """Write ``value`` (cast to the parameter's dtype) into parameter ``i``."""
        dtype = self.param_dtypes[i]
        value = ops.cast(value, dtype)
        if dtype == mstype.bfloat16 and not compiling():
            # The CPU Assign kernel has no bfloat16 (measured); an in-place copy has. In
            # compiled code on CPU bf16 parameters cannot be written (Ascend/GPU can).
            return self.model_params[i].copy_(value)
        return ops.assign(self.model_params[i], value)

    def _bucket_flat(self, new, bucket):
        """This rank's updated shards of the bucket, flat, in the model dtype."""
        dtype = self.param_dtypes[bucket.members[0]]
        if compiling() and dtype == mstype.bfloat16:
            # CPU graph kernels of Reshape/Split lack bfloat16; the cast back is exact.
            dtype = mstype.float32
        parts = []
        for i in bucket.members:
            parts.append(ops.cast(new[i], dtype).reshape((-1,)))
        return parts[0] if len(parts) == 1 else ops.cat(parts, 0)

    def _gather(self, new, bucket):
        """All-gather the bucket's updated shards (model dtype) into its parameters."""
        full = self._kernel().all_gather(self._bucket_flat(new, bucket), 0)
        return self._write_gathered(full.reshape((self.d, bucket.chunk)), bucket)

    def _write_gathered(self, full, bucket):
        """Write the bucket's gathered shards, ``full`` (d, chunk), into its parameters."""
        cols = (full,) if len(bucket.members) == 1 else ops.split(full, bucket.sections, 1)
        done = []
        for j in range(len(bucket.members)):
            i = bucket.members[j]
            sh = self.shards[i]
            w = cols[j].reshape((self.d * sh.shard_rows, sh.rest))
            if sh.pad:
                # The cut in float32: a bf16 row slice keeps its parent's storage, which
                # the eager in-place copy of _assign rejects (measured); exact either way.
                w = ops.cast(w, mstype.float32)[: sh.rows]
            done.append(self._assign(i, w.reshape(self.shapes[i])))
        return done


def _scaled(shards, coef):
    out = []
    for g in shards:
        out.append(g * coef)
    return out
