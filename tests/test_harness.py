"""The worker harness: msrun command, ports, merging, cleanup, and real msrun jobs.

Unit tests run without MindSpore. The ``multiprocess`` tests start real msrun jobs
(10-40 s each on two cores), one launch per scenario: a passing 4-rank job, a rank
that crashes (segfault) or raises, a rank that hangs past the timeout, and a job over
two loopback "nodes". Each also proves that no process of the job is left behind.
"""

import json
import math
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
import uuid

import pytest

from mindscience.distributed.harness import (
    LaunchError,
    build_msrun_command,
    check_port_free,
    find_free_port,
    job_processes,
    launch,
    launch_local_multinode,
    merge_records,
    msrun_starts_scheduler,
    normalize_spec,
    stop_job,
)
from mindscience.distributed.harness import launcher, registry, worker


# ----------------------------------------------------------------------------- msrun command
def test_build_msrun_command_is_the_documented_argv():
    cmd = build_msrun_command(4, spec_path="/r/spec.json", out_dir="/r/results", log_dir="/r",
                              master_port=29500, msrun="/venv/bin/msrun", script="/h/worker.py")
    assert cmd == [
        "/venv/bin/msrun", "--worker_num=4", "--local_worker_num=4", "--node_rank=0",
        "--master_addr=127.0.0.1", "--master_port=29500", "--log_dir=/r", "--join=True",
        "--tail_worker_log=-2", "/h/worker.py", "--spec", "/r/spec.json", "--out", "/r/results",
    ]


def test_build_msrun_command_for_one_node_of_a_cluster():
    cmd = build_msrun_command(8, spec_path="s", out_dir="o", log_dir="l", master_port=8118,
                              local_worker_num=4, node_rank=1, master_addr="10.0.0.1")
    assert cmd[1:6] == ["--worker_num=8", "--local_worker_num=4", "--node_rank=1",
                        "--master_addr=10.0.0.1", "--master_port=8118"]
    assert cmd[-5:-4] == [launcher.WORKER_SCRIPT]


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(world_size=0), "world_size=0 is invalid"),
        (dict(world_size=4, local_worker_num=3), "local_worker_num=3 is invalid for world_size=4"),
        (dict(world_size=4, local_worker_num=2, node_rank=2), "node_rank=2 is invalid: expected 0..1"),
        (dict(world_size=True), "world_size=True is invalid"),
    ],
)
def test_build_msrun_command_rejects_bad_sizes(kwargs, message):
    with pytest.raises(LaunchError, match=message):
        build_msrun_command(spec_path="s", out_dir="o", log_dir="l", master_port=1, **kwargs)


def test_child_env_speeds_up_one_machine_and_leaves_clusters_alone(monkeypatch):
    for key in ("MS_RETRY_INTERVAL_LOWER", "MS_RETRY_INTERVAL_UPPER", launcher.RANKS_HERE_ENV):
        monkeypatch.delenv(key, raising=False)
    here = launcher._child_env("job-1", None, None, 4, single_machine=True)
    assert (here["MS_RETRY_INTERVAL_LOWER"], here["MS_RETRY_INTERVAL_UPPER"]) == ("0", "1")
    assert here[launcher.RANKS_HERE_ENV] == "4" and here[launcher.JOB_ENV] == "job-1"
    # One node of a cluster keeps MindSpore's own retry spread.
    node = launcher._child_env("job-1", None, None, 4)
    assert "MS_RETRY_INTERVAL_LOWER" not in node and "MS_RETRY_INTERVAL_UPPER" not in node
    # The caller's env and the launcher's own environment win over the defaults.
    mine = launcher._child_env("job-1", {"MS_RETRY_INTERVAL_UPPER": 7, launcher.RANKS_HERE_ENV: 2},
                               None, 4, single_machine=True)
    assert mine["MS_RETRY_INTERVAL_UPPER"] == "7" and mine[launcher.RANKS_HERE_ENV] == "2"
    monkeypatch.setenv("MS_RETRY_INTERVAL_LOWER", "3")
    assert launcher._child_env("job-1", None, None, 4, single_machine=True)["MS_RETRY_INTERVAL_LOWER"] == "3"


def test_normalize_spec_expands_names_and_rejects_junk():
    spec = normalize_spec({"checks": ["basic.ping", {"name": "basic.allreduce", "params": {"size": 3}}],
                           "layout": {"tp": 2}})
    assert spec["checks"] == [{"name": "basic.ping", "params": {}},
                              {"name": "basic.allreduce", "params": {"size": 3}}]
    assert spec["layout"] == {"tp": 2}
    with pytest.raises(LaunchError, match=r"spec\['checks'\]\[0\]=.*expected a check name"):
        normalize_spec({"checks": [{"params": {}}]})
    with pytest.raises(LaunchError, match="not JSON-serialisable"):
        normalize_spec({"checks": [], "x": object()})


# ----------------------------------------------------------------------------- ports
def test_find_free_port_can_be_bound():
    port = find_free_port("127.0.0.1")
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))  # raises if it was not free
    assert 1024 <= port <= 65535


def test_port_in_use_is_a_clear_error_before_anything_starts(tmp_path):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with pytest.raises(LaunchError, match=f"master_port={port} is already in use on 127.0.0.1"):
            check_port_free("127.0.0.1", port)
        with pytest.raises(LaunchError, match="already in use"):
            launch({"checks": ["basic.ping"]}, 2, master_port=port, log_dir=str(tmp_path))
    assert not (tmp_path / "spec.json").exists()  # nothing was started


def test_master_addr_elsewhere_needs_a_port():
    # 127.0.0.2 is bindable here but msrun does not treat it as local (no scheduler).
    assert msrun_starts_scheduler("127.0.0.1") and not msrun_starts_scheduler("127.0.0.2")
    with pytest.raises(LaunchError, match="master_port is required"):
        launch({"checks": []}, 4, local_worker_num=2, node_rank=1, master_addr="127.0.0.2")
    with pytest.raises(LaunchError, match="local in msrun's eyes"):
        launch_local_multinode({"checks": []}, 4, 2, master_addr="127.0.0.1")


# ----------------------------------------------------------------------------- merging
def _rank(*records):
    return {"status": "done", "records": list(records)}


def test_merge_records_all_ranks_must_pass_and_max_error_wins():
    ranks = {
        0: _rank({"step": 0, "check": "c", "group": "tp", "passed": True, "max_error": 0.5, "rank": 0}),
        1: _rank({"step": 0, "check": "c", "group": "tp", "passed": False, "max_error": 2.0, "rank": 1}),
        2: None,  # a rank without results contributes nothing
    }
    assert merge_records(ranks) == [{"step": 0, "check": "c", "group": "tp", "passed": False,
                                     "max_error": 2.0, "ranks": 2, "failed_ranks": [1]}]


def test_merge_records_keeps_dtypes_shapes_and_steps_apart():
    def rec(**kw):
        return {"check": "m", "group": "tp", "passed": True, "max_error": 0.0, **kw}

    records = [rec(step=0, dtype="float32", shape=[2, 3]), rec(step=0, dtype="float16", shape=[2, 3]),
               rec(step=1, dtype="float32", shape=[2, 3]), rec(step=1, dtype="float32", shape=[4])]
    ranks = {r: _rank(*records) for r in range(3)}
    rows = merge_records(ranks)
    assert len(rows) == 4 and all(row["ranks"] == 3 and row["passed"] for row in rows)
    assert [(r["step"], r["dtype"], r["shape"]) for r in rows] == [
        (0, "float32", [2, 3]), (0, "float16", [2, 3]), (1, "float32", [2, 3]), (1, "float32", [4])]
    # A coarser key merges them all.
    assert len(merge_records(ranks, key=("check", "group"))) == 1


def test_merge_records_nan_error_wins_and_none_is_skipped():
    ranks = {0: _rank({"check": "c", "passed": True, "max_error": None}),
             1: _rank({"check": "c", "passed": True, "max_error": float("nan")}),
             2: _rank({"check": "c", "passed": True, "max_error": 3.0})}
    (row,) = merge_records(ranks)
    assert math.isnan(row["max_error"]) and row["passed"] and row["ranks"] == 3


# ----------------------------------------------------------------------------- worker pieces
def test_worker_normalises_records():
    assert worker._records_of(None, "c", 1, 0) == []
    assert worker._records_of({"passed": True}, "c", 1, 2) == [
        {"passed": True, "check": "c", "rank": 1, "step": 2}]
    with pytest.raises(TypeError, match="check 'c' returned int: expected a dict"):
        worker._records_of(3, "c", 0, 0)


def test_worker_skips_only_missing_check_modules(tmp_path, monkeypatch):
    (tmp_path / "broken_checks_mod.py").write_text("import module_that_does_not_exist_xyz\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(registry, "CHECK_MODULES", ("no_such_checks_module_xyz",))
    worker._import_check_modules([])  # a module that does not exist is skipped
    monkeypatch.setattr(registry, "CHECK_MODULES", ("broken_checks_mod",))
    with pytest.raises(ModuleNotFoundError, match="module_that_does_not_exist_xyz"):
        worker._import_check_modules([])  # an import error inside a module is not


def test_launcher_does_not_import_mindspore():
    code = ("import sys, mindscience.distributed.harness as h, mindscience.distributed.harness.launcher;"
            "print('mindspore' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


# ----------------------------------------------------------------------------- cleanup
def _wait_until(predicate, seconds):
    deadline = time.monotonic() + seconds
    while not predicate() and time.monotonic() < deadline:
        time.sleep(0.1)
    return predicate()


def test_stop_job_kills_detached_processes_by_job_id(tmp_path):
    """A child in its own session (like an msrun worker) is found by its environment."""
    job_id = uuid.uuid4().hex
    script = tmp_path / "tree.py"
    script.write_text(textwrap.dedent("""
        import subprocess, sys, time
        subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"],
                         start_new_session=True)
        time.sleep(600)
    """))
    env = {**os.environ, launcher.JOB_ENV: job_id}
    parent = subprocess.Popen([sys.executable, str(script)], env=env, start_new_session=True)
    try:
        assert _wait_until(lambda: len(job_processes(job_id=job_id)) == 2, 10)
        os.kill(parent.pid, signal.SIGKILL)  # the detached child is now an orphan
        parent.wait()
        assert stop_job(job_id) == []
        assert job_processes(job_id=job_id) == {}
    finally:
        stop_job(job_id, [parent])


def test_a_fork_of_the_scheduler_is_not_taken_for_the_scheduler(tmp_path):
    """MindSpore's import forks; until it execs, the child looks like its parent.

    Taken for the scheduler, its exit ended a healthy job as an infra failure.
    """
    job_id = uuid.uuid4().hex
    code = textwrap.dedent("""
        import os, time
        if os.fork() == 0:
            time.sleep(1.0)
            os._exit(0)
        time.sleep(600)
    """)
    env = {**os.environ, launcher.JOB_ENV: job_id, "MS_ROLE": "MS_SCHED"}
    sched = subprocess.Popen([sys.executable, "-c", code, launcher.WORKER_SCRIPT], env=env)
    monitor = launcher._Monitor(
        job_id=job_id, launchers=[], helpers=[], expected=[0], whole_world=True,
        out_dir=str(tmp_path), log_dirs=[], launcher_logs=[], timeout=60,
        on_progress=None, total=1)
    try:
        assert _wait_until(lambda: len(job_processes(job_id=job_id)) == 2, 10)
        monitor._scan()
        assert monitor.schedulers == {sched.pid: None}
        assert _wait_until(lambda: len(job_processes(job_id=job_id)) == 1, 10)  # the fork ended
        monitor._scan()
        monitor._check_launchers()
        assert monitor.infra == []
        sched.kill()
        assert _wait_until(lambda: not launcher._alive(sched.pid), 10)
        monitor._check_launchers()
        assert monitor.infra == [f"the scheduler (pid {sched.pid}) ended with exit code -9 (SIGKILL) "
                                 "before the ranks finished"]
    finally:
        stop_job(job_id, [sched])


# ----------------------------------------------------------------------------- real msrun jobs
def _processes_mentioning(text):
    """Pids of live processes whose command line contains ``text`` (a job's run folder)."""
    found = []
    for pid in launcher._all_pids():
        if pid != os.getpid() and text in launcher._proc_cmdline(pid) and launcher._alive(pid):
            found.append(pid)
    return found


@pytest.mark.multiprocess
def test_interrupt_stops_the_job(tmp_path):
    """Ctrl+C (KeyboardInterrupt) while ranks start: it propagates, and nothing is left."""

    def interrupt_once_ranks_start(snapshot):
        if all(r["status"] != "pending" for r in snapshot["ranks"].values()):
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        launch({"checks": ["basic.ping"]}, 2, timeout=60, log_dir=str(tmp_path),
               on_progress=interrupt_once_ranks_start)
    assert _processes_mentioning(str(tmp_path)) == []


@pytest.mark.multiprocess
def test_launcher_killed_hard_leaves_nothing(tmp_path):
    """SIGKILL on the launcher: the kernel's parent-death signal takes msrun and the ranks."""
    code = ("import sys; from mindscience.distributed.harness import launch; "
            "launch({'checks': [{'name': 'fault.hang', 'params': {'ranks': [0, 1]}}]}, 2, "
            "timeout=300, log_dir=sys.argv[1])")
    parent = subprocess.Popen([sys.executable, "-c", code, str(tmp_path)])
    try:
        # Wait for init(): there MindSpore blocks in C++ holding the GIL (the scheduler
        # does), so only a kernel-level parent-death signal can end the process.
        def in_init(rank):
            try:
                return json.loads((tmp_path / "results" / f"rank_{rank}.json").read_text())["current"]
            except (OSError, ValueError):
                return None

        assert _wait_until(lambda: in_init(0) == in_init(1) == "init", 60), "ranks not in init after 60 s"
        assert len(_processes_mentioning(str(tmp_path))) >= 4  # msrun, scheduler, 2 ranks
    finally:
        parent.kill()
        parent.wait()
    assert _wait_until(lambda: not _processes_mentioning(str(tmp_path)), 5), (
        f"left behind: {_processes_mentioning(str(tmp_path))}")


def _explain(result):
    return f"logs in {result.log_dir}:\n" + "\n".join(
        f"rank {f['rank']} {f['kind']}: {f['reason']}\n{f['log_tail']}" for f in result.failures)


@pytest.mark.multiprocess
def test_four_ranks_ping_and_allreduce(tmp_path, assert_no_leftovers):
    snapshots = []
    result = launch({"checks": ["basic.ping", {"name": "basic.allreduce", "params": {"size": 16}}]},
                    4, timeout=150, log_dir=str(tmp_path), on_progress=snapshots.append)
    assert result.ok and result.passed, _explain(result)
    assert result.failures == [] and not result.timed_out
    assert sorted(result.ranks) == [0, 1, 2, 3]
    for rank, state in result.ranks.items():
        assert state["status"] == "done" and state["done"] == state["total"] == 2
        ping, allreduce = state["records"]
        assert ping["rank"] == rank and ping["world_size"] == 4 and ping["rank_id_env"] == str(rank)
        assert allreduce["check"] == "basic.allreduce" and allreduce["max_error"] == 0.0
    assert len({s["records"][0]["pid"] for s in result.ranks.values()}) == 4
    rows = merge_records(result)
    assert [(r["check"], r["ranks"], r["passed"]) for r in rows] == [
        ("basic.ping", 4, True), ("basic.allreduce", 4, True)]
    # Progress: every rank seen running, and a final snapshot with all done.
    assert any(s["ranks"][0]["status"] in ("starting", "running") for s in snapshots)
    final = snapshots[-1]
    assert final["finished"] and all(r["status"] == "done" for r in final["ranks"].values())
    assert json.loads((tmp_path / "spec.json").read_text())["checks"][0]["name"] == "basic.ping"
    assert result.command[0].endswith("msrun") and (tmp_path / "worker_3.log").exists()
    assert_no_leftovers(result)


@pytest.mark.multiprocess
@pytest.mark.parametrize("mode, expect", [("segfault", "SIGSEGV"), ("raise", "injected fault on rank 1")])
def test_crashing_rank_is_named_and_the_job_stops_at_once(tmp_path, assert_no_leftovers, mode, expect):
    spec = {"checks": ["basic.ping", {"name": "fault.crash", "params": {"ranks": [1], "mode": mode}},
                       "basic.allreduce"]}  # rank 0 would wait in this all-reduce forever
    result = launch(spec, 2, timeout=120, log_dir=str(tmp_path))
    assert not result.ok and not result.timed_out
    assert result.duration_s < 60, "the failure must stop the job, not the timeout"
    first = result.failures[0]
    assert first["rank"] == 1 and first["kind"] == ("crash" if mode == "segfault" else "error")
    assert expect in first["reason"] and "'fault.crash'" in first["reason"]
    # The log tail shows where: faulthandler's stack for a segfault, the traceback otherwise.
    assert "basic.py" in first["log_tail"] and "in crash" in first["log_tail"]
    assert [f["rank"] for f in result.failures] == [1, 0]
    stopped = result.failures[1]
    assert stopped["kind"] == "stopped" and "after rank(s) 1 failed" in stopped["reason"]
    assert_no_leftovers(result)


# Rank 0 finishes in 10-20 s on two cores: 30 s leaves it room and still stops the hang.
HANG_TIMEOUT_S = 30


@pytest.mark.multiprocess
def test_hanging_rank_is_stopped_at_the_timeout(tmp_path, assert_no_leftovers):
    spec = {"checks": ["basic.ping", {"name": "fault.hang", "params": {"ranks": [1], "seconds": 600}}]}
    result = launch(spec, 2, timeout=HANG_TIMEOUT_S, log_dir=str(tmp_path))
    assert result.timed_out and not result.ok
    assert HANG_TIMEOUT_S <= result.duration_s < HANG_TIMEOUT_S + 15
    by_rank = {f["rank"]: f for f in result.failures}
    failure = by_rank[1]
    assert failure["kind"] == "timeout"
    # Rank 0 finishes in 10-20 s; only on a badly overloaded machine may it still be
    # starting at the timeout, and then it must be reported as well.
    assert result.ranks[0]["status"] == "done" or by_rank[0]["kind"] == "timeout"
    assert set(by_rank) <= {0, 1}
    assert "'fault.hang'" in failure["reason"] and f"{HANG_TIMEOUT_S} s timeout" in failure["reason"]
    # Before killing it, the launcher had the rank dump its Python stack into its log.
    assert "in hang" in failure["log_tail"]
    assert_no_leftovers(result)


@pytest.mark.multiprocess
def test_dead_scheduler_is_an_infra_failure(tmp_path, assert_no_leftovers):
    """Without a scheduler the ranks would wait in init() for 600 s; the job stops at once."""
    killed = []

    def kill_scheduler_during_init(snapshot):
        if killed or not all(r["current"] == "init" for r in snapshot["ranks"].values()):
            return
        for pid in _processes_mentioning(str(tmp_path)):  # the job's processes
            if launcher._proc_env(pid).get("MS_ROLE") == "MS_SCHED":
                os.kill(pid, signal.SIGKILL)
                killed.append(pid)

    result = launch({"checks": ["basic.ping"]}, 2, timeout=120, log_dir=str(tmp_path),
                    on_progress=kill_scheduler_during_init)
    assert killed and not result.ok and result.duration_s < 60
    infra, *others = result.failures
    assert infra["rank"] == -1 and infra["kind"] == "infra"
    assert f"the scheduler (pid {killed[0]}) ended with exit code -9 (SIGKILL)" in infra["reason"]
    assert "scheduler.log" in infra["log_tail"]
    assert [(f["rank"], f["kind"]) for f in others] == [(0, "stopped"), (1, "stopped")]
    assert_no_leftovers(result)


@pytest.mark.multiprocess
def test_two_loopback_nodes_of_two_ranks(tmp_path, assert_no_leftovers):
    result = launch_local_multinode({"checks": ["basic.ping", "basic.allreduce"]}, 4, 2,
                                    timeout=150, log_dir=str(tmp_path))
    assert result.ok and result.passed, _explain(result)
    assert sorted(result.ranks) == [0, 1, 2, 3]
    assert all(row["ranks"] == 4 for row in merge_records(result))
    scheduler, node0, node1 = result.commands
    assert scheduler[1] == launcher.WORKER_SCRIPT
    assert "--node_rank=1" in node1 and "--master_addr=127.0.0.2" in node1
    assert (tmp_path / "node0" / "worker_1.log").exists()
    assert (tmp_path / "node1" / "worker_2.log").exists()
    assert_no_leftovers(result)
