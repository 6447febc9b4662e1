"""Worker-side checks of DistributedOptimizer (imported through ``spec["modules"]``).

``optimizer.train``: a small model of the layer set (sequence-parallel embedding,
layernorms whose parameters are ``sequence_parallel``, column/row-parallel MLP, column-
parallel LM head, vocab-parallel cross-entropy) trained ``steps`` steps twice from the
same weights: once with :class:`DistributedOptimizer`, once with the reference
(GradientFinalizer + the AdamW below, written in numpy float64 from the published
algorithm, + the clip below). With ``pp > 1`` the model is cut in two stages and trained
with ``pipeline.forward_backward(schedule="1f1b")``; the embedding and the LM head are
then tied (``shared_embedding``). One record per rank with both loss curves, the largest
parameter difference, the returned norm and the reference's, state sizes and bytes.

``optimizer.errors``: each bad input raises DistributedOptimizerError on every rank
before any collective, and the ranks are still in step afterwards.
"""

from __future__ import annotations

import math
import time

import numpy as np

from mindscience.distributed.harness.checks.groups import layout_label, reinit
from mindscience.distributed.harness.registry import CheckContext, check

V, D, F, S, B = 50, 18, 40, 8, 8
LR, WD, BETAS, EPS = 0.02, 0.01, (0.9, 0.999), 1e-8
_REF_CACHE: dict = {}


def _model(tp, tied: bool):
    """The model (fp32, seeded: every rank draws the same global weights and slices)."""
    import mindspore as ms
    from mindspore import mint, nn, ops

    from mindscience.distributed.modules import (
        ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding,
        vocab_parallel_cross_entropy,
    )

    f32 = dict(compute_dtype=ms.float32, group=tp)

    class LayerNorm(nn.Cell):
        def __init__(self):
            super().__init__()
            rng = np.random.default_rng(7)
            self.weight = ms.Parameter(ms.Tensor((1 + 0.1 * rng.standard_normal(D)).astype(np.float32)),
                                       name="weight")
            self.bias = ms.Parameter(ms.Tensor((0.1 * rng.standard_normal(D)).astype(np.float32)),
                                     name="bias")
            # Each tp rank normalizes its own chunk of the sequence.
            self.weight.sequence_parallel = True
            self.bias.sequence_parallel = True

        def construct(self, x):
            x = ops.cast(x, ms.float32)
            mean = mint.mean(x, -1, keepdim=True)
            var = mint.mean((x - mean) ** 2, -1, keepdim=True)
            return (x - mean) / mint.sqrt(var + 1e-5) * ops.cast(self.weight, ms.float32) \
                + ops.cast(self.bias, ms.float32)

    class Block(nn.Cell):
        def __init__(self):
            super().__init__()
            self.ln = LayerNorm()
            self.fc1 = ColumnParallelLinear(D, F, gather_output=False, use_sequence_parallel=True, **f32)
            self.fc2 = RowParallelLinear(F, D, input_is_parallel=True, use_sequence_parallel=True, **f32)

        def construct(self, x):
            x = ops.cast(x, ms.float32)
            return x + ops.cast(self.fc2(ops.gelu(self.fc1(self.ln(x)))), ms.float32)

    class Front(nn.Cell):
        def __init__(self):
            super().__init__()
            self.embedding = VocabParallelEmbedding(V, D, sequence_parallel=True, group=tp)
            self.block = Block()

        def construct(self, ids):
            return self.block(ops.cast(self.embedding(ids), ms.float32))

    class Back(nn.Cell):
        def __init__(self):
            super().__init__()
            self.block = Block()
            self.head = ColumnParallelLinear(D, V, bias=False, gather_output=False,
                                             use_sequence_parallel=True, **f32)

        def construct(self, h):
            return ops.cast(self.head(self.block(h)), ms.float32)

    class Full(nn.Cell):
        def __init__(self):
            super().__init__()
            self.front = Front()
            self.back = Back()

        def construct(self, ids, target):
            return loss_fn(self.back(self.front(ids)), target)

    def loss_fn(logits, target):
        return mint.mean(vocab_parallel_cross_entropy(logits, target, group=tp))

    ms.set_seed(1234)
    net = Full()
    if tied:
        net.back.head.weight.set_data(net.front.embedding.weight.value())
        net.front.embedding.weight.shared_embedding = True
        net.back.head.weight.shared_embedding = True
    return net, loss_fn


def _batches(steps: int):
    """The same global batch every step, so that the loss must fall."""
    rng = np.random.default_rng(11)
    batch = tuple(rng.integers(0, V, (S, B)).astype(np.int32) for _ in range(2))
    return [batch] * steps


class _Run:
    """One training run at the layout in force: the stage cell, its step and the data."""

    def __init__(self, manager, microbatches: int = 2):
        self.tp = manager.get_tensor_parallel_group()
        self.dp = manager.get_data_parallel_group()
        self.pp = manager.get_pipeline_parallel_group()
        self.net, self.loss_fn = _model(self.tp, tied=self.pp.size > 1)
        self.stage = self.net
        if self.pp.size > 1:
            self.stage = self.net.front if self.pp.rank == 0 else self.net.back
        self.params = self.stage.trainable_params()
        self.microbatches = microbatches

    def local(self, x):
        return np.split(x, self.dp.size, axis=1)[self.dp.rank]

    def grads(self, ids, tgt, grad_fn, mode="pynative"):
        """(loss of this dp rank, raw gradients); ``mode`` is the pipeline's (pp > 1)."""
        import mindspore as ms

        from mindscience.distributed.pipeline import forward_backward

        if self.pp.size == 1:
            return grad_fn(ms.Tensor(self.local(ids)), ms.Tensor(self.local(tgt)))
        m = self.microbatches
        xs = [ms.Tensor(a) for a in np.split(self.local(ids), m, axis=1)]
        ys = [ms.Tensor(a) for a in np.split(self.local(tgt), m, axis=1)]
        return forward_backward(self.stage, xs, ys, self.loss_fn, schedule="1f1b", mode=mode)

    def compile_stage(self, ids, tgt) -> None:
        """Compile this stage's forward and backward (the last stage's with the loss) on
        zeros, before the pipeline runs (pp > 1, ``mode="jit"``).

        Compiled at its first call inside the schedule, a stage keeps its neighbour
        waiting in a transfer for as long as that takes, and MindSpore's CPU collectives
        give up on a long wait (measured here, 8 ranks at load ~70: "AllGather failed" in
        the first header exchange). Only the stage's own tp and dp peers, which do the
        same, take part in its collectives; the pipeline then finds the functions cached
        on the stage (GPTModel does the same before its compiled pipeline step).
        """
        import mindspore as ms
        from mindspore import ops

        from mindscience.distributed.pipeline.stage_fns import stage_fns

        first, last = self.pp.rank == 0, self.pp.rank == self.pp.size - 1
        x = ms.Tensor(np.split(self.local(ids), self.microbatches, axis=1)[0])
        t = ms.Tensor(np.split(self.local(tgt), self.microbatches, axis=1)[0])
        fns = stage_fns(self.stage, self.loss_fn, "jit", first, last)
        if not first:  # the activation: this rank's sequence rows (sequence parallel)
            x = ops.zeros((S // self.tp.size, int(x.shape[1]), D), ms.float32)
        if last:
            fns.loss(x, t, ms.Tensor(0.0, ms.float32), fns.zeros(), ops.zeros((), ms.float32))
        else:
            y = fns.forward(x)
            fns.backward(x, ops.zeros(y.shape, y.dtype), fns.zeros())

    def global_loss(self, loss) -> float:
        import mindspore as ms

        from mindscience.distributed.collectives import all_reduce

        total = all_reduce(ms.Tensor(np.array([float(loss)], np.float32)), self.dp)
        return float(total.asnumpy()[0]) / self.dp.size

    def arrays(self) -> list:
        return [p.float().asnumpy().astype(np.float64) for p in self.params]


def _tp_split(p) -> bool:
    return bool(getattr(p, "tensor_model_parallel", False)
                or getattr(p, "parallel_axis", None) == "tp")


def _reference_norm(run, grads) -> float:
    """Megatron's global norm from the finalized (whole, dp-replicated) gradients in float64:
    tp-split parameters summed over tp, replicated ones once, the tied head (the second copy
    of the embedding, on the last stage) not at all."""
    import mindspore as ms

    from mindscience.distributed.collectives import all_reduce

    def total(values, group):
        if group.size == 1:
            return values
        return float(all_reduce(ms.Tensor(np.array([values], np.float32)), group).asnumpy()[0])

    kept = [(p, g) for p, g in zip(run.params, grads)
            if not (getattr(p, "shared_embedding", False) and run.pp.rank > 0)]
    split = sum(float(np.sum(g * g)) for p, g in kept if _tp_split(p))
    repl = sum(float(np.sum(g * g)) for p, g in kept if not _tp_split(p))
    return math.sqrt(total(total(split, run.tp) + repl, run.pp))


def _reference(manager, steps: int, clip, kind: str, compiled: bool):
    """Loss curve, final weights and norms of GradientFinalizer + the numpy update.

    ``compiled``: the forward and backward under ``ms.jit`` (compiled kernels round
    differently from PyNative's: a compiled run is compared with a compiled reference).
    """
    import mindspore as ms

    from mindscience.distributed.finalize import GradientFinalizer

    run = _Run(manager)
    fin = GradientFinalizer(run.params)
    grad_fn = ms.value_and_grad(run.net, None, run.params)
    if compiled and run.pp.size == 1:
        grad_fn = ms.jit(grad_fn)
    w = run.arrays()
    m = [np.zeros_like(a) for a in w]
    v = [np.zeros_like(a) for a in w]
    losses, norms = [], []
    for t, (ids, tgt) in enumerate(_batches(steps), start=1):
        loss, grads = run.grads(ids, tgt, grad_fn)
        g = [x.float().asnumpy().astype(np.float64) for x in fin(grads)]
        norms.append(_reference_norm(run, g))
        if clip is not None:
            coef = min(1.0, clip / (norms[-1] + 1e-6))
            g = [x * coef for x in g]
        for k in range(len(w)):
            if kind == "sgd":
                gk = g[k] + WD * w[k]
                m[k] = 0.9 * m[k] + gk
                w[k] = w[k] - LR * m[k]
                continue
            if kind == "adamw":
                w[k] = w[k] * (1 - LR * WD)
                gk = g[k]
            else:
                gk = g[k] + WD * w[k]
            m[k] = BETAS[0] * m[k] + (1 - BETAS[0]) * gk
            v[k] = BETAS[1] * v[k] + (1 - BETAS[1]) * gk * gk
            denom = np.sqrt(v[k]) / math.sqrt(1 - BETAS[1] ** t) + EPS
            w[k] = w[k] - LR / (1 - BETAS[0] ** t) * m[k] / denom
        for p, a in zip(run.params, w):
            p.set_data(ms.Tensor(a.astype(np.float32)))
        w = run.arrays()  # what the model holds (float32)
        losses.append(run.global_loss(loss))
    return losses, w, norms


def _shard_of(full: np.ndarray, param) -> np.ndarray:
    """This rank's C1 shard (padded) of a whole reference weight, for a fully_shard one."""
    from mindscience.distributed.optimizer.layout import shard_range

    meta = getattr(param, "fsdp", None)
    if meta is None:
        return full
    start, stop = shard_range(meta.rows, meta.group.size, meta.group.rank)
    rows = full.reshape((meta.rows, -1))[start:stop]
    out = np.zeros((meta.shard_rows, rows.shape[1]), full.dtype)
    out[: stop - start] = rows
    return out.reshape(tuple(param.shape))


def _main_vs_params(opt, params) -> float:
    """Largest |model weight - main weight rounded to the model dtype| over the rows this
    rank's main shard holds (0.0: the all-gather put every shard in its place)."""
    import mindspore as ms

    from mindscience.distributed.optimizer.layout import shard_range

    worst = 0.0
    for i, (sh, p) in enumerate(zip(opt.shards, params)):
        if opt.stage == 0:
            start, stop = 0, sh.rows
        else:
            start, stop = shard_range(sh.rows, opt.d, opt.group.rank)
        slot = opt.main_slot[i]  # float32 parameters are their own main weights: none
        if stop == start or slot < 0:
            continue
        main = opt.mains[slot].asnumpy().reshape(-1, sh.rest)[: stop - start]
        want = ms.Tensor(main, p.dtype).float().asnumpy()
        have = p.float().asnumpy().reshape(-1, sh.rest)
        # Stage 3: the parameter is the shard itself (its first rows are the real ones).
        have = have[: stop - start] if opt.stage == 3 else have[start:stop]
        worst = max(worst, float(np.max(np.abs(have - want))))
    return worst


def _padding_abs(opt) -> float:
    """Largest |value| in the padding rows of this rank's state (must stay 0)."""
    from mindscience.distributed.optimizer.layout import shard_range

    worst = 0.0
    if opt.stage == 0:
        return worst
    mains = [opt.mains[s] if s >= 0 else None for s in opt.main_slot]
    states = [mains] + [list(g) for g in opt.moments]
    for i, sh in enumerate(opt.shards):
        start, stop = shard_range(sh.rows, opt.d, opt.group.rank)
        for group in states:
            if group and group[i] is not None:
                a = group[i].asnumpy()
                if stop - start < sh.shard_rows:
                    worst = max(worst, float(np.max(np.abs(a[stop - start:]))))
    return worst


@check("optimizer.train")
def train(ctx: CheckContext, tp=1, pp=1, stage=1, mode="pynative", dtype="float32", clip=None,
          kind="adamw", steps=5, bucket_size_mb=None) -> dict:
    """DistributedOptimizer vs GradientFinalizer + the numpy update (see the module doc)."""
    import mindspore as ms

    from mindscience.distributed import manager
    from mindscience.distributed.optimizer import DistributedOptimizer

    started = time.perf_counter()
    if pp > 1 and mode == "graph":
        raise ValueError(f"mode='graph' with pp={pp}: the pipeline runs 'pynative' or 'jit'")
    lay = manager.get_layout() if manager.is_initialized() else None
    if lay is None or (lay.tp, lay.cp, lay.pp) != (tp, 1, pp):  # dp = the rest of the world
        lay = reinit(manager, {"tp": tp, "pp": pp})
    # One PyNative reference for every mode: a reference whose value_and_grad was wrapped
    # in ms.jit did not follow its weights' set_data between steps (losses 40 % off).
    key = (tp, pp, clip, kind, steps)
    if key not in _REF_CACHE:
        _REF_CACHE[key] = _reference(manager, steps, clip, kind, False)
    ref_losses, ref_w, ref_norms = _REF_CACHE[key]

    run = _Run(manager)
    if stage == 3:
        from mindscience.distributed.fsdp import fully_shard

        fully_shard(run.stage)
        run.params = run.stage.trainable_params()
        ref_w = [_shard_of(a, p) for a, p in zip(ref_w, run.params)]
    if dtype == "bfloat16":
        # Every parameter but the embedding table (the CPU Gather kernel has no bfloat16):
        # two dtypes, so two buckets.
        for p in run.params:
            if "embedding" not in p.name:
                p.set_dtype(ms.bfloat16)
    opt = DistributedOptimizer(run.params, optimizer=kind, lr=LR, betas=BETAS, eps=EPS,
                               weight_decay=WD, zero_stage=stage, max_grad_norm=clip,
                               bucket_size_mb=bucket_size_mb)
    value_and_grad = ms.value_and_grad(run.net, None, run.params)

    def step(ids, tgt):
        loss, grads = value_and_grad(ids, tgt)
        return loss, opt(grads)

    if mode == "jit":
        step = ms.jit(step)
    elif mode == "graph":
        step = _GraphStep(run.net, opt, run.params)
    losses, norms = [], []
    saved = ms.get_context("mode")
    try:
        if mode == "jit" and run.pp.size > 1:
            run.compile_stage(*_batches(1)[0])
        if mode == "graph":
            ms.set_context(mode=ms.GRAPH_MODE)
        for ids, tgt in _batches(steps):
            if run.pp.size > 1:
                # The stage's forward and backward compiled under "jit"; the step eager.
                loss, grads = run.grads(ids, tgt, None, mode)
                out = opt(grads)
            else:
                loss, out = step(ms.Tensor(run.local(ids)), ms.Tensor(run.local(tgt)))
            losses.append(run.global_loss(loss))
            if clip is not None:
                norms.append(float(out.asnumpy()))
    finally:
        ms.set_context(mode=saved)
    got_w = run.arrays()
    diff = max(float(np.max(np.abs(a - b))) for a, b in zip(got_w, ref_w))
    scale = max(float(np.max(np.abs(b))) for b in ref_w)
    rel = [abs(a - b) / abs(b) for a, b in zip(losses, ref_losses)]
    mem = opt.memory_bytes()
    rec = {
        "check": "optimizer.train", "group": layout_label(manager.get_layout()),
        "tp": tp, "pp": pp, "dp": run.dp.size, "stage": stage, "mode": mode, "dtype": dtype,
        "clip": clip, "steps": steps,
        "kind": kind, "d": opt.d, "group_rank": opt.group.rank, "pp_rank": run.pp.rank,
        "losses": losses, "ref_losses": ref_losses, "loss_rel_error": max(rel),
        "param_max_diff": diff, "param_scale": scale, "norms": norms,
        "ref_norms": ref_norms if clip is not None else [],
        "state_elements": opt.state_elements(), "memory": mem,
        "shapes": [list(p.fsdp.full_shape) if stage == 3 else list(p.shape) for p in run.params],
        "param_dtypes": [str(p.dtype) for p in run.params],
        "main_dtypes": sorted({str(p.dtype) for p in opt.mains}),
        "mains": len(opt.mains),
        "buckets": len(opt.buckets), "padding_max_abs": _padding_abs(opt),
        "main_vs_params": _main_vs_params(opt, run.params),
        "trained": bool(losses[-1] < losses[0]),
        "seconds": round(time.perf_counter() - started, 2),
    }
    rec["max_error"] = rec["loss_rel_error"]
    rec["passed"] = bool(rec["trained"] and rec["padding_max_abs"] == 0.0
                         and rec["main_vs_params"] == 0.0)
    return rec


def _GraphStep(net, opt, params):  # noqa: N802 - builds a Cell
    import mindspore as ms
    from mindspore import nn

    class Step(nn.Cell):
        def __init__(self):
            super().__init__(auto_prefix=False)
            self.net = net
            self.opt = opt
            self.grad_fn = ms.value_and_grad(net, None, params)

        def construct(self, ids, tgt):
            loss, grads = self.grad_fn(ids, tgt)
            return loss, self.opt(grads)

    return Step()


class _FakeFsdp:
    """C3 metadata as fully_shard would set it (the errors check needs no fsdp module)."""

    def __init__(self, group, full_shape):
        from mindscience.distributed.optimizer.layout import shard_rows

        self.group = group
        self.full_shape = tuple(full_shape)
        self.rows = full_shape[0]
        self.shard_rows = shard_rows(self.rows, group.size)
        self.pad = group.size * self.shard_rows - self.rows


@check("optimizer.errors")
def errors(ctx: CheckContext, tp=2) -> list:
    """Every bad input raises DistributedOptimizerError on every rank, before any collective."""
    import mindspore as ms

    from mindscience.distributed import manager
    from mindscience.distributed.collectives import all_reduce
    from mindscience.distributed.group import ParallelGroup
    from mindscience.distributed.optimizer import DistributedOptimizer, DistributedOptimizerError

    lay = manager.get_layout() if manager.is_initialized() else None
    if lay is None or (lay.tp, lay.cp, lay.pp) != (tp, 1, 1):
        lay = reinit(manager, {"tp": tp})
    dpcp = manager.get_data_context_parallel_group()

    def fresh():
        return _Run(manager).params

    def grads_of(params):
        return tuple(ms.Tensor(np.zeros(p.shape, np.float32)) for p in params)

    def with_fsdp(group):
        params = fresh()
        for p in params:
            p.fsdp = _FakeFsdp(group, (p.shape[0] * group.size,) + tuple(p.shape[1:]))
        return params

    built = fresh()
    good = DistributedOptimizer(built, zero_stage=1)
    g = grads_of(built)
    others = tuple(r for r in range(ctx.world_size) if r != ctx.rank)[: dpcp.size]
    foreign = ParallelGroup(key="dp-cp", ranks=others, rank=0, backend_name="not-mine")
    fsdp_other = manager.get_group("tp")
    cases = [
        ("zero_stage", lambda: DistributedOptimizer(fresh(), zero_stage=4), ["zero_stage=4", "0, 1, 2 or 3"]),
        ("optimizer", lambda: DistributedOptimizer(fresh(), optimizer="lamb"), ["'lamb'", "adamw"]),
        ("lr", lambda: DistributedOptimizer(fresh(), lr=-1.0), ["lr=-1.0", ">= 0"]),
        ("betas", lambda: DistributedOptimizer(fresh(), betas=(0.9, 1.5)), ["betas=(0.9, 1.5)", "[0, 1)"]),
        ("max_grad_norm", lambda: DistributedOptimizer(fresh(), max_grad_norm=0), ["max_grad_norm=0"]),
        ("main_dtype", lambda: DistributedOptimizer(fresh(), main_params_dtype=ms.float16),
         ["main_params_dtype", "float32"]),
        ("grad_count", lambda: good(g[:-1]), [f"got {len(g) - 1} gradients", f"{len(g)} parameters"]),
        ("grad_shape", lambda: good((ms.Tensor(np.zeros((3, 3), np.float32)),) + g[1:]),
         ["grads[0] has shape (3, 3)", f"expected {tuple(built[0].shape)}"]),
        ("grad_dtype", lambda: good((ms.Tensor(np.zeros(built[0].shape, np.float16)),) + g[1:]),
         ["grads[0] has dtype float16", "float32"]),
        ("group_crosses_tp", lambda: DistributedOptimizer(fresh(), group=manager.get_group("tp-dp")),
         ["crosses tensor or pipeline", "outside this rank's dp-cp group"]),
        ("group_without_rank", lambda: DistributedOptimizer(fresh(), group=foreign),
         ["does not hold this rank", f"({ctx.rank})"]),
        ("stage3_not_sharded", lambda: DistributedOptimizer(fresh(), zero_stage=3),
         ["not sharded by fully_shard", "zero_stage=3"]),
        ("stage3_other_group", lambda: DistributedOptimizer(with_fsdp(fsdp_other), zero_stage=3),
         ["groups disagree", str(list(fsdp_other.ranks))]),
        ("fsdp_at_stage1", lambda: DistributedOptimizer(with_fsdp(dpcp), zero_stage=1),
         ["sharded by fully_shard but zero_stage=1", "zero_stage=3"]),
        ("already_built", lambda: DistributedOptimizer(built), ["already stepped"]),
    ]
    records = []
    for name, make, words in cases:
        raised, message = None, ""
        try:
            make()
        except DistributedOptimizerError as exc:  # the typed error, nothing broader
            raised, message = type(exc).__name__, str(exc)
        missing = [w for w in words if w not in message]
        records.append({"check": "optimizer.errors", "group": layout_label(lay), "case": name,
                        "raised": raised, "message": message, "missing": missing,
                        "is_value_error": isinstance(DistributedOptimizerError("x"), ValueError),
                        "passed": bool(raised and not missing), "max_error": 0.0})
    # Still in step: a world all-reduce and a real step after all the failures.
    world = manager.get_group("tp-cp-dp-pp")
    total = float(all_reduce(ms.Tensor(np.ones((1,), np.float32)), world).asnumpy()[0])
    good(g)
    records.append({"check": "optimizer.errors", "group": layout_label(lay), "case": "in_step",
                    "raised": None, "message": "", "missing": [], "world_sum": total,
                    "passed": bool(total == ctx.world_size), "max_error": 0.0})
    return records


def _gpt_overlap(stage: int, bucket_size_mb, steps: int) -> dict:
    """tiny GPTModel (pp == 1) through ``forward_backward(mode="pynative", optimizer=opt)``,
    overlapped and not: the weights after ``steps`` steps of 2 micro-batches each."""
    from mindscience.distributed.models import GPTModel, TransformerConfig
    from mindscience.distributed.optimizer import DistributedOptimizer

    cfg = TransformerConfig.from_model_spec("tiny-gpt", precision="fp32", num_layers=1)
    rng = np.random.default_rng(5)
    ids = rng.integers(0, cfg.vocab_size, (4, cfg.seq_length)).astype(np.int32)
    out = {}
    for flag in (False, True):
        net = GPTModel(cfg, seed=3)
        opt = DistributedOptimizer(net.trainable_params(), lr=LR, zero_stage=stage,
                                   bucket_size_mb=bucket_size_mb, overlap_grad_reduce=flag,
                                   overlap_param_gather=flag)
        for _ in range(steps):
            _, grads = net.forward_backward(ids, ids, 2, mode="pynative", optimizer=opt)
            opt(grads)
        waits = opt.param_gather_waits()  # the hooks of every forward after the first
        opt.finish_param_gather()
        out[flag] = ([p.asnumpy() for p in net.trainable_params()], len(opt.overlap_timeline()),
                     len(opt.buckets), waits)
    return out


@check("optimizer.overlap")
def overlap(ctx: CheckContext, tp=1, pp=1, stages=(0, 1, 2), steps=2, bucket_size_mb=0,
            gpt=False) -> dict:
    """``overlap_grad_reduce=True`` and ``overlap_param_gather=True`` (the stage attached
    with ``attach_param_gather``) against the same step without them, fp32, 2
    micro-batches: the weights after ``steps`` steps must be equal bit for bit at every
    stage in ``stages``; ``param_gathers`` counts the weight gathers written by the next
    forward's hooks and by the final ``finish_param_gather``. pp == 1: ``opt.overlap_backward`` around the last micro-batch's
    ``value_and_grad`` (the earlier sum passed as ``accumulated``); pp > 1: the 1F1B
    pipeline with ``on_chunk_done`` -> ``opt.grads_ready`` (what GPTModel does);
    ``gpt``: also a 1-layer tiny GPTModel through ``forward_backward(optimizer=opt)``.
    ``bucket_size_mb=0``: one bucket per parameter, so that some launch before the end."""
    import mindspore as ms

    from mindscience.distributed import manager
    from mindscience.distributed.optimizer import DistributedOptimizer
    from mindscience.distributed.pipeline import forward_backward

    started = time.perf_counter()
    lay = manager.get_layout() if manager.is_initialized() else None
    if lay is None or (lay.tp, lay.cp, lay.pp) != (tp, 1, pp):
        lay = reinit(manager, {"tp": tp, "pp": pp})
    rows = []
    for stage in stages:
        weights, launched, modes = {}, {}, None
        for flag in (False, True):
            run = _Run(manager)
            opt = DistributedOptimizer(run.params, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD,
                                       zero_stage=stage, bucket_size_mb=bucket_size_mb,
                                       overlap_grad_reduce=flag, overlap_param_gather=flag)
            hooked = opt.attach_param_gather(run.stage)
            modes = opt.grad_reduce_overlap("pynative", pp)
            vg = ms.value_and_grad(run.net, None, run.params)
            count = waited = 0
            for ids, tgt in _batches(steps):
                if pp > 1:
                    m = run.microbatches
                    xs = [ms.Tensor(a) for a in np.split(run.local(ids), m, axis=1)]
                    ys = [ms.Tensor(a) for a in np.split(run.local(tgt), m, axis=1)]
                    opt.start_step()

                    def done(c, params, grads, opt=opt):
                        opt.grads_ready({q.name: g for q, g in zip(params, grads)})
                    _, grads = forward_backward(run.stage, xs, ys, run.loss_fn, schedule="1f1b",
                                                mode="pynative", on_chunk_done=done)
                else:
                    halves = [np.split(run.local(a), 2, axis=1) for a in (ids, tgt)]
                    _, acc = vg(ms.Tensor(halves[0][0]), ms.Tensor(halves[1][0]))
                    with opt.overlap_backward({q.name: a for q, a in zip(run.params, acc)}):
                        _, last = vg(ms.Tensor(halves[0][1]), ms.Tensor(halves[1][1]))
                    grads = tuple(a + g for a, g in zip(acc, last))
                opt(grads)
                count += len(opt.overlap_timeline())
                # the step took the launched results (it waited on each handle)
                waited += sum("done_s" in row for row in opt.overlap_timeline())
            gathers = dict(opt.param_gather_waits(), hooked=hooked)
            opt.finish_param_gather()  # the last step's gathers, before reading the weights
            gathers["finished"] = opt.param_gather_waits()["finish"]
            weights[flag] = [p.asnumpy() for p in run.params]
            launched[flag] = (count, waited, gathers)
        diff = max(float(np.max(np.abs(a - b))) for a, b in zip(weights[False], weights[True]))
        same = all(np.array_equal(a, b) for a, b in zip(weights[False], weights[True]))
        rows.append({"stage": stage, "bitwise_equal": bool(same), "max_abs_diff": diff,
                     "launched": launched[True][0], "waited": launched[True][1],
                     "launched_without": launched[False][0],
                     "param_gathers": launched[True][2], "param_gathers_without": launched[False][2],
                     "gather_overlapped": opt.param_gather_overlap("pynative")[0],
                     "overlapped": modes[0], "buckets": len(opt.buckets)})
    rec = {"check": "optimizer.overlap", "group": layout_label(manager.get_layout()),
           "tp": tp, "pp": pp, "rows": rows}
    if gpt:
        got = _gpt_overlap(1, bucket_size_mb, 2)
        rec["gpt_bitwise_equal"] = all(np.array_equal(a, b) for a, b in zip(got[False][0], got[True][0]))
        rec["gpt_launched"] = got[True][1]
        rec["gpt_buckets"] = got[True][2]
        rec["gpt_param_gathers"] = got[True][3]
    rec["seconds"] = round(time.perf_counter() - started, 2)
    rec["passed"] = bool(all(r["bitwise_equal"] and r["launched"] > 0 for r in rows)
                         and rec.get("gpt_bitwise_equal", True))
    return rec
