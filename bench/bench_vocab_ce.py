"""vocab_parallel_cross_entropy vs gathering the logits + dense cross-entropy: time and memory.

    msrun --worker_num=4 --local_worker_num=4 --master_port=8119 --log_dir=logs/bench_ce \
          --join=True bench/bench_vocab_ce.py --tokens 2048 --vocab 32768

Every rank of tp = 4 holds logits ``(T, V/4)`` (float32). "parallel":
``vocab_parallel_cross_entropy(logits, target)``; "gather":
``ops.cross_entropy(gather_from_hidden(logits, tp), target, reduction="none")`` (the full
``(T, V)`` on every rank; its backward keeps this rank's slice). Forward + backward of the
mean loss, one warm-up and ``--iters`` timed runs (median); the peak resident memory is
reset before each variant, "parallel" first (the CPU memory pool keeps what a run
allocated, so the second figure is at least the first). Rank 0 prints the table.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import numpy as np

import mindspore as ms
from mindspore import ops

sys.path.insert(0, __import__("os").path.join(__import__("os").path.dirname(__file__), "..", "examples"))
import _common as C  # noqa: E402
from long_sequence import _reset_peak, current_mib, peak_mib  # noqa: E402

from mindscience.distributed import mappings  # noqa: E402
from mindscience.distributed.modules import vocab_parallel_cross_entropy  # noqa: E402


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--vocab", type=int, default=32768)
    parser.add_argument("--iters", type=int, default=3)
    args = parser.parse_args(argv)
    from mindspore.communication import get_group_size

    C.setup(tensor_parallel_size=get_group_size())
    tp = C.tp_group()
    rng = np.random.default_rng(tp.rank)
    logits = ms.Tensor(rng.standard_normal((args.tokens, args.vocab // tp.size)).astype(np.float32))
    target = ms.Tensor(np.random.default_rng(0).integers(0, args.vocab, args.tokens).astype(np.int32))

    def parallel(x):
        return vocab_parallel_cross_entropy(x, target).mean()

    def gather(x):
        full = mappings.gather_from_hidden(x, tp)
        return ops.cross_entropy(full, target, reduction="none").mean()

    rows = {}
    base = current_mib()
    for name, fn in (("parallel", parallel), ("gather", gather)):
        grad_fn = ms.value_and_grad(fn)
        loss, _ = grad_fn(logits)
        _reset_peak()
        times = []
        for _ in range(args.iters):
            t0 = time.perf_counter()
            value, grad = grad_fn(logits)
            grad.asnumpy()
            times.append(time.perf_counter() - t0)
        rows[name] = (statistics.median(times), peak_mib(), float(value.asnumpy()))
    table = np.zeros((tp.size, 6), np.float32)
    table[tp.rank] = [rows["parallel"][0], rows["parallel"][1], rows["gather"][0], rows["gather"][1],
                      base, abs(rows["parallel"][2] - rows["gather"][2])]
    table = ops.AllReduce()(ms.Tensor(table)).asnumpy() if tp.size > 1 else table
    if tp.rank == 0:
        mib = args.tokens * args.vocab * 4 / 2**20
        print(f"tp = {tp.size}, T = {args.tokens}, V = {args.vocab} (full logits {mib:.0f} MiB float32), "
              f"fwd+bwd, median of {args.iters}")
        print("| rank | parallel s | parallel peak MiB | gather s | gather peak MiB | baseline MiB | |loss diff| |")
        print("|---|---|---|---|---|---|---|")
        for r, row in enumerate(table):
            print(f"| {r} | {row[0]:.3f} | {row[1]:.0f} | {row[2]:.3f} | {row[3]:.0f} | {row[4]:.0f} | {row[5]:.1e} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
