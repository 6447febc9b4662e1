"""Test-only harness checks of ``parallelize_module`` and the dense models they use.

Imported by the worker ranks of ``_parallelize_job.py`` (through the spec's "modules",
with ``tests/`` on PYTHONPATH) and by ``test_parallelize.py`` for the models.

The model is written without any parallel code: an embedding plus a float input, two
pre-norm blocks (fused-qkv attention, then an MLP) and a final norm and output head.
Block 0 uses ``nn.Dense`` (fc1 with ``activation="gelu"``) and multi-head attention;
block 1 uses ``mint.nn.Linear`` and grouped-query attention (8 query heads, 4 kv heads),
so the plan meets every supported linear type, an activation, ``chunks=3`` and unequal
chunks.
"""

from __future__ import annotations

import math

import numpy as np

import mindspore as ms
from mindspore import mint, nn, ops

from mindscience.distributed.harness.registry import check
from mindscience.distributed.parallelize import (ColwiseParallel, HeadParallel, RowwiseParallel,
                                                 SequenceParallel, VocabParallel)

HIDDEN, FFN, VOCAB, HEADS, SEQ, BATCH = 32, 64, 64, 8, 8, 2
REL_TOL = 1e-5


class Attention(nn.Cell):
    """Softmax attention over ``(S, B, H)`` with a fused q|k|v projection; key/value heads
    are shared by ``num_heads // num_kv_heads`` consecutive query heads."""

    def __init__(self, hidden, num_heads, num_kv_heads, dense_qkv):
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = hidden // num_heads
        width = (num_heads + 2 * num_kv_heads) * self.head_dim
        self.qkv = nn.Dense(hidden, width) if dense_qkv else mint.nn.Linear(hidden, width)
        self.proj = mint.nn.Linear(hidden, hidden) if dense_qkv else nn.Dense(hidden, hidden)

    def construct(self, x):
        qkv = self.qkv(x)
        # The shape of the projection's output, not of x: under sequence parallelism x
        # holds this rank's rows and the column layer gathers the whole sequence.
        s, b = qkv.shape[0], qkv.shape[1]
        q_w = self.num_heads * self.head_dim
        kv_w = self.num_kv_heads * self.head_dim
        q = qkv[:, :, :q_w].reshape(s, b, self.num_heads, self.head_dim)
        k = qkv[:, :, q_w:q_w + kv_w].reshape(s, b, self.num_kv_heads, self.head_dim)
        v = qkv[:, :, q_w + kv_w:].reshape(s, b, self.num_kv_heads, self.head_dim)
        group = self.num_heads // self.num_kv_heads
        if group > 1:
            k = ops.repeat_interleave(k, group, 2)
            v = ops.repeat_interleave(v, group, 2)
        scores = ops.matmul(q.transpose(1, 2, 0, 3), k.transpose(1, 2, 3, 0))
        probs = ops.softmax(scores * (1.0 / math.sqrt(self.head_dim)), -1)
        out = ops.matmul(probs, v.transpose(1, 2, 0, 3))  # (B, heads, S, hd)
        return self.proj(out.transpose(2, 0, 1, 3).reshape(s, b, q_w))


class Block(nn.Cell):
    def __init__(self, index, gqa):
        super().__init__()
        dense = index == 0
        kv_heads = HEADS // 2 if gqa and not dense else HEADS
        self.norm1 = nn.LayerNorm((HIDDEN,))
        self.attn = Attention(HIDDEN, HEADS, kv_heads, dense)
        self.norm2 = nn.LayerNorm((HIDDEN,))
        if dense:
            self.fc1 = nn.Dense(HIDDEN, FFN, activation="gelu")
            self.fc2 = mint.nn.Linear(FFN, HIDDEN)
        else:
            self.fc1 = mint.nn.Linear(HIDDEN, FFN)
            self.fc2 = nn.Dense(FFN, HIDDEN)
        self.gelu_after_fc1 = not dense

    def construct(self, x):
        x = x + self.attn(self.norm1(x))
        h = self.fc1(self.norm2(x))
        if self.gelu_after_fc1:
            h = ops.gelu(h)
        return x + self.fc2(h)


class DenseLM(nn.Cell):
    """``head(norm(blocks(embed(ids) + x)))``: logits ``(S, B, VOCAB)``."""

    def __init__(self, gqa=True):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.layers = nn.CellList([Block(0, gqa), Block(1, gqa)])
        self.norm = nn.LayerNorm((HIDDEN,))
        self.head = nn.Dense(HIDDEN, VOCAB, has_bias=False)

    def construct(self, ids, x):
        h = self.embed(ids) + x
        for layer in self.layers:
            h = layer(h)
        return self.head(self.norm(h))


def plan(gqa=True) -> dict:
    kv = HIDDEN // 2 if gqa else HIDDEN
    return {
        "embed": VocabParallel(),
        "layers.*.attn": HeadParallel("num_heads", "num_kv_heads"),
        "layers.0.attn.qkv": ColwiseParallel(chunks=3),
        "layers.1.attn.qkv": ColwiseParallel(chunks=(HIDDEN, kv, kv)),
        "layers.*.attn.proj": RowwiseParallel(),
        "layers.*.fc1": ColwiseParallel(),
        "layers.*.fc2": RowwiseParallel(),
        "layers.*.norm?": SequenceParallel(),
        "norm": SequenceParallel(),
        "head": ColwiseParallel(gather_output=True),
    }


def build(seed=0, gqa=True):
    ms.set_seed(seed)
    np.random.seed(seed)
    model = DenseLM(gqa)
    # Non-trivial norm parameters, so their (sequence-parallel) gradients are tested too.
    rng = np.random.default_rng(seed + 100)
    for name, param in model.parameters_and_names():
        if ".norm" in f".{name}":
            param.set_data(ms.Tensor(rng.uniform(0.5, 1.5, param.shape).astype(np.float32)
                                     if name.endswith("gamma") else
                                     rng.normal(0, 0.1, param.shape).astype(np.float32)))
    return model


def data(seed=0, seq=SEQ, batch=BATCH):
    rng = np.random.default_rng(seed)
    ids = ms.Tensor(rng.integers(0, VOCAB, (seq, batch)), ms.int32)
    x = ms.Tensor(rng.standard_normal((seq, batch, HIDDEN)).astype(np.float32))
    cot = ms.Tensor(rng.standard_normal((seq, batch, VOCAB)).astype(np.float32))
    return ids, x, cot


def expected_local(full: np.ndarray, param, size: int, rank: int) -> np.ndarray:
    """This rank's part of a dense tensor, as the parameter's sharding marks say."""
    from mindscience.distributed.parallelize.styles import column_rows
    from mindscience.distributed.sharding import get_sharding, local_slices

    chunks = getattr(param, "partition_chunks", None)
    if chunks is not None:
        return np.concatenate([full[a:b] for a, b in column_rows(chunks, size, rank)], 0)
    sharding = get_sharding(param)
    if sharding["axis"] != "tp":
        return full
    dim = sharding["partition_dim"]
    parts = []
    for a, b in local_slices(full.shape[dim], size, rank, sharding["partition_stride"]):
        index = [slice(None)] * full.ndim
        index[dim] = slice(a, b)
        parts.append(full[tuple(index)])
    return np.concatenate(parts, dim)


def rel_err(got, want) -> float:
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    if got.shape != want.shape:
        return float("inf")
    return float(np.max(np.abs(got - want)) / max(np.max(np.abs(want)), 1e-30)) if want.size else 0.0


def rows(t, size, rank):
    n = t.shape[0] // size
    return t[rank * n:(rank + 1) * n]


def grads_of(model, ids, x, cot, mode="pynative"):
    params = model.trainable_params()

    def loss_fn(inp_ids, inp_x):
        out = model(inp_ids, inp_x)
        return (out * cot).sum(), out

    fn = ms.value_and_grad(loss_fn, grad_position=1, weights=params, has_aux=True)
    if mode == "jit":
        fn = ms.jit(fn)
    (loss, out), (dx, dw) = fn(ids, x)
    return params, loss, out, dx, dw


# ----------------------------------------------------------------------------- checks
def _reinit(tp):
    from mindscience.distributed import manager
    from mindscience.distributed.harness.checks.groups import reinit

    reinit(manager, {"tp": tp})
    return manager


@check("parallelize.parity")
def parity(ctx, tp=2, sequence_parallel=False, mode="pynative", seed=0) -> dict:
    """Dense vs parallelized model on this rank: the weights right after parallelizing,
    the output, the input gradient and every weight gradient (after GradientFinalizer)."""
    from mindscience.distributed import checkpoint
    from mindscience.distributed.finalize import GradientFinalizer
    from mindscience.distributed.parallelize import parallelize_module

    manager = _reinit(tp)
    group = manager.get_tensor_parallel_group()
    ms.set_context(mode=ms.PYNATIVE_MODE)
    dense, model = build(seed), build(seed)
    dense_names = [n for n, _ in dense.parameters_and_names()]
    parallelize_module(model, plan(), sequence_parallel=sequence_parallel)
    names = [n for n, _ in model.parameters_and_names()]
    ckpt_names = [n for n, _, _ in checkpoint.named_parameters(model)]
    full = {n: p.asnumpy() for n, p in dense.parameters_and_names()}
    weight_err = max(rel_err(p.asnumpy(), expected_local(full[n], p, group.size, group.rank))
                     for n, p in model.parameters_and_names())

    ids, x, cot = data(seed)
    key = ("parallelize.dense", seed)
    if key not in ctx.scratch:  # the same dense reference for every case of the job
        ctx.scratch[key] = grads_of(dense, ids, x, cot)[2:]
    d_out, d_dx, d_dw = ctx.scratch[key]
    x_in = rows(x, group.size, group.rank) if sequence_parallel else x
    params, _, out, dx, dw = grads_of(model, ids, x_in, cot, mode)
    dw = GradientFinalizer(params)(tuple(dw))
    dense_grads = dict(zip([p.name for p in dense.trainable_params()], d_dw))
    grad_errs = {p.name: rel_err(g.asnumpy(), expected_local(dense_grads[p.name].asnumpy(), p,
                                                             group.size, group.rank))
                 for p, g in zip(params, dw)}
    want_dx = rows(d_dx, group.size, group.rank) if sequence_parallel else d_dx
    errors = {"weights": weight_err, "output": rel_err(out.asnumpy(), d_out.asnumpy()),
              "input_grad": rel_err(dx.asnumpy(), want_dx.asnumpy()),
              "weight_grads": max(grad_errs.values())}
    sp_marked = sorted(p.name for p in params if getattr(p, "sequence_parallel", False))
    return {"check": "parallelize.parity", "group": "tp", "tp": tp, "dp": manager.get_layout().dp,
            "sequence_parallel": sequence_parallel, "mode": mode,
            "passed": bool(max(errors.values()) <= REL_TOL and names == dense_names
                           and ckpt_names == dense_names),
            "max_error": max(errors.values()), "errors": errors,
            "worst_grad": max(grad_errs, key=grad_errs.get),
            "names_equal": names == dense_names, "checkpoint_names_equal": ckpt_names == dense_names,
            "sequence_parallel_params": sp_marked,
            "local_shapes": {n: list(p.shape) for n, p in model.parameters_and_names()}}


@check("parallelize.checkpoint")
def save_checkpoint(ctx, directory, tp=2, seed=1) -> dict:
    """Parallelize the equal-chunk model (gqa=False: q|k|v by partition_stride) at tp and
    save it with checkpoint.save into ``directory``; the parent loads it into a dense
    model in a plain process and compares with ``build(seed, gqa=False)``."""
    from mindscience.distributed import checkpoint
    from mindscience.distributed.parallelize import parallelize_module

    manager = _reinit(tp)
    ms.set_context(mode=ms.PYNATIVE_MODE)
    model = parallelize_module(build(seed, gqa=False), plan(gqa=False))
    checkpoint.save(model, directory, step=0)
    group = manager.get_tensor_parallel_group()
    return {"check": "parallelize.checkpoint", "group": "tp", "tp": group.size,
            "dp": manager.get_layout().dp, "passed": True, "max_error": 0.0,
            "local_shapes": {n: list(p.shape) for n, p in model.parameters_and_names()}}


@check("parallelize.example")
def example(ctx, tp=2, **params) -> dict:
    """examples/parallelize_dense.py at tp x dp (its record compares with the dense model)."""
    import parallelize_dense  # examples/ is on the ranks' PYTHONPATH (the job's env)

    _reinit(tp)
    record = parallelize_dense.run(**params)
    record["check"] = "parallelize.example"
    record.setdefault("group", "world")
    return record
