"""How the pipeline runtime sums parameter gradients over micro-batches: three ways, timed.

    python bench/bench_pipeline_accumulate.py [--mode pynative|jit] [--steps 40]

One process (no launch, no lock needed). A stage of ``--layers`` x (matmul ``dim x dim`` +
bias + tanh); one "step" = the backward of ``--microbatches`` micro-batches
(``grad of sum(stage(x) * dy)``, as the runtime's ``B``) and the sum of the parameter
gradients:

* ``python``: the compiled (or eager) grad function, then ``acc + g`` per parameter in
  Python (eager adds), what the runtime did before;
* ``assign_add``: ``ops.assign_add`` into zero buffers made for the step (in place);
* ``fused`` (jit only): ``acc + g`` inside the compiled function, the accumulators passed
  as separate arguments (what ``pipeline.stage_fns`` does under ``mode="jit"``).

The variants run interleaved, step after step, so that a change of machine load hits all
of them; prints the median and minimum per step and the largest difference of the summed
gradients from ``python``'s.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mode", choices=("pynative", "jit"), default="jit")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--microbatches", type=int, default=8)
    args = parser.parse_args(argv)

    import mindspore as ms
    from mindspore import mint, nn, ops

    rng = np.random.default_rng(0)
    dim = args.dim

    class Stage(nn.Cell):
        def __init__(self):
            super().__init__()
            self.w = ms.ParameterTuple([ms.Parameter(ms.Tensor(
                (rng.standard_normal((dim, dim)) / np.sqrt(dim)).astype(np.float32)), name=f"w{k}")
                for k in range(args.layers)])
            self.b = ms.ParameterTuple([ms.Parameter(ms.Tensor(np.zeros(dim, np.float32)), name=f"b{k}")
                                        for k in range(args.layers)])

        def construct(self, x):
            for w, b in zip(self.w, self.b):
                x = mint.tanh(mint.matmul(x, w) + b)
            return x

    stage = Stage()
    params = stage.trainable_params()

    def vjp(x, dy):
        return (stage(x) * dy).sum()

    grad = ms.grad(vjp, grad_position=0, weights=params)

    def fused(x, dy, *acc):
        dx, g = grad(x, dy)
        return (dx,) + tuple(a + b for a, b in zip(acc, g))

    jit = args.mode == "jit"
    grad_c = ms.jit(grad) if jit else grad
    fused_c = ms.jit(fused) if jit else None
    xs = [ms.Tensor(rng.standard_normal((16, dim)).astype(np.float32)) for _ in range(args.microbatches)]
    dys = [ms.Tensor(rng.standard_normal((16, dim)).astype(np.float32)) for _ in range(args.microbatches)]
    zeros = tuple(ops.zeros(q.shape, q.dtype) for q in params)

    def step(variant):
        if variant == "python":
            acc = None
            for x, dy in zip(xs, dys):
                _, g = grad_c(x, dy)
                acc = tuple(g) if acc is None else tuple(a + b for a, b in zip(acc, g))
        elif variant == "assign_add":
            acc = tuple(ops.zeros(q.shape, q.dtype) for q in params)
            for x, dy in zip(xs, dys):
                _, g = grad_c(x, dy)
                for a, b in zip(acc, g):
                    ops.assign_add(a, b)
        else:
            acc = zeros
            for x, dy in zip(xs, dys):
                acc = fused_c(x, dy, *acc)[1:]
        return [a.asnumpy() for a in acc]

    variants = ["python", "assign_add"] + (["fused"] if jit else [])
    for v in variants:  # compile and warm up
        step(v)
    times = {v: [] for v in variants}
    last = {}
    for _ in range(args.steps):
        for v in variants:
            t0 = time.perf_counter()
            last[v] = step(v)
            times[v].append(time.perf_counter() - t0)
    print(f"| mode | variant | median ms/step | min ms/step | max abs diff vs python |")
    print("|---|---|---|---|---|")
    for v in variants:
        diff = max(float(np.abs(a - b).max()) for a, b in zip(last[v], last["python"]))
        print(f"| {args.mode} | {v} | {statistics.median(times[v]) * 1e3:.2f} | "
              f"{min(times[v]) * 1e3:.2f} | {diff:.1e} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
