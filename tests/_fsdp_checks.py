"""Worker-side checks of ``fully_shard`` (imported by the worker through spec["modules"]).

Each check builds the same small model twice from one seed: a reference kept whole
(its gradients finalized by GradientFinalizer: tp sum of sequence-parallel parameters,
dp-cp mean) and a fully sharded copy. It returns, per mode and parameter, the largest
difference between the sharded gradient and this rank's rows of the reference
gradient, relative to the reference's largest entry, and the losses of both.

The model: VocabParallelEmbedding -> a plain RMS norm Cell -> ColumnParallelLinear ->
tanh -> RowParallelLinear (residual) -> nn.LayerNorm -> nn.Dense -> mint.nn.Linear ->
ColumnParallelLinear head -> vocab_parallel_cross_entropy, with sequence parallelism
when tp > 1. Every dim-0 size is chosen so that the group does not divide it (padding).
"""

from __future__ import annotations

import time

import numpy as np

from mindscience.distributed.harness.registry import check

VOCAB, HIDDEN, FFN, SEQ, BATCH = 30, 10, 12, 8, 2
_KEEP = []  # compiled functions stay referenced (MindSpore caches them by identity)


def _layout(tp=1, pp=1):
    from mindscience.distributed import manager

    if manager.is_initialized():
        cur = manager.get_layout()
        if (cur.tp, cur.cp, cur.pp) == (tp, 1, pp):
            return
        manager.destroy_parallel()
    manager.initialize_parallel(tensor_parallel_size=tp, pipeline_parallel_size=pp)


def _model_classes():
    import mindspore as ms
    from mindspore import mint, nn, ops

    from mindscience.distributed.modules import (ColumnParallelLinear, RowParallelLinear,
                                                 VocabParallelEmbedding,
                                                 vocab_parallel_cross_entropy)
    from mindscience.distributed.sharding import mark_sharding

    class RMSNorm(nn.Cell):
        """A plain Cell with a weight Parameter."""

        def __init__(self, h):
            super().__init__()
            self.weight = ms.Parameter(ms.Tensor(np.random.uniform(0.5, 1.5, (h,)).astype(np.float32)),
                                       name="weight")

        def construct(self, x):
            return x * ops.rsqrt((x * x).mean(-1, keep_dims=True) + 1e-6) * self.weight

    class Block(nn.Cell):
        def __init__(self, sp, hidden=HIDDEN, ffn=FFN):
            super().__init__()
            self.norm = RMSNorm(hidden)
            self.fc1 = ColumnParallelLinear(hidden, ffn, gather_output=False,
                                            use_sequence_parallel=sp, compute_dtype=None)
            self.fc2 = RowParallelLinear(ffn, hidden, input_is_parallel=True,
                                         use_sequence_parallel=sp, compute_dtype=None)
            self.ln = nn.LayerNorm((hidden,))
            self.dense = nn.Dense(hidden, hidden)
            self.lin = mint.nn.Linear(hidden, hidden)
            if sp:  # replicated parameters that see this tp rank's tokens only
                for p in (self.norm.weight, self.ln.gamma, self.ln.beta, self.dense.weight,
                          self.dense.bias, self.lin.weight, self.lin.bias):
                    mark_sharding(p, axis=None, sequence_parallel=True)

        def construct(self, h):
            h = h + self.fc2(ops.tanh(self.fc1(self.norm(h))))
            return self.lin(ops.tanh(self.dense(self.ln(h))))

    class Net(nn.Cell):
        def __init__(self, sp, vocab=VOCAB, hidden=HIDDEN, ffn=FFN, layers=1):
            super().__init__()
            from mindscience.distributed import manager

            self.tp = manager.get_tensor_parallel_group()  # compiled code cannot look it up
            self.embed = VocabParallelEmbedding(vocab + (vocab % 2), hidden, sequence_parallel=sp)
            self.block = Block(sp, hidden, ffn)
            # More blocks (fsdp.units): one fully_shard unit each.
            self.more = nn.CellList([Block(sp, hidden, ffn) for _ in range(layers - 1)])
            self.head = ColumnParallelLinear(hidden, vocab + (vocab % 2), bias=False,
                                             gather_output=False, use_sequence_parallel=sp,
                                             compute_dtype=None)

        def construct(self, ids, targets):
            h = self.block(self.embed(ids))
            for block in self.more:
                h = block(h)
            logits = self.head(h)
            return vocab_parallel_cross_entropy(logits, targets, group=self.tp).mean()

    return Net, Block


def _build(seed, sp, shard=False, reshard=False, prefetch=True, units=False, **dims):
    """The model; ``shard``: fully sharded, ``units``: each block its own unit, then the root."""
    import mindspore as ms

    from mindscience.distributed import fully_shard

    Net, _ = _model_classes()
    ms.set_seed(seed)
    np.random.seed(seed)
    net = Net(sp, **dims)
    if shard:
        if units:
            for block in [net.block, *net.more]:
                fully_shard(block, reshard_after_forward=reshard, prefetch=prefetch)
        fully_shard(net, reshard_after_forward=reshard, prefetch=prefetch)
    return net


def _data(dp_rank, step=0):
    rng = np.random.default_rng(1000 * step + dp_rank)
    ids = rng.integers(0, VOCAB, (SEQ, BATCH)).astype(np.int32)
    tgt = rng.integers(0, VOCAB, (SEQ, BATCH)).astype(np.int32)
    return ids, tgt


def _value_and_grad(mode, net, params, *args):
    import mindspore as ms

    fn = ms.value_and_grad(net, None, params)
    if mode == "graph":
        ms.set_context(mode=ms.GRAPH_MODE)
        try:
            _KEEP.append(fn)
            return fn(*args)
        finally:
            ms.set_context(mode=ms.PYNATIVE_MODE)
    if mode == "jit":
        fn = ms.jit(fn)
        _KEEP.append(fn)
    return fn(*args)


def _shard_error(ref_grad, shard_grad, info):
    """Relative error of the shard gradient against this rank's rows of the reference,
    and the largest |entry| of its padding rows."""
    from mindscience.distributed.fsdp import shard_range

    g = info.group
    ref = np.asarray(ref_grad).reshape((info.rows,) + tuple(info.shard_shape[1:]))
    start, stop = shard_range(info.rows, g.size, g.rank)
    got = np.asarray(shard_grad)
    n = stop - start
    err = 0.0
    if n:  # relative to the largest entry of the whole reference gradient
        err = float(np.max(np.abs(got[:n] - ref[start:stop]))) / max(1e-30, float(np.max(np.abs(ref))))
    pad = float(np.max(np.abs(got[n:]))) if got.shape[0] > n else 0.0
    return err, pad


@check("fsdp.parity")
def parity(ctx, tp=1, modes=("pynative", "jit", "graph"), reshard=(False,), poison=True):
    """Loss and gradient shards of the fully sharded model vs the finalized reference."""
    import mindspore as ms

    from mindscience.distributed import GradientFinalizer, manager

    _layout(tp=tp)
    sp = tp > 1
    dp_rank = manager.get_data_context_parallel_group().rank
    ids, tgt = (ms.Tensor(a) for a in _data(dp_rank))
    records = []
    # The reference runs once, in PyNative (compiling it per mode would double the
    # compile time); compiled and eager float32 agree far inside the 1e-6 tolerance.
    ref = _build(7, sp)
    ref_params = ref.trainable_params()
    ref_loss, ref_grads = _value_and_grad("pynative", ref, ref_params, ids, tgt)
    ref_grads = GradientFinalizer(ref_params)(ref_grads)
    ref_by_name = {p.name: g.asnumpy() for p, g in zip(ref_params, ref_grads)}
    for mode in modes:
        # compiled: the default flags (reshard_after_forward=True runs as False there)
        for rs in (reshard if mode == "pynative" else (True,)):
            net = _build(7, sp, shard=True, reshard=rs, units=True)  # the block, then the root
            params = net.trainable_params()
            names_same = [p.name for p in params] == [p.name for p in ref_params]
            poisoned = 0
            if poison:  # padding rows must never reach the model
                for p in params:
                    info = p.fsdp
                    start, stop = _rows_of(info)
                    if stop - start < info.shard_rows:
                        data = p.asnumpy()
                        data[stop - start:] = 1e3
                        p.set_data(ms.Tensor(data))
                        poisoned += 1
            t0 = time.perf_counter()
            loss, grads = _value_and_grad(mode, net, params, ids, tgt)
            grads = GradientFinalizer(params)(grads)
            seconds = time.perf_counter() - t0
            worst, worst_pad, per_param = 0.0, 0.0, {}
            for p, g in zip(params, grads):
                err, pad = _shard_error(ref_by_name[p.name], g.asnumpy(), p.fsdp)
                per_param[p.name] = err
                worst, worst_pad = max(worst, err), max(worst_pad, pad)
            records.append({
                "check": "fsdp.parity", "group": f"tp{tp}-dp{ctx.world_size // tp}",
                "mode": mode, "reshard": rs, "loss": float(loss), "ref_loss": float(ref_loss),
                "loss_error": abs(float(loss) - float(ref_loss)) / max(1e-30, abs(float(ref_loss))),
                "max_error": worst, "pad_grad": worst_pad, "per_param": per_param,
                "names_same": names_same, "poisoned": poisoned,
                "shard_shapes": {p.name: list(p.shape) for p in params},
                "full_shapes": {p.name: list(p.fsdp.full_shape) for p in params},
                "seconds": round(seconds, 3),
                "passed": names_same and worst < 1e-6 and worst_pad == 0.0,
            })
    return records


def _rows_of(info):
    from mindscience.distributed.fsdp import shard_range

    return shard_range(info.rows, info.group.size, info.group.rank)


def _stage_class():
    import mindspore as ms
    from mindspore import mint, nn, ops

    class Stage(nn.Cell):
        """One pipeline stage: nn.Dense -> a plain norm Cell -> mint.nn.Linear -> nn.LayerNorm."""

        def __init__(self, h):
            super().__init__()
            self.dense = nn.Dense(h, h)
            self.scale = ms.Parameter(ms.Tensor(np.random.uniform(0.5, 1.5, (h,)).astype(np.float32)),
                                      name="scale")
            self.lin = mint.nn.Linear(h, h)
            self.ln = nn.LayerNorm((h,))

        def construct(self, x):
            x = ops.tanh(self.dense(x)) * self.scale
            return self.ln(ops.tanh(self.lin(x)))

    return Stage


def _mse(out, t):
    # (no import inside: the pipeline compiles loss_fn under mode="jit")
    return ((out - t) ** 2).mean()


@check("fsdp.pipeline")
def pipeline(ctx, schedules=("1f1b", "gpipe"), modes=("pynative", "jit"), hidden=9, m=4):
    """pp2 x dp2: a fully sharded stage under forward_backward equals the whole stage +
    GradientFinalizer (dp mean), rows for rows."""
    import mindspore as ms

    from mindscience.distributed import GradientFinalizer, fully_shard, manager
    from mindscience.distributed.pipeline import forward_backward

    _layout(tp=1, pp=ctx.world_size // 2)
    pp = manager.get_pipeline_parallel_group()
    dp = manager.get_data_context_parallel_group()
    Stage = _stage_class()
    rng = np.random.default_rng(50 + dp.rank)
    xs = [ms.Tensor(rng.standard_normal((2, hidden)).astype(np.float32)) for _ in range(m)]
    ts = [ms.Tensor(rng.standard_normal((2, hidden)).astype(np.float32)) for _ in range(m)]
    inputs = [x if pp.rank == 0 else None for x in xs]
    targets = [t if pp.rank == pp.size - 1 else None for t in ts]
    records = []
    for mode in modes:
        for schedule in schedules:
            stages = []
            for shard in (False, True):
                np.random.seed(11 + pp.rank)
                ms.set_seed(11 + pp.rank)
                stage = Stage(hidden)
                if shard:
                    fully_shard(stage)
                _KEEP.append(stage)
                loss, grads = forward_backward(stage, inputs, targets, _mse, schedule=schedule,
                                               mode=mode)
                params = stage.trainable_params()
                grads = GradientFinalizer(params)(grads)
                stages.append((float(loss), params, grads))
            (ref_loss, ref_params, ref_grads), (loss, params, grads) = stages
            worst, worst_pad = 0.0, 0.0
            for p, g, rg in zip(params, grads, ref_grads):
                err, pad = _shard_error(rg.asnumpy(), g.asnumpy(), p.fsdp)
                worst, worst_pad = max(worst, err), max(worst_pad, pad)
            loss_error = abs(loss - ref_loss) / max(1e-30, abs(ref_loss))
            records.append({
                "check": "fsdp.pipeline", "group": f"pp{pp.size}-dp{dp.size}", "mode": mode,
                "schedule": schedule, "loss": loss, "ref_loss": ref_loss, "loss_error": loss_error,
                "max_error": worst, "pad_grad": worst_pad,
                "shard_shapes": {p.name: list(p.shape) for p in params},
                "passed": loss_error <= 1e-6 and worst < 1e-6 and worst_pad == 0.0,
            })
    return records


def _adamw_numpy(p, g, m, v, t, lr, b1, b2, eps, wd):
    p = p * (1.0 - lr * wd)
    m[...] = b1 * m + (1 - b1) * g
    v[...] = b2 * v + (1 - b2) * g * g
    return p - (lr / (1 - b1 ** t)) * m / (np.sqrt(v) / np.sqrt(1 - b2 ** t) + eps)


@check("fsdp.train")
def train(ctx, steps=5, lr=1e-3, weight_decay=0.01):
    """dp4: fully_shard + DistributedOptimizer(zero_stage=3, AdamW) for ``steps`` steps vs
    the whole model + GradientFinalizer + a numpy AdamW: losses every step, and the
    gathered parameters at the end.

    Every step trains on the same batch (the loss must fall). The learning rate is small
    because Adam normalises each entry by its own gradient scale: an entry whose gradient
    is ~1e-7 of the largest moves by ~lr whatever the rounding of the two reductions
    (measured at lr=1e-2: 5.3e-6 relative after 5 steps; at 1e-3 it scales down with lr).
    """
    import mindspore as ms

    from mindscience.distributed import DistributedOptimizer, GradientFinalizer, manager

    _layout(tp=1)
    dp = manager.get_data_context_parallel_group()
    b1, b2, eps = 0.9, 0.999, 1e-8
    ref = _build(7, False)
    ref_params = ref.trainable_params()
    finalize = GradientFinalizer(ref_params)
    ref_grad = ms.value_and_grad(ref, None, ref_params)
    state = {p.name: (np.zeros(p.shape, np.float64), np.zeros(p.shape, np.float64)) for p in ref_params}
    net = _build(7, False, shard=True)
    params = net.trainable_params()
    opt = DistributedOptimizer(params, optimizer="adamw", lr=lr, betas=(b1, b2), eps=eps,
                               weight_decay=weight_decay, zero_stage=3)
    grad_fn = ms.value_and_grad(net, None, params)
    losses, ref_losses, pads = [], [], 0.0
    for step in range(steps):
        ids, tgt = (ms.Tensor(a) for a in _data(dp.rank))
        loss, grads = grad_fn(ids, tgt)
        opt(grads)
        losses.append(float(loss))
        rloss, rgrads = ref_grad(ids, tgt)
        rgrads = finalize(rgrads)
        ref_losses.append(float(rloss))
        for p, g in zip(ref_params, rgrads):
            m, v = state[p.name]
            new = _adamw_numpy(p.asnumpy().astype(np.float64), g.asnumpy().astype(np.float64),
                               m, v, step + 1, lr, b1, b2, eps, weight_decay)
            p.set_data(ms.Tensor(new.astype(np.float32)))
    worst, per_param = 0.0, {}
    for p, rp in zip(params, ref_params):
        info = p.fsdp
        full = p._fsdp_gathers[0](p).asnumpy()  # the eager all-gather fully_shard uses
        # scaled as the layer checks do: |diff| / max(1, max |ref|) (a bias that starts at
        # 0 is ~1e-3 after 5 steps, and its plain relative error would be rounding noise)
        want = rp.asnumpy().astype(np.float64)
        per_param[p.name] = float(np.max(np.abs(full - want))) / max(1.0, float(np.max(np.abs(want))))
        worst = max(worst, per_param[p.name])
        n = _rows_of(info)[1] - _rows_of(info)[0]
        pads = max(pads, float(np.max(np.abs(p.asnumpy()[n:]))) if n < info.shard_rows else 0.0)
    loss_err = max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses))
    memory = opt.memory_bytes()
    return {"check": "fsdp.train", "group": f"dp{dp.size}", "steps": steps, "losses": losses,
            "ref_losses": ref_losses, "loss_error": loss_err, "max_error": worst,
            "pad_weight": pads, "memory_bytes": memory, "per_param": per_param,
            "passed": loss_err <= 1e-6 and worst <= 1e-6 and pads == 0.0
            and losses[-1] < losses[0]}


def _param_bytes(net):
    return int(sum(int(np.prod(p.shape)) * 4 for p in net.trainable_params()))


@check("fsdp.bench")
def bench(ctx, vocab=4096, hidden=512, ffn=2048, seq=128, batch=4, steps=5,
          modes=("pynative", "jit")):
    """Per-rank parameter bytes before/after fully_shard at dp4 and the step time
    (forward + backward + GradientFinalizer; median of ``steps`` after one warm-up)."""
    import statistics

    import mindspore as ms

    from mindscience.distributed import GradientFinalizer, manager

    _layout(tp=1)
    dp = manager.get_data_context_parallel_group()
    rng = np.random.default_rng(dp.rank)
    ids = ms.Tensor(rng.integers(0, vocab, (seq, batch)).astype(np.int32))
    tgt = ms.Tensor(rng.integers(0, vocab, (seq, batch)).astype(np.int32))
    dims = dict(vocab=vocab, hidden=hidden, ffn=ffn)
    records = []
    for mode in modes:
        for label, shard, reshard in (("whole", False, False), ("fully_shard", True, False),
                                      ("fully_shard+reshard", True, True)):
            if reshard and mode != "pynative":
                continue
            net = _build(7, False, shard=shard, reshard=reshard, **dims)
            params = net.trainable_params()
            fn = ms.value_and_grad(net, None, params)
            if mode == "jit":
                fn = ms.jit(fn)
            _KEEP.append(fn)
            finalize = GradientFinalizer(params)
            times = []
            for i in range(steps + 1):
                t0 = time.perf_counter()
                loss, grads = fn(ids, tgt)
                grads = finalize(grads)
                float(loss)
                _ = [g.asnumpy() for g in grads[-1:]]
                if i:
                    times.append(time.perf_counter() - t0)
            records.append({"check": "fsdp.bench", "group": f"dp{dp.size}", "mode": mode,
                            "model": label, "param_bytes": _param_bytes(net),
                            "full_param_bytes": int(sum(int(np.prod(getattr(p, "fsdp").full_shape
                                                                     if shard else p.shape)) * 4
                                                        for p in params)),
                            "step_s_median": round(statistics.median(times), 4),
                            "step_s_min": round(min(times), 4), "loss": float(loss),
                            "dims": {**dims, "seq": seq, "batch": batch}, "passed": True})
    return records


def _bf16_net(seed):
    import mindspore as ms
    from mindspore import nn, ops

    from mindscience.distributed.modules import ColumnParallelLinear, RowParallelLinear

    class Bf16Net(nn.Cell):
        """bfloat16 parameters (the gather's float32 round trip for reshape and slicing)."""

        def __init__(self):
            super().__init__()
            kw = dict(param_init_dtype=ms.bfloat16, compute_dtype=ms.bfloat16)
            self.fc1 = ColumnParallelLinear(9, 14, **kw)
            self.fc2 = RowParallelLinear(14, 7, **kw)

        def construct(self, x, t):
            y = self.fc2(ops.tanh(self.fc1(x)))
            return ((y - t) ** 2).mean()

    ms.set_seed(seed)
    return Bf16Net()


@check("fsdp.bf16")
def bf16(ctx, modes=("pynative", "jit")):
    """dp4, bfloat16 parameters: loss equal to the whole model's, and each gradient shard
    within one bfloat16 rounding (2^-8 of the largest entry) of the finalized gradient."""
    import mindspore as ms

    from mindscience.distributed import GradientFinalizer, fully_shard, manager

    _layout(tp=1)
    dp = manager.get_data_context_parallel_group()
    rng = np.random.default_rng(70 + dp.rank)
    x = ms.Tensor(rng.standard_normal((6, 9)).astype(np.float32))
    t = ms.Tensor(rng.standard_normal((6, 7)).astype(np.float32))
    ref = _bf16_net(3)
    ref_params = ref.trainable_params()
    ref_loss, ref_grads = _value_and_grad("pynative", ref, ref_params, x, t)
    ref_grads = GradientFinalizer(ref_params)(ref_grads)
    records = []
    for mode in modes:
        net = fully_shard(_bf16_net(3))
        params = net.trainable_params()
        loss, grads = _value_and_grad(mode, net, params, x, t)
        grads = GradientFinalizer(params)(grads)
        worst, worst_pad = 0.0, 0.0
        for p, g, rg in zip(params, grads, ref_grads):
            err, pad = _shard_error(rg.astype(ms.float32).asnumpy(),
                                    g.astype(ms.float32).asnumpy(), p.fsdp)
            worst, worst_pad = max(worst, err), max(worst_pad, pad)
        loss_error = abs(float(loss) - float(ref_loss)) / abs(float(ref_loss))
        records.append({
            "check": "fsdp.bf16", "group": f"dp{dp.size}", "mode": mode, "loss_error": loss_error,
            "max_error": worst, "pad_grad": worst_pad,
            "dtypes": sorted({str(p.dtype) for p in params} | {str(g.dtype) for g in grads}),
            "shard_shapes": {p.name: list(p.shape) for p in params},
            "passed": loss_error <= 1e-6 and worst <= 2.0 ** -8 and worst_pad == 0.0,
        })
    return records
