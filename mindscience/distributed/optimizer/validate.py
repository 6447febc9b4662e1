"""Argument checks of :class:`DistributedOptimizer` (no MindSpore import).

Each takes plain values (parameters are read through their ``name``, ``shape`` and
attributes only) and raises :class:`~.errors.DistributedOptimizerError` naming the
value, what was expected and the fix. They depend only on the arguments and the layout,
so every rank raises the same error before any collective.
"""

from __future__ import annotations

import math
import numbers

from .errors import DistributedOptimizerError
from .layout import OPTIMIZERS, STAGES, is_number, shard_rows

__all__ = ["check_options", "check_params", "check_group", "check_fsdp", "check_grads",
           "check_overlap"]

PARAM_DTYPES = ("float16", "bfloat16", "float32")


def _fail(message: str):
    raise DistributedOptimizerError("DistributedOptimizer: " + message)


def check_options(optimizer, zero_stage, betas, eps, weight_decay, bucket_size_mb,
                  max_grad_norm, momentum, lr_is_schedule, lr) -> tuple:
    """Validate the scalar options; returns ``(beta1, beta2)`` as floats."""
    if not isinstance(zero_stage, numbers.Integral) or isinstance(zero_stage, bool) \
            or zero_stage not in STAGES:
        _fail(f"zero_stage={zero_stage!r} is invalid: expected 0, 1, 2 or 3 (0 replicates the "
              "optimizer state, 1 shards it, 2 also the gradients, 3 steps fully_shard "
              "parameters); pass one of those.")
    if optimizer not in OPTIMIZERS:
        _fail(f"optimizer={optimizer!r} is invalid: expected one of {', '.join(OPTIMIZERS)}.")
    if not lr_is_schedule and not (is_number(lr) and math.isfinite(lr) and lr >= 0):
        _fail(f"lr={lr!r} is invalid: expected a finite number >= 0 or a "
              "mindspore.nn.learning_rate_schedule.LearningRateSchedule.")
    if (not isinstance(betas, (tuple, list)) or len(betas) != 2
            or not all(is_number(b) and 0 <= b < 1 for b in betas)):
        _fail(f"betas={betas!r} is invalid: expected two numbers in [0, 1), e.g. (0.9, 0.999).")
    for name, value in (("eps", eps), ("weight_decay", weight_decay)):
        if not (is_number(value) and math.isfinite(value) and value >= 0):
            _fail(f"{name}={value!r} is invalid: expected a finite number >= 0.")
    if optimizer in ("adam", "adamw") and eps == 0:
        _fail("eps=0 is invalid for Adam(W): a zero second moment would divide by 0; pass "
              "e.g. eps=1e-8.")
    if bucket_size_mb is not None and not (is_number(bucket_size_mb) and bucket_size_mb >= 0):
        _fail(f"bucket_size_mb={bucket_size_mb!r} is invalid: expected None (the default size) "
              "or a number >= 0 (MiB per flat buffer; 0 gives one buffer per parameter).")
    if max_grad_norm is not None and not (is_number(max_grad_norm) and max_grad_norm > 0
                                          and math.isfinite(max_grad_norm)):
        _fail(f"max_grad_norm={max_grad_norm!r} is invalid: expected None (no clipping) or a "
              "finite number > 0.")
    if not (is_number(momentum) and 0 <= momentum < 1):
        _fail(f"momentum={momentum!r} is invalid: expected a number in [0, 1) (0: plain SGD).")
    return float(betas[0]), float(betas[1])


def check_params(params, dtype_names) -> None:
    """A non-empty list of distinct, uniquely named float parameters."""
    if not params:
        _fail("params is empty: pass the trainable parameters, e.g. net.trainable_params().")
    seen = {}
    for i, (p, dt) in enumerate(zip(params, dtype_names)):
        if not hasattr(p, "name") or not hasattr(p, "shape"):
            _fail(f"params[{i}] is a {type(p).__name__}, not a Parameter: pass "
                  "mindspore.Parameter objects.")
        if dt not in PARAM_DTYPES:
            _fail(f"params[{i}] ({p.name!r}) has dtype {dt}: expected one of "
                  f"{', '.join(PARAM_DTYPES)}.")
        if p.name in seen:
            _fail(f"params[{i}] and params[{seen[p.name]}] are both named {p.name!r}: the state "
                  "Parameters are named after them, so names must be unique (put the layers "
                  "in one parent Cell, or pass each parameter once).")
        seen[p.name] = i
        if getattr(p, "msdist_optimizer_built", False):
            _fail(f"params[{i}] ({p.name!r}) is already stepped by another DistributedOptimizer: "
                  "build one optimizer per parameter.")


def check_group(group, world_rank, dp_cp_ranks) -> None:
    """``group`` contains this rank and, when the layout is known, lies in its dp-cp group.

    Args:
        group: The optimizer group (``ranks``, ``rank``, ``key``).
        world_rank: This process's global rank.
        dp_cp_ranks: Members of this rank's dp-cp group, or None when no layout is known.
    """
    if world_rank not in group.ranks or group.ranks[group.rank] != world_rank:
        _fail(f"group {group.key!r} with ranks {list(group.ranks)} does not hold this rank "
              f"({world_rank}) at its group rank {group.rank}: pass this rank's own group, "
              "e.g. manager.get_data_context_parallel_group().")
    if dp_cp_ranks is not None and not set(group.ranks) <= set(dp_cp_ranks):
        extra = sorted(set(group.ranks) - set(dp_cp_ranks))
        _fail(f"group {group.key!r} with ranks {list(group.ranks)} crosses tensor or pipeline "
              f"parallelism: ranks {extra} are outside this rank's dp-cp group "
              f"{list(dp_cp_ranks)}, so they hold other weights. Pass the dp-cp group (the "
              "default), the dp or cp group, or a subset of them.")


def check_fsdp(params, shapes, stage, group) -> None:
    """Stage 3 needs every parameter sharded by ``fully_shard`` on ``group`` (contract C3);
    stages 0-2 need none of them sharded."""
    for i, (p, shape) in enumerate(zip(params, shapes)):
        meta = getattr(p, "fsdp", None)
        if stage < 3:
            if meta is not None:
                _fail(f"params[{i}] ({p.name!r}) is sharded by fully_shard but zero_stage="
                      f"{stage}: its gradient is already reduce-scattered. Pass zero_stage=3.")
            continue
        if meta is None:
            _fail(f"params[{i}] ({p.name!r}) is not sharded by fully_shard, and zero_stage=3 "
                  "steps only fully_shard parameters: call fully_shard(module) first, or use "
                  "zero_stage=2.")
        if tuple(meta.group.ranks) != tuple(group.ranks):
            _fail(f"params[{i}] ({p.name!r}) is sharded over ranks {list(meta.group.ranks)} but "
                  f"the optimizer group is {list(group.ranks)}: the groups disagree. Pass "
                  "group=<the group given to fully_shard>.")
        c = shard_rows(int(meta.rows), group.size)
        want = (c,) + tuple(meta.full_shape[1:])
        if (int(meta.shard_rows) != c or tuple(shape) != want
                or int(meta.pad) != group.size * c - int(meta.rows)):
            _fail(f"params[{i}] ({p.name!r}) has shape {tuple(shape)} and fsdp metadata "
                  f"rows={meta.rows} shard_rows={meta.shard_rows} pad={meta.pad}: expected the "
                  f"C1 shard {want} of {tuple(meta.full_shape)} over {group.size} ranks. "
                  "Shard it with fully_shard, not by hand.")


def check_grads(grads, shapes, dtype_names, grad_dtype_names) -> None:
    """The gradients match the parameters in count, shape and dtype (PyNative call)."""
    if not isinstance(grads, (tuple, list)):
        _fail(f"grads is a {type(grads).__name__}: expected a tuple of gradients, one per "
              "parameter, as value_and_grad or pipeline.forward_backward returns.")
    if len(grads) != len(shapes):
        _fail(f"got {len(grads)} gradients for {len(shapes)} parameters: pass the gradients of "
              "exactly the parameters the optimizer was built with, in the same order.")
    for i, (shape, dt, gdt) in enumerate(zip(shapes, dtype_names, grad_dtype_names)):
        g = grads[i]
        if tuple(g.shape) != tuple(shape):
            _fail(f"grads[{i}] has shape {tuple(g.shape)}: expected {tuple(shape)}, the shape of "
                  "its parameter; pass the gradients in the parameters' order.")
        if gdt not in (dt, "float32"):
            _fail(f"grads[{i}] has dtype {gdt}: expected {dt} (the parameter's) or float32.")


def check_overlap(overlap_grad_reduce, overlap_param_gather) -> None:
    """The two overlap options are bools."""
    for name, value in (("overlap_grad_reduce", overlap_grad_reduce),
                        ("overlap_param_gather", overlap_param_gather)):
        if not isinstance(value, bool):
            _fail(f"{name}={value!r} is invalid: expected True or False.")
