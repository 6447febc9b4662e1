"""Execution modes and uneven sequences: compiled vs eager mappings, uneven vs even splits (4 ranks).

Requirements measured (issues 8 and 10):

* each of the nine mappings, forward and forward+backward (``ms.value_and_grad``;
  ``--autograd grad`` for ``ms.grad``, see ``bench/mode_bench_checks.py``), compiled
  (``ms.jit`` of a named function calling the mapping, compiled once before timing)
  vs eager (PyNative): the median time of each and the ratio compiled / eager;
* uneven vs even: gather_from_sequence, reduce_scatter_to_sequence and the two
  all-to-alls with ``S = 4k+1`` (``split_sizes=even_split_sizes(S, 4)``) vs ``S = 4k``
  at 16 MiB, eager (target <= 1.15x) and compiled.

Run (by hand; a benchmark, not a test; ~6 min on the 2-core CPU machine (364 s measured)):

    python bench/bench_modes.py [--size-mib 16] [--repeats 4] [--warmup 1] [--sections abuv]

One msrun launch through the harness launcher starts 4 ranks; each rank runs the check
``bench.modes`` of ``bench/mode_bench_checks.py`` (tp = 4). Size convention and timing
method are those of ``bench/bench_mappings.py`` (see ``bench/mode_bench_checks.py``):
per row the slowest rank's time (max over ranks per round, then the median over
rounds), the ratio of the two medians, the range of the per-round ratio and each
rank's own ratio. The load average before and after is printed: 4 ranks on 2 cores
are oversubscribed, and other jobs on the machine add to the noise.
"""

from __future__ import annotations

import argparse
import json
import platform
import shlex
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BENCH = Path(__file__).resolve().parent
for p in (str(ROOT), str(BENCH)):
    if p not in sys.path:
        sys.path.insert(0, p)

from bench_mappings import (  # noqa: E402
    _cpu_model, _fmt, _loadavg, _nproc, _version, aggregate, run_bench_launch)


CHECK = "bench.modes"
MODULE = "mode_bench_checks"
UNEVEN_TARGET = 1.15


def render(rows: list[dict], world: int, compile_ms: dict, autograd: str) -> str:
    ranks = list(range(world))
    rank_cols = "/".join(f"r{r}" for r in ranks)
    lines = []

    def emit(title, head_a, head_b, section, intro, with_compile):
        sel = [r for r in rows if r["section"] == section]
        if not sel:
            return
        lines.append(f"### {title}\n")
        lines.append(intro + "\n")
        extra_head = " compile s |" if with_compile else ""
        lines.append(f"| mapping | what | {head_a} ms | {head_b} ms | ratio | ratio range over rounds "
                     f"| per-rank ratio {rank_cols} |{extra_head} max abs diff |")
        lines.append("|---|---|---|---|---|---|---|" + ("---|" if with_compile else "") + "---|")
        for r in sel:
            per = " / ".join(_fmt(r["rank_ratios"].get(k), 3) for k in ranks)
            diff = "-" if r["max_error"] is None else f"{r['max_error']:g}"
            comp = ""
            if with_compile:
                c = compile_ms.get((r["section"], r["mapping"]))
                comp = f" {_fmt(c / 1e3 if c is not None else None, 1)} |"
            lines.append(
                f"| {r['mapping']} | {r['what']} | {_fmt(r['map_ms'])} | {_fmt(r['bare_ms'])} | "
                f"**{_fmt(r['ratio'], 3)}** | {_fmt(r['ratio_lo'], 3)}-{_fmt(r['ratio_hi'], 3)} | {per} |"
                f"{comp} {diff} |"
            )
        lines.append("")

    emit("(a) forward: compiled (`ms.jit`) vs eager (PyNative)", "compiled", "eager", "a",
         "ratio = compiled / eager. compile s = the first (compiling) call, slowest rank, "
         "not in the timings. max abs diff: compiled vs eager output.", True)
    emit(f"(b) forward+backward: `ms.jit(ms.{autograd}(loss))` vs `ms.{autograd}(loss)`, "
         "loss = sum(mapping(x)*c)", "compiled", "eager", "b",
         "ratio = compiled / eager. max abs diff: compiled vs eager gradient (and loss value).", True)
    emit("(c) uneven vs even, eager forward", "uneven", "even", "u",
         f"ratio = uneven (S = 4k+1, split_sizes=even_split_sizes(S, 4)) / even (S = 4k); "
         f"target <= {UNEVEN_TARGET:.2f}x. max abs diff: uneven output vs a numpy reference.", False)
    emit("(d) uneven vs even, compiled forward (`ms.jit` on both sides)", "uneven", "even", "v",
         "ratio = uneven / even, both compiled. compile s = the uneven side's first call. "
         "max abs diff: uneven output vs a numpy reference.", True)
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-mib", type=float, default=16.0)
    parser.add_argument("--iters", type=int, default=1,
                        help="timed calls per round (1: every call is isolated by barrier + sync)")
    parser.add_argument("--repeats", type=int, default=4, help="rounds per measurement (median)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed calls of each side first")
    parser.add_argument("--sections", default="abuv",
                        help="subset of 'abuv': a fwd modes, b fwd+bwd modes, u uneven eager, "
                             "v uneven compiled")
    parser.add_argument("--mappings", default="", help="comma-separated subset of the mappings")
    parser.add_argument("--autograd", choices=("value_and_grad", "grad"), default="value_and_grad",
                        help="section b: ms.value_and_grad (default) or ms.grad")
    parser.add_argument("--world-size", type=int, default=4)
    parser.add_argument("--timeout", type=float, default=1200.0, help="seconds for the whole launch")
    parser.add_argument("--json", help="also write the raw per-rank records here")
    args = parser.parse_args(argv)

    command = "python bench/bench_modes.py " + " ".join(shlex.quote(a) for a in (argv or sys.argv[1:]))
    load_before = _loadavg()
    spec = {
        "checks": [{"name": CHECK, "params": {
            "size_mib": args.size_mib, "iters": args.iters, "repeats": args.repeats,
            "warmup": args.warmup, "sections": args.sections, "mappings": args.mappings,
            "autograd": args.autograd}}],
        "modules": [MODULE],
    }
    launched = run_bench_launch(spec, args.world_size, args.timeout, progress_every_s=60)
    if launched is None:
        return 1
    result, wall, load_after = launched
    if args.json:
        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump({r: (s or {}).get("records") for r, s in result.ranks.items()}, fh, indent=1)

    rows = aggregate(result.ranks)
    # Compile time of the compiled (first) side: the slowest rank.
    compile_ms: dict = {}
    for state in result.ranks.values():
        for rec in (state or {}).get("records", []):
            c = (rec.get("compile_ms") or {}).get("a")
            if c is not None:
                key = (rec["section"], rec["mapping"])
                compile_ms[key] = max(compile_ms.get(key, 0.0), c)
    recs = next(iter(result.ranks.values()))["records"]
    S, H, G = recs[0]["S"], recs[0]["H"], recs[0]["G"]
    passed = all(rec.get("passed") for s in result.ranks.values() for rec in (s or {}).get("records", []))
    timings = {r: (s or {}).get("timings", {}) for r, s in result.ranks.items()}

    print(f"## Execution modes and uneven sequences, {G} ranks, {args.size_mib:g} MiB float32 "
          f"(S, H) = ({S}, {H})\n")
    print(f"command: `{command.strip()}`  ")
    print(f"machine: nproc {_nproc()} ({_cpu_model()}), python {platform.python_version()}, "
          f"mindspore {_version('mindspore')}, numpy {_version('numpy')}; one msrun launch, "
          f"{args.world_size} ranks, group tp={G}  ")
    print(f"load average (1/5/15 min) before: {load_before}; after: {load_after}  ")
    print(f"launch wall time {wall:.0f} s; per rank: "
          + ", ".join(f"r{r} init {t.get('init_s', '?')} s, bench "
                      f"{sum(c['s'] for c in t.get('checks', [])):.0f} s" for r, t in sorted(timings.items())))
    print(f"timing: {args.warmup} warm-up call(s) per side after the compiling call, then {args.repeats} "
          f"rounds x {args.iters} calls per side (A/B order alternating), barrier before each timed loop, "
          "`mindspore.runtime.synchronize()` after it; ms = slowest rank, median over rounds.  ")
    print("every compiled output/gradient equal to eager, every uneven output equal to numpy: "
          f"{passed}\n")
    print(render(rows, args.world_size, compile_ms, args.autograd))
    for sec, label in (("u", "eager"), ("v", "compiled")):
        sel = [r for r in rows if r["section"] == sec]
        if sel:
            worst = max(sel, key=lambda r: r["ratio"])
            met = all(r["ratio"] <= UNEVEN_TARGET for r in sel)
            print(f"uneven/even {label}: worst ratio {worst['ratio']:.3f} ({worst['mapping']}); "
                  f"<= {UNEVEN_TARGET:.2f}x {'met' if met else 'NOT met'} by all.")
    for sec in ("a", "b"):
        sel = [r for r in rows if r["section"] == sec]
        if sel:
            print(f"compiled/eager section {sec}: median of the ratios "
                  f"{statistics.median(r['ratio'] for r in sel):.3f}, "
                  f"range {min(r['ratio'] for r in sel):.3f}-{max(r['ratio'] for r in sel):.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
