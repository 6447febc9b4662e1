"""Pipeline step time with the stage forwards kept vs recomputed (tiny-gpt, 4 CPU ranks).

    flock /tmp/msdist-mp.lock python bench/bench_pipeline_kept.py [--pp 2,4] [-m 8] [--mode pynative]

For each ``--pp`` (pp2 x dp2 and pp4 on 4 ranks): GPTModel("tiny-gpt")'s stages through
``pipeline.forward_backward`` (1F1B, ``-m`` micro-batches of 2 sequences), a step with
``recompute="none"`` (kept stage forwards) and one with ``"full"`` (each stage but the last
re-runs its forward in the backward) in turn, ``--steps`` each after a warm-up; the median
step time of the slowest rank for each, and kept / full. Both give the same loss (checked).
One launch per run; prints markdown.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))

from bench_mappings import run_bench_launch  # noqa: E402


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pp", default="2,4")
    parser.add_argument("-m", "--microbatches", type=int, default=8)
    parser.add_argument("--mode", default="pynative", choices=("pynative", "jit"))
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--tp", type=int, default=1, help="tp x pp (x dp) on the 4 ranks")
    args = parser.parse_args(argv)
    world = 4
    checks = [{"name": "bench.pipeline_kept", "params": {
        "layout": {"tp": args.tp, "pp": int(p)}, "microbatches": args.microbatches, "mode": args.mode,
        "steps": args.steps}} for p in args.pp.split(",")]
    spec = {"layout": {"world_size": world}, "modules": ["pipeline_kept_bench_checks"],
            "checks": checks}
    out = run_bench_launch(spec, world, timeout=1500)
    if out is None:
        return 1
    result, wall, load = out
    recs = [r for rank in range(world) for r in (result.ranks[rank] or {}).get("records", [])]
    print(f"## tiny-gpt pipeline step, kept vs recomputed stage forwards, 4 CPU ranks, "
          f"{args.mode}, m = {args.microbatches} (launch {wall:.0f} s, load after {load})\n")
    print("| layout | kept step s (median, slowest rank) | recompute step s | kept / recompute "
          "| same loss |")
    print("|---|---|---|---|---|")
    for p in sorted({r["pp"] for r in recs}):
        mine = [r for r in recs if r["pp"] == p]
        kept = max(r["kept_s"] for r in mine)
        full = max(r["full_s"] for r in mine)
        same = all(r["passed"] for r in mine)
        dp = world // (p * args.tp)
        name = (f"tp{args.tp} x " if args.tp > 1 else "") + (f"pp{p} x dp{dp}" if dp > 1 else f"pp{p}")
        print(f"| {name} | {kept:.3f} | {full:.3f} | {kept / full:.2f} | {same} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
