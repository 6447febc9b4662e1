"""Pipeline benchmarks: the measured bubble of 1F1B and interleaved, and the cost of p2p.

    flock /tmp/msdist-mp.lock python bench/bench_pipeline.py [--stages 4] [--json out.json]

1. ``bench.pipeline_bubble`` on ``--stages`` pipeline ranks (one CPU rank each): the idle
   fraction of every stage per step (1 - time in F/B / step wall time, each step ended by
   a device synchronization), for 1F1B and interleaved (v = 2) at m = 4, 8, 16, against
   the model: idle/compute = (p - 1) / (v m), i.e. an idle fraction of
   (p - 1) / (v m + p - 1); and against the schedule's own simulation (F = 1, B = 2 units).
2. ``bench.p2p_cost``: ``ring_shift`` over the pp group against a bare all-reduce of the
   same bytes over that group, and (a probe) its two pair phases issued at once with
   ``async_op=True``; a stage send (send_forward / recv_forward) between stages 0 and 1
   against a bare all-reduce / all-gather of the same bytes over the same 2-rank pair.
   ``--only p2p`` runs just this.
Prints markdown.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))

from bench_mappings import run_bench_launch  # noqa: E402


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stages", type=int, default=4)
    parser.add_argument("--microbatches", default="4,8,16")
    parser.add_argument("--dim", type=int, default=1024)
    parser.add_argument("--json", default=None)
    parser.add_argument("--only", choices=("bubble", "p2p"), default=None,
                        help="run one of the two benchmarks (default both)")
    args = parser.parse_args(argv)
    from mindscience.distributed.pipeline import build, theoretical_bubble

    ms_ = [int(m) for m in args.microbatches.split(",")]
    spec = {"layout": {"world_size": args.stages, "pp": args.stages},
            "modules": ["pipeline_bench_checks"],
            "checks": [{"name": "bench.pipeline_bubble", "params": {"microbatches": ms_, "dim": args.dim, "batch": 64}},
                       {"name": "bench.p2p_cost", "params": {}}]}
    if args.only:
        want = {"bubble": "bench.pipeline_bubble", "p2p": "bench.p2p_cost"}[args.only]
        spec["checks"] = [c for c in spec["checks"] if c["name"] == want]
    out = run_bench_launch(spec, args.stages, timeout=1500)
    if out is None:
        return 1
    result, wall, load = out
    recs = [r for rank in range(args.stages) for r in (result.ranks[rank] or {}).get("records", [])]
    p = args.stages
    print(f"## Pipeline bubble, {p} stages (one CPU rank each), launch {wall:.0f} s, load after {load}\n")
    print("| schedule | m | v | idle per stage (measured) | mean | simulated | model (p-1)/(vm+p-1) | step s |")
    print("|---|---|---|---|---|---|---|---|")
    rows = {}
    for r in recs:
        if r["check"] == "bench.pipeline_bubble":
            rows.setdefault((r["schedule"], r["microbatches"], r["virtual_stages"]), {})[r["stage"]] = r
    table = []
    for (schedule, m, v), per in sorted(rows.items()):
        idle = [per[s]["idle_fraction"] for s in sorted(per)]
        sim = build(schedule, p, m, v).bubble_fraction
        ratio = theoretical_bubble(p, m, v)
        model = ratio / (1 + ratio)
        step = max(per[s]["step_s"] for s in per)
        table.append({"schedule": schedule, "m": m, "v": v, "idle": idle, "simulated": sim,
                      "model": model, "step_s": step})
        print(f"| {schedule} | {m} | {v} | {' / '.join(f'{x:.2f}' for x in idle)} | "
              f"{statistics.mean(idle):.3f} | {sim:.3f} | {model:.3f} | {step:.3f} |")
    print("\n## p2p cost (median of 20 calls, after 3 warm-ups; slowest rank)\n")
    print(f"| bytes | ring_shift ({p} ranks) ms | bare {p}-rank all-reduce ms | ring_shift / bare | "
          "checked ring_shift ms | async two pairs ms | stage send ms | bare pair all-reduce ms | "
          "stage send / bare | bare pair all-gather ms |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    cost, errors = {}, set()
    for r in recs:
        if r["check"] == "bench.p2p_cost":
            c = cost.setdefault(r["bytes"], {})
            for k, t in r["times_s"].items():
                if isinstance(t, str):
                    errors.add(t)
                else:
                    c[k] = max(c.get(k, 0.0), t)
    for size, c in sorted(cost.items()):
        ms_of = lambda k: f"{c[k] * 1e3:.2f}" if k in c else "-"  # noqa: E731
        print(f"| {size} | {ms_of('ring_shift')} | {ms_of('bare_group_all_reduce')} | "
              f"{c['ring_shift'] / c['bare_group_all_reduce']:.2f} | {ms_of('ring_shift_checked')} | "
              f"{ms_of('async_two_pairs')} | "
              f"{ms_of('stage_send')} | {ms_of('bare_pair_all_reduce')} | "
              f"{c['stage_send'] / c['bare_pair_all_reduce']:.2f} | {ms_of('bare_pair_all_gather')} |")
    for err in sorted(errors):
        print(f"\nasync two pairs failed: {err}")
    if args.json:
        Path(args.json).write_text(json.dumps({"bubble": table, "p2p": cost}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
