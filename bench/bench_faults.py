"""Benchmark what faults cost ``msdist train``: the checkpoint stall, and a restart.

    python bench/bench_faults.py stall                 # ~1 GiB, sync vs --async-save, 3 repeats
    python bench/bench_faults.py stall --gib 2 --dir /data
    python bench/bench_faults.py restart               # a rank killed at step 3 of tiny-gpt at dp2

``stall``: one process (every group of size 1) holding a cell of ``--gib`` GiB of float32
parameters (tensors of 64 MiB). The training step stalls for ``checkpoint.save`` whole
(synchronous), and for ``checkpoint.save_async`` only until it returns (the host copy);
the background write is timed as well (until the checkpoint is in place). Each repeat
writes a new ``step_<k>`` and removes it afterwards; the page cache is not dropped (that
needs root), so every contender writes to a warm disk alike.

``restart``: ``msdist train`` on a 2-rank dp2 layout, tiny-gpt, PyNative, 6 steps,
``--save-every 2 --max-restarts 1`` with ``MSDIST_FAULT=1:3:kill``; the time from the
rank's death (the wall-clock time the fault writes to its log just before SIGKILL) to the
end of the first step after the restart, and its parts:

* detect: death -> the launcher sees the failure (``LaunchResult.failed_at``);
* stop: -> every process of the job stopped (the harness waits ``FAILURE_SETTLE_S`` for
  further failures, SIGTERMs, SIGKILLs after ``KILL_GRACE_S``);
* relaunch: -> the relaunched ranks start ``train.setup`` (the decision, msrun, MindSpore's
  import and ``init()``);
* build + load: -> the model built and the checkpoint loaded (``load_s`` of it);
* first step: -> the first step after the restart done.

Prints JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

TENSOR_MIB = 64


def stall(gib: float, directory: str, repeat: int) -> dict:
    import numpy as np

    import mindspore as ms
    from mindspore import nn

    from mindscience.distributed import checkpoint

    count = max(1, round(gib * 1024 / TENSOR_MIB))
    rows = TENSOR_MIB * (1 << 20) // 4 // 1024
    cell = nn.Cell()
    for i in range(count):
        setattr(cell, f"w{i}", ms.Parameter(ms.Tensor(np.full((rows, 1024), i, np.float32)), name=f"w{i}"))
    nbytes = count * rows * 1024 * 4
    sync, copy, background, buffers = [], [], [], {}
    for k in range(repeat):
        path = os.path.join(directory, f"step_{2 * k}")
        t0 = time.perf_counter()
        checkpoint.save(cell, path, step=2 * k)
        sync.append(time.perf_counter() - t0)
        shutil.rmtree(path)
        path = os.path.join(directory, f"step_{2 * k + 1}")
        t0 = time.perf_counter()
        pending = checkpoint.save_async(cell, path, step=2 * k + 1, host_buffers=buffers)
        copy.append(time.perf_counter() - t0)
        checkpoint.agree_written(pending)
        background.append(pending.written_s)
        shutil.rmtree(path)
    med = statistics.median
    return {"bytes": nbytes, "gib": nbytes / 2**30, "tensors": count, "repeat": repeat,
            "sync_stall_s": [round(x, 3) for x in sync], "async_stall_s": [round(x, 3) for x in copy],
            "async_background_write_s": [round(x, 3) for x in background],
            "sync_median_s": round(med(sync), 3), "async_median_s": round(med(copy), 3),
            "ratio": round(med(copy) / med(sync), 3),
            "sync_gib_per_s": round(nbytes / 2**30 / med(sync), 3)}


def restart(directory: str) -> dict:
    layout = os.path.join(directory, "dp2.yaml")
    with open(layout, "w") as fh:
        fh.write("world_size: 2\nbackend: cpu\n")
    logs, save = os.path.join(directory, "logs"), os.path.join(directory, "ckpt")
    env = {**os.environ, "MSDIST_FAULT": "1:3:kill"}
    msdist = os.path.join(os.path.dirname(sys.executable), "msdist")
    command = [msdist, "train", layout, "--model", "tiny-gpt", "--steps", "6", "--mode", "pynative", "--save", save,
               "--save-every", "2", "--max-restarts", "1", "--format", "json", "--log-dir", logs]
    t0 = time.perf_counter()
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=1200)
    wall = time.perf_counter() - t0
    if done.returncode:
        raise SystemExit(f"msdist train failed ({done.returncode}):\n{done.stderr[-3000:]}")
    report = json.loads(done.stdout)
    (record,) = report["restarts"]
    died = None
    with open(os.path.join(logs, "worker_1.log"), errors="replace") as fh:
        for line in fh:
            if line.startswith("msdist fault: ") and " fires at " in line:
                died = float(line.rsplit(" ", 1)[1])
    with open(os.path.join(logs, "restart_1", "results", "rank_0.json")) as fh:
        records = json.load(fh)["records"]
    setup = next(r for r in records if r.get("check") == "train.setup")
    first = next(r for r in records if r.get("check") == "train.step")
    parts = {"detect_s": record["failed_at"] - died, "stop_s": record["stopped_at"] - record["failed_at"],
             "decide_s": record["relaunch_at"] - record["stopped_at"],
             "relaunch_s": setup["started_at"] - record["relaunch_at"],
             "build_and_load_s": setup["ready_at"] - setup["started_at"],
             "load_s": setup["resumed"]["load_s"], "first_step_s": first["at"] - setup["ready_at"]}
    return {"command": "MSDIST_FAULT=1:3:kill msdist " + " ".join(command[1:]), "wall_s": round(wall, 2),
            "death_to_first_step_s": round(first["at"] - died, 3),
            "parts": {k: round(v, 3) for k, v in parts.items()},
            "losses": [s["loss"] for s in report["steps"]], "restart": {k: record[k] for k in
                                                                        ("rank", "kind", "resumed_from",
                                                                         "steps_lost", "seconds_lost")}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("what", choices=("stall", "restart"))
    parser.add_argument("--gib", type=float, default=1.0)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--dir", default=None, help="Where to write (default: a temporary folder).")
    args = parser.parse_args()
    directory = tempfile.mkdtemp(prefix="bench-faults-", dir=args.dir)
    try:
        if args.what == "stall":
            out = stall(args.gib, directory, args.repeat)
        else:
            out = restart(directory)
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
