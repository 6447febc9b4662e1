"""Finding and stopping a job's processes through ``/proc`` (Linux, as msrun on CPU is).

msrun starts each worker with ``setsid``, so killing msrun's process group misses them.
Every process of a job instead carries ``MSDIST_HARNESS_JOB=<id>`` in its environment
(msrun hands its environment down), which ``/proc/<pid>/environ`` shows; descendants of
the processes we started (from ``/proc/<pid>/stat``) are added for safety.

Example::

    stop_job(job_id, [msrun_popen])   # -> [] once nothing of the job is left
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from typing import Optional, Sequence

JOB_ENV = "MSDIST_HARNESS_JOB"
KILL_GRACE_S = 2.0


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
