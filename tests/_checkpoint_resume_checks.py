"""Resume the example transformer from a sharded checkpoint at other layouts, pipeline included.

Test-only (``msdist verify`` does not run it): the worker imports this module through
``spec["modules"]`` (``["_checkpoint_resume_checks"]``, tests/ on the ranks' PYTHONPATH).

``checkpoint.resume_transformer`` (4 ranks by default; any world size the layouts divide):

1. At ``first`` (default tp2 x dp2) build the model of ``examples/inside_train_pipeline.py``:
   ``layers`` (default 4) pre-layernorm ``Layer``s (tensor-parallel attention and MLP),
   stacked as ``layers.<i>`` in one ``Stage``, with ``nn.AdamWeightDecay`` and
   :class:`~mindscience.distributed.finalize.GradientFinalizer` (PyNative). Train ``steps``
   steps, ``checkpoint.save`` model + optimizer (moments, step counter, learning rate),
   train ``steps`` more: the uninterrupted losses.
2. At each of ``others`` (default tp4, then tp1 x dp4): new groups, the model built from a
   DIFFERENT seed, ``checkpoint.load``, the same next ``steps`` batches: the losses must
   equal the uninterrupted ones within ``atol`` and the loaded step the saved one.
3. At each of ``pipelines`` (default tp2 x pp2): stage s builds layers ``s*L/pp ..`` as
   ``layers.0 ..``, named globally with ``checkpoint.set_global_layer_names``, loads the
   same checkpoint (each stage's optimizer takes its own copy of the replicated step
   counter and learning rate) and trains with ``pipeline.forward_backward(schedule="1f1b")``
   over ``microbatches`` equal micro-batches of each dp rank's share of the global batch:
   the pipeline's loss (the mean of the micro-batch means) is then the batch's mean loss,
   and its gradients those of that mean, so the losses must match within ``atol`` too.
4. With ``block=True``, the same for ``examples/inside_train_transformer.py``'s ``Block`` (vocab-
   parallel embedding, sequence-parallel layers, column-parallel LM head, vocab-parallel
   cross-entropy) at ``first`` then each of ``others`` (no pipeline: it is one block).

The loss of a step is the global batch's: the mean over dp (x cp) of each rank's mean, the
same number at every layout. One record per rank and leg (with its ``seconds``); restores
the layout in force. Measured on 4 ranks sharing 2 cores: ~41 s a rank with 4 layers (the
first leg ~15 s, each resumed leg 6-11 s; ``layers=2``: 22-28 s); ``block=True`` adds ~15 s.
"""

from __future__ import annotations

import os
import shutil
import time

import numpy as np

from _checkpoint_checks import _barrier, group_mean, train_steps
from _examples_checks import load_example
from mindscience.distributed.harness.checks.groups import current_layout_args, layout_label, reinit, restore
from mindscience.distributed.harness.registry import CheckContext, check

NAME = "checkpoint.resume_transformer"
# inside_train_pipeline's sizes: 4 heads split over tp <= 4, 8 sequences over dp x micro-batches.
DIMS = {"seq_len": 8, "batch": 8, "d_model": 16, "num_heads": 4, "ffn": 32}


def _optimizer(params, lr: float):
    from mindspore import nn

    # nn.AdamWeightDecay: moments to reshard, and it runs on CPU (mint.optim.AdamW does not).
    return nn.AdamWeightDecay(params, learning_rate=lr, weight_decay=0.01)


class _Example:
    """An example script's model; ``batches`` are its global (ids or inputs, targets) pairs."""

    def __init__(self, example: str, lr: float):
        self.mod = load_example(example)
        self.lr = lr

    def batches(self, n: int) -> list:
        d = DIMS
        return self.mod.global_batches(n, d["seq_len"], d["batch"], d["d_model"], 0)


class _Layers(_Example):
    """examples/inside_train_pipeline.py's model: ``layers`` pre-layernorm ``Layer``s (tensor-
    parallel attention and MLP) in a ``Stage``, mean-square loss against random targets."""

    name = "layers"

    def __init__(self, layers: int, lr: float):
        super().__init__("inside_train_pipeline", lr)
        self.layers = layers

    def build(self, seed: int, pipeline: bool = False):
        """This rank's stage (every layer, or its pipeline stage's ``layers / pp``), the
        optimizer, and the cell to save/load (both, layers named by global index)."""
        from mindspore import nn

        from mindscience.distributed import checkpoint, manager

        d = DIMS
        weights = self.mod.dense_weights(self.layers, d["d_model"], d["ffn"], seed)
        pp = manager.get_pipeline_parallel_group()
        per = self.layers // pp.size if pipeline else self.layers
        first = pp.rank * per if pipeline else 0
        stage = self.mod.Stage(self.mod.build_layers(
            range(first, first + per), weights, manager.get_tensor_parallel_group(),
            d["d_model"], d["num_heads"], d["ffn"], d["seq_len"]))
        optimizer = _optimizer(stage.trainable_params(), self.lr)
        state = checkpoint.set_global_layer_names(nn.CellList([stage, optimizer]), first)
        return stage, optimizer, state

    def train(self, stage, optimizer, batches) -> list:
        """pp == 1: value_and_grad on this dp rank's share of each batch, dp mean, AdamW."""
        from mindscience.distributed import manager

        dp = manager.get_data_parallel_group()
        return train_steps(lambda x, y: self.mod.mse(stage(x), y), optimizer, batches,
                           lambda x, y: (np.split(x, dp.size, axis=1)[dp.rank],
                                         np.split(y, dp.size, axis=1)[dp.rank]), dp)

    def train_pipeline(self, stage, optimizer, batches, microbatches: int) -> list:
        """1F1B over ``microbatches`` equal slices of this dp rank's share of each batch:
        the pipeline's loss, the mean of the micro-batch means, is the share's mean."""
        import mindspore as ms

        from mindscience.distributed import manager
        from mindscience.distributed.finalize import GradientFinalizer
        from mindscience.distributed.pipeline import forward_backward

        pp = manager.get_pipeline_parallel_group()
        dp = manager.get_data_parallel_group()
        finalizer = GradientFinalizer(optimizer.parameters)
        losses = []
        for x, y in batches:
            xl, yl = (np.split(a, dp.size, axis=1)[dp.rank] for a in (x, y))
            xs, ys = [None] * microbatches, [None] * microbatches
            if pp.rank == 0:
                xs = [ms.Tensor(a) for a in np.split(xl, microbatches, axis=1)]
            if pp.rank == pp.size - 1:
                ys = [ms.Tensor(a) for a in np.split(yl, microbatches, axis=1)]
            loss, grads = forward_backward(stage, xs, ys, self.mod.mse, schedule="1f1b")
            optimizer(finalizer(grads))
            losses.append(group_mean(loss, dp))
        return losses


class _Block(_Example):
    """examples/inside_train_transformer.py's ``Block``: vocab-parallel embedding, sequence-
    parallel layer, column-parallel LM head, vocab-parallel cross-entropy (pp == 1)."""

    name = "block"

    def __init__(self, lr: float):
        super().__init__("inside_train_transformer", lr)

    def build(self, seed: int, pipeline: bool = False):
        from mindspore import nn

        from mindscience.distributed import manager

        d = DIMS
        block = self.mod.Block(manager.get_tensor_parallel_group(),
                               manager.get_context_parallel_group(),
                               d["d_model"], d["num_heads"], d["ffn"], d["seq_len"])
        self.mod.load_weights(block, self.mod.dense_weights(d["d_model"], d["ffn"], seed))
        optimizer = _optimizer(block.trainable_params(), self.lr)
        return block, optimizer, nn.CellList([block, optimizer])

    def train(self, block, optimizer, batches) -> list:
        """The block's cross-entropy; gradients finalized (sequence-parallel ones summed
        over tp, all averaged over dp-cp); AdamW."""
        from mindscience.distributed import manager

        tp, cp, dp = (manager.get_tensor_parallel_group(), manager.get_context_parallel_group(),
                      manager.get_data_parallel_group())
        return train_steps(block, optimizer, batches, lambda x, y: self.mod.local_batch(x, y, tp, cp, dp),
                           manager.get_data_context_parallel_group())


# ----------------------------------------------------------------------------- the check
def _check_sizes(lay, layers: int, microbatches: int, pipeline: bool) -> None:
    d = DIMS
    need = lay.dp * lay.cp * (microbatches if pipeline else 1)
    if d["batch"] % need:
        raise ValueError(f"layout {layout_label(lay)}: the global batch of {d['batch']} does not "
                         f"split into dp x cp{' x microbatches' if pipeline else ''} = {need} "
                         "equal parts; choose layouts (or microbatches) that divide it.")
    if d["num_heads"] % lay.tp or d["seq_len"] % lay.tp or layers % lay.pp:
        raise ValueError(f"layout {layout_label(lay)}: {d['num_heads']} heads, a sequence of "
                         f"{d['seq_len']} and {layers} layers must divide by tp (heads, "
                         "sequence) and pp (layers); use tp in (1, 2, 4) and pp dividing layers.")


def _record(lay, model, role, losses, want, atol, started, saved_step=None, info=None) -> dict:
    """One leg's record (``started``: the leg's perf_counter start)."""
    err = 0.0 if want is None else float(np.max(np.abs(np.array(losses) - np.array(want))))
    rec = {"check": NAME, "group": layout_label(lay), "model": model, "role": role,
           "losses": losses, "max_error": err, "atol": atol,
           "trained": bool(len(set(losses)) > 1),
           "seconds": round(time.perf_counter() - started, 2)}
    if info is None:
        rec["passed"] = rec["trained"]
    else:
        rec.update(saved_step=saved_step, loaded_step=info["step"], loaded=len(info["loaded"]),
                   moments=sum("adam_m" in n or "adam_v" in n for n in info["loaded"]))
        rec["passed"] = bool(err <= atol and info["step"] == saved_step and rec["moments"] > 0)
    return rec


def _legs(manager, model, layers, first, others, pipelines, steps, atol, microbatches,
          ckpt) -> list:
    """Save ``model`` at ``first`` after ``steps`` steps; resume at ``others``, ``pipelines``."""
    from mindscience.distributed import checkpoint

    data = model.batches(2 * steps)
    before, after = data[:steps], data[steps:]
    t0 = time.perf_counter()
    lay = reinit(manager, first)
    _check_sizes(lay, layers, microbatches, False)
    net, opt, state = model.build(seed=0)
    model.train(net, opt, before)
    checkpoint.save(state, ckpt, step=steps, extra={"layout": layout_label(lay), "model": model.name})
    want = model.train(net, opt, after)
    records = [_record(lay, model.name, "uninterrupted", want, None, atol, t0)]
    for spec, pipeline in [(s, False) for s in others] + [(s, True) for s in pipelines]:
        t0 = time.perf_counter()
        lay = reinit(manager, spec)
        _check_sizes(lay, layers, microbatches, pipeline)
        net, opt, state = model.build(seed=99, pipeline=pipeline)
        info = checkpoint.load(state, ckpt)
        if pipeline:
            got = model.train_pipeline(net, opt, after, microbatches)
        else:
            got = model.train(net, opt, after)
        rec = _record(lay, model.name, "pipeline_resumed" if pipeline else "resumed", got, want,
                      atol, t0, steps, info)
        if pipeline:
            rec.update(schedule="1f1b", microbatches=microbatches,
                       stage=manager.get_pipeline_parallel_rank())
        records.append(rec)
    return records


@check(NAME)
def resume_transformer(ctx: CheckContext, first=None, others=None, pipelines=None, steps: int = 2,
                       layers: int = 4, microbatches: int = 2, lr: float = 0.01,
                       atol: float = 1e-6, block: bool = False) -> list:
    """Save the example transformer (``layers`` layers) at ``first`` after ``steps`` steps,
    resume at each of ``others`` and of ``pipelines`` (e.g. ``{"tp": 2, "pp": 2}``: 1F1B
    over ``microbatches``); ``block=True`` adds inside_train_transformer's Block at ``first`` and
    ``others`` (off by default: see the module doc for the cost)."""
    import mindspore as ms

    from mindscience.distributed import manager

    if steps < 2:
        raise ValueError(f"steps={steps}: need >= 2 so that the resumed losses can show training "
                         "moved; pass steps=2 or more.")
    first = first or {"tp": 2}
    others = [{"tp": 4}, {"tp": 1}] if others is None else others
    pipelines = [{"tp": 2, "pp": 2}] if pipelines is None else pipelines
    saved_args = current_layout_args(manager)
    saved_mode = ms.get_context("mode")
    root = os.path.join(ctx.out_dir or ".", "checkpoint_resume_transformer")
    records = []
    try:
        # PyNative keeps compile time out (AdamWeightDecay's update still compiles itself).
        ms.set_context(mode=ms.PYNATIVE_MODE)
        records += _legs(manager, _Layers(layers, lr), layers, first, others, pipelines, steps,
                         atol, microbatches, os.path.join(root, "layers"))
        if block:
            records += _legs(manager, _Block(lr), layers, first, others, [], steps, atol,
                             microbatches, os.path.join(root, "block"))
    finally:
        restore(manager, saved_args)
        ms.set_context(mode=saved_mode)
    _barrier()  # every rank has read the checkpoints before rank 0 deletes them
    if ctx.rank == 0:
        shutil.rmtree(root, ignore_errors=True)
    return records
