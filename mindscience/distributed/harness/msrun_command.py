"""The msrun side of a launch: free ports, the msrun command line, the ranks' environment.

Pure Python with no MindSpore import. :mod:`.launcher` puts these together; the
upstream-style test and ``msdist verify --dry-run`` build commands with them directly.

Example::

    port = find_free_port()
    argv = build_msrun_command(4, spec_path="spec.json", out_dir="results",
                               log_dir="logs", master_port=port, msrun=find_msrun())
"""

from __future__ import annotations

import ctypes
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import uuid
from typing import Mapping, Optional

from .processes import JOB_ENV

WORKER_SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "worker.py")
# The folder holding the ``mindscience`` package: first on the ranks' PYTHONPATH, so a
# source checkout works without ``pip install -e``.
_PACKAGE_ROOT = os.path.abspath(os.path.join(os.path.dirname(WORKER_SCRIPT), "..", "..", ".."))

# Ranks started on this machine (the worker sizes its CPU thread pool by it).
RANKS_HERE_ENV = "MSDIST_RANKS_HERE"
# msrun tails every worker log to its stdout unless --tail_worker_log names other ranks.
# Those ``tail -f`` processes duplicate the logs and never end on their own, so name a
# rank that does not exist (msrun then logs one warning per worker).
NO_TAIL = "-2"
# MindSpore's workers retry reaching the scheduler every 3-5 s (a random pick); on one
# machine the scheduler listens a moment after their first try, so most of a launch's
# init() was that wait. 0-1 s took a 4-rank ping job from 20-21 s to 13 s (measured).
# Only where the whole job runs here: on a cluster the wider spread spares the scheduler a
# burst of connections from every node. The environment (or ``env``) overrides both.
SINGLE_MACHINE_ENV = {"MS_RETRY_INTERVAL_LOWER": "0", "MS_RETRY_INTERVAL_UPPER": "1"}
# Ports at or above the kernel's ephemeral range can be handed to an outgoing
# connection at any moment (the ranks' own connections to the scheduler, for one).
_PORT_RANGE = (20000, 32000)


class LaunchError(RuntimeError):
    """The job could not be started: a bad argument, a port in use, msrun not found."""


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
               ranks_here: int = 1, single_machine: bool = False) -> dict:
    child = dict(os.environ)
    # How many ranks share this machine's cores (the worker sizes its CPU thread pool).
    child[RANKS_HERE_ENV] = str(ranks_here)
    if single_machine:
        for key, value in SINGLE_MACHINE_ENV.items():
            child.setdefault(key, value)
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
