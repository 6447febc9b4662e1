"""Parallelize a dense model written without any parallel code, and train it.

    msrun --worker_num=4 --local_worker_num=4 --master_port=8128 --log_dir=logs/parallelize \
          --join=True examples/parallelize_dense.py --tp 2 [--sequence-parallel]
    python examples/parallelize_dense.py          # one process: tp1, the dense model

``DenseModel`` below is plain MindSpore: an embedding, two pre-norm MLP blocks
(``nn.Dense`` with ``activation="gelu"`` in one, ``mint.nn.Linear`` in the other) and a
final norm and output head. One call turns it into a tensor-parallel model, in place::

    parallelize_module(model, PLAN, sequence_parallel=...)

with the plan ``PLAN`` below: the embedding split by vocabulary rows, ``fc1`` by output
features, ``fc2`` by input features (one all-reduce per block forward, one backward),
the norms marked for sequence parallelism, and the head split by vocabulary with its
output gathered, so the user's loss code is unchanged. The parameter names stay the
dense ones (``layers.0.fc1.weight``), and so does the training loop; the optimizer is
the library's ``DistributedOptimizer`` (SGD with momentum, ZeRO stage 1), which averages
the gradients over the data-parallel replicas, sums those of sequence-parallel
parameters over tp and shards the momentum over the data-parallel ranks. The dense
model trains with ``nn.SGD`` (the same update).

On 4 ranks with ``--tp 2`` the layout is tp2 x dp2: each data-parallel replica trains on
half of the global batch. Every rank also trains the dense model on the whole batch in
its own process, from the same seed; the script prints both loss curves and exits 1 if
they differ by more than 1e-5 (relative) or if the final weights (this rank's slices)
differ by more than 1e-4.
"""

from __future__ import annotations

import argparse
import sys

import numpy as np

import mindspore as ms
from mindspore import mint, nn, ops

import _common as C
from mindscience.distributed import collectives, manager
from mindscience.distributed.group import ParallelGroup
from mindscience.distributed.optimizer import DistributedOptimizer
from mindscience.distributed.parallelize import (ColwiseParallel, RowwiseParallel,
                                                 SequenceParallel, VocabParallel,
                                                 parallelize_module)

VOCAB, HIDDEN, FFN = 128, 32, 128

PLAN = {
    "embed": VocabParallel(),
    "layers.*.fc1": ColwiseParallel(),
    "layers.*.fc2": RowwiseParallel(),
    "layers.*.norm": SequenceParallel(),
    "final_norm": SequenceParallel(),
    "head": ColwiseParallel(gather_output=True),
}


# ----------------------------------------------------------------------------- the dense model
class Block(nn.Cell):
    def __init__(self, use_mint: bool):
        super().__init__()
        self.norm = nn.LayerNorm((HIDDEN,))
        if use_mint:
            self.fc1 = mint.nn.Linear(HIDDEN, FFN)
            self.fc2 = mint.nn.Linear(FFN, HIDDEN)
        else:
            self.fc1 = nn.Dense(HIDDEN, FFN, activation="gelu")
            self.fc2 = nn.Dense(FFN, HIDDEN)
        self.gelu = use_mint

    def construct(self, x):
        h = self.fc1(self.norm(x))
        if self.gelu:
            h = ops.gelu(h)
        return x + self.fc2(h)


class DenseModel(nn.Cell):
    """Token ids ``(S, B)`` -> logits ``(S, B, VOCAB)``."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.layers = nn.CellList([Block(use_mint=False), Block(use_mint=True)])
        self.final_norm = nn.LayerNorm((HIDDEN,))
        self.head = nn.Dense(HIDDEN, VOCAB, has_bias=False)

    def construct(self, ids):
        h = self.embed(ids)
        for layer in self.layers:
            h = layer(h)
        return self.head(self.final_norm(h))


# ----------------------------------------------------------------------------- training
def train(model, ids, targets, steps: int, optimizer, dp_group=None) -> list:
    """``steps`` steps of ``optimizer`` on the mean cross-entropy; the loss of every step
    (the mean over the data-parallel replicas when ``dp_group`` is given)."""
    params = model.trainable_params()

    def loss_fn(inp, tgt):
        logits = model(inp)
        return ops.cross_entropy(logits.reshape(-1, VOCAB), tgt.reshape(-1))

    grad_fn = ms.value_and_grad(loss_fn, None, params)
    losses = []
    for _ in range(steps):
        loss, grads = grad_fn(ids, targets)
        optimizer(grads)
        if dp_group is not None and dp_group.size > 1:
            loss = collectives.all_reduce(loss, dp_group) / dp_group.size
        losses.append(float(loss.asnumpy()))
    return losses


def _dp_group() -> ParallelGroup:
    return manager.get_data_context_parallel_group() if manager.is_initialized() \
        else ParallelGroup.trivial("dp-cp")


def run(steps: int = 5, lr: float = 0.2, seq_len: int = 16, batch: int = 4,
        sequence_parallel: bool = False, seed: int = 0) -> dict:
    """Train the dense and the parallelized model; compare losses and final weights.

    ``batch`` is the global batch: each data-parallel replica takes ``batch / dp`` of it.
    The parallel groups must exist (or none: tp1, the dense model twice).
    """
    tp, dp = C.tp_group(), _dp_group()
    if batch % dp.size:
        raise ValueError(f"batch={batch} is not divisible by the data-parallel size {dp.size}; "
                         f"pass a multiple of {dp.size}.")
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, VOCAB, (seq_len + 1, batch))
    inputs, targets = ms.Tensor(ids[:-1], ms.int32), ms.Tensor(ids[1:], ms.int32)

    ms.set_seed(seed)
    dense = DenseModel()
    ms.set_seed(seed)
    model = parallelize_module(DenseModel(), PLAN, sequence_parallel=sequence_parallel)

    dense_losses = train(dense, inputs, targets, steps,
                         nn.SGD(dense.trainable_params(), learning_rate=lr, momentum=0.9))
    per = batch // dp.size
    mine = slice(dp.rank * per, (dp.rank + 1) * per)
    # The same SGD as ZeRO stage 1: it sums the sequence-parallel gradients over tp,
    # averages all of them over dp, and shards the momentum over the dp ranks.
    optimizer = DistributedOptimizer(model.trainable_params(), optimizer="sgd", lr=lr,
                                     momentum=0.9, zero_stage=1)
    losses = train(model, inputs[:, mine], targets[:, mine], steps, optimizer, dp)

    rel = [abs(p - d) / max(abs(d), 1e-12) for p, d in zip(losses, dense_losses)]
    dense_params = dict(dense.parameters_and_names())
    errors = {"loss (relative)": max(rel)}
    for name, param in model.parameters_and_names():
        full = dense_params[name]  # the dense names are kept
        if getattr(param, "tensor_model_parallel", False):
            full = C.rows(full, tp) if param.partition_dim == 0 else C.cols(full, tp)
        errors[f"final {name}"] = C.max_abs(param, full)
    record = C.result("examples.parallelize_dense", errors, C.ATOL, tp=tp.size, dp=dp.size,
                      sequence_parallel=sequence_parallel,
                      dense_losses=[round(v, 7) for v in dense_losses],
                      parallel_losses=[round(v, 7) for v in losses])
    record["passed"] = bool(record["passed"] and max(rel) <= 1e-5
                            and dense_losses[-1] < dense_losses[0])
    return record


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tp", type=int, default=2,
                        help="tensor-parallel size under msrun (the rest is data parallel)")
    parser.add_argument("--sequence-parallel", action="store_true")
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args(argv)
    C.setup(tensor_parallel_size=args.tp if C.launched_by_msrun() else 1)
    record = run(steps=args.steps, sequence_parallel=args.sequence_parallel)
    if C.world_rank() == 0:
        print(f"dense losses:    {record['dense_losses']}")
        print(f"parallel losses: {record['parallel_losses']} (tp={record['tp']}, dp={record['dp']})")
    return C.report(record)


if __name__ == "__main__":
    sys.exit(main())
