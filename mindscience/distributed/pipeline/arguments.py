"""Checks of :func:`~.runtime.forward_backward`'s arguments that need no other rank.

Everything here runs before the call's first collective, so a bad argument raises a
:class:`PipelineError` naming the value and the fix instead of failing inside MindSpore
after other ranks started a transfer.
"""

from __future__ import annotations

import numbers

from mindspore import Tensor, nn

from ..p2p import _MAX_NDIM
from .recompute import RECOMPUTE
from .schedules import SCHEDULES

__all__ = ["PipelineError", "MODES", "check_args", "check_activation_shape", "data_problem",
           "check_recompute"]

MODES = ("pynative", "jit")


class PipelineError(ValueError):
    """Invalid arguments to :func:`forward_backward`, or a stage whose tensors changed shape."""


def _kind(value) -> str:
    return "None" if value is None else type(value).__name__


def check_args(stage, inputs, targets, loss_fn, schedule, mode) -> None:
    """The checks every rank can make on its own arguments alone."""
    if schedule not in SCHEDULES:
        raise PipelineError(f"schedule={schedule!r} is unknown: expected one of {', '.join(SCHEDULES)}.")
    if mode not in MODES:
        raise PipelineError(f"mode={mode!r} is invalid: expected one of {', '.join(MODES)}.")
    if schedule == "interleaved":
        if not isinstance(stage, (list, tuple)):
            raise PipelineError(
                "schedule='interleaved' needs stage = a list of the v model chunks (nn.Cell) this "
                f"rank holds, got {_kind(stage)}.")
        if not stage:
            raise PipelineError(
                "schedule='interleaved' needs stage = a list of the v model chunks (nn.Cell) this "
                "rank holds, got an empty list.")
        for c, cell in enumerate(stage):
            if not isinstance(cell, nn.Cell):
                raise PipelineError(
                    f"schedule='interleaved': stage[{c}] is {_kind(cell)}, expected an nn.Cell (each "
                    "entry of stage is one model chunk of this rank).")
    elif not isinstance(stage, nn.Cell):
        raise PipelineError(
            f"stage must be this rank's nn.Cell for schedule={schedule!r}, got "
            f"{_kind(stage)} (a list of chunks needs schedule='interleaved').")
    if not isinstance(inputs, (list, tuple)):
        hint = (" (a single tensor: split it into micro-batches, e.g. list(mint.chunk(x, m)))"
                if isinstance(inputs, Tensor) else "")
        raise PipelineError(
            f"inputs must be a non-empty list of micro-batches (entries may be None on stages "
            f"other than the first), got {_kind(inputs)}{hint}.")
    if not inputs:
        raise PipelineError(
            "inputs must be a non-empty list of micro-batches (entries may be None on stages "
            "other than the first), got an empty list.")
    if not isinstance(targets, (list, tuple)) or len(targets) != len(inputs):
        raise PipelineError(
            f"targets must be a list as long as inputs ({len(inputs)} micro-batches), got "
            f"{len(targets) if isinstance(targets, (list, tuple)) else _kind(targets)}.")
    if not callable(loss_fn):
        raise PipelineError(
            f"loss_fn must be callable: loss_fn(output, target) -> scalar, got {_kind(loss_fn)}.")


def check_recompute(recompute) -> str:
    """``recompute`` itself, else a PipelineError naming the choices."""
    if not isinstance(recompute, str) or recompute not in RECOMPUTE:
        raise PipelineError(
            f"recompute={recompute!r} is invalid: expected one of {', '.join(RECOMPUTE)} "
            "('full': every stage but the last recomputes its forward in the backward; "
            "'none'/'selective': keep the stage activations where the schedule allows it, "
            "see pipeline.recompute.runtime_recompute).")
    return recompute


def check_activation_shape(activation_shape):
    """``activation_shape`` as a tuple of ints (or None), else a PipelineError."""
    if activation_shape is None:
        return None
    # At most p2p's rank limit: a longer shape would pass here and fail in one rank's header.
    ok = isinstance(activation_shape, (list, tuple)) and 0 < len(activation_shape) <= _MAX_NDIM and all(
        isinstance(d, numbers.Integral) and not isinstance(d, bool) and d > 0
        for d in activation_shape)
    if not ok:
        raise PipelineError(
            f"activation_shape={activation_shape!r} is invalid: expected a tuple or list of "
            f"positive ints (at most {_MAX_NDIM}), the shape of the tensor one stage sends to the "
            "next (e.g. (micro_batch, seq, hidden)), or None to learn it at the first call.")
    return tuple(int(d) for d in activation_shape)


def data_problem(inputs, targets, first: bool, last: bool, p: int, i: int):
    """What is wrong with this rank's micro-batches (a message), or None.

    The first stage reads every entry of ``inputs`` (Tensors of one shape and dtype: the
    activations between stages are exchanged once and must not change), the last stage
    every entry of ``targets`` (Tensors).
    """
    where = f"pipeline rank {i} of {p}"
    if first:
        for j, x in enumerate(inputs):
            if not isinstance(x, Tensor):
                return (f"inputs[{j}] is {_kind(x)} on the first pipeline stage ({where}), which "
                        f"reads every micro-batch: pass a Tensor for each of the {len(inputs)} "
                        "micro-batches there (only other stages may pass None).")
        ref = inputs[0]
        for j, x in enumerate(inputs[1:], 1):
            if tuple(x.shape) != tuple(ref.shape) or x.dtype != ref.dtype:
                return (f"inputs[{j}] has shape {tuple(x.shape)} {x.dtype} on the first pipeline "
                        f"stage ({where}), inputs[0] has {tuple(ref.shape)} {ref.dtype}: the "
                        "micro-batches of a step must share one shape and dtype (the stages "
                        "exchange the activation shape once); pad or split them evenly.")
    if last:
        for j, t in enumerate(targets):
            if not isinstance(t, Tensor):
                return (f"targets[{j}] is {_kind(t)} on the last pipeline stage ({where}), which "
                        f"computes loss_fn(output, targets[j]): pass a Tensor for each of the "
                        f"{len(targets)} micro-batches there (only other stages may pass None).")
    return None
