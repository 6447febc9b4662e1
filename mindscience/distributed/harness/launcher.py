"""Start the worker harness on N ranks with msrun, watch it, and leave no process behind.

Pure Python with no MindSpore import, so that ``msdist verify`` starts at once.

How a run works::

    launch(spec, 4)
      ├─ writes <log_dir>/spec.json, picks a free port
      ├─ msrun --worker_num=4 ... worker.py --spec <log_dir>/spec.json --out <log_dir>/results
      │    ├─ scheduler   worker.py with MS_ROLE=MS_SCHED: init() serves the job, then exits
      │    └─ rank 0..3   worker.py: init(), run the checks, rewrite results/rank_<r>.json
      └─ every 0.2 s: read rank_<r>.json, look for dead ranks, call on_progress
         stop when: every rank finished | a rank reports "error" or dies | timeout
         always:    kill every process of the job by PID (SIGTERM, grace, SIGKILL)

The rooms: :mod:`.msrun_command` (ports, the msrun argv, the ranks' environment),
:mod:`.processes` (finding a job's processes in ``/proc`` and stopping them all),
:mod:`.monitor` (watching the ranks and reporting failures); this module puts them
together and merges the ranks' records.

Multi-node: :func:`launch` runs one node of a real cluster (``node_rank``,
``master_addr``); :func:`launch_local_multinode` simulates several nodes on loopback
with a scheduler started by hand (:func:`start_scheduler`), because msrun only starts a
scheduler when ``master_addr`` is an address of this machine, and ``127.0.0.2`` is not.
"""

from __future__ import annotations

import json
import math
import os
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from typing import Callable, Mapping, Optional, Sequence

# The rooms of a launch, re-exported here where callers have always found them.
from .monitor import FAILURE_KINDS, POLL_S, _Monitor  # noqa: F401
from .msrun_command import (  # noqa: F401
    RANKS_HERE_ENV,
    WORKER_SCRIPT,
    LaunchError,
    _check_sizes,
    _check_timeout,
    _child_env,
    _popen,
    build_msrun_command,
    check_port_free,
    find_free_port,
    find_msrun,
    msrun_starts_scheduler,
    start_scheduler,
)
from .processes import (  # noqa: F401
    JOB_ENV,
    KILL_GRACE_S,
    _alive,
    _all_pids,
    _proc_cmdline,
    _proc_env,
    job_processes,
    kill_processes,
    stop_job,
)

RESULTS_DIR = "results"
DEFAULT_TIMEOUT_S = 300.0


@dataclass
class LaunchResult:
    """What a launch produced.

    Attributes:
        ok: Every expected rank reported ``"done"``, none failed, no timeout and msrun
            did not fail. Checks may still report ``passed: False``: see :attr:`passed`.
        returncode: msrun's exit code (the first non-zero one of several msruns).
            Negative: killed by that signal, by the launcher when ``stopped``.
        timed_out: The job ran past ``timeout`` and was stopped.
        duration_s: Wall time of the launch.
        ranks: Global rank -> the rank's last result JSON (see ``worker.py``), or None
            when it never wrote one.
        failures: ``{"rank", "kind", "reason", "log_tail"}`` for each rank that raised
            (kind ``"error"``), died (``"crash"``), ran out of time (``"timeout"``),
            produced no result (``"missing"``) or was stopped after another rank failed
            (``"stopped"``); rank -1 with kind ``"infra"`` when msrun or the scheduler
            failed on its own. Most important first; within a kind, the rank that got
            least far first (in a hang, usually the culprit).
        log_dir: Run folder: ``spec.json``, ``results/``, msrun's logs.
        command: The msrun argv (node 0's for a local multi-node run).
        commands: Every command started (scheduler and msruns).
        stopped: The launcher stopped msrun rather than msrun exiting by itself. On a
            single machine this is normal: once every rank has finished and exited, the
            launcher does not wait the ~5 s the scheduler takes to notice.
        warnings: Things that did not fail the run but deserve a look.
        job_id: The ``MSDIST_HARNESS_JOB`` value every process of the job carried.
        master_port: The scheduler's port (``MS_SCHED_PORT`` of every process).
        failed_at: Wall-clock time (``time.time()``) the launcher saw the first failure,
            or None (for ``msdist train --max-restarts``' timings).
        ended_at: Wall-clock time every process of the job was stopped.
    """

    ok: bool
    returncode: Optional[int]
    timed_out: bool
    duration_s: float
    ranks: dict
    failures: list
    log_dir: str
    command: list
    commands: list = field(default_factory=list)
    stopped: bool = False
    warnings: list = field(default_factory=list)
    job_id: str = ""
    master_port: Optional[int] = None
    failed_at: Optional[float] = None
    ended_at: Optional[float] = None

    @property
    def passed(self) -> bool:
        """The run was ok and every record of every rank says ``passed``."""
        return self.ok and all(row["passed"] for row in merge_records(self))

    def records(self) -> list:
        """The records merged across ranks, see :func:`merge_records`."""
        return merge_records(self)


# --------------------------------------------------------------------------- spec


def normalize_spec(spec: Mapping) -> dict:
    """Validate a spec and expand ``"name"`` shorthands to ``{"name", "params"}``.

    Raises:
        LaunchError: not a mapping with a ``checks`` list of names or
            ``{"name": ..., "params": {...}}`` items, or not JSON-serialisable.
    """
    if not isinstance(spec, Mapping):
        raise LaunchError(
            f"spec={spec!r} is invalid: expected a mapping such as "
            "{'checks': [{'name': 'basic.ping', 'params': {}}]}."
        )
    checks = spec.get("checks")
    if not isinstance(checks, (list, tuple)):
        raise LaunchError(
            f"spec['checks']={checks!r} is invalid: expected a list of check names or "
            "{'name': ..., 'params': {...}} items."
        )
    items = []
    for i, item in enumerate(checks):
        if isinstance(item, str):
            item = {"name": item}
        if not isinstance(item, Mapping) or not isinstance(item.get("name"), str):
            raise LaunchError(
                f"spec['checks'][{i}]={item!r} is invalid: expected a check name or "
                "{'name': 'basic.ping', 'params': {...}}."
            )
        params = item.get("params") or {}
        if not isinstance(params, Mapping):
            raise LaunchError(
                f"spec['checks'][{i}]['params']={params!r} is invalid: expected a mapping of "
                "keyword arguments for the check."
            )
        items.append({"name": item["name"], "params": dict(params)})
    out = {**spec, "checks": items}
    try:
        json.dumps(out)
    except (TypeError, ValueError) as exc:
        raise LaunchError(
            f"spec is not JSON-serialisable ({exc}): use lists, dicts, numbers and strings."
        ) from None
    return out


# --------------------------------------------------------------------------- launching


def _prepare_run_dir(log_dir: Optional[str], spec: dict) -> tuple:
    """Create the run folder; returns (run_dir, out_dir, spec_path)."""
    run_dir = os.path.abspath(log_dir) if log_dir else tempfile.mkdtemp(prefix="msdist-run-")
    out_dir = os.path.join(run_dir, RESULTS_DIR)
    os.makedirs(out_dir, exist_ok=True)
    # Result files of an earlier run in the same folder would read as this run's.
    for name in os.listdir(out_dir):
        if name.startswith("rank_") and name.endswith(".json"):
            os.remove(os.path.join(out_dir, name))
    spec_path = os.path.join(run_dir, "spec.json")
    with open(spec_path, "w", encoding="utf-8") as fh:
        json.dump(spec, fh, indent=2)
    return run_dir, out_dir, spec_path


def _remove_half_written(out_dir) -> None:
    """Delete the status files a rank was writing when it was killed.

    A worker writes ``rank_N.json.<pid>.tmp`` and renames it over ``rank_N.json``; a rank
    stopped between the two leaves the temporary file behind. Nothing reads it (the
    rename never happened), so once every process is gone it is only litter.
    """
    if not out_dir or not os.path.isdir(out_dir):
        return
    for name in os.listdir(out_dir):
        if name.endswith(".tmp"):
            try:
                os.remove(os.path.join(out_dir, name))
            except FileNotFoundError:
                pass


def _run_job(*, job_id, start, expected, whole_world, out_dir, log_dirs, launcher_logs,
             timeout, on_progress, total) -> dict:
    """Start the job's processes, watch them, and always stop them all.

    ``start(launchers, helpers)`` appends the Popens it starts, so that even a start
    that fails halfway leaves the launcher knowing what to stop.

    Returns:
        The LaunchResult fields other than log_dir and command(s).
    """
    started = time.monotonic()
    launchers, helpers = [], []
    monitor = _Monitor(job_id=job_id, launchers=launchers, helpers=helpers, expected=expected,
                       whole_world=whole_world, out_dir=out_dir, log_dirs=log_dirs,
                       launcher_logs=launcher_logs, timeout=timeout, on_progress=on_progress,
                       total=total)
    try:
        start(launchers, helpers)
        monitor.run()
        if monitor.timed_out or monitor.first_failure_at is not None:
            monitor.dump_stacks()  # where the ranks still running are stuck, for the logs
    finally:
        stopped = any(p.poll() is None for p in launchers)
        left = stop_job(job_id, launchers + helpers)
        if not left:
            _remove_half_written(out_dir)
    monitor.read_states(force=True)
    monitor.read_exit_codes()
    codes = [p.returncode for p in launchers]
    returncode = next((c for c in codes if c not in (None, 0)), codes[0] if codes else None)
    failures = monitor.failures(returncode, stopped)
    if on_progress is not None:
        on_progress(monitor.snapshot(failures))
    warnings = list(monitor.warnings)
    if left:
        warnings.append(f"processes {left} of the job could not be killed")
    clean_exit = returncode == 0 or (stopped and monitor.all_done())
    failed_at = None
    if monitor.first_failure_at is not None:
        failed_at = time.time() - (time.monotonic() - monitor.first_failure_at)
    return dict(
        ok=monitor.all_done() and not failures and not monitor.timed_out and clean_exit,
        returncode=returncode,
        timed_out=monitor.timed_out,
        duration_s=round(time.monotonic() - started, 3),
        ranks={r: monitor.states[r] for r in expected},
        failures=failures,
        stopped=stopped,
        warnings=warnings,
        failed_at=failed_at,
        ended_at=time.time(),
    )


def launch(
    spec: Mapping,
    world_size: int,
    *,
    local_worker_num: Optional[int] = None,
    node_rank: int = 0,
    master_addr: str = "127.0.0.1",
    master_port: Optional[int] = None,
    timeout: float = DEFAULT_TIMEOUT_S,
    log_dir: Optional[str] = None,
    env: Optional[Mapping] = None,
    on_progress: Optional[Callable[[dict], None]] = None,
    python: Optional[str] = None,
) -> LaunchResult:
    """Run the spec's checks on this node's ranks with msrun and collect the results.

    One machine: ``launch(spec, 4)``. One node of a real cluster, on every node:
    ``launch(spec, 8, local_worker_num=4, node_rank=i, master_addr="10.0.0.1",
    master_port=8118)``; msrun on the master node starts the scheduler.

    Args:
        spec: ``{"checks": [...], "layout": {...}}``, see ``worker.py``.
        world_size: Total number of ranks of the job.
        local_worker_num: Ranks on this node; defaults to ``world_size``.
        node_rank: This node's index; it runs ranks ``node_rank*L .. node_rank*L+L-1``.
        master_addr: The scheduler's address.
        master_port: The scheduler's port. None picks a free one, which needs
            ``master_addr`` to be this machine's.
        timeout: Seconds until the job is stopped and its unfinished ranks reported.
        log_dir: Run folder for ``spec.json``, ``results/`` and msrun's logs; a new
            temporary folder when None (kept, for the logs).
        env: Extra environment variables for msrun and the ranks.
        on_progress: Called about every 0.2 s with a snapshot dict (``elapsed_s``,
            ``ranks``: rank -> ``status``, ``current``, ``done``, ``total``), and once
            more at the end with ``finished: True``.
        python: Interpreter for the ranks; defaults to ``sys.executable``.

    Returns:
        A :class:`LaunchResult`. Failing ranks are reported there, not raised.

    Raises:
        LaunchError: the job could not be started; the message says how to fix it.
    """
    spec = normalize_spec(spec)
    _check_timeout(timeout)
    local = world_size if local_worker_num is None else local_worker_num
    _check_sizes(world_size, local, node_rank)
    starts_scheduler = msrun_starts_scheduler(master_addr)
    if master_port is None:
        if not starts_scheduler:
            raise LaunchError(
                f"master_port is required: msrun starts no scheduler for master_addr="
                f"{master_addr!r} (not an address of this machine in msrun's eyes), so the "
                "scheduler runs elsewhere or is started by hand. Pass the port it listens on."
            )
        master_port = find_free_port(master_addr)
    elif starts_scheduler:
        check_port_free(master_addr, master_port)
    msrun = find_msrun(python)
    run_dir, out_dir, spec_path = _prepare_run_dir(log_dir, spec)
    command = build_msrun_command(
        world_size, spec_path=spec_path, out_dir=out_dir, log_dir=run_dir,
        master_port=master_port, local_worker_num=local, node_rank=node_rank,
        master_addr=master_addr, msrun=msrun,
    )
    job_id = uuid.uuid4().hex
    msrun_log = os.path.join(run_dir, "msrun.log")

    def start(launchers, helpers):
        child_env = _child_env(job_id, env, python, local,
                               single_machine=local == world_size and starts_scheduler)
        launchers.append(_popen(command, child_env, msrun_log))

    first = node_rank * local
    fields = _run_job(
        job_id=job_id, start=start, expected=range(first, first + local),
        whole_world=local == world_size, out_dir=out_dir, log_dirs=[run_dir],
        launcher_logs=[msrun_log], timeout=timeout, on_progress=on_progress,
        total=len(spec["checks"]),
    )
    return LaunchResult(log_dir=run_dir, command=command, commands=[command], job_id=job_id,
                        master_port=master_port, **fields)


def launch_local_multinode(
    spec: Mapping,
    world_size: int,
    nodes: int,
    *,
    master_addr: str = "127.0.0.2",
    master_port: Optional[int] = None,
    timeout: float = DEFAULT_TIMEOUT_S,
    log_dir: Optional[str] = None,
    env: Optional[Mapping] = None,
    on_progress: Optional[Callable[[dict], None]] = None,
    python: Optional[str] = None,
) -> LaunchResult:
    """Simulate ``nodes`` nodes on this machine: a scheduler plus one msrun per node.

    Every msrun gets ``--master_addr=127.0.0.2``, which routes to loopback but which
    msrun does not take for a local address, so none starts a scheduler (with
    ``127.0.0.1`` each would, and all but one would fail); :func:`start_scheduler`
    starts the one scheduler. Node ``i`` runs ranks ``i*L .. i*L+L-1`` with ``L =
    world_size // nodes`` and logs to ``<log_dir>/node<i>``; all ranks write their
    results to the one ``<log_dir>/results``.

    Args:
        spec: See :func:`launch`.
        world_size: Total number of ranks.
        nodes: Number of simulated nodes; must divide ``world_size``.
        master_addr: A loopback address other than 127.0.0.1.
        master_port: The scheduler's port; None picks a free one.
        timeout: See :func:`launch`.
        log_dir: See :func:`launch`.
        env: See :func:`launch`.
        on_progress: See :func:`launch`.
        python: See :func:`launch`.

    Raises:
        LaunchError: bad sizes, a ``master_addr`` that msrun treats as local, a port
            in use, msrun not found.
    """
    spec = normalize_spec(spec)
    _check_timeout(timeout)
    if isinstance(nodes, bool) or not isinstance(nodes, int) or nodes < 1:
        raise LaunchError(f"nodes={nodes!r} is invalid: expected a positive integer.")
    if isinstance(world_size, int) and world_size % nodes:
        raise LaunchError(
            f"nodes={nodes} does not divide world_size={world_size}: every node runs the same "
            "number of ranks. Pick a divisor of world_size."
        )
    local = world_size // nodes
    _check_sizes(world_size, local, 0)
    if msrun_starts_scheduler(master_addr):
        raise LaunchError(
            f"master_addr={master_addr!r} is local in msrun's eyes, so every node's msrun would "
            "start its own scheduler. Use another loopback address such as 127.0.0.2."
        )
    if master_port is None:
        master_port = find_free_port(master_addr)
    else:
        check_port_free(master_addr, master_port)
    msrun = find_msrun(python)
    run_dir, out_dir, spec_path = _prepare_run_dir(log_dir, spec)
    node_dirs = [os.path.join(run_dir, f"node{i}") for i in range(nodes)]
    commands = [
        build_msrun_command(
            world_size, spec_path=spec_path, out_dir=out_dir, log_dir=node_dirs[i],
            master_port=master_port, local_worker_num=local, node_rank=i,
            master_addr=master_addr, msrun=msrun,
        )
        for i in range(nodes)
    ]
    msrun_logs = [os.path.join(d, "msrun.log") for d in node_dirs]
    job_id = uuid.uuid4().hex

    def start(launchers, helpers):
        helpers.append(start_scheduler(
            world_size, master_addr=master_addr, master_port=master_port,
            log_path=os.path.join(run_dir, "scheduler.log"), spec_path=spec_path,
            out_dir=out_dir, env=env, python=python, job_id=job_id,
        ))
        child_env = _child_env(job_id, env, python, world_size, single_machine=True)
        for command, log in zip(commands, msrun_logs):
            launchers.append(_popen(command, child_env, log))

    fields = _run_job(
        job_id=job_id, start=start, expected=range(world_size), whole_world=True,
        out_dir=out_dir, log_dirs=[run_dir] + node_dirs, launcher_logs=msrun_logs,
        timeout=timeout, on_progress=on_progress, total=len(spec["checks"]),
    )
    scheduler = [python or sys.executable, WORKER_SCRIPT, "--spec", spec_path, "--out", out_dir]
    return LaunchResult(log_dir=run_dir, command=commands[0], commands=[scheduler] + commands,
                        job_id=job_id, master_port=master_port, **fields)


# --------------------------------------------------------------------------- merging

#: Record fields that identify one measurement across ranks ("step" is the check's
#: position in the spec, so two runs of a check with other params stay apart).
IDENTITY_KEYS = ("step", "check", "group", "case", "op", "dtype", "shape", "size")


def _freeze(value):
    if isinstance(value, list):
        return tuple(_freeze(v) for v in value)
    if isinstance(value, dict):
        return tuple(sorted((k, _freeze(v)) for k, v in value.items()))
    return value


def _larger_error(current, new):
    # NaN must win: a NaN error on any rank is a failure worth seeing.
    if current is None or (isinstance(new, float) and math.isnan(new)):
        return new
    if isinstance(current, float) and math.isnan(current):
        return current
    return max(current, new)


def merge_records(result, key: Sequence[str] = IDENTITY_KEYS) -> list:
    """Merge the records of all ranks into one row per measurement.

    Records are matched on the ``key`` fields they have (a field missing on both sides
    matches). A row passes when the record passed on every rank that produced it; its
    ``max_error`` is the largest over those ranks (NaN wins, None is skipped).

    Args:
        result: A :class:`LaunchResult`, or a mapping rank -> result JSON (or None).
        key: Identity fields; defaults to :data:`IDENTITY_KEYS`.

    Returns:
        ``[{<key fields present>, "passed", "max_error", "ranks": n, "failed_ranks": [...]}]``
        in order of first appearance, lowest rank first.

    Example::

        >>> merge_records({
        ...     0: {"records": [{"check": "c", "group": "tp", "passed": True, "max_error": 0.5}]},
        ...     1: {"records": [{"check": "c", "group": "tp", "passed": False, "max_error": 1.0}]},
        ... })  # doctest: +NORMALIZE_WHITESPACE
        [{'check': 'c', 'group': 'tp', 'passed': False, 'max_error': 1.0, 'ranks': 2,
          'failed_ranks': [1]}]
    """
    ranks = result.ranks if isinstance(result, LaunchResult) else result
    merged = {}
    for rank in sorted(ranks):
        for record in (ranks[rank] or {}).get("records", []):
            ident = tuple((f, _freeze(record[f])) for f in key if f in record)
            row = merged.get(ident)
            if row is None:
                row = merged[ident] = {f: record[f] for f in key if f in record}
                row.update(passed=True, max_error=None, ranks=0, failed_ranks=[])
            row["ranks"] += 1
            if not record.get("passed", False):
                row["passed"] = False
                row["failed_ranks"].append(rank)
            if record.get("max_error") is not None:
                row["max_error"] = _larger_error(row["max_error"], record["max_error"])
    return list(merged.values())
