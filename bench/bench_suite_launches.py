"""Where the test suite's multi-process time goes: one shared launch per world size, per check.

The suite runs every job family of one world size (tests/_*_job.py, tests/test_mappings.py)
in one msrun launch (tests/_jobs.py). This script runs that launch outside pytest and prints
rank 0's wall and CPU seconds per check, summed per check family, so a change that is meant
to make the suite faster can be measured where the time is. Usage::

    python bench/bench_suite_launches.py 8                      # mappings8 + models8 + optimizer8
    python bench/bench_suite_launches.py 4 --families fsdp,models
    python bench/bench_suite_launches.py 4 --json /tmp/ws4.json

Reported in docs/BENCHMARKS.md ("The test suite's time"). On 2 cores every rank does the same
work at the same time, so a check's wall time is about (ranks x its CPU seconds) / cores: only
less work per rank makes a launch shorter.
"""

from __future__ import annotations

import argparse
import glob
import importlib
import json
import os
import sys
import time

TESTS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("world_size", type=int, help="the launch: every family of this world size")
    parser.add_argument("--families", default="", help="comma-separated family names (default: all)")
    parser.add_argument("--json", default="", help="also write the per-rank timings here")
    args = parser.parse_args(argv)

    sys.path.insert(0, TESTS)
    os.chdir(TESTS)  # the families' specs name their modules relative to tests/
    import _jobs

    for path in sorted(glob.glob(os.path.join(TESTS, "_*_job.py"))):
        importlib.import_module(os.path.basename(path)[:-3])
    importlib.import_module("test_mappings")  # registers mappings4 / mappings8
    fams = [f for f in _jobs.families().values() if f.world_size == args.world_size]
    if args.families:
        wanted = set(args.families.split(","))
        unknown = wanted - {f.name for f in fams}
        if unknown:
            parser.error(f"--families {sorted(unknown)}: no such family of world size {args.world_size}; "
                         f"expected some of {sorted(f.name for f in fams)}")
        fams = [f for f in fams if f.name in wanted]
    if not fams:
        parser.error(f"no job family has world size {args.world_size}")
    _jobs._SELECTED = {f.name for f in fams}  # noqa: SLF001 - one launch for all of them, as in pytest
    t0 = time.perf_counter()
    _jobs.run(fams[0].name)
    wall = time.perf_counter() - t0

    out = {"world_size": args.world_size, "wall_s": wall, "launches": []}
    for names, result in _jobs.launches():
        ranks = {r: (st or {}).get("timings") for r, st in result.ranks.items()}
        out["launches"].append({"families": names, "ok": result.ok, "timings": ranks})
        print(f"launch {','.join(names)}: ok={result.ok}")
        zero = ranks.get(0) or ranks.get("0") or {}
        per_family: dict = {}
        for c in zero.get("checks") or []:
            print(f"  {c['s']:8.1f} s  {c.get('cpu_s', 0.0):7.1f} cpu s  {c['name']}")
            fam = c["name"].split(".")[0]
            per_family[fam] = per_family.get(fam, 0.0) + c["s"]
        print("  per family: " + ", ".join(f"{k} {v:.0f} s" for k, v in
                                         sorted(per_family.items(), key=lambda kv: -kv[1])))
    print(f"wall {wall:.1f} s (launch included)")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump(out, fh, indent=1)
    return 0 if all(l["ok"] for l in out["launches"]) else 1


if __name__ == "__main__":
    sys.exit(main())
