"""Whole-process timing of ``msdist plan`` (issue: plan speed).

Measures, as a user would see it, the wall time of the ``msdist`` process:
* ``msdist plan <65,536-rank layout> --format json > /dev/null``
* the same at 16,384 / 65,536 / 262,144 ranks, to show the cost is linear in world size
* 65,536 ranks with split experts (ep 64, etp 1): the expert groups and columns
* cold start of ``msdist plan`` on the default layout, and that MindSpore is not imported
* each row's CPU seconds beside the wall time (the CPU time holds under load)

Run:  python bench/bench_plan.py [--repeat 7]
Prints a markdown table (best and median of N runs).
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def msdist() -> list[str]:
    exe = shutil.which("msdist") or str(Path(sys.executable).parent / "msdist")
    return [exe]


CPU_SECONDS: dict = {}  # command -> CPU seconds (user + system) of each run


def timed(cmd: list[str], repeat: int) -> list[float]:
    times, cpu = [], []
    for _ in range(repeat):
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        start = time.perf_counter()
        subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=True)
        times.append(time.perf_counter() - start)
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        # The CPU time of the process: unlike the wall time, it barely moves when other jobs
        # load the machine.
        cpu.append(after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime)
    CPU_SECONDS[tuple(cmd)] = cpu
    return times


def scaled_layout(folder: Path, world: int) -> Path:
    # Same shape as layouts/ascend-65536.yaml, dp scaled with the world.
    path = folder / f"world-{world}.yaml"
    path.write_text(
        f"world_size: {world}\ndevices_per_node: 16\ntp: 8\ncp: 2\npp: 16\norder: tp-cp-dp-pp\nbackend: ascend\n"
    )
    return path


def expert_layout(folder: Path, world: int) -> Path:
    # ascend-65536's shape with its experts split DeepSeek-V3-style: ep 64, etp 1 (edp = world/1024).
    path = folder / f"experts-{world}.yaml"
    path.write_text(
        f"world_size: {world}\ndevices_per_node: 16\ntp: 8\ncp: 2\npp: 16\nep: 64\netp: 1\n"
        "order: tp-cp-ep-dp-pp\nbackend: ascend\n"
    )
    return path


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeat", type=int, default=7)
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        cases = [("layouts/ascend-65536.yaml (65,536 ranks) --format json", [str(ROOT / "layouts/ascend-65536.yaml"), "--format", "json"])]
        for world in (16384, 65536, 262144):
            cases.append((f"scaled layout, {world:,} ranks --format json", [str(scaled_layout(Path(tmp), world)), "--format", "json"]))
        cases.append(("ep64 x etp1 over the same 65,536 ranks --format json",
                      [str(expert_layout(Path(tmp), 65536)), "--format", "json"]))
        cases.append(("default layout (cpu-4), rich tables", []))
        cases.append(("default layout (cpu-4) --format json", ["--format", "json"]))
        for label, extra in cases:
            cmd = msdist() + ["plan", *extra]
            t = timed(cmd, args.repeat)
            rows.append((label, min(t), statistics.median(t), statistics.median(CPU_SECONDS[tuple(cmd)])))
    probe = subprocess.run(
        [sys.executable, "-c", "import sys, runpy; sys.argv=['msdist','plan']; "
         "import mscli.main as m\ntry:\n    m.main()\nexcept SystemExit:\n    pass\n"
         "print('mindspore imported:', any(k.split('.')[0]=='mindspore' for k in sys.modules), file=sys.stderr)"],
        capture_output=True, text=True,
    )
    print(f"python {sys.version.split()[0]}, {os.cpu_count()} cores, best/median of {args.repeat} runs, "
          f"load average {os.getloadavg()[0]:.1f}\n")
    print("| command | best s | median s | CPU median s |")
    print("|---|---|---|---|")
    for label, best, med, cpu in rows:
        print(f"| `msdist plan` {label} | {best:.3f} | {med:.3f} | {cpu:.3f} |")
    by_world = {r[0]: r for r in rows}
    t16 = by_world["scaled layout, 16,384 ranks --format json"][1]
    t65 = by_world["scaled layout, 65,536 ranks --format json"][1]
    t262 = by_world["scaled layout, 262,144 ranks --format json"][1]
    print(f"\nscaling (best): 4x ranks 16k->65k = {t65 / t16:.2f}x time, 65k->262k = {t262 / t65:.2f}x time")
    print(probe.stderr.strip().splitlines()[-1])


if __name__ == "__main__":
    main()
