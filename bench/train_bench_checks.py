"""Worker-side check of bench/bench_train.py: GradientFinalizer per tensor vs bucketed.

``bench.finalize``: a model-shaped list of ``num_params`` parameter tensors (a
transformer's mix: per layer two [h, h]-ish matrices, their biases, two layernorm
pairs; a third of them ``sequence_parallel``), float32 gradients, timed in PyNative and
under ``ms.jit`` with ``bucket_size_mb=0`` (one all-reduce per tensor) and the default
buckets. Per round every rank times ``iters`` calls; the parent takes the slowest rank.
"""

from __future__ import annotations

import time

import numpy as np

from mindscience.distributed.harness.checks.groups import ensure_manager, layout_label
from mindscience.distributed.harness.registry import CheckContext, check


def _shapes(num_params: int, hidden: int) -> list:
    pattern = [((hidden, hidden), False), ((hidden,), False), ((hidden,), True), ((hidden,), True),
               ((4 * hidden, hidden), False), ((4 * hidden,), False)]
    return [pattern[i % len(pattern)] for i in range(num_params)]


@check("bench.finalize")
def bench_finalize(ctx: CheckContext, num_params=120, hidden=64, iters=3, repeats=3,
                   bucket_sizes_mb=(0, 32.0), modes=("pynative", "jit")) -> list:
    import mindspore as ms

    from mindscience.distributed.finalize import GradientFinalizer

    manager = ensure_manager(ctx)
    params, grads = [], []
    for i, (shape, sp) in enumerate(_shapes(num_params, hidden)):
        p = ms.Parameter(ms.Tensor(np.zeros(shape, np.float32)), name=f"p{i}")
        if sp:
            p.sequence_parallel = True
        params.append(p)
        grads.append(ms.Tensor(np.full(shape, ctx.rank + 1.0, np.float32)))
    grads = tuple(grads)
    total_bytes = sum(int(np.prod(s)) * 4 for s, _ in _shapes(num_params, hidden))
    records = []
    for mode in modes:
        for mb in bucket_sizes_mb:
            fin = GradientFinalizer(params, bucket_size_mb=mb)
            fn = ms.jit(fin.construct) if mode == "jit" else fin
            t0 = time.perf_counter()
            out = fn(grads)
            out[-1].asnumpy()
            first_s = time.perf_counter() - t0
            rounds = []
            for _ in range(repeats):
                t0 = time.perf_counter()
                for _ in range(iters):
                    out = fn(grads)
                out[-1].asnumpy()
                rounds.append((time.perf_counter() - t0) / iters)
            records.append({
                "check": "bench.finalize", "group": "tp+dp-cp", "passed": True, "max_error": 0.0,
                "mode": mode, "bucket_size_mb": mb, "num_params": num_params,
                "bytes": total_bytes, "buckets": [len(fin.tp_buckets), len(fin.dp_buckets)],
                "first_call_s": first_s, "round_s": rounds,
                "layout": layout_label(manager.get_layout()),
            })
    return records
