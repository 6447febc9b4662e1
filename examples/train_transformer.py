"""Train GPTModel as tp x cp x dp (sequence parallel, Ulysses attention) and match the dense model.

    msrun --worker_num=8 --local_worker_num=8 --master_port=8118 --log_dir=logs/train \\
          --join=True examples/train_transformer.py --tp 2 --cp 2      # tp2 x cp2 x dp2
    python examples/train_transformer.py                                # one process: dense

The parallel program is: initialize_parallel, GPTModel(cfg), DistributedOptimizer over its
parameters, then per step ``model.forward_backward -> optimizer``. The optimizer sums the
sequence-parallel gradients over tp, averages all of them over dp-cp and steps (ZeRO 1: each
dp-cp rank keeps a shard of the momentum). The dense model (``parallel=False``, the same seed,
so the same global weights) trains on the whole global batch in the same process; the losses
must agree within ``rtol``. examples/inside_train_transformer.py wires such a model by hand.
"""

from __future__ import annotations

import argparse
import sys

import numpy as np

from mindspore import nn

import _common as C
from mindscience.distributed.collectives import all_reduce
from mindscience.distributed.models import GPTModel, TransformerConfig
from mindscience.distributed.optimizer import DistributedOptimizer

NAME = "examples.train_transformer"


def run(steps: int = 3, method: str = "ulysses", mode: str = "jit", rows: int = 2, lr: float = 0.2,
        seed: int = 0, rtol: float = 1e-5) -> dict:
    """Train ``steps`` steps at the layout in force (none: the dense model twice).

    ``rows`` sequences per dp rank and step; ``method`` is the cp attention (ring, ulysses,
    allgather_kv). Returns the record: both loss curves and their largest relative gap; it
    passes when the gap is within ``rtol`` and the dense loss fell.
    """
    cfg = TransformerConfig.from_model_spec("tiny-gpt", num_layers=2, seq_length=16,
                                            context_parallel_method=method, sequence_parallel=True)
    model = GPTModel(cfg, seed=seed)                    # this rank's part
    dense = GPTModel(cfg, seed=seed, parallel=False)    # the whole model, the same weights
    optimizer = DistributedOptimizer(model.trainable_params(), optimizer="sgd", lr=lr, momentum=0.9)
    dense_optimizer = nn.SGD(dense.trainable_params(), learning_rate=lr, momentum=0.9)
    if steps < 1:
        raise ValueError(f"steps={steps} is invalid: expected an integer >= 1.")
    dp = C.dp_group()
    rng = np.random.default_rng(seed)
    losses, dense_losses = [], []
    for _ in range(steps):
        # A toy corpus of the first 16 token ids: enough structure for the loss to fall.
        ids = rng.integers(0, 16, (dp.size * rows, cfg.seq_length + 1)).astype(np.int32)
        inputs, labels = ids[:, :-1], ids[:, 1:]         # predict the next token
        mine = slice(dp.rank * rows, (dp.rank + 1) * rows)
        loss, grads = model.forward_backward(inputs[mine], labels[mine], mode=mode)
        optimizer(grads)
        losses.append(float((all_reduce(loss, dp) / dp.size).asnumpy()))  # the global batch's
        loss, grads = dense.forward_backward(inputs, labels, mode="pynative")
        dense_optimizer(grads)
        dense_losses.append(float(loss.asnumpy()))
    rel = max(abs(a - b) / abs(b) for a, b in zip(losses, dense_losses))
    record = C.result(NAME, {"loss (relative)": rel}, rtol, layout=C.layout_label(), method=method,
                      mode=mode, losses=losses, dense_losses=dense_losses,
                      parameters={"this rank": C.numel(model), "dense": C.numel(dense)})
    record["passed"] = bool(record["passed"] and dense_losses[-1] < dense_losses[0])
    return record


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tp", type=C.positive_int, default=2)
    parser.add_argument("--cp", type=C.positive_int, default=2)
    parser.add_argument("--method", default="ulysses", choices=("ring", "ulysses", "allgather_kv"))
    parser.add_argument("--mode", default="jit", choices=("jit", "pynative"))
    parser.add_argument("--steps", type=C.positive_int, default=3)
    args = parser.parse_args(argv)
    C.setup(*((args.tp, args.cp) if C.launched_by_msrun() else (1, 1)))  # one process: dense
    return C.report(run(steps=args.steps, method=args.method, mode=args.mode))


if __name__ == "__main__":
    sys.exit(main())
