"""Cost of the nine communication mappings vs the bare collectives they wrap (4 ranks).

Requirement measured: "On 4 ranks with 16 MiB tensors: each mapping's time divided by
the bare collective it wraps (<= 1.10x wanted); the CPU compositions' cost relative to
all-reduce / all-gather of the same tensor."

Run (by hand; a benchmark, not a test; ~3-5 min on the 2-core CPU machine):

    python bench/bench_mappings.py [--size-mib 16] [--iters 1] [--repeats 4] [--warmup 1]

One msrun launch through the harness launcher starts 4 ranks; each rank runs the check
``bench.mappings`` of ``bench/mapping_bench_checks.py`` (tp = 4, so the group of
interest holds all 4 ranks). See that module for the size convention and the timing
method. This script prints markdown tables: per row the slowest rank's time (max over
ranks per round, then the median over rounds, as nccl-tests keeps the slowest rank),
the ratio of the two medians, the range of the per-round ratio, and each rank's own
ratio.

Four ranks on 2 cores are CPU-oversubscribed: single timings are noisy (rounds can
differ by 10-30 %), so read ratios together with their range, and rerun when the
machine is busy (the load average before and after is printed).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BENCH = Path(__file__).resolve().parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from mindscience.distributed.harness import launch  # noqa: E402  (no MindSpore import)

CHECK = "bench.mappings"
MODULE = "mapping_bench_checks"
TARGET_RATIO = 1.10


def _version(pkg: str) -> str:
    try:
        return importlib.metadata.version(pkg)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def _loadavg() -> str:
    try:
        with open("/proc/loadavg", encoding="utf-8") as fh:
            return " ".join(fh.read().split()[:3])
    except OSError:
        return "n/a"


def slowest_median(records, key):
    """Median over steps of the slowest rank's time: ``records`` are the ranks' records of
    one case, each with a per-step list under ``key``."""
    n = len(records[0][key])
    return statistics.median(max(r[key][i] for r in records) for i in range(n))


def run_bench_launch(spec, world_size: int, timeout: float, progress_every_s: float = 30):
    """One msrun launch of ``spec`` with bench/ and tests/ on the workers' PYTHONPATH (for
    the spec's check ``modules``: the examples' checks are tests/_examples_checks.py), a
    progress line on stderr every ``progress_every_s``.

    Returns ``(result, wall_s, load_after)``, or None after printing the failures.
    """
    paths = (str(BENCH), str(BENCH.parent / "tests"), os.environ.get("PYTHONPATH", ""))
    env = {"PYTHONPATH": os.pathsep.join(p for p in paths if p)}
    last = [0.0]

    def progress(snap):
        now = time.time()
        if now - last[0] >= progress_every_s or snap.get("finished"):
            last[0] = now
            cur = {r: (s or {}).get("current") for r, s in (snap.get("ranks") or {}).items()}
            print(f"[{snap.get('elapsed_s', 0):6.0f} s] load {_loadavg()} {cur}", file=sys.stderr, flush=True)

    t0 = time.perf_counter()
    result = launch(spec, world_size, timeout=timeout, env=env, on_progress=progress)
    wall = time.perf_counter() - t0
    load_after = _loadavg()
    if not result.ok:
        print(f"launch failed (log dir {result.log_dir}):", file=sys.stderr)
        for f in result.failures:
            print(f"  rank {f['rank']} {f['kind']}: {f['reason']}\n{f.get('log_tail', '')}", file=sys.stderr)
        return None
    return result, wall, load_after


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as fh:
            for line in fh:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "n/a"


def _nproc() -> str:
    try:
        return subprocess.run(["nproc"], capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return str(os.cpu_count())


def _fmt(v, digits=1) -> str:
    return "-" if v is None else f"{v:.{digits}f}"


def aggregate(ranks: dict) -> list[dict]:
    """One row per measurement: slowest rank per round, medians, ratios, per-rank ratios."""
    rows: dict = {}
    order = []
    for rank in sorted(ranks):
        state = ranks[rank] or {}
        for rec in state.get("records", []):
            if "t_map" not in rec:
                continue
            key = (rec["section"], rec["mapping"], rec["what"])
            if key not in rows:
                rows[key] = {"section": key[0], "mapping": key[1], "what": key[2],
                             "per_rank": {}, "max_error": None}
                order.append(key)
            row = rows[key]
            row["per_rank"][rank] = (rec["t_map"], rec["t_bare"])
            if rec.get("max_error") is not None:
                row["max_error"] = max(row["max_error"] or 0.0, rec["max_error"])
    out = []
    for key in order:
        row = rows[key]
        per_rank = row["per_rank"]
        n = min(len(t[0]) for t in per_rank.values())
        slow_map = [max(t[0][i] for t in per_rank.values()) for i in range(n)]
        slow_bare = [max(t[1][i] for t in per_rank.values()) for i in range(n)]
        med_map, med_bare = statistics.median(slow_map), statistics.median(slow_bare)
        round_ratios = [a / b for a, b in zip(slow_map, slow_bare) if b > 0]
        row.update(
            map_ms=med_map,
            bare_ms=med_bare,
            ratio=med_map / med_bare if med_bare > 0 else None,
            ratio_lo=min(round_ratios) if round_ratios else None,
            ratio_hi=max(round_ratios) if round_ratios else None,
            rank_ratios={r: statistics.median(t[0]) / statistics.median(t[1])
                         for r, t in per_rank.items() if statistics.median(t[1]) > 0},
            rank_map_ms={r: statistics.median(t[0]) for r, t in per_rank.items()},
            rank_bare_ms={r: statistics.median(t[1]) for r, t in per_rank.items()},
        )
        out.append(row)
    return out


def render(rows: list[dict], world: int) -> str:
    ranks = list(range(world))
    rank_cols = "/".join(f"r{r}" for r in ranks)
    lines = []

    def emit(title, head_map, head_bare, section, intro):
        sel = [r for r in rows if r["section"] == section]
        if not sel:
            return
        lines.append(f"### {title}\n")
        lines.append(intro + "\n")
        lines.append(f"| mapping | what | {head_map} ms | {head_bare} ms | ratio | ratio range over rounds "
                     f"| per-rank ratio {rank_cols} | max abs diff |")
        lines.append("|---|---|---|---|---|---|---|---|")
        for r in sel:
            per = " / ".join(_fmt(r["rank_ratios"].get(k), 3) for k in ranks)
            diff = "-" if r["max_error"] is None else f"{r['max_error']:g}"
            lines.append(
                f"| {r['mapping']} | {r['what']} | {_fmt(r['map_ms'])} | {_fmt(r['bare_ms'])} | "
                f"**{_fmt(r['ratio'], 3)}** | {_fmt(r['ratio_lo'], 3)}-{_fmt(r['ratio_hi'], 3)} | {per} | {diff} |"
            )
        lines.append("")

    emit("(a) forward: mapping vs the bare collective it wraps", "mapping", "bare", "a",
         "bare = the `collectives` call the mapping's forward makes (for the three local "
         "mappings: the identity / `own_slice`, no communication; their ratio is not a "
         "communication overhead). max abs diff: mapping output vs bare output.")
    emit("(b) forward+backward: `ms.grad` of sum(mapping(x)*c) vs the same collectives by hand",
         "ms.grad", "by hand", "b",
         "by hand = forward collective, the same loss `(out*c).sum()`, dy = ones*c (d loss / d out, "
         "the two kernels autograd runs for it), backward collective applied to dy; no autograd. "
         "The first row is the loss alone (no mapping): autograd's own cost. "
         "max abs diff: grad vs by-hand dx.")
    emit("(c) compositions and alternatives", "first", "second", "c",
         "ratio = first / second, both from `what`. `C` = mindscience.distributed.collectives, "
         "`md` = mindspore.mint.distributed.")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-mib", type=float, default=16.0)
    parser.add_argument("--iters", type=int, default=1,
                        help="timed calls per round (1: every call is isolated by barrier + sync)")
    parser.add_argument("--repeats", type=int, default=4, help="rounds per measurement (median)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed calls of each side first")
    parser.add_argument("--sections", default="abc", help="subset of 'abc'")
    parser.add_argument("--world-size", type=int, default=4)
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds for the whole launch")
    parser.add_argument("--json", help="also write the raw per-rank records here")
    args = parser.parse_args(argv)

    command = "python bench/bench_mappings.py " + " ".join(shlex.quote(a) for a in (argv or sys.argv[1:]))
    load_before = _loadavg()
    spec = {
        "checks": [{"name": CHECK, "params": {
            "size_mib": args.size_mib, "iters": args.iters, "repeats": args.repeats,
            "warmup": args.warmup, "sections": args.sections}}],
        "modules": [MODULE],
    }
    launched = run_bench_launch(spec, args.world_size, args.timeout)
    if launched is None:
        return 1
    result, wall, load_after = launched
    if args.json:
        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump({r: (s or {}).get("records") for r, s in result.ranks.items()}, fh, indent=1)

    rows = aggregate(result.ranks)
    any_state = next(iter(result.ranks.values()))
    recs = any_state["records"]
    S = next(r["S"] for r in recs if "S" in r)
    H = next(r["H"] for r in recs if "H" in r)
    G = next(r["G"] for r in recs if "G" in r)
    sanity = [((s or {}).get("records") or [])[-1] for s in result.ranks.values()]
    timings = {r: (s or {}).get("timings", {}) for r, s in result.ranks.items()}

    print(f"## Mapping overhead, {G} ranks, {args.size_mib:g} MiB float32 (S, H) = ({S}, {H})\n")
    print(f"command: `{command.strip()}`  ")
    print(f"machine: nproc {_nproc()} ({_cpu_model()}), python {platform.python_version()}, "
          f"mindspore {_version('mindspore')}, numpy {_version('numpy')}; one msrun launch, "
          f"{args.world_size} ranks, group tp={G}  ")
    print(f"load average (1/5/15 min) before: {load_before}; after: {load_after}  ")
    print(f"launch wall time {wall:.0f} s; per rank: "
          + ", ".join(f"r{r} init {t.get('init_s', '?')} s, bench "
                      f"{sum(c['s'] for c in t.get('checks', [])):.0f} s" for r, t in sorted(timings.items())))
    print(f"timing: {args.warmup} warm-up call(s) per side, then {args.repeats} rounds x {args.iters} "
          "calls per side (A/B order alternating), barrier before each timed loop, "
          "`mindspore.runtime.synchronize()` after it; ms = mean per call of the slowest rank, "
          "median over rounds. 4 ranks on 2 cores: noisy, read the ratio range.  ")
    print(f"sizes (nccl-tests convention, F = the {args.size_mib:g} MiB tensor (S, H)): all_reduce F in/out; "
          "reduce_scatter F in -> F/G out; all_gather F/G in -> F out (gathered OUTPUT = F); "
          f"all_to_all F sent per rank (the CPU composition all-gathers G*F = {G * args.size_mib:g} MiB).  ")
    print("input intact after all in-place calls on every rank: "
          + str(all(s.get("passed") for s in sanity)) + "\n")
    print(render(rows, args.world_size))
    comm_a = [r for r in rows if r["section"] == "a" and "no comm" not in r["what"]]
    worst = max(comm_a, key=lambda r: r["ratio"]) if comm_a else None
    if worst:
        met = all(r["ratio"] <= TARGET_RATIO for r in comm_a)
        print(f"forward mappings that communicate: worst ratio {worst['ratio']:.3f} ({worst['mapping']}); "
              f"<= {TARGET_RATIO:.2f}x {'met' if met else 'NOT met'} by all.")
    b = [r for r in rows if r["section"] == "b" and "no comm" not in r["what"]]
    if b:
        worst_b = max(b, key=lambda r: r["ratio"])
        print(f"forward+backward: worst ratio {worst_b['ratio']:.3f} ({worst_b['mapping']}); "
              f"<= {TARGET_RATIO:.2f}x {'met' if all(r['ratio'] <= TARGET_RATIO for r in b) else 'NOT met'} by all.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
