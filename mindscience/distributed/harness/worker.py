"""The program every rank runs: read a spec, run the named checks, report after each one.

msrun starts this file once per rank (``python worker.py --spec S --out D``); on the
machine that hosts the scheduler the same file is started once more with
``MS_ROLE=MS_SCHED``. In that role it only calls ``mindspore.communication.init()``,
which is how a MindSpore scheduler serves the job, and exits.

A spec is JSON::

    {
      "checks": [{"name": "basic.ping", "params": {}}, ...],
      "layout": {"world_size": 4, "tp": 2},   # optional, passed to topology.Layout
      "init": true,                            # optional, call communication.init()
      "device_target": "CPU",                  # optional, else $MSDIST_DEVICE_TARGET
      "modules": ["my.checks"],                # optional extra check modules to import
      "gather": false                          # optional: rank 0 writes gathered.json with
    }                                          # every rank's results (cluster runs)

Protocol with the launcher: the worker owns ``<out>/rank_<r>.json`` and atomically
rewrites it before ``init()`` (status ``"starting"``) and after every check::

    {"rank": 1, "world_size": 4, "pid": 1234, "status": "running",
     "current": "basic.allreduce", "done": 1, "total": 2,
     "records": [...], "error": null, "timings": {...}, "updated": 1700000000.0}

``status`` is ``"starting"``, ``"running"``, ``"done"`` or ``"error"``. On an exception
the worker writes ``"error"`` with the traceback and exits with code 1 at once: after a
failed collective the ranks fall out of step, so continuing would only hang or corrupt
later checks.
"""

from __future__ import annotations

import argparse
import ctypes
import faulthandler
import importlib
import json
import os
import signal
import socket
import sys
import threading
import time
import traceback

# ``python worker.py`` puts this folder first on sys.path, where the harness's own
# modules (``registry.py``, ``processes.py``, ``monitor.py``, ``checks/``, ...) would
# shadow any top-level module of the same name
# that MindSpore or a check imports. Drop it before importing anything else.
_HERE = os.path.dirname(os.path.abspath(__file__))
if sys.path and os.path.abspath(sys.path[0] or os.curdir) == _HERE:
    del sys.path[0]

EXIT_CHECK_FAILED = 1
EXIT_ORPHANED = 3
ORPHAN_POLL_S = 1.0


def _jsonable(value):
    """``json.dumps`` fallback: numpy scalars/arrays and tensors become plain values."""
    if hasattr(value, "asnumpy"):  # mindspore.Tensor
        value = value.asnumpy()
    if hasattr(value, "tolist"):  # numpy arrays and scalars
        return value.tolist()
    if hasattr(value, "item"):
        return value.item()
    return str(value)


class StatusFile:
    """The rank's result file, rewritten atomically so the launcher never reads half of it.

    Args:
        out_dir: Folder shared by all ranks of the job.
        rank: Global rank; names the file ``rank_<rank>.json``.
        world_size: Number of ranks.
        total: Number of checks in the spec.
    """

    def __init__(self, out_dir: str, rank: int, world_size: int, total: int):
        self.path = os.path.join(out_dir, f"rank_{rank}.json")
        self.state = {
            "rank": rank,
            "world_size": world_size,
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "status": "starting",
            "current": None,
            "done": 0,
            "total": total,
            "records": [],
            "error": None,
            "timings": {"checks": []},
            "updated": time.time(),
        }

    def write(self, **changes) -> None:
        """Merge ``changes`` into the state and replace the file atomically."""
        self.state.update(changes)
        self.state["updated"] = time.time()
        tmp = f"{self.path}.{os.getpid()}.tmp"
        with open(tmp, "w", encoding="utf-8") as fh:
            json.dump(self.state, fh, default=_jsonable)
        # os.replace is atomic on POSIX: a reader sees the old or the new file, never a mix.
        os.replace(tmp, self.path)


def _die_with_parent() -> None:
    """Have the kernel kill this process when its parent (msrun or the launcher) dies.

    msrun starts ranks in their own sessions, so if msrun is killed hard (the launcher
    killed, OOM) nothing else would stop a rank blocked in a collective. The kernel's
    parent-death signal works even while MindSpore blocks in C++ holding the GIL (a
    scheduler in ``init()`` does); a watch thread is the fallback where prctl is missing.
    """
    parent_pid = os.getppid()
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # 1 = PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        _watch_parent(parent_pid)
    if os.getppid() != parent_pid:  # the parent died before prctl took effect
        os._exit(EXIT_ORPHANED)


def _watch_parent(parent_pid: int) -> None:
    def watch():
        while True:
            time.sleep(ORPHAN_POLL_S)
            if os.getppid() != parent_pid:
                sys.stderr.write(f"worker {os.getpid()}: parent {parent_pid} is gone, exiting\n")
                sys.stderr.flush()
                os._exit(EXIT_ORPHANED)

    threading.Thread(target=watch, name="orphan-watch", daemon=True).start()


def _import_check_modules(extra: list[str]) -> None:
    """Import the registry's check modules (missing ones skipped) and ``extra`` (required)."""
    from mindscience.distributed.harness.registry import CHECK_MODULES

    for name in CHECK_MODULES:
        try:
            importlib.import_module(name)
        except ModuleNotFoundError as exc:
            # Only a module that does not exist (yet) is skipped; a module that exists
            # but fails to import one of its own dependencies must fail loudly.
            if exc.name != name:
                raise
    for name in extra:
        importlib.import_module(name)


def _records_of(result, name: str, rank: int, index: int) -> list[dict]:
    """Normalise what a check returned to a list of records tagged with rank and step."""
    if result is None:
        items = []
    elif isinstance(result, dict):
        items = [result]
    elif isinstance(result, (list, tuple)) and all(isinstance(r, dict) for r in result):
        items = list(result)
    else:
        raise TypeError(
            f"check {name!r} returned {type(result).__name__}: expected a dict, a list of "
            "dicts or None. Return records such as {'check': ..., 'passed': True}."
        )
    records = []
    for item in items:
        record = dict(item)
        record.setdefault("check", name)
        record["rank"] = rank
        # The position in the spec tells two runs of one check (other params) apart.
        record["step"] = index
        records.append(record)
    return records


def _set_device(spec: dict) -> None:
    """Select the spec's (or ``$MSDIST_DEVICE_TARGET``'s) device; must precede init().

    The device decides the backend init() starts: MCCL on CPU, HCCL on Ascend, NCCL on GPU.
    """
    import mindspore as ms

    target = spec.get("device_target") or os.environ.get("MSDIST_DEVICE_TARGET")
    if target:
        ms.set_device(target)


def _limit_cpu_threads(ms):
    """On CPU, give each rank its share of this machine's cores for its kernels.

    MindSpore starts 25 CPU kernel threads per process by default; N ranks on a few
    cores then contend for them (measured on 2 cores, 4 ranks: the 4-rank mapping
    battery took 85-88 s with the default and 66-79 s with one thread per rank).
    ``$MSDIST_CPU_THREADS`` overrides the share. Returns the count set, or None where
    the device is not the CPU.
    """
    if ms.get_context("device_target") != "CPU":
        return None
    from mindscience.distributed.harness.msrun_command import RANKS_HERE_ENV

    ranks_here = max(1, int(os.environ.get(RANKS_HERE_ENV) or 1))
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    threads = int(os.environ.get("MSDIST_CPU_THREADS") or max(1, (cores or 1) // ranks_here))
    ms.device_context.cpu.op_tuning.threads_num(threads)
    return threads


def _synchronous_pynative(ms):
    """On CPU, run PyNative operators synchronously (``pynative_synchronize=True``).

    MindSpore 2.10's asynchronous PyNative pipeline keeps its queue threads busy between
    operators; on CPU, where a kernel of a small model takes microseconds, that costs far
    more than the kernels and takes the cores the other ranks need (measured, one process
    on 2 cores, GPTModel tiny-gpt shape, 2 micro-batches, one kernel thread: 0.54 s and
    1.07 CPU s per PyNative step asynchronous, 0.058 s and 0.11 CPU s synchronous; the
    same losses). ``$MSDIST_PYNATIVE_SYNC=0`` keeps the asynchronous default. Returns
    whether it was set (None where the device is not the CPU).
    """
    if ms.get_context("device_target") != "CPU":
        return None
    on = os.environ.get("MSDIST_PYNATIVE_SYNC", "1") != "0"
    if on:
        ms.set_context(pynative_synchronize=True)
    return on


def _serve_scheduler(spec: dict) -> int:
    """Scheduler role: ``init()`` serves the cluster until the workers finish."""
    from mindspore.communication import init

    _set_device(spec)
    init()
    return 0


def _init_context(spec: dict, status: StatusFile | None, out_dir: str):
    """Import MindSpore, join the job and build the CheckContext (rank known after init)."""
    timings = {}
    t0 = time.perf_counter()
    import mindspore as ms

    _set_device(spec)
    ms.set_context(mode=ms.PYNATIVE_MODE)
    timings["cpu_threads"] = _limit_cpu_threads(ms)
    timings["pynative_synchronize"] = _synchronous_pynative(ms)
    timings["import_s"] = round(time.perf_counter() - t0, 3)
    _import_check_modules(list(spec.get("modules") or []))

    if spec.get("init", True):
        if status:
            status.write(current="init", timings={**status.state["timings"], **timings})
        from mindspore.communication import get_group_size, get_rank, init

        t0 = time.perf_counter()
        init()
        timings["init_s"] = round(time.perf_counter() - t0, 3)
        rank, world_size = get_rank(), get_group_size()
    else:
        rank = int(os.environ.get("RANK_ID", "0"))
        world_size = int(os.environ.get("RANK_SIZE", "1"))
    # CPU seconds of this process (all its threads) so far: on a shared machine wall
    # times mostly measure the other jobs, CPU times what the rank itself spent.
    timings["startup_cpu_s"] = round(time.process_time(), 3)

    layout = None
    if spec.get("layout"):
        from mindscience.distributed.topology import Layout

        layout = Layout(**spec["layout"])
    from mindscience.distributed.harness.registry import CheckContext

    ctx = CheckContext(rank=rank, world_size=world_size, layout=layout, out_dir=out_dir)
    return ctx, timings


GATHERED_FILE = "gathered.json"


def _gather_to_rank0(state: dict, rank: int, out_dir: str) -> None:
    """Bring every rank's results to rank 0 over the backend (spec ``"gather": true``).

    On a real cluster each node only sees its own ranks' files; rank 0's node prints
    the report, so it needs the others' records. ``all_gather_object`` works on the
    world group on every backend, CPU included.
    """
    from mindspore.mint.distributed import all_gather_object

    mine = {**state, "status": "done", "current": None}
    everyone = [None] * int(state["world_size"])
    all_gather_object(everyone, mine)
    if rank == 0:
        gathered = {str(item["rank"]): item for item in everyone if item}
        path = os.path.join(out_dir, GATHERED_FILE)
        tmp = f"{path}.tmp"
        with open(tmp, "w", encoding="utf-8") as fh:
            json.dump(gathered, fh, default=_jsonable)
        os.replace(tmp, path)


def run_worker(spec: dict, out_dir: str) -> int:
    """Run the spec's checks in this rank and keep ``rank_<r>.json`` up to date.

    Args:
        spec: The parsed spec (see the module docstring).
        out_dir: Folder for the per-rank result files.

    Returns:
        0 when every check ran (records may still say ``passed: False``); on an
        exception the process exits with code 1 right after writing the error.
    """
    from mindscience.distributed.harness.registry import get_check

    checks = list(spec.get("checks") or [])
    # msrun exports RANK_ID before init(); a status file written now makes a hang in
    # init() visible to the launcher ("starting", current "init").
    env_rank = os.environ.get("RANK_ID")
    status = None
    if env_rank is not None:
        status = StatusFile(out_dir, int(env_rank), int(os.environ.get("RANK_SIZE", "1")), len(checks))
        status.write(current="import")
    try:
        ctx, timings = _init_context(spec, status, out_dir)
        if status is None or status.state["rank"] != ctx.rank:
            status = StatusFile(out_dir, ctx.rank, ctx.world_size, len(checks))
        status.write(world_size=ctx.world_size, status="running",
                     timings={**status.state["timings"], **timings})
        records = []
        for index, item in enumerate(checks):
            name = item["name"]
            status.write(current=name, done=index)
            t0, cpu0 = time.perf_counter(), time.process_time()
            result = get_check(name)(ctx, **(item.get("params") or {}))
            seconds = round(time.perf_counter() - t0, 4)
            records.extend(_records_of(result, name, ctx.rank, index))
            status.state["timings"]["checks"].append(
                {"name": name, "s": seconds, "cpu_s": round(time.process_time() - cpu0, 4)})
            status.write(done=index + 1, records=records)
        if spec.get("gather"):
            _gather_to_rank0(status.state, ctx.rank, out_dir)
        status.write(status="done", current=None)
        return 0
    except Exception:  # noqa: BLE001 - every failure must reach the launcher
        tb = traceback.format_exc()
        sys.stderr.write(tb)
        if status is not None:
            try:
                status.write(status="error", error=tb)
            except Exception:  # noqa: BLE001 - the exit code still tells the launcher
                traceback.print_exc()
        sys.stdout.flush()
        sys.stderr.flush()
        # os._exit: interpreter teardown runs MindSpore's finalizers, which can block on
        # peers that are still waiting in a collective.
        os._exit(EXIT_CHECK_FAILED)


def _load_spec(path: str) -> dict:
    if path == os.devnull:  # a hand-started scheduler may get no spec
        return {}
    with open(path, encoding="utf-8") as fh:
        return json.load(fh)


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``python worker.py --spec SPEC --out DIR``."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--spec", required=True, help="path of the JSON spec")
    parser.add_argument("--out", required=True, help="folder for rank_<r>.json result files")
    args = parser.parse_args(argv)

    _die_with_parent()
    # SIGUSR1 dumps every thread's Python stack into the worker log: the launcher sends
    # it to a rank before killing it on timeout, so the log shows where it hung.
    faulthandler.register(signal.SIGUSR1, all_threads=True)

    spec = _load_spec(args.spec)
    if os.environ.get("MS_ROLE") == "MS_SCHED":
        return _serve_scheduler(spec)
    os.makedirs(args.out, exist_ok=True)
    return run_worker(spec, args.out)


if __name__ == "__main__":
    sys.exit(main())
