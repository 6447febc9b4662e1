"""Bench check of the pipeline runtime's recompute: ``bench.recompute_step`` (see
bench_recompute.py)."""

from __future__ import annotations

import resource
import statistics
import time

import numpy as np
from mindspore import mint

from mindscience.distributed.harness.registry import CheckContext, check


def _loss(out, t):
    return mint.mean((out - t) ** 2)


@check("bench.recompute_step")
def recompute_step(ctx: CheckContext, layers=4, dim=512, batch=256, microbatches=8, steps=6,
                   warmup=2) -> list:
    """GPipe steps with recompute="full" then "none": step time, counted bytes, peak RSS."""
    import mindspore as ms
    from mindspore import nn

    from mindscience.distributed.harness.checks.groups import ensure_manager
    from mindscience.distributed.pipeline.runtime import forward_backward

    g = ensure_manager(ctx).get_pipeline_parallel_group()
    p, i = g.size, g.rank

    class Stage(nn.Cell):
        def __init__(self):
            super().__init__()
            rng = np.random.default_rng(i)
            self.w = ms.ParameterTuple([ms.Parameter(ms.Tensor(
                (rng.standard_normal((dim, dim)) / np.sqrt(dim)).astype(np.float32)),
                name=f"w{k}") for k in range(layers)])

        def construct(self, x):
            for w in self.w:
                x = mint.tanh(mint.matmul(x, w))
            return x

    stage = Stage()
    rng = np.random.default_rng(5)
    xs = [ms.Tensor(rng.standard_normal((batch, dim)).astype(np.float32)) if i == 0 else None
          for _ in range(microbatches)]
    ts = [ms.Tensor(rng.standard_normal((batch, dim)).astype(np.float32)) if i == p - 1 else None
          for _ in range(microbatches)]
    act = batch * dim * 4
    param_bytes = sum(int(np.prod(q.shape)) * 4 for q in stage.trainable_params())
    def step(how):
        t0 = time.perf_counter()
        loss, _ = forward_backward(stage, xs, ts, _loss, schedule="gpipe", recompute=how)
        float(loss.asnumpy())
        ms.runtime.synchronize()
        return time.perf_counter() - t0

    # "full" alone first: the peak RSS it reaches; then both, step by step in turn (the
    # machine's load drifts: alternating gives both the same conditions). ru_maxrss only
    # grows, so the second reading is the kept steps' peak.
    for _ in range(warmup):
        step("full")
    rss = {"full": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}
    step("none")
    times = {"full": [], "none": []}
    for _ in range(steps):
        for how in ("full", "none"):
            times[how].append(step(how))
    rss["none"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    last = i == p - 1
    records = []
    for how in ("full", "none"):
        # What a non-last stage holds per micro-batch in flight, counted: "full" its input;
        # kept, what autodiff saves: each matmul's input and each tanh's output.
        per_mb = act if how == "full" else 2 * layers * act
        records.append({"check": "bench.recompute_step", "group": how, "recompute": how,
                        "stage": i, "last_stage": last,
                        "step_s_median": statistics.median(times[how]),
                        "step_s_min": min(times[how]), "steps": steps,
                        "microbatches": microbatches, "param_bytes": param_bytes,
                        "kept_bytes_per_microbatch": None if last else per_mb,
                        "kept_bytes_peak": None if last else per_mb * microbatches,
                        "max_rss_mib": rss[how], "passed": True})
    return records
