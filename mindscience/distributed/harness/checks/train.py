"""The checks that run :class:`~mindscience.distributed.training.loop.Trainer` inside each rank.

``msdist train`` launches ``layout.init``, ``train.setup``, one ``train.step`` per step and
``train.finish``, so the progress display moves with every step and each step's record
reaches the parent at once. ``msdist verify --model M`` adds ``train.dense_compare``.

* ``train.setup``: build the model and optimizer from the spec's ``model`` and
  ``training`` (ModelSpec and TrainingSpec mappings) and ``options`` (:class:`~mindscience.distributed.training.options.TrainOptions`),
  resume when asked; one record with the rank's stage, memory and resumed step.
* ``train.step``: one optimizer step; a record with ``train_step`` (the 1-based counter;
  ``step`` is the harness's position in the spec), ``loss`` (the global batch's) and
  ``time_s``; saves a checkpoint when ``--save``/``--save-every`` say so.
* ``train.finish``: the rank's bytes (``opt.memory_bytes()``) and the checkpoints written.
* ``train.dense_compare``: ``steps`` steps at the layout, then the same steps of the dense
  model (tp = cp = pp = 1, every rank training the whole global batch: the dp mean of
  identical gradients is the dense gradient), from the same initial weights; passes when
  every loss agrees within ``rtol``. Restores the layout in force.
"""

from __future__ import annotations

import math

from ..registry import CheckContext, check

KEY = "trainer"


def _specs(model: dict, training: dict):
    from mindscience.distributed.costmodel.spec import ModelSpec, TrainingSpec

    return ModelSpec(**model), TrainingSpec(**training)


def _options(options: dict):
    from mindscience.distributed.training.options import TrainOptions

    return TrainOptions(**options)


def _set_mode(opts) -> None:
    import mindspore as ms

    # Each step compiles its own graphs in "jit"; the context stays PyNative either way.
    ms.set_context(mode=ms.PYNATIVE_MODE)


@check("train.setup")
def setup(ctx: CheckContext, model: dict, training: dict, options: dict, resume: str | None = None) -> dict:
    """Build the trainer of this rank (and load ``resume``)."""
    import time

    from mindscience.distributed.training.loop import Trainer

    from .groups import ensure_manager

    started_at = time.time()
    ensure_manager(ctx)
    opts = _options(options)
    _set_mode(opts)
    trainer = Trainer(*_specs(model, training), opts)
    resumed = None
    if resume:
        t0 = time.perf_counter()
        info = trainer.resume(resume)
        resumed = {"step": info["step"], "layout": info["layout"], "directory": resume,
                   "loaded": len(info["loaded"]), "load_s": round(time.perf_counter() - t0, 4)}
    trainer.install_stop_handler()
    ctx.scratch[KEY] = trainer
    return {"check": "train.setup", "group": "train", "passed": True, "resumed": resumed,
            "first_step": trainer.first_step, "microbatches": trainer.num_microbatches,
            "started_at": started_at, "ready_at": time.time(),
            "memory": trainer.memory_bytes()}


@check("train.step")
def step(ctx: CheckContext, index: int) -> dict:
    """Step ``index`` of this run (0-based within the run).

    Fires the fault ``MSDIST_FAULT`` names for this rank and step, if any; after the step
    (and its scheduled save) the ranks agree whether any was asked to stop: then every
    rank saves this step, if it has not already, waits until the checkpoint is durable,
    and the remaining steps are skipped."""
    import time

    from mindscience.distributed.training import faults
    from mindscience.distributed.training.options import step_dir

    trainer = ctx.scratch[KEY]
    if trainer.stopped_at is not None:
        return {"check": "train.step", "group": "train", "skipped": True, "passed": True}
    k = trainer.first_step + index
    fault = faults.fault_at(trainer.faults, rank=ctx.rank, step=k + 1, attempt=trainer.attempt)
    if fault is not None:
        faults.fire(fault)
    row = trainer.train_step(k)
    saved = trainer.maybe_save(k)
    stop = trainer.stop_agreed()
    if stop:
        if saved is None and trainer.opts.save:
            saved = trainer.save(step_dir(trainer.opts.save, k + 1), k + 1)
        trainer.wait_for_save()
        trainer.stopped_at = k + 1
    loss = row["loss"]
    # A MoE model's step statistics (Trainer.moe_step), the same on every rank.
    return {**{key: row[key] for key in ("aux_loss", "max_load", "dropped_tokens") if key in row},
            "check": "train.step", "group": "train", "train_step": row["step"], "loss": loss,
            "time_s": row["time_s"], "saved": saved, "stopped": stop, "signal": trainer.stop_signal,
            "at": time.time(),
            "passed": loss is not None and math.isfinite(loss)}


@check("train.finish")
def finish(ctx: CheckContext) -> dict:
    """The rank's memory after training, and the checkpoints it wrote (the last one
    written in the background waited for first)."""
    trainer = ctx.scratch.pop(KEY)
    trainer.wait_for_save()
    return {"check": "train.finish", "group": "train", "passed": True, "memory": trainer.memory_bytes(),
            "saved": trainer.saved, "stopped_at": trainer.stopped_at,
            "save_stall_s": [round(s, 4) for s in trainer.save_stalls]}


def _run(specs, opts, steps: int, replicate: bool = False) -> list:
    from mindscience.distributed.training.loop import Trainer

    trainer = Trainer(*specs, opts, replicate_batch=replicate)
    return [trainer.train_step(k)["loss"] for k in range(steps)]


@check("train.dense_compare")
def dense_compare(ctx: CheckContext, model: dict, training: dict, options: dict, steps: int = 2,
                  rtol: float = 1e-4) -> dict:
    """``steps`` steps at the layout against the dense model on the same batches."""
    import numpy as np

    from mindscience.distributed import manager

    from .groups import current_layout_args, ensure_manager, layout_label, reinit, restore

    ensure_manager(ctx)
    previous = current_layout_args(manager)
    specs, opts = _specs(model, training), _options(options)
    _set_mode(opts)
    try:
        got = _run(specs, opts, steps)
        reinit(manager, {})
        want = _run(specs, opts, steps, replicate=True)
    finally:
        restore(manager, previous)
    got_a, want_a = np.array(got, np.float64), np.array(want, np.float64)
    err = float(np.max(np.abs(got_a - want_a) / np.maximum(np.abs(want_a), 1e-12)))
    return {"check": "train.dense_compare", "group": layout_label(manager.get_layout()), "mode": opts.mode,
            "losses": got, "dense_losses": want, "max_error": err, "rtol": rtol,
            "passed": bool(err <= rtol and (steps == 1 or len(set(got)) > 1))}
