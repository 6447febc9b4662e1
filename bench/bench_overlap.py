"""Gradient-reduction overlap (``DistributedOptimizer(overlap_grad_reduce=True)``) at dp4.

Run (by hand; a benchmark, not a test):

    python bench/bench_overlap.py [--steps 6] [--model tiny-gpt] [--bucket-mb 0.5]

One 4-rank msrun launch (the harness worker: PyNative with ``pynative_synchronize=True``
on CPU, as the test ranks run); this file is also the check module the workers import:

(a) ``bench.overlap_step``: GPTModel (fp32, PyNative, 2 micro-batches) at dp4 (``--world``),
    ZeRO stage 0 and 1, ``GPTModel.forward_backward(..., optimizer=opt)`` + ``opt(grads)``, with
    and without ``overlap_grad_reduce`` (two models, their steps interleaved),
    ``--bucket-mb`` MiB buckets. Per step: the time of
    the forward+backward and of the optimizer call, and for each launched bucket when its
    reduction was launched and when the step's wait on it returned, relative to the end
    of the backward (negative: during the backward). Without overlap every reduction
    starts inside the optimizer call, after the backward.
(b) ``bench.overlap_concurrency``: does an asynchronous all-reduce progress while the
    rank computes? 16 MiB ``mint.distributed.all_reduce(async_op=True)``, then ~N matmuls,
    then ``wait()``, against the all-reduce alone and the matmuls alone (median of
    ``--steps`` rounds, slowest rank).

4 ranks on 2 shared cores are oversubscribed: the ratios are what docs/BENCHMARKS.md
("Gradient-reduction overlap") reports, with the command.
"""

from __future__ import annotations

import argparse
import os
import shlex
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BENCH = Path(__file__).resolve().parent
for _p in (str(ROOT), str(BENCH)):
    if _p not in sys.path:
        sys.path.insert(0, _p)

from mindscience.distributed.harness.registry import check  # noqa: E402  (pure)

WORLD = 4  # --world changes it (dp = the world)


@check("bench.overlap_step")
def overlap_step(ctx, model: str = "tiny-gpt", steps: int = 6, warmup: int = 2,
                 stages=(0, 1), bucket_mb: float = 0.5) -> list:
    import mindspore as ms
    import numpy as np

    from mindscience.distributed import manager
    from mindscience.distributed.checkpoint.cell import _barrier, _world
    from mindscience.distributed.harness.checks.groups import layout_label, reinit
    from mindscience.distributed.models import GPTModel, TransformerConfig
    from mindscience.distributed.optimizer import DistributedOptimizer

    lay = reinit(manager, {"tp": 1})
    config = TransformerConfig.from_model_spec(model, precision="fp32")
    rng = np.random.default_rng(0)
    m = 2
    ids = rng.integers(0, config.vocab_size, (m * config.micro_batch_size, config.seq_length))
    ids = ids.astype(np.int32)
    records = []
    for stage in stages:
        # Both models built first, their steps interleaved (plain, overlapped, plain, ...),
        # so that the machine's load drifts over both alike.
        runs = {}
        for flag in (False, True):
            ms.set_seed(0)
            net = GPTModel(config, seed=0)
            opt = DistributedOptimizer(net.trainable_params(), lr=1e-3, zero_stage=stage,
                                       bucket_size_mb=bucket_mb, overlap_grad_reduce=flag)
            runs[flag] = (net, opt, {"fb_s": [], "opt_s": [], "timelines": []})
        for i in range(warmup + steps):
            for flag in (False, True):
                net, opt, out = runs[flag]
                _barrier(_world()[0])
                t0 = time.perf_counter()
                loss, grads = net.forward_backward(ids, ids, m, mode="pynative", optimizer=opt)
                t1 = time.perf_counter()
                opt(grads).asnumpy()
                t2 = time.perf_counter()
                if i >= warmup:
                    out["fb_s"].append(t1 - t0)
                    out["opt_s"].append(t2 - t1)
                    out["timelines"].append([{"bucket": r["bucket"], "launch": r["launched_s"] - t1,
                                              "done": r["done_s"] - t1}
                                             for r in opt.overlap_timeline()])
        weights = {f: [p.asnumpy() for p in runs[f][0].trainable_params()] for f in runs}
        same = all(np.array_equal(a, b) for a, b in zip(weights[False], weights[True]))
        for flag in (False, True):
            records.append({"check": "bench.overlap_step", "group": layout_label(lay),
                            "stage": stage, "overlap": flag, "buckets": len(runs[flag][1].buckets),
                            **runs[flag][2], "bitwise_equal": bool(same),
                            "passed": True, "max_error": 0.0})
    return records


@check("bench.overlap_concurrency")
def overlap_concurrency(ctx, steps: int = 6, mib: int = 16, matmuls: int = 20) -> dict:
    import mindspore as ms
    from mindspore import mint
    from mindspore.mint import distributed as md

    from mindscience.distributed.checkpoint.cell import _barrier, _world

    big = mint.ones(((mib << 20) // 4,), dtype=ms.float32)
    a = mint.ones((512, 512), dtype=ms.float32) * 1e-3

    def compute():
        z = a
        for _ in range(matmuls):
            z = mint.matmul(z, a)
        return float(z.sum().asnumpy())

    rows = {"compute": [], "allreduce": [], "async_plus_compute": [], "launch": []}
    for _ in range(steps + 1):
        _barrier(_world()[0])
        t0 = time.perf_counter()
        compute()
        rows["compute"].append(time.perf_counter() - t0)
        _barrier(_world()[0])
        y = mint.empty(big.shape, dtype=big.dtype).copy_(big)
        t0 = time.perf_counter()
        md.all_reduce(y, "sum")
        float(y[0].asnumpy())
        rows["allreduce"].append(time.perf_counter() - t0)
        _barrier(_world()[0])
        y = mint.empty(big.shape, dtype=big.dtype).copy_(big)
        t0 = time.perf_counter()
        handle = md.all_reduce(y, "sum", async_op=True)
        rows["launch"].append(time.perf_counter() - t0)
        compute()
        handle.wait()
        float(y[0].asnumpy())
        rows["async_plus_compute"].append(time.perf_counter() - t0)
    return {"check": "bench.overlap_concurrency", "group": "world",
            "rows": {k: v[1:] for k, v in rows.items()}, "passed": True, "max_error": 0.0}


# ----------------------------------------------------------------------------- report
def main(argv=None) -> int:
    from bench_mappings import _loadavg, run_bench_launch, slowest_median

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--model", default="tiny-gpt")
    parser.add_argument("--bucket-mb", type=float, default=0.5)
    parser.add_argument("--stages", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--timeout", type=float, default=900.0)
    parser.add_argument("--skip-steps", action="store_true", help="only (b), the concurrency probe")
    parser.add_argument("--world", type=int, default=WORLD, help="ranks (all data-parallel)")
    args = parser.parse_args(argv)
    command = "python bench/bench_overlap.py " + " ".join(shlex.quote(a) for a in (argv or sys.argv[1:]))
    checks = [] if args.skip_steps else [
        {"name": "bench.overlap_step", "params": {"model": args.model, "steps": args.steps,
                                                  "stages": args.stages, "bucket_mb": args.bucket_mb}}]
    checks.append({"name": "bench.overlap_concurrency", "params": {"steps": args.steps}})
    spec = {"modules": ["bench_overlap"], "checks": checks}
    load_before = _loadavg()
    launched = run_bench_launch(spec, args.world, args.timeout, progress_every_s=60)
    if launched is None:
        return 1
    result, wall, load_after = launched
    recs = [r for st in result.ranks.values() for r in (st or {}).get("records", [])]
    print(f"command: {command}")
    sync = os.environ.get("MSDIST_PYNATIVE_SYNC", "1") != "0"
    print(f"{args.world} ranks (dp{args.world}), wall {wall:.0f} s, load {load_before} -> {load_after}, "
          f"pynative_synchronize={sync}")
    print()
    step = [r for r in recs if r["check"] == "bench.overlap_step"]
    print(f"(a) {args.model}, fp32, PyNative, 2 micro-batches, {args.bucket_mb} MiB buckets; "
          f"median of {args.steps} steps (plain and overlapped steps interleaved), slowest rank")
    print("| stage | overlap | buckets | forward+backward s | optimizer call s | step s | "
          "launched (s after the backward's end, rank 0, median step) | bit for bit |")
    print("|---|---|---|---|---|---|---|---|")
    for stage in sorted({r["stage"] for r in step}):
        for flag in (False, True):
            sel = [r for r in step if r["stage"] == stage and r["overlap"] == flag]
            fb, op = slowest_median(sel, "fb_s"), slowest_median(sel, "opt_s")
            r0 = min(sel, key=lambda r: r["group"])
            n = len(r0["timelines"])
            if flag and n:
                per_bucket = {}
                for tl in r0["timelines"]:
                    for row in tl:
                        per_bucket.setdefault(row["bucket"], []).append(row["launch"])
                launched = ", ".join(f"b{b}: {statistics.median(v):+.3f}"
                                     for b, v in sorted(per_bucket.items(), key=lambda kv: statistics.median(kv[1])))
            else:
                launched = "all in the optimizer call (>= 0)"
            print(f"| {stage} | {flag} | {sel[0]['buckets']} | {fb:.3f} | {op:.3f} | {fb + op:.3f} | "
                  f"{launched} | {sel[0].get('bitwise_equal')} |")
    conc = [r for r in recs if r["check"] == "bench.overlap_concurrency"]
    if conc:
        print()
        print(f"(b) 16 MiB async all-reduce vs 20 matmuls (512x512), median of {args.steps} rounds, slowest rank")
        keys = ("compute", "allreduce", "launch", "async_plus_compute")
        med = {k: statistics.median(max(r["rows"][k][i] for r in conc)
                                    for i in range(len(conc[0]["rows"][k]))) for k in keys}
        print("| compute s | all-reduce s | launch s | async all-reduce + compute s | "
              "sum of the two alone s | hidden share |")
        print("|---|---|---|---|---|---|")
        total = med["compute"] + med["allreduce"]
        hidden = (total - med["async_plus_compute"]) / min(med["compute"], med["allreduce"])
        print(f"| {med['compute']:.3f} | {med['allreduce']:.3f} | {med['launch']:.3f} | "
              f"{med['async_plus_compute']:.3f} | {total:.3f} | {hidden:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
