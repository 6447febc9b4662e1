"""What the library runs for a training, so that ``plan --model`` and ``suggest`` price it (pure).

Some options the cost model knows are run differently by the library, or only in some
layouts. :func:`what_runs` turns a training section into the one the library actually
executes plus a :class:`Runtime` (the behaviours no option names) and a note for every
difference, which the commands print (stderr in rich mode, the JSON ``notes`` list):

=======================  ==============================================================
option / layout          what the library runs, and how it is priced
=======================  ==============================================================
``pp > 1``               the pipeline runtime (1F1B / interleaved) keeps each in-flight
                         micro-batch's stage forward until its backward (PyNative):
                         priced as configured, no note. Where the runtime says it
                         recomputes (``Runtime.stage_recompute``): +1 forward of every
                         stage but the last, their tp collectives again, and one
                         micro-batch of the stage's activations at a time
``overlap_grad_reduce``  the dp-cp gradient reduction (DistributedOptimizer.step /
                         GradientFinalizer) runs after the backward: priced exposed
``zero_stage: 3``        fully_shard's default (``reshard_after_forward=False``): one
                         all-gather per parameter and micro-batch in the forward (again
                         in a re-run forward), one reduce-scatter in the backward; the
                         gathered weights of a stage live from forward to backward
=======================  ==============================================================

:func:`mindscience.distributed.pipeline.recompute.runtime_recompute` (the runtime's own
description, pure), asked with ``pipeline.recompute.model_request(training.recompute)``
(what the model asks), decides the first row: ``"full"`` there is
``Runtime.stage_recompute``. The cost model prices the 1F1B / interleaved schedules in the
runtime's default ``pynative`` mode; a local description takes over if that function is
missing.

Example:
    >>> from mindscience.distributed.costmodel.spec import TrainingSpec
    >>> training, runtime, notes = what_runs(TrainingSpec(), tp=1, cp=1, pp=4, dp=2)
    >>> training.overlap_grad_reduce, runtime.stage_recompute, len(notes)
    (False, False, 1)
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, replace

from .spec import TrainingSpec

__all__ = ["Runtime", "what_runs", "pipeline_recompute"]


@dataclass(frozen=True)
class Runtime:
    """Behaviours of the library that no training option names.

    Args:
        stage_recompute: The pipeline runtime re-runs every model stage's forward but the
            last one's in the backward, keeping only the stage input per micro-batch.
    """

    stage_recompute: bool = False


NO_RUNTIME = Runtime()


def _library_answer(training: TrainingSpec, pp: int):
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
        answer = fn(schedule, "pynative", request(training.recompute), pp, v)
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


def what_runs(training: TrainingSpec, tp: int, cp: int, pp: int, dp: int) -> tuple[TrainingSpec, Runtime, list]:
    """``(training as the library runs it, Runtime, notes)`` for one layout's sizes.

    Notes name the option, what the library does instead and how it is priced; an option
    the library runs as configured gives none.
    """
    notes = []
    d = dp * cp
    stage_recompute, reason = pipeline_recompute(training, pp)
    if stage_recompute:
        inner = {"none": "", "selective": " (training.recompute: selective still drops the attention "
                 "scores inside that re-run)", "full": " (training.recompute: full re-runs each layer once "
                 "more inside it)"}[training.recompute]
        notes.append(f"pp={pp}: {reason.rstrip('. ')}. Priced so: one more forward of every stage but the last, "
                     f"its tp and cp collectives again, and one micro-batch of a stage's activations at a "
                     f"time{inner}.")
    if training.overlap_grad_reduce and d > 1 and training.zero_stage < 3:
        notes.append("training.overlap_grad_reduce: the library reduces the dp-cp gradients after the backward "
                     "(DistributedOptimizer.step / GradientFinalizer), not during it; priced as not overlapped.")
        training = replace(training, overlap_grad_reduce=False)
    if not stage_recompute and pp > 1 and (tp > 1 or cp > 1 or training.zero_stage == 3):
        # pipeline.recompute.runtime_recompute(mode="jit", model_parallel > 1) forces "full".
        notes.append("compiled mode: the pipeline is priced with kept stage forwards, as PyNative runs "
                     "them; compiled (ms.jit, msdist train's default) a stage holding collectives (tp, cp, "
                     "ep, fully_shard) recomputes its forward in the backward instead (one more forward "
                     "of every stage but the last).")
    if training.zero_stage == 3 and d > 1:
        again = " and again before each re-run forward" if stage_recompute else ""
        notes.append(f"zero_stage 3: fully_shard (reshard_after_forward=False) all-gathers every parameter "
                     f"before each micro-batch's forward{again}, reduce-scatters its gradient in the backward, "
                     "and keeps a stage's gathered weights from its forward to its backward; priced so.")
    return training, Runtime(stage_recompute=stage_recompute), notes
