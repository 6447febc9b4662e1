"""Train a tensor-parallel MLP with plain SGD; its loss curve equals the dense model's.

    msrun --worker_num=4 --local_worker_num=4 --master_port=8118 --log_dir=logs/tp_mlp \
          --join=True examples/tp_mlp.py [--sequence-parallel]

The MLP is Megatron's: ``ColumnParallelLinear(gather_output=False) -> gelu ->
RowParallelLinear(input_is_parallel=True)``. Each tp rank holds ``ffn/tp`` of the hidden
units; the only communication is one all-reduce forward (after the second layer) and one
backward (of the input gradient, in the first layer).

With ``--sequence-parallel`` the tokens are split over the tp ranks too: the first layer
all-gathers them, the second reduce-scatters its output, so each rank keeps ``S/tp``
rows, and the loss of a rank covers its rows only (the total is the sum over ranks).
The second layer's bias is then added to a chunk of the rows on each rank, so its
gradient must be summed over the tp group before the step: the layer marks it with
``bias.sequence_parallel = True``, and the loop below all-reduces such gradients.

Both models start from the same seed (so from the same weights), see the same data and
take the same SGD steps; the script prints both loss curves and exits 1 if they differ
by more than 1e-5 (relative) or if the final weights differ by more than 1e-4.
"""

from __future__ import annotations

import argparse
import sys

import numpy as np

import mindspore as ms
from mindspore import mint, nn, ops

import _common as C
from mindscience.distributed import collectives
from mindscience.distributed.modules import ColumnParallelLinear, RowParallelLinear


class DenseMLP(nn.Cell):
    def __init__(self, d_model: int, ffn: int):
        super().__init__()
        self.fc1 = mint.nn.Linear(d_model, ffn)
        self.fc2 = mint.nn.Linear(ffn, d_model)

    def construct(self, x):
        return self.fc2(ops.gelu(self.fc1(x)))


class ParallelMLP(nn.Cell):
    def __init__(self, d_model: int, ffn: int, sequence_parallel: bool = False):
        super().__init__()
        self.fc1 = ColumnParallelLinear(d_model, ffn, gather_output=False,
                                        use_sequence_parallel=sequence_parallel,
                                        compute_dtype=ms.float32)
        self.fc2 = RowParallelLinear(ffn, d_model, input_is_parallel=True,
                                     use_sequence_parallel=sequence_parallel,
                                     compute_dtype=ms.float32)

    def construct(self, x):
        return self.fc2(ops.gelu(self.fc1(x)))


def train(net, x, y, steps: int, lr: float, n_total: int, group=None) -> list:
    """Plain SGD on the mean squared error; returns the loss of every step.

    ``x``/``y`` may be this rank's rows only (sequence parallelism): the loss is then
    the rank's share (normalized by ``n_total``, the element count of the whole
    batch), and ``group`` sums the shares and the gradients of sequence-parallel params.
    """
    params = net.trainable_params()
    optimizer = nn.SGD(params, learning_rate=lr)

    def loss_fn(inp, target):
        return ((net(inp) - target) ** 2).sum() / n_total

    grad_fn = ms.value_and_grad(loss_fn, None, params)
    losses = []
    for _ in range(steps):
        loss, grads = grad_fn(x, y)
        if group is not None:
            loss = collectives.all_reduce(loss, group)
            grads = tuple(
                collectives.all_reduce(g, group) if getattr(p, "sequence_parallel", False) else g
                for p, g in zip(params, grads)
            )
        optimizer(grads)
        losses.append(float(loss.asnumpy()))
    return losses


def run(steps: int = 5, lr: float = 0.1, seq_len: int = 8, batch: int = 2, d_model: int = 16,
        ffn: int = 64, sequence_parallel: bool = False, seed: int = 0) -> dict:
    """Train both models on this rank and compare; the parallel groups must exist."""
    tp = C.tp_group()
    rng = np.random.default_rng(seed)
    x = ms.Tensor(rng.standard_normal((seq_len, batch, d_model)), ms.float32)
    y = ms.Tensor(np.sin(3 * rng.standard_normal((seq_len, batch, d_model))), ms.float32)
    n_total = seq_len * batch * d_model

    ms.set_seed(seed)
    dense = DenseMLP(d_model, ffn)
    ms.set_seed(seed)
    par = ParallelMLP(d_model, ffn, sequence_parallel)

    dense_losses = train(dense, x, y, steps, lr, n_total)
    if sequence_parallel:
        par_losses = train(par, C.rows(x, tp), C.rows(y, tp), steps, lr, n_total, group=tp)
    else:
        par_losses = train(par, x, y, steps, lr, n_total)

    rel = [abs(p - d) / max(abs(d), 1e-12) for p, d in zip(par_losses, dense_losses)]
    errors = {
        "loss (relative)": max(rel),
        "final fc1.weight": C.max_abs(par.fc1.weight, C.rows(dense.fc1.weight, tp)),
        "final fc1.bias": C.max_abs(par.fc1.bias, C.rows(dense.fc1.bias, tp)),
        "final fc2.weight": C.max_abs(par.fc2.weight, C.cols(dense.fc2.weight, tp)),
        "final fc2.bias": C.max_abs(par.fc2.bias, dense.fc2.bias),
    }
    record = C.result("examples.tp_mlp", errors, C.ATOL, tp=tp.size,
                      sequence_parallel=sequence_parallel,
                      dense_losses=[round(v, 7) for v in dense_losses],
                      parallel_losses=[round(v, 7) for v in par_losses])
    # The curve must match more tightly than the weights, and it must go down.
    record["passed"] = bool(record["passed"] and max(rel) <= 1e-5
                            and dense_losses[-1] < dense_losses[0])
    return record


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tp", type=int, default=None, help="tensor-parallel size (default: all ranks)")
    parser.add_argument("--sequence-parallel", action="store_true")
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args(argv)
    from mindspore.communication import get_group_size

    C.setup(tensor_parallel_size=args.tp or get_group_size())
    return C.report(run(steps=args.steps, sequence_parallel=args.sequence_parallel))


if __name__ == "__main__":
    sys.exit(main())
