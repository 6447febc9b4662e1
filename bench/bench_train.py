"""Training benchmarks (issue 8): the example's train step jit vs PyNative, and
GradientFinalizer bucketed vs per tensor.

Run (by hand; a benchmark, not a test):

    python bench/bench_train.py [--steps 8] [--num-params 120] [--world-size 8]

One msrun launch (8 ranks, tp2 x cp2 x dp2) runs, in order:

* ``bench.finalize`` (bench/train_bench_checks.py): ``num_params`` gradients (float32,
  a third marked sequence_parallel), ``GradientFinalizer(bucket_size_mb=0)`` (one
  all-reduce per tensor) vs the default 32 MiB buckets, PyNative and ``ms.jit``; per
  row the slowest rank's median time per call;
* ``examples.inside_train_transformer`` (the hand-wired block) with ``--steps`` steps:
  the median step time (after the first, compiling, step) of the jit-compiled and of
  the PyNative train step, and their loss curves' agreement with the dense model.

8 ranks on 2 cores are oversubscribed: absolute times are dominated by that; the ratios
are what the figures in docs/BENCHMARKS.md report.
"""

from __future__ import annotations

import argparse
import shlex
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BENCH = Path(__file__).resolve().parent
for p in (str(ROOT), str(BENCH)):
    if p not in sys.path:
        sys.path.insert(0, p)

from bench_mappings import _loadavg, run_bench_launch  # noqa: E402  (no MindSpore import)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--num-params", type=int, default=120)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--world-size", type=int, default=8)
    parser.add_argument("--timeout", type=float, default=900.0)
    args = parser.parse_args(argv)
    command = "python bench/bench_train.py " + " ".join(shlex.quote(a) for a in (argv or sys.argv[1:]))
    spec = {
        "layout": {"world_size": args.world_size, "tp": 2, "cp": 2},
        "checks": [
            {"name": "bench.finalize", "params": {"num_params": args.num_params, "hidden": args.hidden}},
            {"name": "examples.inside_train_transformer", "params": {"tp": 2, "cp": 2, "steps": args.steps}},
        ],
        "modules": ["train_bench_checks", "_examples_checks"],
    }
    load_before = _loadavg()
    launched = run_bench_launch(spec, args.world_size, args.timeout, progress_every_s=60)
    if launched is None:
        return 1
    result, wall, load_after = launched
    recs = [r for st in result.ranks.values() for r in (st or {}).get("records", [])]
    print(f"command: {command}")
    print(f"{args.world_size} ranks, wall {wall:.0f} s, load {load_before} -> {load_after}")
    print()
    print("GradientFinalizer, slowest rank's median time per call")
    print("| mode | buckets (tp, dp-cp) | params | MiB | per call ms | vs per-tensor |")
    print("|---|---|---|---|---|---|")
    fin = [r for r in recs if r["check"] == "bench.finalize"]
    rows = {}
    for mode in ("pynative", "jit"):
        for mb in (0, 32.0):
            sel = [r for r in fin if r["mode"] == mode and r["bucket_size_mb"] == mb]
            if not sel:
                continue
            n_rounds = len(sel[0]["round_s"])
            slowest = [max(r["round_s"][i] for r in sel) for i in range(n_rounds)]
            rows[(mode, mb)] = (statistics.median(slowest), sel[0])
    for (mode, mb), (t, r) in rows.items():
        base = rows.get((mode, 0), (t,))[0]
        label = "per tensor" if mb == 0 else f"{mb:g} MiB"
        print(f"| {mode} | {label}: {r['buckets']} | {r['num_params']} | {r['bytes'] / 2**20:.2f} | "
              f"{t * 1e3:.1f} | {base / t:.1f}x faster |" if mb else
              f"| {mode} | {label}: {r['buckets']} | {r['num_params']} | {r['bytes'] / 2**20:.2f} | "
              f"{t * 1e3:.1f} | 1.0x |")
    train = [r for r in recs if r["check"] == "examples.inside_train_transformer"]
    if train:
        jit = max(r["jit_step_s"] for r in train)
        eager = max(r["pynative_step_s"] for r in train)
        print()
        print("examples/inside_train_transformer.py, median step time (slowest rank, steps after the first)")
        print("| step | median s | |")
        print("|---|---|---|")
        print(f"| jit (value_and_grad + GradientFinalizer + AdamW compiled) | {jit:.3f} | |")
        print(f"| PyNative | {eager:.3f} | |")
        print(f"| ratio jit / PyNative | {jit / eager:.2f} | (compiled {eager / jit:.2f}x faster) |")
        print(f"loss vs dense (rel): jit {max(r['errors']['jit loss vs dense (rel)'] for r in train):.1e}, "
              f"PyNative {max(r['errors']['pynative loss vs dense (rel)'] for r in train):.1e}; "
              f"passed on every rank: {all(r['passed'] for r in train)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
