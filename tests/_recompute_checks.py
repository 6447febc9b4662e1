"""Test-only harness checks of activation recompute (imported by the worker through
``spec["modules"]``, see ``_recompute_job.py``).

``recompute.layers``
    A small model with every layer of the set (vocabulary-parallel embedding, the three
    context-parallel attentions, a Column -> tanh -> Row MLP, a Column head and the
    vocabulary-parallel cross-entropy) on tp x cp, in each mode, three ways: nothing
    recomputed; every layer ``Cell.recompute()``-ed (collectives inside the recomputed
    blocks: ring shifts, all-to-alls, all-gathers, all-reduces); the attentions'
    selective ``recompute=True``. Records the largest difference of the loss, the input
    gradient and every parameter gradient against the first way.

``recompute.rng``
    Dropout on the default stream and under the tp RNG tracker's ``fork()`` inside a
    recomputed Column -> Row block, two steps each. PyNative: ``random.recompute`` (the
    streams replayed) against no recompute; the block's two forwards per step (the
    forward and the recomputed one) are recorded and their dropout masks compared; the
    same for plain ``Cell.recompute()`` (recorded: MindSpore restores only its Generator).
    Compiled: ``Cell.recompute()`` with the graph traced inside ``fork()``.

``recompute.pipeline``
    ``forward_backward`` on pp2 (x tp2, the stage a Column -> tanh -> Row with its
    all-reduce) with GPipe: the stage forwards kept (``recompute="none"``, and
    ``"selective"`` with a ``Cell.recompute()``-ed sub-block) against ``"full"``, in
    PyNative; 1F1B asked for ``"none"``, and GPipe under jit, run ``"full"`` (a warning, the
    same numbers).
"""

from __future__ import annotations

import warnings

import numpy as np
from mindspore import mint

from mindscience.distributed.harness.checks.p2p import under_layout
from mindscience.distributed.harness.registry import CheckContext, check

# Compiled functions stay referenced: MindSpore caches them by object identity.
_KEEP: list = []

S, B, H, HEADS, V, FFN = 8, 2, 16, 4, 16, 32


def _max_diff(a, b) -> float:
    return max((float(np.abs(x - y).max()) if x.size else 0.0) for x, y in zip(a, b))


def _grad_fn(mode, net, weights):
    """``run(*args) -> (loss, [input grad, *weight grads])`` as numpy, in ``mode``."""
    import mindspore as ms

    fn = ms.value_and_grad(net, 0, weights)
    if mode == "jit":
        fn = ms.jit(fn)
    _KEEP.append(fn)

    def run(*args):
        if mode == "graph":
            ms.set_context(mode=ms.GRAPH_MODE)
        try:
            loss, (gx, gw) = fn(*args)
        finally:
            ms.set_context(mode=ms.PYNATIVE_MODE)
        return float(loss.asnumpy()), [gx.asnumpy()] + [g.asnumpy() for g in gw]

    return run


def _grad_run(mode, net, args, weights):
    return _grad_fn(mode, net, weights)(*args)


# ------------------------------------------------------------------ recompute.layers
def _layer_model(variant, methods):
    import mindspore as ms
    from mindspore import mint, nn

    from mindscience.distributed.modules import (
        ColumnParallelLinear, ContextParallelAttention, RowParallelLinear,
        VocabParallelEmbedding, vocab_parallel_cross_entropy)

    f32 = ms.float32
    selective = variant == "selective"

    class Mlp(nn.Cell):
        def __init__(self):
            super().__init__()
            self.fc1 = ColumnParallelLinear(H, FFN, gather_output=False, compute_dtype=f32)
            self.fc2 = RowParallelLinear(FFN, H, input_is_parallel=True, compute_dtype=f32)

        def construct(self, x):
            return self.fc2(mint.tanh(self.fc1(x)))

    class Loss(nn.Cell):
        def __init__(self):
            super().__init__()
            self.head = ColumnParallelLinear(H, V, gather_output=False, bias=False,
                                             compute_dtype=f32)
            self.tp = self.head.group  # compiled code cannot ask the manager for it

        def construct(self, x, target):
            return vocab_parallel_cross_entropy(self.head(x), target, group=self.tp).mean()

    class Model(nn.Cell):
        def __init__(self):
            super().__init__()
            self.emb = VocabParallelEmbedding(V, H)
            # causal ring and ulysses, non-causal all-gather KV
            self.attention = nn.CellList([
                ContextParallelAttention(H, HEADS, method=m, causal=m != "allgather_kv",
                                         recompute=selective) for m in methods])
            self.mlp = Mlp()
            self.loss = Loss()
            if variant == "cells":
                for cell in (self.emb, *self.attention, self.mlp, self.loss):
                    cell.recompute()

        def construct(self, x0, ids, target):
            x = self.emb(ids) + x0
            for attention in self.attention:
                x = x + attention(x)
            x = x + self.mlp(x)
            return self.loss(x, target)

    ms.set_seed(1234)  # the same weights in every variant
    return Model()


@check("recompute.layers")
def recompute_layers(ctx: CheckContext, modes=("pynative",), variants=("cells", "selective"),
                     methods=("ring", "ulysses", "allgather_kv"), layout=None) -> list:
    """Loss and gradients with recompute against without, per mode and variant (the
    model holds one attention layer per method in ``methods``)."""
    def body(manager):
        import mindspore as ms

        cp = manager.get_context_parallel_group()
        rng = np.random.default_rng(7)
        ids = rng.integers(0, V, (S, B)).astype(np.int32)
        tgt = rng.integers(0, V, (S, B)).astype(np.int32)
        x0 = rng.standard_normal((S, B, H)).astype(np.float32)
        rows = slice(cp.rank * S // cp.size, (cp.rank + 1) * S // cp.size)
        args = (ms.Tensor(x0[rows]), ms.Tensor(ids[rows]), ms.Tensor(tgt[rows]))
        records = []
        for mode in modes:
            base = _layer_model("none", methods)
            _KEEP.append(base)
            want_loss, want = _grad_run(mode, base, args, base.trainable_params())
            for variant in variants:
                net = _layer_model(variant, methods)
                _KEEP.append(net)
                loss, got = _grad_run(mode, net, args, net.trainable_params())
                err = max(abs(loss - want_loss), _max_diff(got, want))
                records.append({"check": "recompute.layers",
                                "group": f"{mode}.{variant}.{'+'.join(methods)}",
                                "mode": mode, "variant": variant, "methods": list(methods),
                                "loss": loss,
                                "loss_ref": want_loss, "max_error": err,
                                "grads": len(got), "passed": err <= 1e-6})
        return records

    return under_layout(ctx, layout, body)


# ------------------------------------------------------------------ recompute.rng
def _rng_net(eager, masks):
    """A Column -> dropout -> tanh -> Row -> dropout block (in a loss cell). Eager: the
    first dropout under the tracker's ``fork()``, each forward's masks appended to
    ``masks`` as ``(name, mask)``. Compiled: both on the stream in force at the trace."""
    import mindspore as ms
    from mindspore import mint, nn, ops

    from mindscience.distributed import random as msrandom
    from mindscience.distributed.modules import ColumnParallelLinear, RowParallelLinear

    f32 = ms.float32

    class Block(nn.Cell):
        def __init__(self):
            super().__init__()
            self.fc1 = ColumnParallelLinear(H, FFN, gather_output=False, compute_dtype=f32)
            self.fc2 = RowParallelLinear(FFN, H, input_is_parallel=True, compute_dtype=f32)

    class EagerBlock(Block):
        def construct(self, x):
            h = self.fc1(x)
            with msrandom.get_rng_tracker().fork():
                h = ops.dropout(h, p=0.5)
            masks.append(("tracker", (h == 0).asnumpy()))
            y = ops.dropout(self.fc2(mint.tanh(h)), p=0.25)
            masks.append(("default", (y == 0).asnumpy()))
            return y

    class GraphBlock(Block):
        def construct(self, x):
            h = ops.dropout(self.fc1(x), p=0.5)
            return ops.dropout(self.fc2(mint.tanh(h)), p=0.25)

    class Net(nn.Cell):
        def __init__(self):
            super().__init__()
            self.block = EagerBlock() if eager else GraphBlock()

        def construct(self, x):
            y = self.block(x)
            return (y * y).sum()

    return Net()


def _mask_diffs(masks, base_masks, steps):
    """``(replay, vs_none)``: the largest mask difference between each step's forward and
    its recomputed forward, and between the forward and the run without recompute."""
    replay, vs_none = 0.0, 0.0
    for name in ("tracker", "default"):
        mine = [m.astype(np.float32) for n, m in masks if n == name]
        base = [m.astype(np.float32) for n, m in base_masks if n == name]
        per_step = len(mine) // steps  # 2: forward + recomputed forward; 1 without
        for s in range(steps):
            first = mine[per_step * s]
            vs_none = max(vs_none, float(np.abs(first - base[s]).max()))
            for again in mine[per_step * s + 1:per_step * (s + 1)]:
                replay = max(replay, float(np.abs(first - again).max()))
    return replay, vs_none


@check("recompute.rng")
def recompute_rng(ctx: CheckContext, modes=("pynative", "jit", "graph"), steps=2,
                  layout=None) -> list:
    """Dropout in a recomputed block: the same masks and gradients as without recompute."""
    def body(manager):
        import mindspore as ms

        from mindscience.distributed import random as msrandom

        x = ms.Tensor(np.random.default_rng(3).standard_normal((4, B, H)).astype(np.float32))
        records = []
        for mode in modes:
            eager = mode == "pynative"
            ways = ("none", "library", "plain") if eager else ("none", "plain")
            results = {}
            for way in ways:
                masks = []
                msrandom.model_parallel_seed(2024)  # the same weights and streams per way
                net = _rng_net(eager, masks)
                _KEEP.append(net)
                if way == "library":
                    msrandom.recompute(net.block)
                elif way == "plain":
                    net.block.recompute()
                run = _grad_fn(mode, net, net.trainable_params())
                out = []
                for _ in range(steps):
                    if eager:
                        out.append(run(x))
                    else:
                        # Compiled: the seeds are fixed when the graph is traced (the first
                        # call), here inside fork(); later steps advance the kernels' state.
                        with msrandom.get_rng_tracker().fork():
                            out.append(run(x))
                results[way] = (out, masks)
            base, base_masks = results["none"]
            for way in ways[1:]:
                out, masks = results[way]
                err = max(max(abs(a[0] - b[0]), _max_diff(a[1], b[1])) for a, b in zip(out, base))
                rec = {"check": "recompute.rng", "group": f"{mode}.{way}", "mode": mode,
                       "way": way, "max_error": err, "steps": steps}
                if eager:
                    replay, vs_none = _mask_diffs(masks, base_masks, steps)
                    rec.update(forwards=len(masks) // 2, base_forwards=len(base_masks) // 2,
                               mask_replay_diff=replay, mask_vs_none_diff=vs_none,
                               dropped=float(np.mean(masks[0][1])))
                # Plain Cell.recompute() in PyNative is recorded, not required (MindSpore's).
                rec["passed"] = err <= 1e-6 if (way == "library" or not eager) else True
                records.append(rec)
        return records

    return under_layout(ctx, layout, body)


# ------------------------------------------------------------------ recompute.pipeline
def _stage_cls():
    import mindspore as ms
    from mindspore import mint, nn

    from mindscience.distributed.modules import ColumnParallelLinear, RowParallelLinear

    f32 = ms.float32

    class Mlp(nn.Cell):
        def __init__(self):
            super().__init__()
            self.fc1 = ColumnParallelLinear(H, FFN, gather_output=False, compute_dtype=f32)
            self.fc2 = RowParallelLinear(FFN, H, input_is_parallel=True, compute_dtype=f32)

        def construct(self, x):
            return x + self.fc2(mint.tanh(self.fc1(x)))

    class Stage(nn.Cell):
        def __init__(self, marked):
            super().__init__()
            self.a = Mlp()
            self.b = Mlp()
            if marked:
                self.b.recompute()

        def construct(self, x):
            return self.b(self.a(x))

    return Stage


def _pipe_loss(out, t):
    # No import here: the last stage's loss is compiled under mode="jit".
    return mint.mean((out - t) ** 2)


@check("recompute.pipeline")
def recompute_pipeline(ctx: CheckContext, modes=("pynative", "jit"), microbatches=4,
                       layout=None) -> list:
    """GPipe with kept stage activations vs full recompute; 1F1B forced to full."""
    def body(manager):
        import mindspore as ms

        from mindscience.distributed.pipeline import runtime
        from mindscience.distributed.pipeline.runtime import forward_backward

        g = manager.get_pipeline_parallel_group()
        p, i = g.size, g.rank
        rng = np.random.default_rng(11)
        xs = [rng.standard_normal((2, B, H)).astype(np.float32) for _ in range(microbatches)]
        ts = [rng.standard_normal((2, B, H)).astype(np.float32) for _ in range(microbatches)]
        inputs = [ms.Tensor(a) if i == 0 else None for a in xs]
        targets = [ms.Tensor(a) if i == p - 1 else None for a in ts]
        Stage = _stage_cls()
        records = []

        def step(stage, schedule, mode, how):
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                loss, grads = forward_backward(stage, inputs, targets, _pipe_loss,
                                               schedule=schedule, mode=mode, recompute=how)
            return (float(loss.asnumpy()), [q.asnumpy() for q in grads],
                    runtime.last_recompute()[0], runtime.last_peak(), len(caught))

        cases = (("gpipe", "none", False), ("1f1b", "none", False), ("gpipe", "selective", True))
        for mode in modes:
            # One stage per kind for all its runs (they do not change the weights), so
            # that a compiled forward serves the recomputing and the keeping runs alike.
            stages = {}
            for marked in ((False, True) if mode == "pynative" else (False,)):
                ms.set_seed(100 + i)  # this stage's weights, the same for both kinds
                stages[marked] = Stage(marked)
                _KEEP.append(stages[marked])
            # jit runs "full" whatever is asked (recompute.runtime_recompute): one case shows it
            for schedule, recompute, marked in (cases if mode == "pynative" else cases[:1]):
                full = step(stages[marked], schedule, mode, "full")
                kept = step(stages[marked], schedule, mode, recompute)
                err = max(abs(full[0] - kept[0]), _max_diff(full[1], kept[1]))
                want_runs = recompute if (schedule, mode) == ("gpipe", "pynative") else "full"
                records.append({
                    "check": "recompute.pipeline", "group": f"{mode}.{schedule}.{recompute}",
                    "mode": mode, "schedule": schedule, "recompute": recompute,
                    "what_runs": kept[2], "what_runs_full": full[2], "peak": kept[3],
                    "peak_full": full[3], "warnings": kept[4], "loss": kept[0],
                    "max_error": err, "grads": len(kept[1]),
                    "passed": err <= 1e-6 and kept[2] == want_runs and full[2] == "full"})
        return records

    return under_layout(ctx, layout, body)
