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

Finding the job's processes: msrun starts each worker with ``setsid``, so killing
msrun's process group misses them. Every process of a job instead carries
``MSDIST_HARNESS_JOB=<id>`` in its environment (msrun hands its environment down), which
``/proc/<pid>/environ`` shows; descendants of the processes we started (from
``/proc/<pid>/stat``) are added for safety. Both are Linux-only, as msrun on CPU is.

Multi-node: :func:`launch` runs one node of a real cluster (``node_rank``,
``master_addr``); :func:`launch_local_multinode` simulates several nodes on loopback
with a scheduler started by hand (:func:`start_scheduler`), because msrun only starts a
scheduler when ``master_addr`` is an address of this machine, and ``127.0.0.2`` is not.
"""

from __future__ import annotations

import ctypes
import json
import math
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from typing import Callable, Mapping, Optional, Sequence

WORKER_SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "worker.py")
# The folder holding the ``mindscience`` package: first on the ranks' PYTHONPATH, so a
# source checkout works without ``pip install -e``.
_PACKAGE_ROOT = os.path.abspath(os.path.join(os.path.dirname(WORKER_SCRIPT), "..", "..", ".."))

JOB_ENV = "MSDIST_HARNESS_JOB"
# Ranks started on this machine; the worker reads it under the same name (worker.py).
RANKS_HERE_ENV = "MSDIST_RANKS_HERE"
RESULTS_DIR = "results"
DEFAULT_TIMEOUT_S = 300.0
POLL_S = 0.2
# After the first failure, ranks that fail the same way get this long to report their
# own error before the job is stopped.
FAILURE_SETTLE_S = 1.0
# msrun checks its workers once a second and logs a failed worker's exit code then.
MSRUN_POLL_S = 1.2
# How long msrun may take to exit after every rank finished before it is stopped.
EXIT_GRACE_S = 30.0
KILL_GRACE_S = 2.0
LOG_TAIL_LINES = 30
# msrun tails every worker log to its stdout unless --tail_worker_log names other ranks.
# Those ``tail -f`` processes duplicate the logs and never end on their own, so name a
# rank that does not exist (msrun then logs one warning per worker).
NO_TAIL = "-2"
# Ports at or above the kernel's ephemeral range can be handed to an outgoing
# connection at any moment (the ranks' own connections to the scheduler, for one).
_PORT_RANGE = (20000, 32000)

FAILURE_KINDS = ("error", "crash", "timeout", "infra", "missing", "stopped")
_MSRUN_EXIT_RE = re.compile(r"Worker process (\d+) exit with exception\. Error code: (-?\d+)")


class LaunchError(RuntimeError):
    """The job could not be started: a bad argument, a port in use, msrun not found."""


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


# --------------------------------------------------------------------------- ports


def _can_bind(host: str, port: int) -> bool:
    # No SO_REUSEADDR: the test must also fail for a port in TIME_WAIT or bound on the
    # wildcard address, both of which make the scheduler's own bind fail.
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def find_free_port(host: str = "127.0.0.1", *, attempts: int = 50) -> int:
    """Pick a TCP port that is free on ``host``.

    Tries random ports below the kernel's ephemeral range (see ``_PORT_RANGE``) first,
    then lets the kernel choose one (bind to port 0).

    Raises:
        LaunchError: ``host`` is not an address of this machine.
    """
    if not _can_bind(host, 0):
        raise LaunchError(
            f"master_addr={host!r} is not an address of this machine, so no free port can be "
            "picked on it: pass master_port (the scheduler's port on the master node)."
        )
    rng = random.Random()  # not the global generator, which tests may seed
    for _ in range(attempts):
        port = rng.randint(*_PORT_RANGE)
        if _can_bind(host, port):
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def check_port_free(host: str, port: int) -> None:
    """Raise :class:`LaunchError` unless the scheduler could listen on ``host:port``."""
    if isinstance(port, bool) or not isinstance(port, int) or not 1024 <= port <= 65535:
        raise LaunchError(f"master_port={port!r} is invalid: expected an integer in 1024..65535.")
    if not _can_bind(host, port):
        raise LaunchError(
            f"master_port={port} is already in use on {host}: the scheduler could not listen "
            "there. Pass another port, or master_port=None to pick a free one."
        )


def msrun_starts_scheduler(master_addr: str) -> bool:
    """Whether msrun on this machine starts a scheduler for ``master_addr``.

    Mirrors msrun's ``_is_local_ip``: the address is on one of this machine's interfaces
    (``ip -j addr``) or is the source address the kernel picks to reach it. ``127.0.0.2``
    routes to ``lo`` but is neither, which the loopback multi-node recipe relies on.
    """
    try:
        ip = socket.gethostbyname(master_addr)
    except OSError:
        return False
    try:
        out = subprocess.run(["ip", "-j", "addr"], capture_output=True, text=True, timeout=5)
        for iface in json.loads(out.stdout or "[]"):
            if any(a.get("local") == ip for a in iface.get("addr_info", [])):
                return True
    except (OSError, ValueError, subprocess.SubprocessError):
        pass  # no `ip` tool: msrun falls back to the routing test below as well
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((ip, 8117))  # a UDP connect sends nothing, it only picks a route
            return s.getsockname()[0] == ip
    except OSError:
        return False


# --------------------------------------------------------------------------- commands


def find_msrun(python: Optional[str] = None) -> str:
    """Path of msrun: next to the interpreter first, then on PATH.

    Raises:
        LaunchError: msrun is in neither place.
    """
    candidate = os.path.join(os.path.dirname(python or sys.executable), "msrun")
    if os.access(candidate, os.X_OK):
        return candidate
    found = shutil.which("msrun")
    if found:
        return found
    raise LaunchError(
        f"msrun was not found next to {python or sys.executable} nor on PATH: it comes with "
        "MindSpore. Install mindspore into this environment."
    )


def _check_timeout(timeout) -> None:
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
        raise LaunchError(f"timeout={timeout!r} is invalid: expected a positive number of seconds.")


def _check_sizes(world_size, local_worker_num, node_rank) -> None:
    for name, value in (("world_size", world_size), ("local_worker_num", local_worker_num)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise LaunchError(f"{name}={value!r} is invalid: expected a positive integer.")
    if world_size % local_worker_num:
        raise LaunchError(
            f"local_worker_num={local_worker_num} is invalid for world_size={world_size}: "
            "expected a divisor of world_size (every node runs the same number of ranks)."
        )
    nodes = world_size // local_worker_num
    if isinstance(node_rank, bool) or not isinstance(node_rank, int) or not 0 <= node_rank < nodes:
        raise LaunchError(
            f"node_rank={node_rank!r} is invalid: expected 0..{nodes - 1} for {nodes} node(s) "
            f"of {local_worker_num} rank(s)."
        )


def build_msrun_command(
    world_size: int,
    *,
    spec_path: str,
    out_dir: str,
    log_dir: str,
    master_port: int,
    local_worker_num: Optional[int] = None,
    node_rank: int = 0,
    master_addr: str = "127.0.0.1",
    msrun: str = "msrun",
    script: str = WORKER_SCRIPT,
) -> list:
    """The msrun argv that starts this node's ranks of the harness. Starts nothing.

    Example::

        >>> build_msrun_command(2, spec_path="s.json", out_dir="o", log_dir="l",
        ...                     master_port=29500, script="worker.py")  # doctest: +NORMALIZE_WHITESPACE
        ['msrun', '--worker_num=2', '--local_worker_num=2', '--node_rank=0',
         '--master_addr=127.0.0.1', '--master_port=29500', '--log_dir=l', '--join=True',
         '--tail_worker_log=-2', 'worker.py', '--spec', 's.json', '--out', 'o']

    Raises:
        LaunchError: world_size, local_worker_num or node_rank out of range.
    """
    local = world_size if local_worker_num is None else local_worker_num
    _check_sizes(world_size, local, node_rank)
    return [
        msrun,
        f"--worker_num={world_size}",
        f"--local_worker_num={local}",
        f"--node_rank={node_rank}",
        f"--master_addr={master_addr}",
        f"--master_port={master_port}",
        f"--log_dir={log_dir}",
        "--join=True",
        f"--tail_worker_log={NO_TAIL}",
        script,
        "--spec",
        spec_path,
        "--out",
        out_dir,
    ]


def _prepend(paths: str, first: str) -> str:
    return os.pathsep.join([first] + [p for p in paths.split(os.pathsep) if p and p != first])


def _child_env(job_id: str, env: Optional[Mapping], python: Optional[str],
               ranks_here: int = 1) -> dict:
    child = dict(os.environ)
    # How many ranks share this machine's cores (the worker sizes its CPU thread pool).
    child[RANKS_HERE_ENV] = str(ranks_here)
    child.update({k: str(v) for k, v in (env or {}).items()})
    # msrun starts the ranks as plain `python`, looked up on PATH: make it this one.
    child["PATH"] = _prepend(child.get("PATH", ""), os.path.dirname(python or sys.executable))
    child["PYTHONPATH"] = _prepend(child.get("PYTHONPATH", ""), _PACKAGE_ROOT)
    child["PYTHONUNBUFFERED"] = "1"  # complete logs even from a rank that gets killed
    child["PYTHONFAULTHANDLER"] = "1"  # a segfaulting rank logs its Python stack
    child[JOB_ENV] = job_id
    return child


def _prctl():
    try:
        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):  # not Linux/glibc: no parent-death signal
        return None


def _die_with_parent_fn():
    """A preexec_fn that has the kernel SIGKILL the child when the launcher dies.

    Covers the one case the launcher's own cleanup cannot: the launcher killed hard.
    Ranks then notice that their msrun is gone and exit as well (see ``worker.py``).
    prctl is looked up here, in the parent: after fork() only the call may run, since
    dlopen in the child could deadlock on a lock another thread held (a Rich display
    refreshes from its own thread).
    """
    prctl = _prctl()
    if prctl is None:
        return None

    def preexec():
        prctl(1, signal.SIGKILL)  # 1 = PR_SET_PDEATHSIG

    return preexec


def _popen(argv: list, env: dict, log_path: str) -> subprocess.Popen:
    os.makedirs(os.path.dirname(os.path.abspath(log_path)), exist_ok=True)
    preexec = _die_with_parent_fn()
    with open(log_path, "w", encoding="utf-8") as log:
        return subprocess.Popen(
            argv,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            # Own session: Ctrl+C in a terminal reaches only the launcher, which then
            # stops the job in order instead of racing msrun's own SIGINT handling.
            start_new_session=True,
            preexec_fn=preexec,
        )


def start_scheduler(
    world_size: int,
    *,
    master_addr: str,
    master_port: int,
    log_path: str,
    spec_path: str = os.devnull,
    out_dir: str = os.devnull,
    env: Optional[Mapping] = None,
    python: Optional[str] = None,
    job_id: Optional[str] = None,
) -> subprocess.Popen:
    """Start a MindSpore scheduler by hand, as msrun does on the master node.

    Needed when no msrun starts one because ``master_addr`` is not local in msrun's
    eyes (the ``127.0.0.2`` loopback recipe). Runs ``worker.py`` with
    ``MS_ROLE=MS_SCHED MS_SCHED_HOST=<addr> MS_SCHED_PORT=<port> MS_WORKER_NUM=<N>``.

    Args:
        world_size: Number of ranks the scheduler waits for.
        master_addr: Address it listens on.
        master_port: Port it listens on.
        log_path: File for its output.
        spec_path: Passed on like the ranks get it (the scheduler role ignores it).
        out_dir: Likewise.
        env: Extra environment variables.
        python: Interpreter; defaults to ``sys.executable``.
        job_id: ``MSDIST_HARNESS_JOB`` value, by which :func:`stop_job` finds it.

    Returns:
        The scheduler's Popen. The caller stops it (:func:`stop_job`).
    """
    child = _child_env(job_id or uuid.uuid4().hex, env, python)
    child.update(
        MS_ROLE="MS_SCHED",
        MS_SCHED_HOST=master_addr,
        MS_SCHED_PORT=str(master_port),
        MS_WORKER_NUM=str(world_size),
        RANK_SIZE=str(world_size),
        RANK_ID="0",  # what msrun gives its own scheduler
    )
    argv = [python or sys.executable, WORKER_SCRIPT, "--spec", spec_path, "--out", out_dir]
    return _popen(argv, child, log_path)


# --------------------------------------------------------------------------- processes


def _proc_stat(pid: int) -> Optional[list]:
    """Fields 3.. of /proc/<pid>/stat (state, ppid, ...), or None if the process is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            data = fh.read()
    except OSError:
        return None
    # The command name in parentheses may itself contain spaces and parentheses.
    return data[data.rindex(b")") + 2 :].decode().split()


def _alive(pid: int) -> bool:
    stat = _proc_stat(pid)
    return stat is not None and stat[0] not in ("Z", "X")


def _parent(pid: int) -> Optional[int]:
    stat = _proc_stat(pid)
    return int(stat[1]) if stat else None


def _zombie_exit_code(pid: int) -> Optional[int]:
    """Exit code of a dead, not yet reaped process (as Popen reports it), else None."""
    stat = _proc_stat(pid)
    if not stat or stat[0] != "Z" or len(stat) < 50:
        return None
    status = int(stat[49])  # field 52, exit_code, in waitpid() format (Linux >= 3.5)
    return -(status & 0x7F) if status & 0x7F else (status >> 8) & 0xFF


def _proc_env(pid: int) -> dict:
    try:
        with open(f"/proc/{pid}/environ", "rb") as fh:
            raw = fh.read()
    except OSError:  # gone, or another user's process
        return {}
    env = {}
    for item in raw.split(b"\0"):
        key, sep, value = item.partition(b"=")
        if sep:
            env[key.decode(errors="replace")] = value.decode(errors="replace")
    return env


def _proc_cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as fh:
            return fh.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _all_pids() -> list:
    return [int(name) for name in os.listdir("/proc") if name.isdigit()]


def job_processes(*, job_id: Optional[str] = None, port: Optional[int] = None) -> dict:
    """Live processes whose environment has the job's id or ``MS_SCHED_PORT=<port>``.

    Args:
        job_id: The job's ``MSDIST_HARNESS_JOB`` value.
        port: The job's scheduler port (msrun gives it to the scheduler and every rank).

    Returns:
        pid -> that process's environment. Zombies and this process are left out.
    """
    if job_id is None and port is None:
        raise ValueError("job_processes() needs job_id or port: expected at least one to match.")
    found = {}
    for pid in _all_pids():
        if pid == os.getpid():
            continue
        env = _proc_env(pid)
        if (job_id is not None and env.get(JOB_ENV) == job_id) or (
            port is not None and env.get("MS_SCHED_PORT") == str(port)
        ):
            if _alive(pid):
                found[pid] = env
    return found


def _descendants(roots: Sequence[int]) -> set:
    children = {}
    for pid in _all_pids():
        stat = _proc_stat(pid)
        if stat:
            children.setdefault(int(stat[1]), []).append(pid)
    seen, todo = set(), list(roots)
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in seen:
                seen.add(child)
                todo.append(child)
    return seen


def kill_processes(pids: Sequence[int], grace: float = KILL_GRACE_S) -> list:
    """SIGTERM ``pids``, wait up to ``grace`` seconds, then SIGKILL the rest.

    Returns:
        The pids still alive afterwards (normally none).
    """

    def send(sig, targets):
        for pid in targets:
            try:
                os.kill(pid, sig)
            except (ProcessLookupError, PermissionError):
                pass

    def wait(targets, seconds):
        deadline = time.monotonic() + seconds
        while True:
            targets = [p for p in targets if _alive(p)]
            if not targets or time.monotonic() >= deadline:
                return targets
            time.sleep(0.05)

    alive = [p for p in pids if _alive(p)]
    send(signal.SIGTERM, alive)
    alive = wait(alive, grace)
    send(signal.SIGKILL, alive)
    return wait(alive, 2.0)


def stop_job(job_id: str, popens: Sequence[subprocess.Popen] = (), grace: float = KILL_GRACE_S) -> list:
    """Kill every process of a job and reap the ones this process started.

    Finds them by ``MSDIST_HARNESS_JOB=<job_id>`` in their environment plus the
    descendants of ``popens``, and repeats until none is left (a dying msrun may still
    have been starting one).

    Returns:
        Pids that could not be killed (normally none).
    """
    left = []
    for _ in range(3):
        pids = set(job_processes(job_id=job_id)) | _descendants([p.pid for p in popens])
        pids |= {p.pid for p in popens if p.poll() is None}
        pids.discard(os.getpid())
        if not pids:
            break
        left = kill_processes(sorted(pids), grace)
    for p in popens:
        try:
            p.wait(timeout=5)
        except subprocess.TimeoutExpired:
            left.append(p.pid)
    return sorted(set(left))


# --------------------------------------------------------------------------- monitoring


def _tail(path: str, lines: int = LOG_TAIL_LINES) -> str:
    try:
        with open(path, "rb") as fh:
            fh.seek(0, os.SEEK_END)
            fh.seek(max(0, fh.tell() - 256 * 1024))
            text = fh.read().decode(errors="replace")
    except OSError:
        return ""
    return "\n".join(text.splitlines()[-lines:])


def _describe_exit(code: Optional[int]) -> str:
    if code is None:
        return "an unknown exit code"
    if code < 0:
        try:
            return f"exit code {code} ({signal.Signals(-code).name})"
        except ValueError:
            pass
    return f"exit code {code}"


_EXCEPTION_RE = re.compile(r"^[A-Za-z_][\w.]*(Error|Exception|Exit|Interrupt|Fault)\b.*")


def _exception_line(tb: Optional[str]) -> str:
    """The ``SomeError: message`` line of a traceback.

    MindSpore appends a C++ call stack after the Python exception line, so the last
    line of its tracebacks is not the message.
    """
    lines = (tb or "").strip().splitlines()
    for line in reversed(lines):
        if _EXCEPTION_RE.match(line):
            return line.strip()
    return lines[-1].strip() if lines else "?"


def _where(state: Optional[dict]) -> str:
    if not state:
        return "before it wrote any status"
    current = state.get("current")
    place = f"in {current!r}" if current else f"with status {state.get('status')!r}"
    return f"{place} ({state.get('done', 0)}/{state.get('total', '?')} checks done)"


class _Monitor:
    """Watches one job until it ends, fails or times out. Stopping is the caller's job.

    Args:
        job_id: The job's ``MSDIST_HARNESS_JOB`` value.
        launchers: The msrun Popens; the job ends when all have exited.
        helpers: Other Popens of the job (a scheduler started by hand).
        expected: Global ranks that run on this machine.
        whole_world: ``expected`` is every rank of the job, so once they have all
            exited nobody needs the scheduler any more.
        out_dir: Where the ``rank_<r>.json`` files appear.
        log_dirs: msrun log folders (``worker_<r>.log``, ``scheduler.log``).
        launcher_logs: msrun's stdout files (it logs failed workers' exit codes there).
        timeout: Seconds from the start until the job is stopped.
        on_progress: Called with :meth:`snapshot` after every poll.
        total: Number of checks in the spec.
    """

    def __init__(self, *, job_id, launchers, helpers, expected, whole_world, out_dir, log_dirs,
                 launcher_logs, timeout, on_progress, total):
        self.job_id = job_id
        self.launchers = launchers
        self.helpers = helpers
        self.expected = list(expected)
        self.whole_world = whole_world
        self.out_dir = out_dir
        self.log_dirs = log_dirs
        self.launcher_logs = launcher_logs
        self.timeout = timeout
        self.on_progress = on_progress
        self.total = total
        self.start = time.monotonic()
        self.states = {r: None for r in self.expected}
        self.pids = {}  # rank -> pid of its worker, once seen
        self.exit_codes = {}  # pid -> exit code of a worker that died
        self.failed = {}  # rank -> kind ("error" or "crash"), in the order detected
        self.first_failure_at = None
        self.live = {}  # rank -> pid of its live worker process, as of the last scan
        self.schedulers = {}  # scheduler pid -> exit code once it died, else None
        self.infra = []  # reasons why msrun or a scheduler failed
        self.workers_gone_at = None
        self.all_done_at = None
        self.timed_out = False
        self.warnings = []
        self._stamps = {}

    # -- reading

    def read_states(self, force: bool = False) -> None:
        """Re-read the rank files that changed since the last read."""
        if force:
            self._stamps.clear()
        for rank in self.expected:
            path = os.path.join(self.out_dir, f"rank_{rank}.json")
            try:
                st = os.stat(path)
                stamp = (st.st_mtime_ns, st.st_size, st.st_ino)
                if self._stamps.get(rank) == stamp:
                    continue
                with open(path, encoding="utf-8") as fh:
                    self.states[rank] = json.load(fh)
                self._stamps[rank] = stamp
            except (OSError, ValueError):
                continue  # not there yet, or replaced while reading: next poll
            if self.states[rank].get("pid"):
                self.pids.setdefault(rank, self.states[rank]["pid"])

    def _scan(self) -> None:
        """Find this job's live rank and scheduler processes (``self.live``, ``self.schedulers``)."""
        self.live = {}
        # Ranks and schedulers only: not msrun (whose command line names the script too),
        # nor anything else that inherited the job id.
        found = {pid: env for pid, env in job_processes(job_id=self.job_id).items()
                 if env.get("MS_ROLE") and WORKER_SCRIPT in _proc_cmdline(pid)}
        for pid, env in found.items():
            if _parent(pid) in found:
                # A fork of a rank or of the scheduler (MindSpore's import runs
                # subprocesses) has its parent's command line and environment until it
                # execs; taken for the scheduler, its exit would end the job.
                continue
            role, rank = env.get("MS_ROLE"), env.get("RANK_ID", "")
            if role == "MS_WORKER" and rank.isdigit():
                self.live[int(rank)] = pid
            elif role == "MS_SCHED":
                self.schedulers.setdefault(pid, None)

    def read_exit_codes(self) -> None:
        """Collect the exit codes msrun logged for workers that failed."""
        for path in self.launcher_logs:
            for pid, code in _MSRUN_EXIT_RE.findall(_tail(path, lines=500)):
                self.exit_codes.setdefault(int(pid), int(code))

    def status(self, rank: int) -> Optional[str]:
        state = self.states.get(rank)
        return state.get("status") if state else None

    # -- detecting

    def _fail(self, rank: int, kind: str) -> None:
        if rank not in self.failed:
            self.failed[rank] = kind
            self.first_failure_at = self.first_failure_at or time.monotonic()

    def _check_errors(self) -> None:
        for rank in self.expected:
            if self.status(rank) == "error":
                self._fail(rank, "error")

    def _check_deaths(self, live: dict) -> None:
        """A rank whose process is gone before it finished has crashed."""
        self.pids.update({r: pid for r, pid in live.items() if r in self.states})
        dead = [r for r, pid in self.pids.items()
                if r not in live and r not in self.failed
                and self.status(r) not in ("done", "error") and not _alive(pid)]
        for rank in dead:
            code = _zombie_exit_code(self.pids[rank])
            if code is not None:
                self.exit_codes.setdefault(self.pids[rank], code)
        if not dead:
            return
        had_failure = self.first_failure_at is not None
        self.read_states(force=True)  # a rank writes its error just before it exits
        self._check_errors()
        crashed = [r for r in dead if self.status(r) not in ("done", "error")]
        # When msrun saw the crash first it has SIGKILLed the other ranks already: in one
        # batch of deaths, those killed by SIGKILL are collateral of the others.
        codes = {r: self.exit_codes.get(self.pids[r]) for r in crashed}
        if any(c != -signal.SIGKILL for c in codes.values()):
            crashed = [r for r in crashed if codes[r] != -signal.SIGKILL]
        if not had_failure:  # later deaths are collateral of the first failure
            for rank in crashed:
                self._fail(rank, "crash")

    def _check_launchers(self) -> None:
        """msrun or a scheduler that ends before the ranks finished ends the job.

        Without a scheduler the ranks would wait for it in init() for MS_TOPO_TIMEOUT
        (600 s by default).
        """
        if self.all_done() or self.infra:
            return
        for pid, code in self.schedulers.items():
            if code is None and not _alive(pid):
                code = _zombie_exit_code(pid)
                self.schedulers[pid] = code
                self.infra.append(f"the scheduler (pid {pid}) ended with {_describe_exit(code)} "
                                  "before the ranks finished")
        for p in self.launchers + self.helpers:
            if p.poll() not in (None, 0) and p.pid not in self.schedulers:
                what = "the scheduler" if p in self.helpers else "msrun"
                self.infra.append(f"{what} (pid {p.pid}) exited with {_describe_exit(p.returncode)} "
                                  "before the ranks finished")
        if self.infra:
            self.first_failure_at = self.first_failure_at or time.monotonic()

    def all_done(self) -> bool:
        return all(self.status(r) == "done" for r in self.expected)

    def _finished(self, now: float) -> bool:
        if all(p.poll() is not None for p in self.launchers):
            return True
        if self.first_failure_at is not None:
            return now - self.first_failure_at >= FAILURE_SETTLE_S
        if self.all_done():
            self.all_done_at = self.all_done_at or now
            if self.whole_world and not self.live:
                # Every rank finished and exited; the scheduler would take up to 5 s to
                # notice. Wait only for msrun's 1 s poll, which logs bad exit codes.
                self.workers_gone_at = self.workers_gone_at or now
                return now - self.workers_gone_at >= MSRUN_POLL_S
            # Only when this machine runs the whole job: on one node of a cluster, msrun
            # of the master node hosts the scheduler that other nodes may still need.
            if self.whole_world and now - self.all_done_at >= EXIT_GRACE_S:
                self.warnings.append(
                    f"msrun did not exit within {EXIT_GRACE_S:g} s after every rank finished; "
                    "the launcher stopped it."
                )
                return True
        if now - self.start >= self.timeout:
            self.timed_out = True
            return True
        return False

    def run(self) -> None:
        """Poll until the job ends, fails or times out."""
        while True:
            self.read_states()
            self._check_errors()
            self._scan()
            self._check_deaths(self.live)
            self._check_launchers()
            if self.on_progress is not None:
                self.on_progress(self.snapshot())
            if self._finished(time.monotonic()):
                return
            time.sleep(POLL_S)

    def dump_stacks(self) -> None:
        """Have the live ranks print their Python stacks into their logs (SIGUSR1)."""
        self._scan()
        live = self.live
        for pid in live.values():
            try:
                os.kill(pid, signal.SIGUSR1)
            except (ProcessLookupError, PermissionError):
                pass
        if live:
            time.sleep(0.5)

    def snapshot(self, failures: Optional[list] = None) -> dict:
        """Progress for a display: each rank's status, current check and checks done.

        Statuses: ``pending`` (no file yet), ``starting``, ``running``, ``done``,
        ``error``, ``crashed``; in the final snapshot also the failure kinds.
        """
        final = {f["rank"]: f["kind"] for f in failures or []}
        ranks = {}
        for rank in self.expected:
            state = self.states[rank] or {}
            status = state.get("status", "pending")
            if self.failed.get(rank) == "crash":
                status = "crashed"
            ranks[rank] = {
                "status": final.get(rank, status),
                "current": state.get("current"),
                "done": state.get("done", 0),
                "total": state.get("total", self.total),
                "pid": self.pids.get(rank),
            }
        return {
            "elapsed_s": round(time.monotonic() - self.start, 2),
            "timeout_s": self.timeout,
            "total": self.total,
            "ranks": ranks,
            "failed": sorted(self.failed),
            "finished": failures is not None,
        }

    # -- reporting

    def _worker_log(self, rank: int) -> str:
        name = f"worker_{rank}.log"
        for d in self.log_dirs:
            if os.path.exists(os.path.join(d, name)):
                return os.path.join(d, name)
        return os.path.join(self.log_dirs[0], name)

    def _infra_tail(self) -> str:
        paths = [os.path.join(d, "scheduler.log") for d in self.log_dirs] + self.launcher_logs
        return "\n".join(f"== {p}\n{_tail(p)}" for p in paths if os.path.exists(p))

    def _reason(self, rank: int, kind: str, returncode: Optional[int]) -> str:
        state = self.states[rank]
        if kind == "error":
            return f"rank {rank} raised {_where(state)}: {_exception_line((state or {}).get('error'))}"
        if kind == "crash":
            pid = self.pids.get(rank)
            code = self.exit_codes.get(pid)
            return f"rank {rank} (pid {pid}) died {_where(state)} with {_describe_exit(code)}"
        if kind == "timeout":
            reason = (f"rank {rank} did not finish within the {self.timeout:g} s timeout: "
                      f"it was {_where(state)}")
            if (state or {}).get("current") == "init":
                reason += "; init() waits for every rank and the scheduler: is each one up and reachable?"
            return reason
        if kind == "stopped":
            culprits = ", ".join(map(str, sorted(self.failed)))
            cause = f"rank(s) {culprits} failed" if culprits else "msrun or the scheduler failed (rank -1)"
            reason = f"rank {rank} was stopped after {cause}; it was {_where(state)}"
            done = (state or {}).get("done", 0)
            if any(done < (self.states[r] or {}).get("done", 0) for r in self.failed):
                # Typical of a hang: the others time out in a collective this rank never
                # joined (MCCL gives up after about 30 s), so this rank is the suspect.
                reason += ", behind them: it may be why their collective failed"
            return reason
        return (f"rank {rank} produced no final result: msrun exited with code {returncode} "
                f"while it was {_where(state)}")

    def failures(self, returncode: Optional[int], stopped: bool) -> list:
        """Every rank that did not finish, with kind, reason and log tail; most important first."""
        # msrun may have seen a rank die that no poll caught alive: its log names the pid.
        by_pid = {pid: rank for rank, pid in self.pids.items()}
        for pid in self.exit_codes:
            rank = by_pid.get(pid)
            if rank is not None and self.status(rank) not in ("done", "error") and not self.failed:
                self._fail(rank, "crash")
        kinds = dict(self.failed)
        for rank in self.expected:
            if rank not in kinds and self.status(rank) != "done":
                if self.timed_out:
                    kinds[rank] = "timeout"
                elif self.failed or self.infra:
                    kinds[rank] = "stopped"
                else:
                    kinds[rank] = "missing"
        out = [{"rank": r, "kind": k, "reason": self._reason(r, k, returncode),
                "log_tail": _tail(self._worker_log(r))} for r, k in kinds.items()]
        infra = list(self.infra)
        if not self.failed and not infra and returncode not in (None, 0) and not stopped:
            infra.append(f"msrun exited with code {returncode}")
        if infra and not self.failed:
            out.append({"rank": -1, "kind": "infra",
                        "reason": "; ".join(infra) + ": see the scheduler and msrun logs",
                        "log_tail": self._infra_tail()})
        out.sort(key=lambda f: (FAILURE_KINDS.index(f["kind"]),
                                (self.states.get(f["rank"]) or {}).get("done", -1), f["rank"]))
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
    return dict(
        ok=monitor.all_done() and not failures and not monitor.timed_out and clean_exit,
        returncode=returncode,
        timed_out=monitor.timed_out,
        duration_s=round(time.monotonic() - started, 3),
        ranks={r: monitor.states[r] for r in expected},
        failures=failures,
        stopped=stopped,
        warnings=warnings,
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
        launchers.append(_popen(command, _child_env(job_id, env, python, local), msrun_log))

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
        child_env = _child_env(job_id, env, python, world_size)
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
