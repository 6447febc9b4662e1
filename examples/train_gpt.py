"""Train GPTModel at any layout in a few lines, and check the first step against the dense model.

    msrun --worker_num=4 --local_worker_num=4 --master_port=8118 --log_dir=logs/gpt \
          --join=True examples/train_gpt.py --tp 2 --cp 2            # tp2 x cp2 (ring attention)
    msrun ... examples/train_gpt.py --tp 2 --pp 2 --microbatches 4  # tp2 x pp2, 1F1B
    python examples/train_gpt.py                                      # one process: dense

The whole parallel program is: initialize_parallel, GPTModel(cfg), then per step
model.forward_backward -> GradientFinalizer -> optimizer. How the layers are wired
inside is shown by hand in examples/inside_train_transformer.py and
examples/inside_train_pipeline.py.
"""

from __future__ import annotations

import argparse
import sys

import numpy as np

import mindspore as ms
from mindspore import nn

from mindscience.distributed import collectives as C
from mindscience.distributed import manager
from mindscience.distributed.finalize import GradientFinalizer
from mindscience.distributed.models import GPTModel, TransformerConfig


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny-gpt", help="preset name or YAML path")
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--cp", type=int, default=1)
    parser.add_argument("--pp", type=int, default=1)
    parser.add_argument("--microbatches", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--mode", default="jit", choices=("jit", "pynative"))
    args = parser.parse_args(argv)

    import os

    if "MS_ROLE" in os.environ:  # under msrun
        from mindspore.communication import init

        init()
        if os.environ["MS_ROLE"] == "MS_SCHED":  # msrun's scheduler runs the script too
            return 0
        manager.initialize_parallel(tensor_parallel_size=args.tp, context_parallel_size=args.cp,
                                    pipeline_parallel_size=args.pp)
    cfg = TransformerConfig.from_model_spec(args.model, num_layers=4, seq_length=32)
    model = GPTModel(cfg, seed=0)
    finalize = GradientFinalizer(model.trainable_params())
    optimizer = nn.Adam(model.trainable_params(), learning_rate=1e-3)  # nn.Adam runs on CPU

    dp = manager.get_data_parallel_group() if manager.is_initialized() else None
    dp_size, dp_rank = (dp.size, dp.rank) if dp else (1, 0)
    rows = args.microbatches * cfg.micro_batch_size
    rng = np.random.default_rng(0)
    losses = []
    for step in range(args.steps):
        ids = rng.integers(0, cfg.vocab_size, (dp_size * rows, cfg.seq_length)).astype(np.int32)
        labels = np.roll(ids, -1, axis=1)  # predict the next token
        mine = slice(dp_rank * rows, (dp_rank + 1) * rows)
        loss, grads = model.forward_backward(ids[mine], labels[mine],
                                             num_microbatches=args.microbatches, mode=args.mode)
        optimizer(finalize(grads))
        if dp is not None and dp.size > 1:
            loss = C.all_reduce(loss, dp) / dp.size
        losses.append(float(loss.asnumpy()))
        if step == 0:
            # The dense model in this process, the same seed and batch: the same loss.
            dense = GPTModel(cfg, seed=0, parallel=False)
            want, _ = dense.forward_backward(ids, labels, num_microbatches=1, mode="pynative")
            err = abs(losses[0] - float(want.asnumpy())) / float(want.asnumpy())
    print(f"{args.model} at tp{args.tp} x cp{args.cp} x pp{args.pp}: loss "
          + " ".join(f"{v:.4f}" for v in losses) + f"; step 0 vs dense {err:.1e}")
    return 0 if err <= 1e-5 else 1


if __name__ == "__main__":
    sys.exit(main())
