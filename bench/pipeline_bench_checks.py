"""Worker-side checks of bench/bench_pipeline.py.

``bench.pipeline_bubble``: ``forward_backward`` of a compute-bound toy stage (``layers``
matmul + tanh layers of ``dim`` x ``dim`` on a ``(batch, dim)`` micro-batch per chunk)
per schedule and m; every step is timed (``runtime.TIMING``: each step ends with a device
synchronization); per rank: the step's wall time and the time spent in F/B. Idle fraction
= 1 - compute / wall, per stage, median over ``repeats`` steps after a warm-up step.

``bench.p2p_cost``: ``ring_shift(check=False)`` and a stage send (``send_forward`` /
``recv_forward`` with ``check=False``) against a bare all-reduce over the same 2-rank pair
of the same bytes (what the composed transfer is built on), per size; mean of ``iters``.
"""

from __future__ import annotations

import statistics
import time

import numpy as np

from mindscience.distributed.harness.checks.groups import ensure_manager
from mindscience.distributed.harness.registry import CheckContext, check


@check("bench.pipeline_bubble")
def pipeline_bubble(ctx: CheckContext, schedules=("1f1b", "interleaved"), microbatches=(4, 8, 16),
                    dim=256, batch=32, layers=2, repeats=3) -> list:
    import mindspore as ms
    from mindspore import mint, nn

    from mindscience.distributed.pipeline import forward_backward, runtime

    manager = ensure_manager(ctx)
    g = manager.get_pipeline_parallel_group()
    p, i = g.size, g.rank
    rng = np.random.default_rng(0)

    class Toy(nn.Cell):
        def __init__(self, tag):
            super().__init__()
            self.w = ms.ParameterTuple([ms.Parameter(ms.Tensor(
                (rng.standard_normal((dim, dim)) / np.sqrt(dim)).astype(np.float32)), name=f"w{tag}_{k}")
                for k in range(layers)])

        def construct(self, x):
            for w in self.w:
                x = mint.tanh(mint.matmul(x, w))
            return x

    def loss_fn(out, t):
        return mint.mean((out - t) ** 2)

    records = []
    for schedule in schedules:
        v = 2 if schedule == "interleaved" else 1
        chunks = [Toy(f"{schedule}{c}") for c in range(v)]
        holder = nn.CellList(chunks)
        stage = list(holder) if v > 1 else chunks[0]
        for m in microbatches:
            xs = [ms.Tensor(rng.standard_normal((batch, dim)).astype(np.float32)) for _ in range(m)]
            inputs = xs if i == 0 else [None] * m
            targets = xs if i == p - 1 else [None] * m
            forward_backward(stage, inputs, targets, loss_fn, schedule=schedule)  # warm-up, headers
            idle, walls = [], []
            for _ in range(repeats):
                runtime.TIMING["intervals"] = []
                t0 = time.perf_counter()
                forward_backward(stage, inputs, targets, loss_fn, schedule=schedule)
                wall = time.perf_counter() - t0
                steps = runtime.TIMING.pop("intervals")
                busy = sum(e - s for k, s, e in steps if k in ("F", "B"))
                idle.append(1.0 - busy / wall)
                walls.append(wall)
            records.append({"check": "bench.pipeline_bubble", "group": "pp", "schedule": schedule,
                            "stages": p, "microbatches": m, "virtual_stages": v, "stage": i,
                            "idle_fraction": statistics.median(idle),
                            "step_s": statistics.median(walls), "passed": True, "max_error": 0.0})
    return records


def _async_two_pairs(g, x, iters, warmup) -> float:
    """Seconds per shift by one when both pair all-reduces (to the next rank, from the
    previous one) are issued with ``async_op=True`` before either is waited on."""
    from mindspore import mint, ops

    from mindscience.distributed import p2p

    p, i = g.size, g.rank
    me = g.ranks[i]
    out_pair = p2p.pair_group(me, g.ranks[(i + 1) % p], me)
    in_pair = p2p.pair_group(g.ranks[(i - 1) % p], me, me)
    send_first = i % 2 == 0  # even ranks' out pair is the first phase, as in ring_shift

    def once():
        a = x.copy()
        b = ops.zeros(x.shape, x.dtype)
        order = [(a, out_pair), (b, in_pair)] if send_first else [(b, in_pair), (a, out_pair)]
        works = [mint.distributed.all_reduce(t, group=pg.group_name, async_op=True) for t, pg in order]
        for w in works:
            if w is not None:
                w.wait()
        return b

    for _ in range(warmup):
        once()
    each = []
    for _ in range(iters):
        t0 = time.perf_counter()
        y = once().asnumpy()
        each.append(time.perf_counter() - t0)
    if not np.array_equal(y, x.asnumpy()):
        raise RuntimeError("async two pairs: wrong values")
    return statistics.median(each)


@check("bench.p2p_cost")
def p2p_cost(ctx: CheckContext, sizes=(1 << 10, 1 << 18, 1 << 22), iters=20, warmup=3) -> list:
    import mindspore as ms

    from mindscience.distributed import p2p
    from mindscience.distributed.collectives import all_gather, all_reduce

    manager = ensure_manager(ctx)
    g = manager.get_pipeline_parallel_group()
    p, i = g.size, g.rank
    me = g.ranks[i]
    pair = p2p.pair_group(g.ranks[0], g.ranks[1], me) if i < 2 else None
    records = []
    for size in sizes:
        n = size // 4
        x = ms.Tensor(np.ones(n, np.float32))
        times = {}

        def timed(name, fn):
            # The median of per-call times, each call waited for: a mean over a loop is
            # dominated by the odd 1 s stall of 4 ranks sharing 2 cores.
            for _ in range(warmup):
                fn()
            each = []
            for _ in range(iters):
                t0 = time.perf_counter()
                y = fn()
                if y is not None:
                    y.asnumpy()
                each.append(time.perf_counter() - t0)
            times[name] = statistics.median(each)

        timed("ring_shift", lambda: p2p.ring_shift(x, g, 1, check=False))
        timed("ring_shift_checked", lambda: p2p.ring_shift(x, g, 1))  # + the shape/dtype sum
        if pair is not None:  # stages 0 and 1 only: the stage send and the bare pair all-reduce
            if i == 0:
                timed("stage_send", lambda: p2p.send_forward(x, check=False))
            else:
                timed("stage_send", lambda: p2p.recv_forward((n,), ms.float32, check=False))
            timed("bare_pair_all_reduce", lambda: all_reduce(x, pair))
            timed("bare_pair_all_gather", lambda: all_gather(x, pair))
        # The same bytes over the whole pp group: the collective a shift of the group is
        # weighed against, and its two pair phases issued at once (async) to see whether
        # the CPU backend overlaps them.
        timed("bare_group_all_reduce", lambda: all_reduce(x, g))
        try:
            times["async_two_pairs"] = _async_two_pairs(g, x, iters, warmup)
        except Exception as err:  # noqa: BLE001 - a probe: report, don't fail the launch
            times["async_two_pairs_error"] = f"{type(err).__name__}: {err}"[:200]
        records.append({"check": "bench.p2p_cost", "group": "pp", "bytes": size, "stage": i,
                        "times_s": times, "passed": True, "max_error": 0.0})
    return records
