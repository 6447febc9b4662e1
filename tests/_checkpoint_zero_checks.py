"""Worker-side checks of checkpoints of sharded optimizer state and fully sharded parameters
(imported by the workers through ``spec["modules"]``, tests/ on their PYTHONPATH).

The model is the layer set at its smallest: VocabParallelEmbedding -> a LayerNorm Cell ->
ColumnParallelLinear -> gelu -> RowParallelLinear (residual) -> ColumnParallelLinear head
-> vocab_parallel_cross_entropy, every dim-0 size chosen so that 4 (and 2) ranks need
padding rows. Its initial weights are drawn per GLOBAL tensor from a seed and sliced for
this tp rank, so every layout starts from the same model. The optimizer is
DistributedOptimizer (AdamW, weight decay, a linear learning-rate decay schedule: a
resume at the wrong step would change the learning rate).

``ckzero.reference``: ``steps`` steps uninterrupted at tp1 x dp4, stage 0; keeps the
losses and final weights in this process for the later checks.

``ckzero.chain``: ``fully_shard`` + stage 3 at dp4 for ``legs[0]`` steps, saved; loaded at
tp2 x dp2 with stage 1 into a model drawn from another seed, ``legs[1]`` steps, saved;
loaded at tp1 x dp4 with stage 0, the remaining steps. Every leg's losses and the final
weights against the reference.

``ckzero.offline``: stage 2 at tp2 x dp2 for ``first`` steps, saved; rank 0 runs the
offline ``checkpoint.reshard`` to tp1 x dp4; loaded there with stage 1, the rest of the
steps.

The loss of a step is the global batch's (the mean over dp of each rank's mean).
"""

from __future__ import annotations

import os
import shutil
import time
import zlib

import numpy as np

from _checkpoint_checks import _barrier
from mindscience.distributed.harness.checks.groups import layout_label, reinit
from mindscience.distributed.harness.registry import check

V, D, F, S, B = 50, 18, 40, 8, 8
LR, LR_END, WD = 0.02, 0.004, 0.01
_STATE: dict = {}


def _model():
    import mindspore as ms
    from mindspore import mint, nn, ops

    from mindscience.distributed import manager
    from mindscience.distributed.modules import (ColumnParallelLinear, RowParallelLinear,
                                                 VocabParallelEmbedding,
                                                 vocab_parallel_cross_entropy)

    tp = manager.get_tensor_parallel_group()
    f32 = dict(compute_dtype=ms.float32, group=tp)

    class LayerNorm(nn.Cell):
        def __init__(self):
            super().__init__()
            self.weight = ms.Parameter(ms.Tensor(np.ones(D, np.float32)), name="weight")
            self.bias = ms.Parameter(ms.Tensor(np.zeros(D, np.float32)), name="bias")

        def construct(self, x):
            mean = mint.mean(x, -1, keepdim=True)
            var = mint.mean((x - mean) ** 2, -1, keepdim=True)
            return (x - mean) / mint.sqrt(var + 1e-5) * self.weight + self.bias

    class Net(nn.Cell):
        def __init__(self):
            super().__init__()
            self.tp = tp
            self.embedding = VocabParallelEmbedding(V, D, group=tp)
            self.ln = LayerNorm()
            self.fc1 = ColumnParallelLinear(D, F, gather_output=False, **f32)
            self.fc2 = RowParallelLinear(F, D, input_is_parallel=True, **f32)
            self.head = ColumnParallelLinear(D, V, bias=False, gather_output=False, **f32)

        def construct(self, ids, target):
            h = ops.cast(self.embedding(ids), ms.float32)
            h = h + self.fc2(ops.gelu(self.fc1(self.ln(h))))
            logits = self.head(h)
            return mint.mean(vocab_parallel_cross_entropy(logits, target, group=self.tp))

    return Net()


def _init(net, seed: int) -> None:
    """Every parameter from its GLOBAL tensor (drawn from ``seed`` and its name), sliced
    for this rank as the checkpoint plan slices it."""
    import mindspore as ms

    from mindscience.distributed.checkpoint import named_parameters
    from mindscience.distributed.checkpoint.cell import _world
    from mindscience.distributed.checkpoint.plan import global_shape_from_local, piece_for

    layout, rank = _world()
    for name, param, sharding in named_parameters(net):
        gshape = global_shape_from_local(name, tuple(param.shape), sharding, layout)
        rng = np.random.default_rng([seed, zlib.crc32(name.encode())])
        full = rng.standard_normal(gshape).astype(np.float32) * 0.3
        if name.endswith("ln.weight"):
            full = 1.0 + full
        piece = piece_for(name, gshape, sharding, layout, rank)
        if piece["dim"] is not None:
            idx = [slice(None)] * full.ndim
            parts = []
            for g0, g1, _ in piece["ranges"]:
                idx[piece["dim"]] = slice(g0, g1)
                parts.append(full[tuple(idx)])
            full = np.concatenate(parts, piece["dim"])
        param.set_data(ms.Tensor(np.ascontiguousarray(full)))


def _batches(steps: int):
    rng = np.random.default_rng(11)
    return [(rng.integers(0, V, (S, B)).astype(np.int32), rng.integers(0, V, (S, B)).astype(np.int32))
            for _ in range(steps)]


class _Leg:
    """A model + DistributedOptimizer at the layout in force, trained on global batches."""

    def __init__(self, stage: int, seed: int, total_steps: int, shard: bool = False):
        import mindspore as ms
        from mindspore import nn

        from mindscience.distributed import fully_shard, manager
        from mindscience.distributed.optimizer import DistributedOptimizer

        self.dp = manager.get_data_parallel_group()
        self.net = _model()
        _init(self.net, seed)
        if shard:
            fully_shard(self.net)
        schedule = nn.PolynomialDecayLR(LR, LR_END, total_steps, power=1.0)
        params = self.net.trainable_params()
        self.opt = DistributedOptimizer(params, lr=schedule, weight_decay=WD, zero_stage=stage)
        self.cell = nn.CellList([self.net, self.opt])
        self.grad_fn = ms.value_and_grad(self.net, None, params)
        self.params = params

    def train(self, batches) -> list:
        import mindspore as ms

        from mindscience.distributed.collectives import all_reduce

        n = B // self.dp.size
        lo = self.dp.rank * n
        losses = []
        for ids, tgt in batches:
            loss, grads = self.grad_fn(ms.Tensor(ids[:, lo:lo + n]), ms.Tensor(tgt[:, lo:lo + n]))
            self.opt(grads)
            total = all_reduce(loss.reshape(1), self.dp) if self.dp.size > 1 else loss.reshape(1)
            losses.append(float(total.asnumpy()[0]) / self.dp.size)
        return losses

    def weights(self) -> dict:
        """This rank's model parameters by global name (full local tensors)."""
        from mindscience.distributed.checkpoint import named_parameters

        return {n: p.asnumpy().astype(np.float64) for n, p, _ in named_parameters(self.net)}

    def padding_abs(self) -> float:
        """Largest |value| in the padding rows of the optimizer state (must stay 0)."""
        from mindscience.distributed.optimizer.layout import shard_range

        opt, worst = self.opt, 0.0
        if opt.stage == 0 or opt.d == 1:
            return worst
        for i, sh in enumerate(opt.shards):
            start, stop = shard_range(sh.rows, opt.d, opt.group.rank)
            for group in [list(opt.mains)] + [list(g) for g in opt.moments]:
                if group and stop - start < sh.shard_rows:
                    worst = max(worst, float(np.max(np.abs(group[i].asnumpy()[stop - start:]))))
        return worst


def _layout(tp: int):
    """The layout tp x dp(rest), re-creating the groups only when it changes."""
    from mindscience.distributed import manager

    if manager.is_initialized():
        lay = manager.get_layout()
        if (lay.tp, lay.cp, lay.pp) == (tp, 1, 1):
            return lay
    return reinit(manager, {"tp": tp})


def _root(ctx) -> str:
    return os.path.join(ctx.out_dir or ".", "ckzero")


def _rel(got, want) -> float:
    return max(abs(a - b) / abs(b) for a, b in zip(got, want)) if got else float("inf")


@check("ckzero.reference")
def reference(ctx, steps: int = 6) -> dict:
    """The uninterrupted run at tp1 x dp4, stage 0."""
    started = time.perf_counter()
    lay = _layout(1)
    leg = _Leg(stage=0, seed=7, total_steps=steps)
    losses = leg.train(_batches(steps))
    _STATE["reference"] = (losses, leg.weights())
    return {"check": "ckzero.reference", "layout": layout_label(lay), "losses": losses,
            "seconds": round(time.perf_counter() - started, 2)}


def _leg_record(name, lay, leg, losses, want, started, info=None, extra=None) -> dict:
    out = {"check": name, "layout": layout_label(lay), "stage": leg.opt.stage,
           "group_size": leg.opt.d, "losses": losses, "want": want,
           "loss_rel": _rel(losses, want), "padding_abs": leg.padding_abs(),
           "opt_step": int(leg.opt.step.asnumpy()),
           "seconds": round(time.perf_counter() - started, 2)}
    if info is not None:
        out["loaded_step"] = info["step"]
        out["loaded_count"] = len(info["loaded"])
    out.update(extra or {})
    return out


def _final(leg) -> dict:
    """The largest difference of this rank's final weights from the reference's."""
    ref = _STATE["reference"][1]
    got = leg.weights()
    scale = max(float(np.max(np.abs(a))) for a in ref.values())
    diff = max(float(np.max(np.abs(got[n] - ref[n]))) for n in ref)
    return {"weights_same_names": sorted(got) == sorted(ref), "weights_max_diff": diff,
            "weights_rel": diff / scale}


@check("ckzero.chain")
def chain(ctx, legs=(2, 2)) -> list:
    """stage 3 + fully_shard at dp4 -> stage 1 at tp2 x dp2 -> stage 0 at tp1 x dp4."""
    from mindscience.distributed import checkpoint

    want, _ = _STATE["reference"]
    steps = len(want)
    batches = _batches(steps)
    root = os.path.join(_root(ctx), "chain")
    first, second = os.path.join(root, "stage3_dp4"), os.path.join(root, "stage1_tp2")
    a, b = legs
    records = []

    started = time.perf_counter()
    lay = _layout(1)
    leg = _Leg(stage=3, seed=7, total_steps=steps, shard=True)
    losses = leg.train(batches[:a])
    shapes = {p.name: (list(p.shape), list(p.fsdp.full_shape)) for p in leg.params}
    checkpoint.save(leg.cell, first, step=a)
    records.append(_leg_record("ckzero.chain", lay, leg, losses, want[:a], started,
                               extra={"leg": 0, "fsdp_shapes": shapes}))

    started = time.perf_counter()
    lay = _layout(2)
    leg = _Leg(stage=1, seed=99, total_steps=steps)
    info = checkpoint.load(leg.cell, first)
    losses = leg.train(batches[a:a + b])
    checkpoint.save(leg.cell, second, step=a + b)
    records.append(_leg_record("ckzero.chain", lay, leg, losses, want[a:a + b], started, info,
                               extra={"leg": 1}))

    started = time.perf_counter()
    lay = _layout(1)
    leg = _Leg(stage=0, seed=123, total_steps=steps)
    info = checkpoint.load(leg.cell, second)
    losses = leg.train(batches[a + b:])
    records.append(_leg_record("ckzero.chain", lay, leg, losses, want[a + b:], started, info,
                               extra={"leg": 2, **_final(leg)}))
    _barrier()
    if ctx.rank == 0:
        shutil.rmtree(root, ignore_errors=True)
    return records


@check("ckzero.offline")
def offline_reshard(ctx, first: int = 3) -> list:
    """stage 2 at tp2 x dp2, saved; offline reshard to tp1 x dp4; loaded at stage 1."""
    from mindscience.distributed import checkpoint
    from mindscience.distributed.checkpoint.manifest import read_manifest
    from mindscience.distributed.topology.layout import Layout

    want, _ = _STATE["reference"]
    steps = len(want)
    batches = _batches(steps)
    root = os.path.join(_root(ctx), "offline")
    saved, out = os.path.join(root, "stage2_tp2"), os.path.join(root, "resharded_tp1")
    records = []

    started = time.perf_counter()
    lay = _layout(2)
    leg = _Leg(stage=2, seed=7, total_steps=steps)
    losses = leg.train(batches[:first])
    checkpoint.save(leg.cell, saved, step=first)
    records.append(_leg_record("ckzero.offline", lay, leg, losses, want[:first], started,
                               extra={"leg": 0}))

    started = time.perf_counter()
    if ctx.rank == 0:
        checkpoint.reshard(saved, out, Layout(world_size=ctx.world_size, tp=1, dp=ctx.world_size))
    _barrier()
    manifest = read_manifest(out)
    lay = _layout(1)
    leg = _Leg(stage=1, seed=99, total_steps=steps)
    info = checkpoint.load(leg.cell, out)
    losses = leg.train(batches[first:])
    states = sorted(n.rsplit(".", 1)[1] for n, e in manifest["parameters"].items() if e["base"])
    records.append(_leg_record(
        "ckzero.offline", lay, leg, losses, want[first:], started, info,
        extra={"leg": 1, "resharded_layout": manifest["layout"],
               "optimizers": manifest.get("optimizers"),
               "state_suffixes": sorted(set(states)), "state_count": len(states),
               **_final(leg)}))
    _barrier()
    if ctx.rank == 0:
        shutil.rmtree(root, ignore_errors=True)
    return records
