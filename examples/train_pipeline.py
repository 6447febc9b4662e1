"""Train GPTModel as tp x pp x dp under 1F1B and the interleaved schedule, and match the dense model.

    msrun --worker_num=8 --local_worker_num=8 --master_port=8119 --log_dir=logs/pipe \\
          --join=True examples/train_pipeline.py --tp 2 --pp 2       # tp2 x pp2 x dp2
    python examples/train_pipeline.py                                 # one process: dense

The model (4 layers, tied embedding) is cut into pp stages, or pp x 2 chunks with
``virtual_pipeline_stages=2`` (chunk c of pipeline rank i is model stage ``c * pp + i``),
and ``model.forward_backward`` runs the micro-batches of each dp rank through the pipeline:
1F1B for one chunk per rank, the interleaved schedule for two. DistributedOptimizer then
sums the tied embedding's gradients over the first and last stage, averages over dp and
steps. The dense model (``parallel=False``, the same seed) trains on the whole global batch
in the same process; the losses must agree within ``rtol``. examples/inside_train_pipeline.py
cuts and schedules such a model by hand.
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

NAME = "examples.train_pipeline"


def run(steps: int = 3, schedules=("1f1b", "interleaved"), mode: str = "jit", microbatches: int = 4,
        lr: float = 0.2, seed: int = 0, rtol: float = 1e-5) -> dict:
    """Train ``steps`` steps per schedule at the layout in force (none: the dense model twice).

    Each dp rank cuts its ``microbatches`` sequences into micro-batches of one. Returns the
    record: the loss curves and their largest relative gap from the dense model's; it passes
    when the gap is within ``rtol`` and the dense loss fell.
    """
    if steps < 1:
        raise ValueError(f"steps={steps} is invalid: expected an integer >= 1.")
    dp = C.dp_group()
    errors, curves, fell = {}, {}, True
    for schedule in schedules:
        # Interleaved: two chunks per pipeline rank (one process has a single stage).
        chunks = 2 if schedule == "interleaved" and C.pp_group().size > 1 else 1
        cfg = TransformerConfig.from_model_spec("tiny-gpt", num_layers=4, seq_length=16,
                                                virtual_pipeline_stages=chunks)
        model = GPTModel(cfg, seed=seed)                    # this rank's stages only
        dense = GPTModel(cfg, seed=seed, parallel=False)    # the whole model, the same weights
        optimizer = DistributedOptimizer(model.trainable_params(), optimizer="sgd", lr=lr, momentum=0.9)
        dense_optimizer = nn.SGD(dense.trainable_params(), learning_rate=lr, momentum=0.9)
        rng = np.random.default_rng(seed)
        losses, dense_losses = [], []
        for _ in range(steps):
            # A toy corpus of the first 16 token ids: enough structure for the loss to fall.
            ids = rng.integers(0, 16, (dp.size * microbatches, cfg.seq_length + 1)).astype(np.int32)
            inputs, labels = ids[:, :-1], ids[:, 1:]         # predict the next token
            mine = slice(dp.rank * microbatches, (dp.rank + 1) * microbatches)
            loss, grads = model.forward_backward(inputs[mine], labels[mine], num_microbatches=microbatches,
                                                 schedule=schedule, mode=mode)
            optimizer(grads)
            losses.append(float((all_reduce(loss, dp) / dp.size).asnumpy()))  # the global batch's
            loss, grads = dense.forward_backward(inputs, labels, mode="pynative")
            dense_optimizer(grads)
            dense_losses.append(float(loss.asnumpy()))
        curves[f"{schedule} losses"], curves[f"{schedule} dense_losses"] = losses, dense_losses
        errors[f"{schedule} loss (relative)"] = max(abs(a - b) / abs(b) for a, b in zip(losses, dense_losses))
        fell = fell and dense_losses[-1] < dense_losses[0]
    record = C.result(NAME, errors, rtol, layout=C.layout_label(), mode=mode, **curves,
                      parameters={"this rank": C.numel(model), "dense": C.numel(dense)})
    record["passed"] = bool(record["passed"] and fell)
    return record


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tp", type=C.positive_int, default=2)
    parser.add_argument("--pp", type=C.positive_int, default=2)
    parser.add_argument("--schedules", default="1f1b,interleaved",
                        help="comma-separated: 1f1b, gpipe, interleaved")
    parser.add_argument("--mode", default="jit", choices=("jit", "pynative"))
    parser.add_argument("--steps", type=C.positive_int, default=3)
    args = parser.parse_args(argv)
    C.setup(*((args.tp, 1, args.pp) if C.launched_by_msrun() else (1, 1, 1)))  # one process: dense
    schedules = tuple(s for s in args.schedules.split(",") if s)
    return C.report(run(steps=args.steps, schedules=schedules, mode=args.mode))


if __name__ == "__main__":
    sys.exit(main())
