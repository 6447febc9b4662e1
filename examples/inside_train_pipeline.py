"""How it works inside: a 4-layer transformer cut into pipeline stages by hand, trained with
tp2 x pp2 x dp2 under each pipeline schedule, and matched with the dense single-process model
step by step.

``examples/train_pipeline.py`` trains GPTModel the same way in a few lines; this script
shows the stages, the schedules and the gradient finalization underneath.

    msrun --worker_num=8 --local_worker_num=8 --master_port=8119 --log_dir=logs/pipe \
          --join=True examples/inside_train_pipeline.py        # tp2 x pp2 x dp2

Layout (order tp-cp-dp-pp): pipeline groups (0, 4), (1, 5), (2, 6), (3, 7); stage 0 holds
layers 0-1, stage 1 layers 2-3 (``"interleaved"``: 2 chunks per rank, model stage
``c * 2 + i`` = layer ``c * 2 + i``, Megatron's assignment). Each layer is a pre-layernorm
block with Megatron tensor-parallel attention (ColumnParallelLinear qkv over heads,
RowParallelLinear out) and MLP. Each dp rank cuts its half of the global batch into
``microbatches`` micro-batches and :func:`~mindscience.distributed.pipeline.forward_backward`
runs them through the pipeline; :class:`~mindscience.distributed.finalize.GradientFinalizer`
averages the gradients over dp, then SGD updates the weights.

The dense model (the same layers on size-1 groups, the whole global batch, the same initial
weights and SGD) is trained on world rank 0 and shared. Every step's loss (the mean over
dp of the pipeline's loss) must equal the dense loss within ``rtol`` (1e-5, float32) and
the final weights must agree, for every schedule and mode. Exits 1 on a mismatch.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

import numpy as np

import mindspore as ms
from mindspore import mint, nn, ops

import _common as C
from mindscience.distributed import manager
from mindscience.distributed.collectives import all_reduce
from mindscience.distributed.finalize import GradientFinalizer
from mindscience.distributed.group import ParallelGroup
from mindscience.distributed.modules import ColumnParallelLinear, RowParallelLinear
from mindscience.distributed.pipeline import forward_backward, stage_parameters

NAME = "examples.inside_train_pipeline"
RTOL = 1e-5
WEIGHTS_RTOL = 1e-5
SCHEDULE_LIST = ("1f1b", "gpipe", "interleaved")


class Layer(nn.Cell):
    """Pre-layernorm transformer layer, tensor parallel over ``tp`` (dense on size 1)."""

    def __init__(self, tp: ParallelGroup, d_model: int, num_heads: int, ffn: int, seq_len: int):
        super().__init__()
        if num_heads % tp.size:
            raise ValueError(f"num_heads={num_heads} must be divisible by tp={tp.size}")
        f32 = dict(compute_dtype=ms.float32, group=tp)
        self.head_dim = d_model // num_heads
        self.ln1 = C.LayerNorm(d_model)
        self.ln2 = C.LayerNorm(d_model)
        self.qkv = ColumnParallelLinear(d_model, 3 * d_model, gather_output=False, **f32)
        self.proj = RowParallelLinear(d_model, d_model, input_is_parallel=True, **f32)
        self.fc1 = ColumnParallelLinear(d_model, ffn, gather_output=False, **f32)
        self.fc2 = RowParallelLinear(ffn, d_model, input_is_parallel=True, **f32)
        self.mask = ms.Tensor(np.triu(np.ones((seq_len, seq_len), dtype=bool), k=1))
        self.scale = 1.0 / math.sqrt(self.head_dim)

    def attention(self, qkv):
        s, b, f = qkv.shape
        t = qkv.reshape(s, b, f // (3 * self.head_dim), 3, self.head_dim).transpose(1, 2, 3, 0, 4)
        q, k, v = t[:, :, 0], t[:, :, 1], t[:, :, 2]
        scores = ops.masked_fill(mint.matmul(q, k.transpose(0, 1, 3, 2)) * self.scale, self.mask,
                                 float("-inf"))
        out = mint.matmul(mint.nn.functional.softmax(scores, dim=-1), v)
        return out.transpose(2, 0, 1, 3).reshape(s, b, f // 3)

    def construct(self, x):
        h = x + self.proj(self.attention(self.qkv(self.ln1(x))))
        return h + self.fc2(ops.gelu(self.fc1(self.ln2(h))))


class Stage(nn.Cell):
    """A run of consecutive layers: one pipeline stage (or one interleaved chunk)."""

    def __init__(self, layers):
        super().__init__()
        self.layers = nn.CellList(layers)

    def construct(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def mse(out, target):
    return mint.mean((out - target) ** 2)


# ----------------------------------------------------------------------------- weights
_SHARD_DIM = {"qkv.weight": 0, "qkv.bias": 0, "fc1.weight": 0, "fc1.bias": 0,
              "proj.weight": 1, "fc2.weight": 1}


def dense_weights(layers: int, d_model: int, ffn: int, seed: int) -> list:
    """Per layer, the dense initial weights (numpy float32) by parameter name."""
    rng = np.random.default_rng(seed)

    def w(*shape, fan_in):
        return (rng.standard_normal(shape) / math.sqrt(fan_in)).astype(np.float32)

    out = []
    for _ in range(layers):
        out.append({
            "ln1.weight": (1 + 0.1 * rng.standard_normal(d_model)).astype(np.float32),
            "ln1.bias": (0.1 * rng.standard_normal(d_model)).astype(np.float32),
            "qkv.weight": w(3 * d_model, d_model, fan_in=d_model),
            "qkv.bias": w(3 * d_model, fan_in=d_model),
            "proj.weight": w(d_model, d_model, fan_in=d_model),
            "proj.bias": w(d_model, fan_in=d_model),
            "ln2.weight": (1 + 0.1 * rng.standard_normal(d_model)).astype(np.float32),
            "ln2.bias": (0.1 * rng.standard_normal(d_model)).astype(np.float32),
            "fc1.weight": w(ffn, d_model, fan_in=d_model),
            "fc1.bias": w(ffn, fan_in=d_model),
            "fc2.weight": w(d_model, ffn, fan_in=ffn),
            "fc2.bias": w(d_model, fan_in=ffn),
        })
    return out


def _short(name: str) -> str:
    """``layers.1.qkv.weight`` -> ``qkv.weight`` (the name inside its layer)."""
    return ".".join(name.split(".")[-2:])


def shard(name: str, full: np.ndarray, tp: ParallelGroup) -> np.ndarray:
    dim = _SHARD_DIM.get(_short(name))
    if dim is None or tp.size == 1:
        return full
    return np.split(full, tp.size, axis=dim)[tp.rank]


def build_layers(indices, weights, tp, d_model, num_heads, ffn, seq_len) -> list:
    layers = []
    for idx in indices:
        layer = Layer(tp, d_model, num_heads, ffn, seq_len)
        for p in layer.trainable_params():
            p.set_data(ms.Tensor(shard(p.name, weights[idx][_short(p.name)], tp)))
        layers.append(layer)
    return layers


def _layer_index(name: str) -> int:
    """``[0.]layers.1.qkv.weight`` -> 1 (the layer's index inside its stage)."""
    parts = name.split(".")
    return int(parts[parts.index("layers") + 1])


# ----------------------------------------------------------------------------- data
def global_batches(steps, seq_len, batch, d_model, seed):
    rng = np.random.default_rng(seed + 1)
    return [(rng.standard_normal((seq_len, batch, d_model)).astype(np.float32),
             rng.standard_normal((seq_len, batch, d_model)).astype(np.float32))
            for _ in range(steps)]


# ----------------------------------------------------------------------------- training
def train_dense(weights, batches, lr, dims) -> tuple:
    """The dense model on world rank 0 (PyNative), its curve and final weights shared."""
    trivial = ParallelGroup.trivial("tp")
    n_layers = len(weights)
    rank = manager._STATE.rank if manager.is_initialized() else 0  # noqa: SLF001
    curve = np.zeros(len(batches), np.float32)
    final = [{k: np.zeros_like(v) for k, v in w.items()} for w in weights]
    if rank == 0:
        model = Stage(build_layers(range(n_layers), weights, trivial, *dims))
        params = model.trainable_params()
        opt = nn.SGD(params, learning_rate=lr)

        def loss_fn(x, y):
            return mse(model(x), y)

        # Compiled: rank 0 alone computes it while the other ranks wait (PyNative took ~5x longer).
        grad_fn = ms.jit(ms.value_and_grad(loss_fn, None, params))
        for s, (x, y) in enumerate(batches):
            loss, grads = grad_fn(ms.Tensor(x), ms.Tensor(y))
            opt(grads)
            curve[s] = float(loss.asnumpy())
        for p in params:
            final[_layer_index(p.name)][_short(p.name)] = p.asnumpy()
    if manager.is_initialized() and manager.get_layout().world_size > 1:
        names = [(i, k) for i in range(n_layers) for k in weights[i]]
        flat = np.concatenate([curve] + [final[i][k].ravel() for i, k in names])
        flat = ops.AllReduce()(ms.Tensor(flat)).asnumpy()
        curve = flat[:len(batches)]
        start = len(batches)
        for i, k in names:
            size = weights[i][k].size
            final[i][k] = flat[start:start + size].reshape(weights[i][k].shape)
            start += size
    return [float(v) for v in curve], final


def my_layers(schedule: str, p: int, i: int, n_layers: int, v: int) -> list:
    """Layer indices per chunk of pipeline rank i: ``[[...]]`` (one list per chunk)."""
    if schedule == "interleaved":
        per = n_layers // (p * v)
        return [list(range((c * p + i) * per, (c * p + i + 1) * per)) for c in range(v)]
    per = n_layers // p
    return [list(range(i * per, (i + 1) * per))]


_MODELS: dict = {}


def _model(schedule, mode, weights, dims, v):
    """This rank's chunks for ``schedule``, at the initial weights.

    1F1B and GPipe cut the model alike, so they share the cells (and, under jit, the
    compiled stage functions); the weights are reset before each schedule trains.
    """
    tp = manager.get_tensor_parallel_group()
    pp = manager.get_pipeline_parallel_group()
    cut = "interleaved" if schedule == "interleaved" else "plain"
    key = (cut, mode, len(weights), dims, v, pp.ranks)
    held = _MODELS.get(key)
    if held is None:
        chunks_idx = my_layers(schedule, pp.size, pp.rank, len(weights), v)
        chunks = [Stage(build_layers(idx, weights, tp, *dims)) for idx in chunks_idx]
        # One container gives the chunks' parameters unique names ("0.layers.0...",
        # "1.layers.0...") for the optimizer; each chunk still runs (and compiles) on its own.
        holder = nn.CellList(chunks)
        held = _MODELS[key] = (chunks_idx, chunks, holder)
    chunks_idx, chunks, holder = held
    for c, idx in enumerate(chunks_idx):
        for p in chunks[c].trainable_params():
            # In place: after ms.jit compiled a function over p, set_data gives p new memory
            # that the compiled function never sees (measured: it kept the old values).
            ops.assign(p, ms.Tensor(shard(p.name, weights[idx[_layer_index(p.name)]][_short(p.name)], tp)))
    return chunks_idx, chunks, holder


def train_pipeline(schedule, mode, weights, batches, lr, microbatches, dims, v):
    """Train under one schedule; returns the global loss curve, final weights, step time."""
    pp = manager.get_pipeline_parallel_group()
    dp = manager.get_data_parallel_group()
    chunks_idx, chunks, holder = _model(schedule, mode, weights, dims, v)
    stage = list(holder) if schedule == "interleaved" else chunks[0]
    params = stage_parameters(stage)
    opt = nn.SGD(params, learning_rate=lr)
    finalize = GradientFinalizer(params)
    first, last = pp.rank == 0, pp.rank == pp.size - 1
    curve, times = [], []
    for x, y in batches:
        xl = np.split(x, dp.size, axis=1)[dp.rank]
        yl = np.split(y, dp.size, axis=1)[dp.rank]
        xs = [ms.Tensor(a) for a in np.split(xl, microbatches, axis=1)] if first else [None] * microbatches
        ys = [ms.Tensor(a) for a in np.split(yl, microbatches, axis=1)] if last else [None] * microbatches
        t0 = time.perf_counter()
        loss, grads = forward_backward(stage, xs, ys, mse, schedule=schedule, mode=mode)
        opt(finalize(grads))
        times.append(time.perf_counter() - t0)
        curve.append(float(all_reduce(loss, dp).asnumpy()) / dp.size)
    final = {}
    for c, idx in enumerate(chunks_idx):
        for p in chunks[c].trainable_params():
            final[(idx[_layer_index(p.name)], _short(p.name))] = p.asnumpy()
    return curve, final, float(np.median(times[1:])) if len(times) > 1 else times[0]


def rel_err(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b) / np.maximum(np.abs(b), 1e-12)))


def run(steps: int = 3, seq_len: int = 8, batch: int = 8, d_model: int = 16, num_heads: int = 4,
        ffn: int = 32, layers: int = 4, microbatches: int = 4, lr: float = 0.05, seed: int = 0,
        schedules=SCHEDULE_LIST, modes=("pynative", "jit"), virtual_stages: int = 2,
        rtol: float = RTOL, weights_rtol: float = WEIGHTS_RTOL, pynative_schedules=None) -> dict:
    """Train under each schedule x mode and compare with the dense model (needs the groups).

    ``pynative_schedules``: run PyNative only for these (default: every schedule); PyNative
    costs ~10x jit per step on an oversubscribed CPU.
    """
    tp = manager.get_tensor_parallel_group()
    pp = manager.get_pipeline_parallel_group()
    dp = manager.get_data_parallel_group()
    if batch % (dp.size * microbatches):
        raise ValueError(f"batch={batch} must be divisible by dp * microbatches = "
                         f"{dp.size * microbatches}")
    dims = (d_model, num_heads, ffn, seq_len)
    weights = dense_weights(layers, d_model, ffn, seed)
    batches = global_batches(steps, seq_len, batch, d_model, seed)
    t0 = time.perf_counter()
    dense_curve, dense_final = train_dense(weights, batches, lr, dims)
    dense_s = time.perf_counter() - t0
    record = {"check": NAME, "group": "world", "steps": steps, "microbatches": microbatches,
              "layout": {"tp": tp.size, "pp": pp.size, "dp": dp.size}, "layers": layers,
              "dense_loss": dense_curve, "errors": {}, "step_s": {}, "dense_s": dense_s,
              "total_s": {}}
    for schedule in schedules:
        for mode in modes:
            if mode == "pynative" and pynative_schedules is not None and schedule not in pynative_schedules:
                continue
            t0 = time.perf_counter()
            curve, final, step_s = train_pipeline(schedule, mode, weights, batches, lr,
                                                  microbatches, dims, virtual_stages)
            label = f"{schedule} {mode}"
            record["total_s"][label] = time.perf_counter() - t0
            record[f"{label} loss"] = curve
            record["step_s"][label] = step_s
            record["errors"][f"{label} loss vs dense (rel)"] = rel_err(curve, dense_curve)
            record["errors"][f"{label} weights vs dense (rel)"] = max(
                float(np.max(np.abs(w - shard(k[1], dense_final[k[0]][k[1]], tp)))
                      / max(float(np.max(np.abs(dense_final[k[0]][k[1]]))), 1e-12))
                for k, w in final.items())
    loss_errors = [e for k, e in record["errors"].items() if "loss" in k]
    weight_errors = [e for k, e in record["errors"].items() if "weights" in k]
    record["max_error"] = max(loss_errors)
    record["max_weight_error"] = max(weight_errors)
    record["rtol"], record["weights_rtol"] = rtol, weights_rtol
    record["loss_decreases"] = bool(dense_curve[-1] < dense_curve[0])
    record["passed"] = bool(record["max_error"] <= rtol and record["max_weight_error"] <= weights_rtol
                            and record["loss_decreases"])
    return record


def _setup(tp: int, pp: int) -> None:
    ms.set_context(mode=ms.PYNATIVE_MODE)
    if "MS_ROLE" not in os.environ:
        return
    from mindspore.communication import init

    if os.environ.get("MS_ROLE") == "MS_SCHED":
        init()
        raise SystemExit(0)
    init()
    manager.initialize_parallel(tensor_parallel_size=tp, pipeline_parallel_size=pp)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--pp", type=int, default=2)
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--schedules", default=",".join(SCHEDULE_LIST))
    parser.add_argument("--mode", default="pynative,jit", help="comma-separated: pynative, jit")
    parser.add_argument("--json", default=None, help="write the result record here")
    args = parser.parse_args(argv)
    if "MS_ROLE" not in os.environ:
        print("run it under msrun (see the docstring): the pipeline needs tp x pp x dp ranks")
        return 2
    _setup(args.tp, args.pp)
    record = run(steps=args.steps, microbatches=args.microbatches,
                 schedules=tuple(s for s in args.schedules.split(",") if s),
                 modes=tuple(m for m in args.mode.split(",") if m))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump(record, fh)
    ok = all_reduce(ms.Tensor(np.float32(0.0 if record["passed"] else 1.0)),
                    manager.get_group("tp-cp-dp-pp")).asnumpy() == 0
    if manager.get_group("tp-cp-dp-pp").rank == 0:
        print(f"{NAME}: layout {record['layout']}, {'PASS' if ok else 'FAIL'}")
        print("  dense loss: " + " ".join(f"{v:.6f}" for v in record["dense_loss"]))
        for k, v in record["errors"].items():
            print(f"  {k}: {v:.2e}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
