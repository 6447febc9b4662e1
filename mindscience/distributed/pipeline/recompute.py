"""What the pipeline runtime does with stage activations: keep them or recompute them.

Pure Python (no MindSpore): the cost model calls :func:`runtime_recompute` to price what
:func:`~mindscience.distributed.pipeline.forward_backward` will really run, and
:func:`kept_schedule` is the action list the runtime runs when it keeps activations.

Between a micro-batch's forward ``F{j}`` and its backward ``B{j}`` a stage other than the
last either

* recomputes (``"full"``): it keeps only the stage input and runs the forward again inside
  ``B{j}`` (an in-flight micro-batch costs one stage input, plus one extra forward); or
* keeps the forward (``"none"`` / ``"selective"``): ``F{j}`` runs the stage as a top cell
  with ``set_grad(True)`` and ``B{j}`` back-propagates it with
  ``GradOperation(sens_param=True)`` on the very same input tensor (no extra forward).
  ``"selective"`` is ``"none"`` at the runtime level: the cells the model marks (e.g.
  ``ContextParallelAttention(recompute=True)``, ``Cell.recompute()``) recompute inside the
  kept forward.

The last model stage computes its loss and gradients in one pass at ``F{j}`` and never
recomputes. What MindSpore 2.10 allows (measured on CPU, tp2 x pp2 and pp2 x dp2, every
schedule, against the dense model): kept forwards back-propagate in any order, so 1F1B,
interleaved and GPipe keep them in their own order, in PyNative at any tp / cp, and under
jit (a compiled ``construct``) with or without tp collectives in the stage, but not with
cp: two ring-attention layers in a kept compiled stage fail to compile ("The pointer
[func_graph->get_return()] is null"), and with that worked around, the first layer's
input and q/k/v gradients were wrong (the layers share one cached ring cell whose
``bprop`` reads its inputs), so ``mode="jit"`` at ``cp > 1`` recomputes. (Ulysses and
all-gather-KV attention kept exact in a probe; the runtime does not see the method.)

Three things needed care. MindSpore's PyNative recompute cell (``Cell.recompute()``)
re-runs its newest forward in each backward, so the runtime lets each marked cell of a
kept stage find its own forward (:func:`~.stage_fns.any_order_recompute`). A kept
compiled forward hands every consumer of a ``bprop`` Cell that ran more than once in the
graph the output of its last call (two tensor-parallel blocks sharing the cached mapping
cells: the first block's weight gradients wrong, also with one micro-batch in flight and
without collectives), so compiled mappings copy their output outside the shared cell
(``mappings._OwnOutput``). ``mindspore.vjp``, used before, runs its pending backwards
newest-first only; :func:`kept_schedule` (GPipe with newest-first backwards) is what the
runtime ran with it, kept as a schedule.

Example::

    runtime_recompute("1f1b", "pynative", "selective", 4)
    # ("selective", "1f1b keeps each in-flight micro-batch's stage forward from F to B ...")
    runtime_recompute("1f1b", "jit", "none", 2, model_parallel=2)
    # ("none", "1f1b keeps each in-flight micro-batch's stage forward from F to B ...")
    runtime_recompute("1f1b", "jit", "none", 2, model_parallel=4, context_parallel=2)
    # ("full", "mode='jit' with context parallelism in the stage (cp=2): ...")
"""

from __future__ import annotations

import numbers

from . import schedules as S

__all__ = ["RECOMPUTE", "RUNTIME_MODES", "RecomputeError", "runtime_recompute", "model_request",
           "kept_order", "kept_schedule"]

RECOMPUTE = ("full", "selective", "none")
RUNTIME_MODES = ("pynative", "jit")


class RecomputeError(ValueError):
    """A bad ``recompute`` / ``schedule`` / ``mode`` / size passed to :func:`runtime_recompute`."""


def _check(schedule, mode, recompute, pp, virtual_stages) -> None:
    if recompute not in RECOMPUTE:
        raise RecomputeError(f"recompute={recompute!r} is invalid: expected one of "
                             f"{', '.join(RECOMPUTE)} (full: stages recompute their forward in "
                             "the backward; none/selective: keep it where the schedule allows).")
    if schedule not in S.SCHEDULES:
        raise RecomputeError(f"schedule={schedule!r} is unknown: expected one of "
                             f"{', '.join(S.SCHEDULES)}.")
    if mode not in RUNTIME_MODES:
        raise RecomputeError(f"mode={mode!r} is invalid: expected one of "
                             f"{', '.join(RUNTIME_MODES)}.")
    for name, value in (("pp", pp), ("virtual_stages", virtual_stages)):
        if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
            raise RecomputeError(f"{name}={value!r} is invalid: expected an integer >= 1 "
                                 "(the pipeline ranks / the model chunks per rank).")


def runtime_recompute(schedule: str, mode: str, recompute: str, pp: int,
                      virtual_stages: int = 1, model_parallel: int = 1,
                      context_parallel: int = 1) -> tuple:
    """``(what_runs, reason)``: what the pipeline runtime does for this configuration.

    Args:
        schedule: ``"gpipe"``, ``"1f1b"`` or ``"interleaved"``.
        mode: ``"pynative"`` or ``"jit"`` (the runtime's ``mode``).
        recompute: What is asked: ``"full"``, ``"selective"`` or ``"none"``.
        pp: Pipeline ranks.
        virtual_stages: Model chunks per rank (interleaved); ``pp * virtual_stages``
            model stages in all.
        model_parallel: Ranks a stage's forward exchanges data with (``tp * cp * ep *
            etp``; the runtime counts ``fully_shard`` weights as 2): above 1 the stage
            holds collectives (kept as well, in both modes; validated only).
        context_parallel: The stage's cp ranks (included in ``model_parallel``): above 1
            a compiled stage recomputes (see below).

    Returns:
        ``what_runs``: ``"full"`` (every model stage but the last keeps only its input
        and recomputes its forward in the backward), ``"none"`` (stage activations kept
        from ``F`` to ``B``, nothing recomputed by the runtime) or ``"selective"``
        (kept as ``"none"``; the model's marked cells recompute inside). ``reason``: one
        sentence saying why, for notes; it names the forced case.

        By configuration (more than one model stage unless said):

        * ``recompute="full"``: ``"full"``;
        * one model stage (``pp * virtual_stages == 1``): the request, ``"full"`` read
            as ``"none"`` (loss and gradients in one pass, nothing recomputed);
        * ``"none"``/``"selective"`` in PyNative, and under jit with
            ``context_parallel == 1`` at any ``model_parallel``: the request (every
            schedule keeps its forwards and back-propagates them in its own order; see
            the module docstring for what was measured);
        * ``"none"``/``"selective"`` under jit with ``context_parallel > 1``: ``"full"``
            (forced: a kept compiled stage of two ring-attention layers does not compile,
            measured, see the module docstring).

    Raises:
        RecomputeError: an unknown value, or a size < 1.

    Example: ``runtime_recompute("1f1b", "pynative", "selective", 8)[0] == "selective"``;
    ``runtime_recompute("1f1b", "jit", "none", 2, model_parallel=2)[0] == "none"``;
    ``runtime_recompute("1f1b", "jit", "none", 2, 1, 4, context_parallel=2)[0] == "full"``.
    """
    _check(schedule, mode, recompute, pp, virtual_stages)
    if isinstance(model_parallel, bool) or not isinstance(model_parallel, numbers.Integral) \
            or model_parallel < 1:
        raise RecomputeError(f"model_parallel={model_parallel!r} is invalid: expected an integer "
                             ">= 1 (the ranks a stage's forward exchanges data with, tp * cp * ep "
                             "* etp).")
    if isinstance(context_parallel, bool) or not isinstance(context_parallel, numbers.Integral) \
            or context_parallel < 1:
        raise RecomputeError(f"context_parallel={context_parallel!r} is invalid: expected an "
                             "integer >= 1 (the stage's cp ranks).")
    stages = pp * virtual_stages
    if stages == 1:
        what = "none" if recompute == "full" else recompute
        return what, ("one model stage: the runtime computes the loss and the gradients in one "
                      "pass, keeping the activations and recomputing nothing (mark the model's "
                      "cells with Cell.recompute() to recompute inside it).")
    if recompute == "full":
        return "full", ("recompute='full': every model stage but the last keeps its input only "
                        "and recomputes its forward in the backward.")
    if mode == "jit" and context_parallel > 1:
        return "full", ("mode='jit' with context parallelism in the stage (cp="
                        f"{context_parallel}): a kept compiled stage of two ring-attention layers "
                        "fails to compile on MindSpore 2.10 CPU (and the layers share one ring "
                        "cell, whose backward then mixes them), so every model stage but the last "
                        f"recomputes its forward: recompute={recompute!r} is run as 'full'; use "
                        "mode='pynative' to keep activations.")
    return recompute, (f"{schedule} keeps each in-flight micro-batch's stage forward from F to "
                       f"B (mode={mode!r}; the backwards in the schedule's own order, no forward "
                       f"run again); recompute={recompute!r} runs as asked.")


def model_request(recompute: str) -> str:
    """What a model whose layers carry ``recompute`` themselves asks the runtime for.

    ``GPTModel`` marks its cells (``selective``: each attention core; ``full``: each layer,
    :func:`mindscience.distributed.random.recompute`), so the stage forwards are kept and
    those cells recompute inside them: the runtime's ``"selective"``; ``"none"`` keeps
    everything. The cost model asks :func:`runtime_recompute` with this.

    Example: ``model_request("full") == "selective"``.
    """
    if recompute not in RECOMPUTE:
        raise RecomputeError(f"recompute={recompute!r} is invalid: expected one of "
                             f"{', '.join(RECOMPUTE)}.")
    return "none" if recompute == "none" else "selective"


def kept_order(p: int, m: int, rank: int) -> list:
    """GPipe with its backwards newest-first: ``[("F", 0, 0), ..., ("B", m-1, 0), ...]``.

    Every forward, then the backwards from micro-batch m-1 down to 0 (the order in which
    pending ``mindspore.vjp`` backwards can run). Every rank uses the same order, so the
    last stage starts with the micro-batch it has just finished.
    """
    S.compute_order("gpipe", p, m, 1, rank)  # validates p, m, rank's range of use
    return [("F", j, 0) for j in range(m)] + [("B", j, 0) for j in reversed(range(m))]


def kept_schedule(p: int, m: int) -> S.Schedule:
    """The GPipe schedule (name ``"gpipe"``) whose backwards run newest-first, validated.

    Built like :func:`~.schedules.build` (the transfers placed in one global order,
    exchanges merged, simulated as blocking rendezvous; the better placement kept), from
    :func:`kept_order`. Same makespan and peak in flight as ``build("gpipe", p, m)``.

    Raises:
        ScheduleError: ``p`` or ``m`` below 1.
    """
    orders = [kept_order(p, m, r) for r in range(p)]
    times = S._ideal_times(p, m, 1, orders)
    best = None
    for placement in ("consumer", "producer"):
        steps = S._merge_exchanges(S._rank_steps(p, S._events(p, m, 1, orders, times, placement)))
        sched = S.Schedule("gpipe", p, m, 1, [[S._as_actions(r, s) for s in rank]
                                              for r, rank in enumerate(steps)])
        S.validate(sched)
        if best is None or sched.makespan < best.makespan:
            best = sched
    return best
