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
    ``forward_backward`` with every schedule (1F1B, interleaved v = 2, GPipe), mode
    (PyNative, jit) and recompute (none, selective with a ``Cell.recompute()``-ed
    sub-block, full) on the job's pipeline layout (tp2 x pp2: the stage a pair of
    Column -> tanh -> Row blocks with their all-reduces; pp2 x dp2): the loss and this
    rank's gradients against the dense model (every stage chained on every rank, PyNative),
    and the executions of each stage's forward (an in-graph counter): once per micro-batch
    when the activations are kept, twice under ``"full"``.
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
        """Two MLPs; ``calls`` counts the eager runs of the forward (PyNative), so a forward
        run again in a backward shows (compiled, it counts the traces)."""

        def __init__(self, marked):
            super().__init__()
            self.a = Mlp()
            self.b = Mlp()
            self.calls = 0
            if marked:
                self.b.recompute()

        def construct(self, x):
            self.calls += 1
            return self.b(self.a(x))

    class JitStage(Stage):
        """The stage compiled: no Python side effect in the traced ``construct``."""

        def construct(self, x):
            return self.b(self.a(x))

    return Stage, JitStage


def _pipe_loss(out, t):
    # No import here: the last stage's loss is compiled under mode="jit".
    return mint.mean((out - t) ** 2)


def _rel_err(got, want) -> float:
    return max(float(np.abs(a - b).max()) / max(float(np.abs(b).max()), 1e-12)
               for a, b in zip(got, want))


def _compile_stages(cell, p, i, schedules, recomputes, x0, t0):
    """Compile every jit stage function this rank will run, here, with only its tp peers.

    A stage compiling at its first call inside the pipeline keeps its neighbour waiting in a
    transfer, and MindSpore's CPU collectives give up after ~55 s (on a loaded machine a
    few graphs take that long): GPTModel._compile_stages does the same.
    """
    import mindspore as ms
    from mindspore import ops

    from mindscience.distributed.pipeline.stage_fns import stage_fns

    done = set()
    for schedule in schedules:
        v = _PIPE_SCHEDULES[schedule]
        stages = p * v
        for recompute in recomputes:
            marked = recompute == "selective"
            kept = recompute != "full"
            for c in range(v):
                k = c * p + i
                first, last = k == 0, k == stages - 1
                key = (k, marked, first, last, kept)
                if key in done:
                    continue
                done.add(key)
                fns = stage_fns(cell(k, marked, "jit"), _pipe_loss, "jit", first, last)
                x = ms.Tensor(x0)
                if last:
                    fns.loss(x, ms.Tensor(t0), ms.Tensor(0.0, ms.float32), fns.zeros(),
                             ops.zeros((), ms.float32))
                elif kept:
                    y, pending = fns.keep(x)
                    fns.backward_kept(pending, ops.zeros(y.shape, y.dtype), fns.zeros())
                else:
                    y = fns.forward(x)
                    fns.backward(x, ops.zeros(y.shape, y.dtype), fns.zeros())


# schedule -> chunks per rank (v)
_PIPE_SCHEDULES = {"1f1b": 1, "gpipe": 1, "interleaved": 2}


@check("recompute.pipeline")
def recompute_pipeline(ctx: CheckContext, modes=("pynative", "jit"),
                       schedules=("1f1b", "interleaved", "gpipe"),
                       recomputes=("none", "selective", "full"), microbatches=4,
                       layout=None, tag="pp") -> list:
    """Every schedule x mode x recompute against the dense model (every stage run on
    every rank in one process); the stage forwards counted."""
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
        classes = dict(zip(("pynative", "jit"), _stage_cls()))
        cells = {}

        def cell(k, marked, mode="pynative"):
            # Model stage k's weights depend on k only: one cell per (k, marked) serves
            # every schedule and recompute, so each graph compiles once. (Every rank of a
            # run takes new cells or none: the runtime agrees on a configuration at the
            # first call with a cell.)
            if (k, marked, mode) not in cells:
                ms.set_seed(100 + k)
                cells[(k, marked, mode)] = classes[mode](marked)
                _KEEP.append(cells[(k, marked, mode)])
            return cells[(k, marked, mode)]

        dense = {}

        def reference(stages):
            """Loss and every stage's gradients of the dense model (PyNative), once per size."""
            if stages not in dense:
                model = [cell(k, False) for k in range(stages)]
                weights = [q for c in model for q in c.trainable_params()]

                def loss_of(x, t):
                    for c in model:
                        x = c(x)
                    return _pipe_loss(x, t) / microbatches

                vg = ms.value_and_grad(loss_of, None, weights)
                total, acc = 0.0, None
                for x, t in zip(xs, ts):
                    value, grads = vg(ms.Tensor(x), ms.Tensor(t))
                    total += float(value.asnumpy())
                    got = [q.asnumpy() for q in grads]
                    acc = got if acc is None else [a + b for a, b in zip(acc, got)]
                per_stage, at = [], 0
                for c in model:
                    n = len(c.trainable_params())
                    per_stage.append(acc[at:at + n])
                    at += n
                dense[stages] = (total, per_stage)
            return dense[stages]

        for schedule in schedules:
            reference(p * _PIPE_SCHEDULES[schedule])
        # Every rank has finished the reference's tp collectives before the pipeline's first
        # one: MindSpore's CPU collectives of two groups out of step mix their messages.
        from mindspore import mint as _mint
        _mint.distributed.all_reduce(ms.Tensor(np.ones(1, np.float32)))
        if "jit" in modes:
            _compile_stages(cell, p, i, schedules, recomputes, xs[0], ts[0])
            _mint.distributed.all_reduce(ms.Tensor(np.ones(1, np.float32)))
        records = []
        for mode in modes:
            for schedule in schedules:
                v = _PIPE_SCHEDULES[schedule]
                stages = p * v
                ks = [c * p + i for c in range(v)]
                want_loss, want = reference(stages)
                for recompute in recomputes:
                    marked = recompute == "selective"
                    mine = [cell(k, marked, mode) for k in ks]
                    stage = mine if schedule == "interleaved" else mine[0]
                    before = [c.calls for c in mine]
                    with warnings.catch_warnings(record=True) as caught:
                        warnings.simplefilter("always")
                        loss, grads = forward_backward(stage, inputs, targets, _pipe_loss,
                                                       schedule=schedule, mode=mode,
                                                       recompute=recompute)
                    calls = [c.calls - b for c, b in zip(mine, before)]
                    got = [q.asnumpy() for q in grads]
                    ref = [q for k in ks for q in want[k]]
                    loss = float(loss.asnumpy())
                    err = max(abs(loss - want_loss) / abs(want_loss), _rel_err(got, ref))
                    what = runtime.last_recompute()[0]
                    # Kept in both modes, with the tp collectives too (compiled: the
                    # mappings' outputs copied out of their shared cells, mappings._OwnOutput).
                    want_runs = recompute
                    # A model stage's forward runs once per micro-batch when kept, twice
                    # when recomputed; the last computes loss and gradients in one pass.
                    want_calls = [microbatches * (2 if want_runs == "full" and k != stages - 1
                                                  else 1) for k in ks]
                    if mode == "jit":  # traced once, before this check: nothing to count
                        calls = want_calls = None
                    records.append({
                        "check": "recompute.pipeline",
                        "group": f"{tag}.{mode}.{schedule}.{recompute}",
                        "stages": stages, "model_stages": ks,
                        "mode": mode, "schedule": schedule, "recompute": recompute,
                        "what_runs": what, "peak": runtime.last_peak(),
                        "warnings": len(caught), "loss": loss, "loss_dense": want_loss,
                        "rel_error": err, "grads": len(got), "forward_calls": calls,
                        "want_forward_calls": want_calls,
                        "want_runs": want_runs,
                        "passed": (err <= 1e-5 and what == want_runs and calls == want_calls
                                   and not caught)})
        return records

    return under_layout(ctx, layout, body)
