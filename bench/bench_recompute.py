"""Pipeline step with kept vs recomputed stage activations (GPipe, PyNative).

    flock /tmp/msdist-mp.lock python bench/bench_recompute.py [--layers 4 --dim 512 --batch 256 -m 8]

Two ranks (pp = 2), each stage ``layers`` x (``dim`` x ``dim`` matmul + tanh), ``-m``
micro-batches of ``batch`` rows: ``forward_backward(..., schedule="gpipe",
recompute="full")`` and ``recompute="none"`` (kept forwards) step by step in turn, median
step time per rank, the parameter bytes and the activation bytes a non-last stage holds
at the peak, counted (full: one stage input per micro-batch; kept: every matmul input and
tanh output), and the ranks' peak RSS after full-only warm-up steps, then after the kept
steps. Prints markdown.
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
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--dim", type=int, default=512)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("-m", "--microbatches", type=int, default=8)
    parser.add_argument("--steps", type=int, default=6)
    args = parser.parse_args(argv)
    spec = {"layout": {"world_size": 2, "pp": 2}, "modules": ["recompute_bench_checks"],
            "checks": [{"name": "bench.recompute_step", "params": {
                "layers": args.layers, "dim": args.dim, "batch": args.batch,
                "microbatches": args.microbatches, "steps": args.steps}}]}
    out = run_bench_launch(spec, 2, timeout=900)
    if out is None:
        return 1
    result, wall, load = out
    recs = [r for rank in range(2) for r in (result.ranks[rank] or {}).get("records", [])]
    print(f"## GPipe step, pp = 2, {args.layers} x {args.dim}^2 per stage, m = {args.microbatches}"
          f" x {args.batch} rows (launch {wall:.0f} s, load after {load})\n")
    print("| recompute | stage | median step s | min step s | parameter MiB | kept activations "
          "MiB (peak, counted) | peak RSS MiB |")
    print("|---|---|---|---|---|---|---|")
    for r in recs:
        kept = "-" if r["kept_bytes_peak"] is None else f"{r['kept_bytes_peak'] / 2**20:.1f}"
        print(f"| {r['recompute']} | {r['stage']} | {r['step_s_median']:.3f} | {r['step_s_min']:.3f} "
              f"| {r['param_bytes'] / 2**20:.1f} | {kept} | {r['max_rss_mib']:.0f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
