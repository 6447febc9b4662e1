"""Cost of ``msdist verify`` against a bare msrun launch, its busbw table, and memcpy bandwidth.

    python bench/bench_verify.py [--repeat 2] [--json out.json]

1. Wall time of ``msrun --worker_num=4 ... trivial.py`` where each of the 4 ranks imports
   MindSpore, calls ``init()`` and all-reduces 8 floats (the floor any launch pays), with
   MindSpore's defaults and again with the worker retry interval the harness launcher
   sets on one machine (``SINGLE_MACHINE_ENV``: the floor of a launch of ours).
2. Wall time of the whole ``msdist verify`` on the default layout (plan, launch 4 CPU ranks,
   every correctness check, the default bandwidth sweep, report). Target: <= 2.0x of (1).
3. The busbw table of the last verify run (as printed by verify).
4. memcpy bandwidth of this machine (numpy copy of a 256 MiB buffer, one core), the
   physical reference for the busbw figures.
Prints markdown.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

TRIVIAL = """
import numpy as np
import mindspore as ms
from mindspore import ops
from mindspore.communication import init
init()
out = ops.AllReduce()(ms.Tensor(np.ones(8, np.float32)))
assert float(out.asnumpy()[0]) == 4.0
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def exe(name: str) -> str:
    return shutil.which(name) or str(Path(sys.executable).parent / name)


def bare_msrun(folder: Path, extra_env=None) -> float:
    script = folder / "trivial.py"
    script.write_text(TRIVIAL)
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}", **(extra_env or {})}
    start = time.perf_counter()
    subprocess.run(
        [exe("msrun"), "--worker_num=4", "--local_worker_num=4", f"--master_port={free_port()}",
         f"--log_dir={folder / 'logs'}", "--join=True", str(script)],
        check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env, cwd=folder,
    )
    return time.perf_counter() - start


def verify(folder: Path) -> tuple[float, dict]:
    report = folder / "report.json"
    start = time.perf_counter()
    proc = subprocess.run([exe("msdist"), "verify", "--format", "json", "--output", str(report),
                           "--log-dir", str(folder / "vlogs")], stdout=subprocess.DEVNULL,
                          stderr=subprocess.DEVNULL)
    seconds = time.perf_counter() - start
    if proc.returncode != 0:
        raise SystemExit(f"msdist verify failed with exit code {proc.returncode}")
    return seconds, json.loads(report.read_text())


def memcpy_gbps(mib: int = 256, repeat: int = 5) -> float:
    src = np.ones(mib * 2**20 // 8, np.float64)
    dst = np.empty_like(src)
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - start)
    return src.nbytes / best / 1e9


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--json", help="also save the last verify report here")
    args = parser.parse_args()
    from mindscience.distributed.harness.msrun_command import SINGLE_MACHINE_ENV

    bare, fast, full, report = [], [], [], None
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.repeat):
            # Alternate the two so that a change of machine load hits both alike.
            (Path(tmp) / f"b{i}").mkdir()
            bare.append(bare_msrun(Path(tmp) / f"b{i}"))
            (Path(tmp) / f"f{i}").mkdir()
            fast.append(bare_msrun(Path(tmp) / f"f{i}", SINGLE_MACHINE_ENV))
            (Path(tmp) / f"v{i}").mkdir()
            seconds, report = verify(Path(tmp) / f"v{i}")
            full.append(seconds)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
    print(f"{os.cpu_count()} cores, python {sys.version.split()[0]}, load before end: {os.getloadavg()[0]:.2f}\n")
    print("| run | times s | median s |")
    print("|---|---|---|")
    print(f"| bare msrun, 4 trivial ranks | {', '.join(f'{t:.1f}' for t in bare)} | {statistics.median(bare):.1f} |")
    retry = ", ".join(f"{k}={v}" for k, v in SINGLE_MACHINE_ENV.items())
    print(f"| bare msrun, same, {retry} | {', '.join(f'{t:.1f}' for t in fast)} | {statistics.median(fast):.1f} |")
    print(f"| msdist verify (default layout) | {', '.join(f'{t:.1f}' for t in full)} | {statistics.median(full):.1f} |")
    print(f"\nratio verify / bare msrun (medians): {statistics.median(full) / statistics.median(bare):.2f}x "
          f"(MindSpore's defaults), {statistics.median(full) / statistics.median(fast):.2f}x (same retry interval)\n")
    print("| op | group | n | bytes | time us | algbw GB/s | busbw GB/s | #wrong | impl |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in report["bandwidth"]:
        print(f"| {r['op']} | {r['group']} | {r['group_size']} | {r['bytes']} | {r['time_us']:.0f} | "
              f"{r['algbw_gbps']:.4f} | {r['busbw_gbps']:.4f} | {r['wrong']} | "
              f"{'composed' if r['composed'] else 'native'} |")
    print(f"\nmemcpy (numpy copy, 256 MiB, best of 5, one core): {memcpy_gbps():.2f} GB/s")


if __name__ == "__main__":
    main()
