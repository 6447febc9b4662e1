"""Watching a running job: rank status files, dead ranks, msrun and the scheduler.

:class:`_Monitor` polls until the job ends, fails or times out, and then turns what it
saw into the launch's failure list (kind, reason, log tail per rank). It stops nothing:
:mod:`.launcher` does that, always, afterwards.
"""

from __future__ import annotations

import json
import os
import re
import signal
import time
from typing import Optional

from .msrun_command import WORKER_SCRIPT
from .processes import _alive, _parent, _proc_cmdline, _zombie_exit_code, job_processes

POLL_S = 0.2
# After the first failure, ranks that fail the same way get this long to report their
# own error before the job is stopped.
FAILURE_SETTLE_S = 1.0
# msrun checks its workers once a second and logs a failed worker's exit code then.
MSRUN_POLL_S = 1.2
# How long msrun may take to exit after every rank finished before it is stopped.
EXIT_GRACE_S = 30.0
LOG_TAIL_LINES = 30

FAILURE_KINDS = ("error", "crash", "timeout", "infra", "missing", "stopped")
_MSRUN_EXIT_RE = re.compile(r"Worker process (\d+) exit with exception\. Error code: (-?\d+)")


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
        Each rank also has ``records``: those of its checks done so far.
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
                # the records of the checks done so far (a caller may show them as they come)
                "records": state.get("records", []),
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
