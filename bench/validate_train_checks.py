"""Worker-side check of bench/validate_train.py: ``msdist train``'s training step at one layout.

``bench.train_layout`` re-creates the parallel groups for ``(tp, cp, pp)`` (dp is the
rest of the world) with ``manager.initialize_parallel``, as the harness checks do, builds
the :class:`~mindscience.distributed.training.loop.Trainer` that ``msdist train`` builds
(GPTModel + DistributedOptimizer, AdamW) from the same model and training mappings, and
times ``steps`` optimizer steps. One launch runs it once per layout, so the 13-25 s
msrun start is paid once.

Record: ``layout`` ``{tp, cp, pp, dp}``, ``times_s`` (this rank's seconds per step, the
first one compiling under jit), ``losses``, ``build_s`` and ``microbatches``; the parent
keeps the slowest rank's median of the steps after the first.
"""

from __future__ import annotations

import gc
import math
import time

from mindscience.distributed.harness.checks.groups import reinit
from mindscience.distributed.harness.registry import CheckContext, check


@check("bench.train_layout")
def train_layout(ctx: CheckContext, tp: int, cp: int, pp: int, model: dict, training: dict, options: dict) -> dict:
    """``options['steps']`` steps of the Trainer at ``tp x cp x pp`` (dp: the rest)."""
    import mindspore as ms

    from mindscience.distributed import manager
    from mindscience.distributed.costmodel.spec import ModelSpec, TrainingSpec
    from mindscience.distributed.training.loop import Trainer
    from mindscience.distributed.training.options import TrainOptions

    # The previous layout's trainer holds Parameters and compiled graphs: drop them first.
    gc.collect()
    lay = reinit(manager, {"tp": tp, "cp": cp, "pp": pp})
    # As harness/checks/train.py: the context stays PyNative; "jit" compiles each step's graphs.
    ms.set_context(mode=ms.PYNATIVE_MODE)
    opts = TrainOptions(**options)
    record = {"check": "bench.train_layout", "group": "train", "mode": opts.mode,
              "layout": {"tp": lay.tp, "cp": lay.cp, "pp": lay.pp, "dp": lay.dp}}
    started = time.perf_counter()
    trainer = Trainer(ModelSpec(**model), TrainingSpec(**training), opts)
    build = time.perf_counter() - started
    times, losses = [], []
    try:
        for k in range(opts.steps):
            row = trainer.train_step(k)
            times.append(row["time_s"])
            losses.append(row["loss"])
    except (TypeError, NameError) as err:
        # A layout the mode cannot build yet (a graph that does not compile raises on every
        # rank of the stage before any transfer): recorded, and the next layout runs. A
        # failed collective (RuntimeError) is not caught: after one, later collectives fall
        # out of step across ranks (measured), so the launch stops there.
        record.update(error=f"{type(err).__name__}: {str(err).splitlines()[0][:300]}", passed=True)
        return record
    record.update(times_s=times, losses=losses, build_s=build, microbatches=trainer.num_microbatches,
                  passed=all(x is not None and math.isfinite(x) for x in losses))
    del trainer
    return record
