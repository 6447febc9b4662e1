"""How it works inside: a transformer block wired by hand from the library's layers, trained
with tp x cp x dp, compiled, against the dense model's loss curve.

``examples/train_transformer.py`` trains the same kind of model (GPTModel) in a few lines;
this script shows what such a model does underneath.

    msrun --worker_num=8 --local_worker_num=8 --master_port=8118 --log_dir=logs/train \
          --join=True examples/inside_train_transformer.py     # tp2 x cp2 x dp2, jit + PyNative

    python examples/inside_train_transformer.py               # one process: the dense model

The block (token embedding, pre-layernorm, 4 heads, GELU MLP, language-model head) runs
on 8 ranks as tp2 x cp2 x dp2, with the library's layers:

    ids (S/cp, b)          this rank's sequence chunk (cp) and batch shard (dp) of token ids
      -> VocabParallelEmbedding, sequence parallel   (S/(cp*tp), b, D): table rows over tp
      -> LayerNorm                                   params sequence_parallel=True
      -> ColumnParallelLinear qkv, sequence parallel (S/cp, b, 3D/tp): my tp heads
      -> context_parallel_attention(method="ulysses", causal) over cp   (S/cp, b, D/tp)
      -> RowParallelLinear, sequence parallel        (S/(cp*tp), b, D)  + residual
      -> LayerNorm -> Column (F/tp) -> GELU -> Row   (S/(cp*tp), b, D)  + residual
      -> ColumnParallelLinear head, sequence parallel (S/cp, b, V/tp): vocabulary over tp
      -> vocab_parallel_cross_entropy, mean over this rank's tokens

The train step ``value_and_grad -> GradientFinalizer -> AdamW`` is compiled
with ``mindspore.jit``; :class:`~mindscience.distributed.finalize.GradientFinalizer`
sums the sequence-parallel parameters' gradients over tp and averages every gradient
over the dp-cp group. The dense model (the same class on size-1 groups, the whole
global batch, the same initial weights) is trained alongside in each process, and the
loss curves, and the final weights, must agree within ``rtol`` (float32). The same
script in PyNative must give the same curve. Exits 1 on a mismatch.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time

import numpy as np

import mindspore as ms
from mindspore import mint, nn, ops
from mindspore.communication import get_group_size, get_rank

import _common as C
from mindscience.distributed import manager
from mindscience.distributed.collectives import all_reduce
from mindscience.distributed.finalize import GradientFinalizer
from mindscience.distributed.group import ParallelGroup
from mindscience.distributed.modules import (
    ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding, context_parallel_attention,
    vocab_parallel_cross_entropy,
)

RTOL = 1e-4
# Final weights after AdamW: its m / sqrt(v) turns float32 rounding in near-zero
# gradients into visible update differences, so the weights get a looser bound than
# the loss curve (measured ~1e-4 of the largest entry after 6 steps).
WEIGHTS_RTOL = 1e-3
NAME = "examples.inside_train_transformer"


VOCAB = 64


class Block(nn.Cell):
    """Embedding, pre-layernorm transformer block, LM head + cross-entropy; dense when the
    groups have size 1.

    Args:
        tp: Tensor-parallel group (vocabulary, heads and MLP columns; sequence parallelism).
        cp: Context-parallel group (Ulysses attention over the sequence).
        d_model, num_heads, ffn: Sizes of the whole model.
        seq_len: Global sequence length (kept for the callers; the attention masks by
            global positions itself).
        vocab: Vocabulary size (divisible by tp).
    """

    def __init__(self, tp: ParallelGroup, cp: ParallelGroup, d_model: int, num_heads: int,
                 ffn: int, seq_len: int, vocab: int = VOCAB):
        super().__init__()
        if num_heads % (tp.size * cp.size):
            raise ValueError(
                f"num_heads={num_heads} must be divisible by tp*cp={tp.size * cp.size}: "
                "each rank attends with whole heads"
            )
        self.tp, self.cp = tp, cp
        self.head_dim = d_model // num_heads
        f32 = dict(compute_dtype=ms.float32, group=tp)
        self.embedding = VocabParallelEmbedding(vocab, d_model, sequence_parallel=True, group=tp)
        self.ln1 = C.LayerNorm(d_model)
        self.ln2 = C.LayerNorm(d_model)
        for ln in (self.ln1, self.ln2):
            # Each tp rank normalizes its own chunk of the sequence: the gradients of
            # these (replicated) parameters are partial sums over tp.
            ln.weight.sequence_parallel = True
            ln.bias.sequence_parallel = True
        self.qkv = ColumnParallelLinear(d_model, 3 * d_model, gather_output=False,
                                        use_sequence_parallel=True, **f32)
        self.proj = RowParallelLinear(d_model, d_model, input_is_parallel=True,
                                      use_sequence_parallel=True, **f32)
        self.fc1 = ColumnParallelLinear(d_model, ffn, gather_output=False,
                                        use_sequence_parallel=True, **f32)
        self.fc2 = RowParallelLinear(ffn, d_model, input_is_parallel=True,
                                     use_sequence_parallel=True, **f32)
        self.head = ColumnParallelLinear(d_model, vocab, bias=False, gather_output=False,
                                         use_sequence_parallel=True, **f32)

    def attention(self, qkv):
        s, b, f = qkv.shape
        t = qkv.reshape(s, b, f // (3 * self.head_dim), 3, self.head_dim)  # [head, (q|k|v), d]
        q, k, v = t[:, :, :, 0], t[:, :, :, 1], t[:, :, :, 2]               # (S/cp, b, h/tp, d)
        out = context_parallel_attention(q, k, v, self.cp, method="ulysses", causal=True)
        return out.reshape(s, b, f // 3)

    def construct(self, ids, target):
        x = self.embedding(ids)                                      # (S/(cp tp), b, D)
        a = self.attention(self.qkv(self.ln1(x)))                    # (S/cp, b, D/tp)
        h = x + self.proj(a)                                         # (S/(cp tp), b, D)
        m = ops.gelu(self.fc1(self.ln2(h)))  # (mint gelu has no CPU kernel)
        h = h + self.fc2(m)
        logits = self.head(h)                                        # (S/cp, b, V/tp)
        return mint.mean(vocab_parallel_cross_entropy(logits, target, group=self.tp))


# ----------------------------------------------------------------------------- weights
def dense_weights(d_model: int, ffn: int, seed: int, vocab: int = VOCAB) -> dict:
    """The dense model's initial weights (numpy, float32), by parameter name."""
    rng = np.random.default_rng(seed)

    def w(*shape, fan_in):
        return (rng.standard_normal(shape) / math.sqrt(fan_in)).astype(np.float32)

    return {
        "embedding.weight": rng.standard_normal((vocab, d_model)).astype(np.float32),
        "head.weight": w(vocab, d_model, fan_in=d_model),
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
    }


# Which dim of each parameter the tp group shards (None: replicated).
_SHARD_DIM = {"qkv.weight": 0, "qkv.bias": 0, "fc1.weight": 0, "fc1.bias": 0,
              "proj.weight": 1, "fc2.weight": 1, "embedding.weight": 0, "head.weight": 0}


def shard_of(name: str, full: np.ndarray, tp: ParallelGroup) -> np.ndarray:
    """This tp rank's shard of a dense parameter (the whole of a replicated one)."""
    dim = _SHARD_DIM.get(name)
    if dim is None or tp.size == 1:
        return full
    return np.split(full, tp.size, axis=dim)[tp.rank]


def load_weights(block: Block, weights: dict) -> None:
    for p in block.trainable_params():
        p.set_data(ms.Tensor(shard_of(p.name, weights[p.name], block.tp)))


# ----------------------------------------------------------------------------- data
def global_batches(steps: int, seq_len: int, batch: int, d_model: int, seed: int,
                   vocab: int = VOCAB):
    """``steps`` (ids, target ids) pairs of shape (S, B), int32, the same on every rank
    (``d_model`` is unused; kept for the callers)."""
    rng = np.random.default_rng(seed + 1)
    return [(rng.integers(0, vocab, (seq_len, batch)).astype(np.int32),
             rng.integers(0, vocab, (seq_len, batch)).astype(np.int32))
            for _ in range(steps)]


def local_batch(x: np.ndarray, y: np.ndarray, tp, cp, dp):
    """This rank's ids (S/cp, B/dp) and target ids (S/cp, B/dp).

    The global sequence is cut into cp chunks (the Ulysses all-to-all concatenates in
    cp-rank order); every tp rank of a cp chunk holds all of its ids (the embedding
    reduce-scatters its output over tp, the LM head all-gathers the sequence back).
    """
    xb = np.split(x, dp.size, axis=1)[dp.rank]
    yb = np.split(y, dp.size, axis=1)[dp.rank]
    return np.split(xb, cp.size, axis=0)[cp.rank], np.split(yb, cp.size, axis=0)[cp.rank]


# ----------------------------------------------------------------------------- training
def make_step(block: Block, lr: float, mode: str, finalize: bool):
    """The train step (value_and_grad -> finalize -> AdamW), compiled for ``mode="jit"``."""
    params = block.trainable_params()
    # nn.AdamWeightDecay: mint.optim.AdamW has no CPU kernel in MindSpore 2.10 (measured).
    optimizer = nn.AdamWeightDecay(params, learning_rate=lr, weight_decay=0.01)
    grad_fn = ms.value_and_grad(block, None, optimizer.parameters)
    finalizer = GradientFinalizer(optimizer.parameters) if finalize else None

    def step(x, y):
        loss, grads = grad_fn(x, y)
        if finalizer is not None:
            grads = finalizer(grads)
        optimizer(grads)
        return loss

    return ms.jit(step) if mode == "jit" else step


def train(block: Block, batches, lr: float, mode: str, finalize: bool, shard=None):
    """Loss per step (this rank's), and the median step time in seconds (after step 0)."""
    step = make_step(block, lr, mode, finalize)
    losses, times = [], []
    for x, y in batches:
        xl, yl = shard(x, y) if shard else (x, y)
        t0 = time.perf_counter()
        loss = step(ms.Tensor(xl), ms.Tensor(yl))
        value = float(loss.asnumpy())
        times.append(time.perf_counter() - t0)
        losses.append(value)
    return losses, float(np.median(times[1:])) if len(times) > 1 else times[0]


def global_loss(local_losses, dp_cp: ParallelGroup):
    """Mean of the ranks' local losses over dp-cp: the loss of the whole global batch."""
    if dp_cp.size == 1:
        return list(local_losses)
    t = all_reduce(ms.Tensor(np.array(local_losses, dtype=np.float32)), dp_cp)
    return [float(v) / dp_cp.size for v in t.asnumpy()]


def rel_err(a, b) -> float:
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return float(np.max(np.abs(a - b) / np.maximum(np.abs(b), 1e-12)))


def train_dense(weights, batches, lr, d_model, num_heads, ffn, seq_len):
    """The dense reference (PyNative), trained on world rank 0 only and shared with a
    world all-reduce: 8 processes on a few cores would otherwise all compute it at once.

    Returns the loss curve, the median step time (rank 0's; 0 elsewhere) and the final
    weights by name.
    """
    trivial = ParallelGroup.trivial
    names = list(weights)
    rank, world = (get_rank(), get_group_size()) if C.launched_by_msrun() else (0, 1)
    curve, step_s, final = [0.0] * len(batches), 0.0, {n: np.zeros_like(w) for n, w in weights.items()}
    if rank == 0:
        dense = Block(trivial("tp"), trivial("cp"), d_model, num_heads, ffn, seq_len)
        load_weights(dense, weights)
        curve, step_s = train(dense, batches, lr, "pynative", finalize=False)
        final = {p.name: p.asnumpy() for p in dense.trainable_params()}
    if world > 1:
        flat = np.concatenate([np.asarray(curve, np.float32)] + [final[n].ravel() for n in names])
        flat = ops.AllReduce()(ms.Tensor(flat)).asnumpy()
        curve = [float(v) for v in flat[:len(batches)]]
        start = len(batches)
        for n in names:
            size = weights[n].size
            final[n] = flat[start:start + size].reshape(weights[n].shape)
            start += size
    return curve, step_s, final


def weight_err(got: np.ndarray, want: np.ndarray) -> float:
    """Max abs difference relative to the tensor's largest entry."""
    return float(np.max(np.abs(got - want)) / max(float(np.max(np.abs(want))), 1e-12))


def run(steps: int = 6, seq_len: int = 16, batch: int = 4, d_model: int = 16,
        num_heads: int = 4, ffn: int = 32, lr: float = 1e-2, seed: int = 0,
        modes=("jit", "pynative"), rtol: float = RTOL, weights_rtol: float = WEIGHTS_RTOL) -> dict:
    """Train the parallel block in each of ``modes`` and the dense block; compare curves.

    The parallel groups must exist (``_common.setup`` or the test harness); with none,
    the "parallel" model is the dense one on size-1 groups.
    """
    if manager.is_initialized():
        tp = manager.get_tensor_parallel_group()
        cp = manager.get_context_parallel_group()
        dp = manager.get_data_parallel_group()
        dp_cp = manager.get_data_context_parallel_group()
    else:
        tp, cp, dp, dp_cp = (ParallelGroup.trivial(k) for k in ("tp", "cp", "dp", "dp-cp"))
    for what, size, n in (("seq_len", seq_len, cp.size * tp.size), ("batch", batch, dp.size)):
        if size % n:
            raise ValueError(f"{what}={size} must be divisible by {n} for this layout")
    weights = dense_weights(d_model, ffn, seed)
    batches = global_batches(steps, seq_len, batch, d_model, seed)
    dense_curve, dense_time, dense_final = train_dense(weights, batches, lr, d_model,
                                                       num_heads, ffn, seq_len)
    record = {"check": NAME, "group": "world", "steps": steps, "dense_loss": dense_curve,
              "dense_step_s": dense_time, "layout": {"tp": tp.size, "cp": cp.size, "dp": dp.size},
              "shape": [seq_len, batch, d_model], "errors": {}}
    curves = {}
    for mode in modes:
        block = Block(tp, cp, d_model, num_heads, ffn, seq_len)
        load_weights(block, weights)
        local, step_s = train(block, batches, lr, mode, finalize=True,
                              shard=lambda x, y: local_batch(x, y, tp, cp, dp))
        curve = global_loss(local, dp_cp)
        curves[mode] = curve
        record[f"{mode}_loss"] = curve
        record[f"{mode}_step_s"] = step_s
        record["errors"][f"{mode} loss vs dense (rel)"] = rel_err(curve, dense_curve)
        record["errors"][f"{mode} weights vs dense (rel)"] = max(
            weight_err(p.asnumpy(), shard_of(p.name, dense_final[p.name], tp))
            for p in block.trainable_params())
    if len(curves) > 1:
        first, *rest = list(curves)
        for mode in rest:
            record["errors"][f"{mode} vs {first} loss (rel)"] = rel_err(curves[mode], curves[first])
    loss_errors = [v for k, v in record["errors"].items() if "weights" not in k]
    weight_errors = [v for k, v in record["errors"].items() if "weights" in k]
    record["max_error"] = max(loss_errors)
    record["max_weight_error"] = max(weight_errors) if weight_errors else 0.0
    record["rtol"], record["weights_rtol"] = rtol, weights_rtol
    decreasing = dense_curve[-1] < dense_curve[0]
    record["loss_decreases"] = bool(decreasing)
    record["passed"] = bool(record["max_error"] <= rtol and record["max_weight_error"] <= weights_rtol
                            and decreasing)
    if "jit_step_s" in record and "pynative_step_s" in record:
        record["jit_speedup"] = record["pynative_step_s"] / record["jit_step_s"]
    return record


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--cp", type=int, default=2)
    parser.add_argument("--mode", default="jit,pynative", help="comma-separated: jit, pynative")
    parser.add_argument("--json", default=None, help="write the result record here")
    args = parser.parse_args(argv)
    if C.launched_by_msrun():
        C.setup(args.tp, args.cp)
    else:
        C.setup(1, 1)
    record = run(steps=args.steps, modes=tuple(m.strip() for m in args.mode.split(",") if m.strip()))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump(record, fh)
    ok = C.all_ranks_passed(record["passed"]) if C.launched_by_msrun() else record["passed"]
    if not C.launched_by_msrun() or C.world_rank() == 0:
        print(f"{NAME}: layout {record['layout']}, {'PASS' if ok else 'FAIL'}")
        print("  dense loss:   " + " ".join(f"{v:.6f}" for v in record["dense_loss"]))
        for mode in ("jit", "pynative"):
            if f"{mode}_loss" in record:
                print(f"  {mode:8s} loss: " + " ".join(f"{v:.6f}" for v in record[f"{mode}_loss"])
                      + f"   (median step {record[f'{mode}_step_s'] * 1e3:.1f} ms)")
        for k, v in record["errors"].items():
            print(f"  {k}: {v:.2e}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
