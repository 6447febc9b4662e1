"""ZeRO benchmarks: bytes each rank holds per stage vs the cost model, and step times.

Run (by hand; a benchmark, not a test):

    python bench/bench_zero.py [--steps 6] [--model tiny-gpt]

One 4-rank msrun launch; this file is also the check module the workers import
(``bench.zero_memory``, ``bench.zero_step``):

(a) memory: for the GPTModel preset (default tiny-gpt) at dp4 and tp2 x dp2, in fp32 and
    bf16, and ZeRO stages 0-3 (stage 3 after ``fully_shard``): the bytes of weights,
    gradient buffers and optimizer state each rank holds, from the Parameters
    (``DistributedOptimizer.memory_bytes()``), against the cost model's
    ``costmodel.memory.bytes_per_parameter(precision, stage, d)`` times the rank's local
    parameter count (contract C2; padding is the difference).
(b) step time at dp4, fp32, PyNative: ``model.forward_backward`` + ``opt(grads)`` per
    stage; the median over ``--steps`` steps after 2 warm-up steps of the slowest rank's
    time, the optimizer call alone and the whole step.

4 ranks on 2 shared cores are oversubscribed: absolute times are dominated by that; the
ratios to stage 0 are what docs/BENCHMARKS.md ("DistributedOptimizer (ZeRO stages 0-3)") reports.
"""

from __future__ import annotations

import argparse
import shlex
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BENCH = Path(__file__).resolve().parent
for _p in (str(ROOT), str(BENCH)):
    if _p not in sys.path:
        sys.path.insert(0, _p)

from mindscience.distributed.harness.registry import check  # noqa: E402  (pure)

WORLD = 4
LAYOUTS = ({"tp": 1}, {"tp": 2})
PRECISIONS = ("fp32", "bf16")


def _build(model_name: str, precision: str, stage: int):
    import mindspore as ms

    from mindscience.distributed.models import GPTModel, TransformerConfig
    from mindscience.distributed.optimizer import DistributedOptimizer

    config = TransformerConfig.from_model_spec(model_name, precision=precision)
    ms.set_seed(0)
    model = GPTModel(config)
    if stage == 3:
        from mindscience.distributed.fsdp import fully_shard

        fully_shard(model)
    opt = DistributedOptimizer(model.trainable_params(), lr=1e-3, zero_stage=stage)
    return config, model, opt


def _local_params(model) -> int:
    """Elements of this rank's parameters after the tp/pp split (before any ZeRO shard)."""
    n = 0
    for p in model.trainable_params():
        shape = p.fsdp.full_shape if getattr(p, "fsdp", None) is not None else p.shape
        count = 1
        for s in shape:
            count *= int(s)
        n += count
    return n


@check("bench.zero_memory")
def zero_memory(ctx, model: str = "tiny-gpt") -> list:
    from mindscience.distributed import manager
    from mindscience.distributed.costmodel.memory import bytes_per_parameter
    from mindscience.distributed.harness.checks.groups import layout_label, reinit

    records = []
    for layout in LAYOUTS:
        lay = reinit(manager, layout)
        for precision in PRECISIONS:
            for stage in range(4):
                _, net, opt = _build(model, precision, stage)
                held = opt.memory_bytes()
                n = _local_params(net)
                per = bytes_per_parameter(precision, stage, opt.d)
                priced = {k: per[k] * n for k in ("weights", "gradients", "optimizer")}
                records.append({
                    "check": "bench.zero_memory", "group": layout_label(lay), "layout": layout_label(lay),
                    "precision": precision, "stage": stage, "d": opt.d, "params": n,
                    "held": held, "priced": priced,
                    "ratio": sum(held.values()) / sum(priced.values()),
                    "passed": True, "max_error": 0.0,
                })
    return records


@check("bench.zero_step")
def zero_step(ctx, model: str = "tiny-gpt", steps: int = 6, warmup: int = 2,
              stages=(0, 1, 2, 3)) -> list:
    import numpy as np

    from mindscience.distributed import manager
    from mindscience.distributed.checkpoint.cell import _barrier, _world
    from mindscience.distributed.harness.checks.groups import layout_label, reinit

    lay = reinit(manager, {"tp": 1})
    records = []
    for stage in stages:
        config, net, opt = _build(model, "fp32", stage)
        rng = np.random.default_rng(0)
        rows = config.micro_batch_size
        ids = rng.integers(0, config.vocab_size, (rows, config.seq_length)).astype(np.int32)
        fb_s, opt_s, losses = [], [], []
        for i in range(warmup + steps):
            _barrier(_world()[0])
            t0 = time.perf_counter()
            loss, grads = net.forward_backward(ids, ids, 1, mode="pynative")
            t1 = time.perf_counter()
            out = opt(grads)
            out.asnumpy()  # wait for the step
            t2 = time.perf_counter()
            losses.append(float(loss.asnumpy()))
            if i >= warmup:
                fb_s.append(t1 - t0)
                opt_s.append(t2 - t1)
        records.append({"check": "bench.zero_step", "group": layout_label(lay), "stage": stage,
                        "d": opt.d, "fb_s": fb_s, "opt_s": opt_s, "losses": losses,
                        "memory": opt.memory_bytes(), "passed": bool(losses[-1] < losses[0]),
                        "max_error": 0.0})
    return records


# ----------------------------------------------------------------------------- report
def main(argv=None) -> int:
    from bench_mappings import _loadavg, run_bench_launch, slowest_median

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--model", default="tiny-gpt")
    parser.add_argument("--timeout", type=float, default=900.0)
    parser.add_argument("--skip-steps", action="store_true", help="only the memory table")
    parser.add_argument("--skip-memory", action="store_true", help="only the step times")
    parser.add_argument("--step-stages", type=int, nargs="+", default=[0, 1, 2, 3])
    args = parser.parse_args(argv)
    command = "python bench/bench_zero.py " + " ".join(shlex.quote(a) for a in (argv or sys.argv[1:]))
    checks = [] if args.skip_memory else [{"name": "bench.zero_memory", "params": {"model": args.model}}]
    if not args.skip_steps:
        checks.append({"name": "bench.zero_step", "params": {"model": args.model, "steps": args.steps,
                                                             "stages": args.step_stages}})
    spec = {"checks": checks, "modules": ["bench_zero"]}
    load_before = _loadavg()
    launched = run_bench_launch(spec, WORLD, args.timeout, progress_every_s=60)
    if launched is None:
        return 1
    result, wall, load_after = launched
    recs = [r for st in result.ranks.values() for r in (st or {}).get("records", [])]
    print(f"command: {command}")
    print(f"{WORLD} ranks, wall {wall:.0f} s, load {load_before} -> {load_after}")
    print()
    print(f"(a) bytes a rank holds, {args.model} (largest over ranks), vs the cost model (C2 x local params)")
    print("| layout | precision | stage | d | local params | weights | gradients | optimizer | "
          "total | cost model | held / priced |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    mem = [r for r in recs if r["check"] == "bench.zero_memory"]
    if not mem:
        print("(memory table skipped)")
    keys = sorted({(r["layout"], r["precision"], r["stage"]) for r in mem})
    for layout, precision, stage in keys:
        sel = [r for r in mem if (r["layout"], r["precision"], r["stage"]) == (layout, precision, stage)]
        r = max(sel, key=lambda x: sum(x["held"].values()))
        h, p = r["held"], r["priced"]
        print(f"| {layout.split(':')[0]} | {precision} | {stage} | {r['d']} | {r['params']:,} | "
              f"{h['weights']:,} | {h['gradients']:,} | {h['optimizer']:,} | {sum(h.values()):,} | "
              f"{sum(p.values()):,.0f} | {r['ratio']:.4f} |")
    if mem:
        worst = max(abs(r["ratio"] - 1) for r in mem)
        print(f"largest |held / priced - 1| over every rank: {worst:.4f}")
    step = [r for r in recs if r["check"] == "bench.zero_step"]
    if step:
        print()
        print(f"(b) step time at dp4, fp32, PyNative, median of {args.steps} steps (slowest rank)")
        print("| stage | forward+backward s | optimizer call s | step s | step vs stage 0 | bytes held |")
        print("|---|---|---|---|---|---|")
        base = None
        for stage in sorted({r["stage"] for r in step}):
            sel = [r for r in step if r["stage"] == stage]
            fb, op = slowest_median(sel, "fb_s"), slowest_median(sel, "opt_s")
            total = fb + op
            base = total if base is None else base
            held = max(sum(r["memory"].values()) for r in sel)
            print(f"| {stage} | {fb:.3f} | {op:.3f} | {total:.3f} | {total / base:.2f}x | {held:,} |")
        print(f"every stage trained (loss fell): {all(r['passed'] for r in step)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
