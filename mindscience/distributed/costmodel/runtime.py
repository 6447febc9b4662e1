"""What the library runs for a training, so that ``plan --model`` and ``suggest`` price it (pure).

Some options the cost model knows are run differently by the library, or only in some
layouts or modes. :func:`what_runs` turns a training section into the one the library
actually executes plus a :class:`Runtime` (the behaviours no option names) and a note for
every difference, which the commands print (stderr in rich mode, the JSON ``notes`` list).
It asks the library's own pure rules, through importlib, and falls back to a local
description of the library as it was before they existed where a rules module is missing:

=========================  ===========================================================
option / layout            rule asked (fallback), and how it is priced
=========================  ===========================================================
``pp > 1``                 ``pipeline.recompute.runtime_recompute``: kept stage forwards
                           (priced as configured, no note) or, where it says
                           ``"full"``, +1 forward of every stage but the last, their tp
                           and cp collectives again, one micro-batch of a stage's
                           activations at a time. Fallback: re-run
``overlap_grad_reduce``    ``optimizer.overlap_rules.grad_reduce_overlap(mode, zero_stage,
                           pp)``: overlapped (only what exceeds the last micro-batch's
                           backward is exposed) or exposed with a note. Fallback: exposed
``overlap_param_gather``   ``optimizer.overlap_rules.param_gather_overlap(mode,
                           zero_stage)``, stages 1-2: the weights' all-gather hidden
                           behind the first micro-batch's forward, or exposed with a
                           note. Fallback: exposed
``zero_stage: 3``          ``fsdp.rules.fsdp_runtime(mode, reshard_after_forward,
                           prefetch)``: one bucketed all-gather per unit (a layer; the
                           embeddings and head one more), again for the backward when
                           resharding, ``units_alive`` units' gathered weights at once,
                           prefetched gathers and per-unit reduce-scatters hidden behind
                           the unit's neighbours' compute. Fallback (``fully_shard``
                           before units): one all-gather per parameter, kept from the
                           forward to the backward (a stage's weights alive), exposed
fp32 main weights          ``optimizer.overlap_rules.main_weight_bytes(param_bytes,
                           zero_stage)`` bytes per element (before dividing by d).
                           Fallback: 4 at stages 1-3 and for 16-bit weights, else 0
=========================  ===========================================================

The cost model prices the runtime's PyNative behaviour (``mode="pynative"``); where the
compiled mode (``ms.jit``, ``msdist train``'s default) runs something else, a note says so.

Example:
    >>> from mindscience.distributed.costmodel.spec import TrainingSpec
    >>> training, runtime, notes = what_runs(TrainingSpec(), tp=1, cp=1, pp=4, dp=2)
    >>> runtime.stage_recompute
    False
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, replace

from .spec import TrainingSpec

__all__ = ["Runtime", "what_runs", "pipeline_recompute", "grad_reduce_overlap", "param_gather_overlap",
           "main_weight_bytes", "fsdp_runtime"]

PRICED_MODE = "pynative"


@dataclass(frozen=True)
class Runtime:
    """Behaviours of the library that no training option names.

    Args:
        stage_recompute: The pipeline runtime re-runs every model stage's forward but the
            last one's in the backward, keeping only the stage input per micro-batch.
        fsdp_units: ZeRO-3 gathers one bucket per wrapped unit (a layer, and one for the
            rest of a stage) instead of one call per parameter.
        fsdp_gathers_per_unit: All-gathers of a unit per micro-batch (2 when the weights
            are freed after the forward and gathered again for the backward).
        fsdp_units_alive: Leaf units whose gathered weights are alive at once besides the
            root unit's; None: a whole stage's, kept from a micro-batch's forward to its
            backward.
    """

    stage_recompute: bool = False
    fsdp_units: bool = False
    fsdp_gathers_per_unit: int = 1
    fsdp_units_alive: int | None = None


NO_RUNTIME = Runtime()


def _rule(module: str, name: str):
    """The library's pure rule ``mindscience.distributed.<module>.<name>``, or None where it is missing."""
    try:
        return getattr(importlib.import_module(f"mindscience.distributed.{module}"), name)
    except (ImportError, AttributeError):
        return None


def _overlap_answer(fn, *args):
    """``(bool, str)`` from a rule, or None when it is missing or answers something else."""
    if fn is None:
        return None
    try:
        answer = fn(*args)
    except (TypeError, ValueError):
        return None
    if isinstance(answer, tuple) and len(answer) == 2 and isinstance(answer[0], bool):
        return answer[0], str(answer[1] or "")
    return None


def grad_reduce_overlap(mode: str, zero_stage: int, pp: int = 1) -> tuple[bool, str]:
    """Whether ``overlap_grad_reduce=True`` reduces the dp-cp gradients during the backward in ``mode``.

    ``optimizer.overlap_rules.grad_reduce_overlap`` where it exists. Fallback (the library
    before it): no, the reduction runs after the backward.

        >>> grad_reduce_overlap("pynative", 0)[0] in (True, False)
        True
    """
    answer = _overlap_answer(_rule("optimizer.overlap_rules", "grad_reduce_overlap"), mode, zero_stage, pp)
    if answer is not None:
        return answer
    return False, ("the library reduces the dp-cp gradients after the backward (DistributedOptimizer.step / "
                   "GradientFinalizer), not during it")


def param_gather_overlap(mode: str, zero_stage: int) -> tuple[bool, str]:
    """Whether ``overlap_param_gather=True`` (stages 1-2) overlaps the weights' all-gather with the next forward.

    ``optimizer.overlap_rules.param_gather_overlap`` where it exists. Fallback: no, the
    optimizer step all-gathers the updated weights before it returns.
    """
    answer = _overlap_answer(_rule("optimizer.overlap_rules", "param_gather_overlap"), mode, zero_stage)
    if answer is not None:
        return answer
    return False, "the optimizer step all-gathers the updated weights before it returns, not during the next forward"


def main_weight_bytes(param_bytes: int, zero_stage: int) -> int:
    """Bytes per element of the fp32 main weights a rank keeps (before dividing by d).

    ``optimizer.overlap_rules.main_weight_bytes`` where it exists. Fallback (the library
    before it): 4 at stages 1-3 and for 16-bit weights; 0 for fp32 weights at stage 0.

        >>> main_weight_bytes(2, 0), main_weight_bytes(4, 0)
        (4, 0)
    """
    fn = _rule("optimizer.overlap_rules", "main_weight_bytes")
    if fn is not None:
        try:
            got = fn(param_bytes, zero_stage)
        except (TypeError, ValueError):
            got = None
        if isinstance(got, int) and not isinstance(got, bool) and got >= 0:
            return got
    return 4 if zero_stage >= 1 or param_bytes != 4 else 0


# fully_shard before per-unit gathers: one all-gather per parameter, kept to the backward.
FSDP_FALLBACK = {"reshard_after_forward": False, "prefetch": False, "gathers_per_unit": 1, "units_alive": None,
                 "per_unit": False,
                 "reason": "fully_shard all-gathers every parameter separately before each micro-batch's forward "
                           "and keeps a stage's gathered weights from its forward to its backward, nothing "
                           "prefetched"}


def fsdp_runtime(mode: str, reshard_after_forward: bool = True, prefetch: bool = True) -> dict:
    """What ``fully_shard`` runs: ``fsdp.rules.fsdp_runtime`` where it exists, else :data:`FSDP_FALLBACK`.

    Keys: ``reshard_after_forward``, ``prefetch`` (bools, what runs), ``gathers_per_unit``
    (1 or 2 per micro-batch), ``units_alive`` (units of gathered weights alive at once; None:
    a whole stage's), ``per_unit`` (one bucketed gather per unit) and ``reason`` (why
    something asked does not run, or None).
    """
    fn = _rule("fsdp.rules", "fsdp_runtime")
    if fn is not None:
        try:
            got = fn(mode, reshard_after_forward, prefetch)
        except (TypeError, ValueError):
            got = None
        keys = ("reshard_after_forward", "prefetch", "gathers_per_unit", "units_alive")
        if isinstance(got, dict) and all(k in got for k in keys):
            return {**{k: got[k] for k in keys}, "per_unit": True, "reason": got.get("reason")}
    return dict(FSDP_FALLBACK)


def _library_answer(training: TrainingSpec, pp: int, mode: str = PRICED_MODE, model_parallel: int = 1,
                    context_parallel: int = 1):
    """``(recompute that runs, reason)`` from ``pipeline.recompute.runtime_recompute``, or None."""
    try:
        module = importlib.import_module("mindscience.distributed.pipeline.recompute")
        fn = module.runtime_recompute
    except (ImportError, AttributeError):
        return None
    v = training.virtual_pipeline_stages
    schedule = "interleaved" if v > 1 else "1f1b"
    # The model marks its own cells (training.recompute) and asks the runtime for kept
    # stage forwards (GPTModel.forward_backward): ask what it asks.
    request = getattr(module, "model_request", lambda r: r)
    try:
        answer = fn(schedule, mode, request(training.recompute), pp, v, model_parallel,
                    context_parallel=context_parallel)
    except (TypeError, ValueError):  # another signature: fall back to the local description
        return None
    if isinstance(answer, tuple) and len(answer) == 2 and isinstance(answer[0], str):
        return answer
    return None


def pipeline_recompute(training: TrainingSpec, pp: int) -> tuple[bool, str | None]:
    """Whether the pipeline runtime re-runs each stage's forward in the backward, and why.

    Local description (used unless ``pipeline.recompute.runtime_recompute`` answers): every
    ``pp > 1`` schedule the cost model prices (1F1B, interleaved) keeps only the stage
    input of a micro-batch in flight (``mindscience.distributed.pipeline.runtime``).
    """
    if pp <= 1:
        return False, None
    answer = _library_answer(training, pp)
    if answer is not None:
        runs, reason = answer
        return runs == "full", reason
    schedule = "interleaved" if training.virtual_pipeline_stages > 1 else "1F1B"
    return True, (f"the {schedule} pipeline runtime keeps only each stage's input per micro-batch in flight "
                  "and re-runs the stage's forward in its backward")


def _compiled_differs(training: TrainingSpec, tp: int, cp: int, pp: int, stage_recompute: bool) -> bool:
    """The compiled pipeline recomputes where PyNative keeps (the runtime's rule asked for ``jit``)."""
    if stage_recompute or pp <= 1:
        return False
    parallel = tp * cp * (2 if training.zero_stage == 3 else 1)
    answer = _library_answer(training, pp, "jit", parallel, cp)
    if answer is None:  # no rule: the runtime of part 1 forces "full" under jit with collectives
        return parallel > 1
    return answer[0] == "full"


def what_runs(training: TrainingSpec, tp: int, cp: int, pp: int, dp: int,
              mode: str = PRICED_MODE) -> tuple[TrainingSpec, Runtime, list]:
    """``(training as the library runs it, Runtime, notes)`` for one layout's sizes.

    Notes name the option, what the library does instead and how it is priced; an option
    the library runs as configured gives none. ``mode``: the execution mode priced,
    ``"pynative"`` (``plan``, ``suggest``: notes say where compiled mode differs) or
    ``"jit"`` (``msdist train --mode jit`` prices its own run).
    """
    notes = []
    d = dp * cp
    if mode != PRICED_MODE:
        return _what_runs_compiled(training, tp, cp, pp, dp, notes)
    stage_recompute, reason = pipeline_recompute(training, pp)
    if stage_recompute:
        inner = {"none": "", "selective": " (training.recompute: selective still drops the attention "
                 "scores inside that re-run)", "full": " (training.recompute: full re-runs each layer once "
                 "more inside it)"}[training.recompute]
        notes.append(f"pp={pp}: {reason.rstrip('. ')}. Priced so: one more forward of every stage but the last, "
                     f"its tp and cp collectives again, and one micro-batch of a stage's activations at a "
                     f"time{inner}.")
    z = training.zero_stage
    if training.overlap_grad_reduce and d > 1 and z < 3:
        runs, why = grad_reduce_overlap(PRICED_MODE, z, pp)
        if not runs:
            notes.append(f"training.overlap_grad_reduce: {why.rstrip('. ')}; priced as not overlapped.")
            training = replace(training, overlap_grad_reduce=False)
        elif not grad_reduce_overlap("jit", z, pp)[0]:
            notes.append("compiled mode: the dp-cp gradient reduction is priced overlapped with the backward, as "
                         f"PyNative runs it; compiled: {grad_reduce_overlap('jit', z, pp)[1].rstrip('. ')}.")
    if training.overlap_param_gather:
        runs, why = param_gather_overlap(PRICED_MODE, z) if d > 1 and z in (1, 2) else (False, "")
        if d > 1 and z in (1, 2) and not runs:
            notes.append(f"training.overlap_param_gather: {why.rstrip('. ')}; priced as not overlapped.")
        elif runs:
            compiled, compiled_why = param_gather_overlap("jit", z)
            if not compiled:
                notes.append("compiled mode: the updated weights' all-gather is priced overlapped with the next "
                             f"forward, as PyNative runs it; compiled: {compiled_why.rstrip('. ')}.")
        if not runs:
            training = replace(training, overlap_param_gather=False)
    if _compiled_differs(training, tp, cp, pp, stage_recompute):
        notes.append("compiled mode: the pipeline is priced with kept stage forwards, as PyNative runs "
                     "them; compiled (ms.jit, msdist train's default) a stage with context parallelism "
                     "(cp > 1) recomputes its forward in the backward instead (one more forward of every "
                     "stage but the last).")
    fsdp = {"per_unit": False, "gathers_per_unit": 1, "units_alive": None}
    if z == 3 and d > 1:
        fsdp = fsdp_runtime(PRICED_MODE, training.reshard_after_forward, training.fsdp_prefetch)
        training = replace(training, reshard_after_forward=bool(fsdp["reshard_after_forward"]),
                           fsdp_prefetch=bool(fsdp["prefetch"]))
        if not fsdp["per_unit"]:
            again = " and again before each re-run forward" if stage_recompute else ""
            notes.append(f"zero_stage 3: {fsdp['reason']}{again}; priced so.")
        elif fsdp.get("reason"):
            notes.append(f"zero_stage 3: {str(fsdp['reason']).rstrip('. ')}; priced as it runs.")
    return training, _runtime(stage_recompute, fsdp), notes


def _runtime(stage_recompute: bool, fsdp: dict) -> Runtime:
    """The :class:`Runtime` of a pipeline answer and an ``fsdp_runtime``-shaped dict."""
    return Runtime(stage_recompute=stage_recompute, fsdp_units=bool(fsdp["per_unit"]),
                   fsdp_gathers_per_unit=int(fsdp["gathers_per_unit"]),
                   # Kept from the forward to the backward, every unit's gathered weights are alive.
                   fsdp_units_alive=fsdp["units_alive"] if fsdp.get("reshard_after_forward") else None)


def _what_runs_compiled(training: TrainingSpec, tp: int, cp: int, pp: int, dp: int, notes: list):
    """:func:`what_runs` for compiled mode (``ms.jit``): every rule asked with ``"jit"``."""
    d, z = dp * cp, training.zero_stage
    stage_recompute, reason = False, None
    if pp > 1:
        parallel = tp * cp * (2 if z == 3 else 1)
        answer = _library_answer(training, pp, "jit", parallel, cp)
        stage_recompute, reason = (answer[0] == "full", answer[1]) if answer is not None else \
            pipeline_recompute(training, pp)
    if stage_recompute:
        notes.append(f"pp={pp}: {reason.rstrip('. ')}. Priced so: one more forward of every stage but the last.")
    if training.overlap_grad_reduce and d > 1 and z < 3:
        runs, why = grad_reduce_overlap("jit", z, pp)
        if not runs:
            notes.append(f"training.overlap_grad_reduce: {why.rstrip('. ')}; priced as not overlapped.")
            training = replace(training, overlap_grad_reduce=False)
    if training.overlap_param_gather:
        runs, why = param_gather_overlap("jit", z) if d > 1 and z in (1, 2) else (False, "")
        if d > 1 and z in (1, 2) and not runs:
            notes.append(f"training.overlap_param_gather: {why.rstrip('. ')}; priced as not overlapped.")
        if not runs:
            training = replace(training, overlap_param_gather=False)
    fsdp = {"per_unit": False, "gathers_per_unit": 1, "units_alive": None, "reshard_after_forward": False}
    if z == 3 and d > 1:
        fsdp = fsdp_runtime("jit", training.reshard_after_forward, training.fsdp_prefetch)
        training = replace(training, reshard_after_forward=bool(fsdp["reshard_after_forward"]),
                           fsdp_prefetch=bool(fsdp["prefetch"]))
        # Compiled fully_shard gathers per parameter inside the graph (fsdp.rules).
        fsdp["per_unit"] = fsdp["per_unit"] and bool(fsdp["reshard_after_forward"] or fsdp["prefetch"])
        if fsdp.get("reason"):
            notes.append(f"zero_stage 3: {str(fsdp['reason']).rstrip('. ')}; priced so.")
    return training, _runtime(stage_recompute, fsdp), notes
