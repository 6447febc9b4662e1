"""Training that survives faults (``msdist train --max-restarts``, save on signal, ``--async-save``,
``--keep-last``, ``MSDIST_FAULT``, ``--elastic``).

In-process first (no rank launched): the fault switch, the checkpoint folder's bookkeeping, the
rendezvous, the signal guard, a background save, and the restart loop with the launcher patched.
Then end to end on CPU ranks, every loss compared with the first six steps of an uninterrupted
dp2 run, which is also the SIGTERM case: EXACTLY at its own layout (dp2), within 1e-5 at the others
(any two layouts agree so); the launches are shared between the cases (see docs/faults.md, "What the
tests run"):

* dp2, the reference: SIGTERM to msdist train itself after step 6 (passed on to the ranks, which
  save their step: exit 3): 1 launch;

* tp2 x dp2: ``exit`` of rank 1 at step 1 (before the first checkpoint: restart from 0), then
  ``kill`` of rank 1 at step 3 in the relaunch (restart from step 2): 3 launches;
* tp2 x pp2: ``hang`` of rank 2 at step 3 (restart from step 2): 2 launches;
* 1 rank: ``raise`` at step 2 in every launch, one restart allowed: exhausted, exit 1: 2 launches;
* dp2: ``term`` of rank 1 at step 3 with --async-save (every rank saves step 3, exit 3), then the
  resume with ``save-kill`` of rank 1 while step 4's checkpoint is written in the background
  (restart from step 3) and --keep-last 2: 3 launches;
* 2 loopback nodes x 2 ranks at tp2 x dp2, node 1 gone after step 3, --elastic: 2 launches.
"""

import json
import os
import signal
import subprocess
import sys
import threading
import time

import mindspore  # noqa: F401 - imported at collection, so conftest sizes its kernel threads for this process
import numpy as np
import pytest
from typer.testing import CliRunner

import mindscience.distributed.harness as harness
from mindscience.distributed.harness import LaunchResult
from mindscience.distributed.harness.rendezvous import Rendezvous
from mindscience.distributed.training import faults
from mindscience.distributed.training.options import TrainOptionError
from mscli.main import app

runner = CliRunner()
STEPS = 6


def layout_file(tmp_path, name, world, **sizes):
    path = tmp_path / f"{name}.yaml"
    path.write_text(f"world_size: {world}\nbackend: cpu\n" + "".join(f"{k}: {v}\n" for k, v in sizes.items()))
    return str(path)


def invoke(*args):
    return runner.invoke(app, ["train", *map(str, args)])


def fake_checkpoint(save, step):
    """A ``step_<k>`` that reads as complete (its manifest exists) for the folder bookkeeping."""
    path = save / f"step_{step}"
    path.mkdir(parents=True)
    (path / "manifest.json").write_text(json.dumps({"step": step}))
    return str(path)


# ----------------------------------------------------------------------------- the fault switch
def test_fault_switch_parses_and_fires_only_where_asked():
    got = faults.parse_faults("1:3:kill, 0:2:exit:*,2:4:save-kill:1")
    assert got == [faults.Fault(1, 3, "kill", 0), faults.Fault(0, 2, "exit", None),
                   faults.Fault(2, 4, "save-kill", 1)]
    assert faults.fault_at(got, rank=1, step=3, attempt=0).kind == "kill"
    assert faults.fault_at(got, rank=1, step=3, attempt=1) is None  # a relaunch does not fail again
    assert faults.fault_at(got, rank=0, step=2, attempt=5).kind == "exit"  # '*': every launch
    assert faults.fault_at(got, rank=2, step=4, attempt=1) is None  # a save fault fires in the writer
    assert faults.fault_at(got, rank=2, step=4, attempt=1, kinds=faults.SAVE_KINDS).kind == "save-kill"
    assert faults.parse_faults(None) == [] and faults.parse_faults(" ") == []
    for bad in ("1:3", "x:3:kill", "1:0:kill", "1:3:explode", "1:3:kill:last"):
        with pytest.raises(TrainOptionError, match="RANK:STEP:KIND"):
            faults.parse_faults(bad)


def test_a_bad_or_impossible_fault_is_refused_before_any_rank_starts(tmp_path, monkeypatch):
    monkeypatch.setattr(harness, "launch", lambda *a, **k: pytest.fail("a rank was launched"))
    dp2 = layout_file(tmp_path, "dp2", 2)
    monkeypatch.setenv(faults.FAULT_ENV, "1:3:boom")
    result = invoke(dp2, "--model", "tiny-gpt", "--steps", 4)
    assert result.exit_code == 2 and "item '1:3:boom' is invalid" in result.stderr
    monkeypatch.setenv(faults.FAULT_ENV, "5:3:kill")
    result = invoke(dp2, "--model", "tiny-gpt", "--steps", 4)
    assert result.exit_code == 2 and "fault 5:3:kill never fires: the run has ranks 0..1 and steps up to 4" \
        in result.stderr
    monkeypatch.delenv(faults.FAULT_ENV)
    for args, fragment in ((["--max-restarts", -1], "--max-restarts -1 is invalid"),
                           (["--rejoin-timeout", 0], "--rejoin-timeout 0.0 is invalid"),
                           (["--async-save"], "--async-save needs --save DIR"),
                           (["--keep-last", 2], "--keep-last needs --save DIR")):
        result = invoke(dp2, "--model", "tiny-gpt", *args)
        assert result.exit_code == 2 and fragment in result.stderr, result.stderr


# ----------------------------------------------------------------------------- the --save folder
def test_newest_complete_keep_last_and_leftovers(tmp_path):
    save = tmp_path / "ckpt"
    for step in (2, 4, 6):
        fake_checkpoint(save, step)
    (save / "step_8.partial").mkdir()  # a save that crashed before its manifest
    (save / "step_8.partial" / "rank_00000.safetensors").write_bytes(b"x")
    (save / "notes").mkdir()
    assert faults.newest_complete(str(save)) == (6, str(save / "step_6"))
    assert faults.newest_complete(str(save), at_most=5) == (4, str(save / "step_4"))
    assert faults.newest_complete(str(tmp_path / "none")) is None
    assert faults.to_delete([2, 4, 6, 8], 2) == [2, 4] and faults.to_delete([2, 4], 0) == []
    assert faults.to_delete([2, 4, 6], 1, protect=[4]) == [2]
    assert faults.keep_last(str(save), 2) == [str(save / "step_2")]
    assert sorted(os.listdir(save)) == ["notes", "step_4", "step_6", "step_8.partial"]
    assert faults.leftovers(str(save)) == [str(save / "step_8.partial")]
    assert faults.clean_leftovers(str(save)) == [str(save / "step_8.partial")]
    assert sorted(os.listdir(save)) == ["notes", "step_4", "step_6"]
    # the fallback rename's crash window: a complete .partial without its step_<k> is the newest
    fake_checkpoint(save, 10)
    os.replace(save / "step_10", save / "step_10.partial")
    assert faults.clean_leftovers(str(save)) == [] and faults.newest_complete(str(save))[0] == 10
    assert faults.kept_steps([(1, 5.0, 0.5), (2, 4.9, 0.4), (3, 4.8, 0.4)], 2) == [(1, 5.0, 0.5),
                                                                                   (2, 4.9, 0.4)]


def test_rendezvous_node_zero_decides_for_the_nodes_that_came_back(tmp_path):
    root = str(tmp_path / "rdv")
    node0, node1 = Rendezvous(root, 2, timeout_s=5.0), Rendezvous(root, 2, timeout_s=5.0)
    got = {}

    def other():
        node1.check_in(1, 1, {"reason": "rank 2 died"})
        got["decision"] = node1.await_decision(1)

    thread = threading.Thread(target=other)
    thread.start()
    node0.check_in(1, 0)
    present, waited = node0.gather(1, [0, 1])
    assert present == [0, 1] and waited < 5.0
    assert node0.infos(1)[1]["reason"] == "rank 2 died"
    node0.decide(1, {"action": "launch", "nodes": [0, 1], "first_step": 2})
    thread.join(10)
    assert got["decision"] == {"action": "launch", "nodes": [0, 1], "first_step": 2}
    # a node that does not check in within the rejoin timeout is gone
    short = Rendezvous(root, 2, timeout_s=0.3)
    short.check_in(2, 0)
    started = time.monotonic()
    present, waited = short.gather(2, [0, 1])
    assert present == [0] and 0.3 <= waited < 2 and time.monotonic() - started < 2


def test_signal_guard_passes_the_first_signal_on_and_stops_at_the_second():
    from mscli.restarts import SignalGuard

    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        with SignalGuard() as guard:
            guard.watch({"ranks": {0: {"pid": child.pid}}})
            os.kill(os.getpid(), signal.SIGTERM)
            assert guard.signal == signal.SIGTERM
            assert child.wait(10) == -signal.SIGTERM  # passed on to the rank
            with pytest.raises(KeyboardInterrupt):
                os.kill(os.getpid(), signal.SIGINT)
                time.sleep(1)
        assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # restored
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()


# ----------------------------------------------------------------------------- a background save
def _cell(value):
    import mindspore as ms
    from mindspore import nn

    cell = nn.Cell()
    cell.w = ms.Parameter(ms.Tensor(np.full((64, 32), value, np.float32)), name="w")
    return cell


def test_async_save_is_visible_only_when_whole_and_a_failed_write_keeps_the_previous(tmp_path):
    from mindscience.distributed import checkpoint
    from mindscience.distributed.checkpoint.errors import CheckpointError

    save = tmp_path / "ckpt"
    cell = _cell(1.0)
    gate = threading.Event()
    pending = checkpoint.save_async(cell, str(save / "step_1"), step=1, before_write=gate.wait)
    cell.w.set_data(cell.w * 5)  # training goes on: the checkpoint holds the host copy
    assert faults.complete_steps(str(save)) == []  # not visible while it is written
    gate.set()
    checkpoint.agree_written(pending)
    assert faults.newest_complete(str(save)) == (1, str(save / "step_1"))
    assert pending.host_copy_s >= 0 and pending.written_s > 0
    loaded = _cell(0.0)
    checkpoint.load(loaded, str(save / "step_1"))
    assert float(loaded.w.asnumpy()[0, 0]) == 1.0

    def crash():
        raise OSError("disk full")

    failed = checkpoint.save_async(cell, str(save / "step_2"), step=2, before_write=crash)
    with pytest.raises(CheckpointError, match="disk full"):
        checkpoint.agree_written(failed)
    assert faults.newest_complete(str(save))[0] == 1 and faults.leftovers(str(save)) == []


# ----------------------------------------------------------------------------- the restart loop, launcher patched
def rank_state(rank, first, losses, done=True, stopped_at=None):
    records = [{"check": "train.setup", "group": "train", "passed": True, "first_step": first}]
    for i, loss in enumerate(losses):
        step = first + i + 1
        records.append({"check": "train.step", "group": "train", "train_step": step, "loss": loss, "time_s": 0.5,
                        "passed": True, "stopped": step == stopped_at, "saved": None})
    if done:
        records.append({"check": "train.finish", "group": "train", "passed": True, "saved": [],
                        "memory": {"stage": 0, "weights": 1, "gradients": 1, "optimizer": 2}})
    return {"rank": rank, "status": "done" if done else "running", "records": records}


class Script:
    """Plays one LaunchResult per launch: ``(ranks, failures, before)``; ``before`` runs first
    (it writes the checkpoints the launch would have written)."""

    def __init__(self, *launches):
        self.launches, self.calls = list(launches), []

    def __call__(self, spec, world_size, *args, **kwargs):
        self.calls.append({"spec": spec, "world_size": world_size, "attempt": os.environ.get(faults.ATTEMPT_ENV),
                           **kwargs})
        ranks, failures, before = self.launches.pop(0)
        if before:
            before()
        return LaunchResult(ok=not failures, returncode=1 if failures else 0, timed_out=False, duration_s=3.0,
                            ranks=ranks, failures=failures, log_dir=kwargs.get("log_dir") or "/tmp/x",
                            command=["msrun"], failed_at=time.time() if failures else None, ended_at=time.time())


CRASH = {"rank": 1, "kind": "crash", "reason": "rank 1 (pid 7) died in 'train.step' with exit code -9 (SIGKILL)",
         "log_tail": ""}


def test_restart_resumes_from_the_newest_complete_checkpoint_and_reports_it(tmp_path, monkeypatch):
    save = tmp_path / "ckpt"
    loss = [5.5, 5.4, 5.3, 5.2]
    script = Script(({r: rank_state(r, 0, loss[:2], done=False) for r in range(2)}, [CRASH],
                     lambda: (fake_checkpoint(save, 2), (save / "step_4.partial").mkdir())),
                    ({r: rank_state(r, 2, loss[2:]) for r in range(2)}, [], None))
    monkeypatch.setattr(harness, "launch", script)
    dp2 = layout_file(tmp_path, "dp2", 2)
    result = invoke(dp2, "--model", "tiny-gpt", "--steps", 4, "--save", save, "--save-every", 2,
                    "--max-restarts", 1, "--format", "json", "--log-dir", tmp_path / "logs")
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert [(s["step"], s["loss"]) for s in report["steps"]] == list(zip(range(1, 5), loss))
    (restart,) = report["restarts"]
    assert restart["attempt"] == 1 and restart["rank"] == 1 and restart["kind"] == "crash"
    assert "SIGKILL" in restart["reason"] and restart["reached_step"] == 2
    assert restart["resumed_from"] == 2 and restart["checkpoint"] == str(save / "step_2")
    assert restart["steps_lost"] == 0 and restart["layout"] is None
    first, second = script.calls
    assert (first["attempt"], second["attempt"]) == ("0", "1")
    options = second["spec"]["checks"][1]["params"]
    assert options["resume"] == str(save / "step_2") and options["options"]["steps"] == 2
    assert [c["name"] for c in second["spec"]["checks"]].count("train.step") == 2
    assert second["log_dir"] == str(tmp_path / "logs" / "restart_1")
    assert faults.leftovers(str(save)) == []  # the crashed save's .partial was cleaned


def test_restarts_run_out_and_the_last_failure_is_named(tmp_path, monkeypatch):
    error = {"rank": 0, "kind": "error", "reason": "rank 0 raised in 'train.step': InjectedFault: boom",
             "log_tail": ""}
    script = Script(*[({0: rank_state(0, 0, [], done=False)}, [error], None)] * 3)
    monkeypatch.setattr(harness, "launch", script)
    one = layout_file(tmp_path, "one", 1)
    result = invoke(one, "--model", "tiny-gpt", "--steps", 3, "--max-restarts", 2)
    assert result.exit_code == 1 and len(script.calls) == 3
    assert "2 restart(s) ran; the last launch failed too" in result.stderr
    assert "rank 0 failed: error: rank 0 raised in 'train.step': InjectedFault: boom" in result.stderr
    assert "restart 2: rank 0 error after step 0" in result.stdout  # from the start: no --save
    assert "-> resumed from step 0 (no checkpoint: from the start)" in result.stdout


def test_a_node_that_does_not_rejoin_stops_the_run_without_elastic(tmp_path, monkeypatch):
    monkeypatch.setenv(faults.FAULT_ENV, "2:2:node")
    crash = dict(CRASH, rank=2)
    script = Script(({r: rank_state(r, 0, [5.5], done=False) for r in range(4)}, [crash], None))
    monkeypatch.setattr(harness, "launch_local_multinode", script)
    lay = layout_file(tmp_path, "tp2dp2", 4, tp=2)
    result = invoke(lay, "--model", "tiny-gpt", "--steps", 3, "--loopback-nodes", 2, "--max-restarts", 1,
                    "--rejoin-timeout", 0.2, "--format", "json", "--log-dir", tmp_path / "logs")
    assert result.exit_code == 1 and len(script.calls) == 1
    out = json.loads(result.stdout)
    assert "node(s) 1 did not rejoin within the 0.2 s --rejoin-timeout; pass --elastic" in out["failure"]
    assert not (tmp_path / "logs" / ".rendezvous").exists()


def test_elastic_picks_suggests_layout_for_the_devices_left():
    from mindscience.distributed.topology.layout import Layout
    from mscli.commands.train import check_model, model_and_options
    from mscli.restarts import elastic_layout

    layout = Layout(world_size=4, tp=2, devices_per_node=2)
    workload, opts = model_and_options(layout, "tiny-gpt", steps=6)
    new, why = elastic_layout(workload, layout, opts, 2, 2, check_model)
    assert new.world_size == 2 and new.tp * new.cp * new.dp * new.pp == 2
    assert opts.global_batch_size % (opts.micro_batch_size * new.dp) == 0
    assert "msdist suggest's fastest layout of 2 devices for tiny-gpt at global batch 8" in why


# ----------------------------------------------------------------------------- end to end
MODE = "pynative"


def stop_after(status, step: int, sent: threading.Event) -> None:
    """Send SIGTERM to this process (where msdist train's signal guard runs) once the rank
    whose status file is ``status`` has finished ``step``."""
    deadline = time.monotonic() + 900
    while time.monotonic() < deadline and not sent.is_set():
        try:
            records = json.loads(status.read_text()).get("records", [])
        except (OSError, ValueError):
            records = []
        if any((r.get("train_step") or 0) >= step for r in records):
            sent.set()
            os.kill(os.getpid(), signal.SIGTERM)
            return
        time.sleep(0.1)


@pytest.fixture(scope="module")
def signalled(tmp_path_factory):
    """The uninterrupted run: msdist train of tiny-gpt at dp2 for up to 20 steps, stopped by a
    SIGTERM to msdist train itself once step 6 is done (the signal is passed on to the ranks, which
    finish their step, save it and stop: exit 3). Its first six losses are the reference."""
    tmp_path = tmp_path_factory.mktemp("signalled")
    one = layout_file(tmp_path, "dp2", 2)
    save, logs = tmp_path / "ckpt", tmp_path / "logs"
    sent = threading.Event()
    watcher = threading.Thread(target=stop_after, args=(logs / "results" / "rank_0.json", STEPS, sent),
                               daemon=True)
    watcher.start()
    try:
        result = invoke(one, "--model", "tiny-gpt", "--steps", 20, "--save", save, "--mode", MODE,
                        "--format", "json", "--log-dir", logs)
    finally:
        sent.set()
        watcher.join(5)
    assert result.exit_code == 3, result.output[-3000:]
    assert_nothing_left(tmp_path)
    return json.loads(result.stdout), save


@pytest.fixture(scope="module")
def reference(signalled):
    report, _ = signalled
    want = [s["loss"] for s in report["steps"]][:STEPS]
    assert len(want) == STEPS and len(set(want)) == STEPS
    return want


def run_train(tmp_path, name, *args, fault=None, code=0):
    env = {faults.FAULT_ENV: fault} if fault else {}
    before = dict(os.environ)
    os.environ.update(env)
    try:
        result = invoke(*args, "--format", "json", "--timeout", 600, "--mode", MODE, "--log-dir",
                        tmp_path / f"logs_{name}")
    finally:
        os.environ.clear()
        os.environ.update(before)
    assert result.exit_code == code, result.output[-3000:]
    assert_nothing_left(tmp_path)
    return json.loads(result.stdout)


def assert_nothing_left(tmp_path):
    """No process of the test's runs (their spec files live under tmp_path) and no temporary
    checkpoint entry or rendezvous folder."""
    from mindscience.distributed.harness.processes import _all_pids, _alive, _proc_cmdline

    left = [pid for pid in _all_pids() if str(tmp_path) in _proc_cmdline(pid) and _alive(pid)]
    assert not left, f"processes outlived the run: {left}"
    for root, dirs, files in os.walk(tmp_path):
        names = dirs + files
        assert not [n for n in names if n.endswith((".partial", ".old", ".deleting", ".tmp"))], (root, names)
        assert ".rendezvous" not in dirs, root


def losses(report):
    return [s["loss"] for s in report["steps"]]


@pytest.mark.multiprocess
def test_kill_and_exit_at_tp2_dp2_restart_to_the_uninterrupted_losses(tmp_path, reference):
    """rank 1 exits at step 1 (no checkpoint yet: from step 0), then is killed at step 3 of the
    relaunch (from step 2): rc 0 and the six losses are the uninterrupted run's."""
    lay = layout_file(tmp_path, "tp2dp2", 4, tp=2)
    save = tmp_path / "ckpt"
    report = run_train(tmp_path, "a", lay, "--model", "tiny-gpt", "--steps", STEPS, "--save", save,
                       "--save-every", 2, "--max-restarts", 2, fault="1:1:exit:0,1:3:kill:1")
    np.testing.assert_allclose(losses(report), reference, rtol=1e-5)
    assert [s["step"] for s in report["steps"]] == list(range(1, STEPS + 1))
    first, second = report["restarts"]
    assert (first["rank"], first["resumed_from"], first["checkpoint"]) == (1, 0, None)
    assert "exit code 13" in first["reason"]
    assert (second["rank"], second["resumed_from"], second["checkpoint"]) == (1, 2, str(save / "step_2"))
    assert "SIGKILL" in second["reason"] and second["steps_lost"] == 0
    assert sorted(os.listdir(save)) == ["step_2", "step_4", "step_6"]


@pytest.mark.multiprocess
def test_hang_at_tp2_pp2_restarts_to_the_uninterrupted_losses(tmp_path, reference):
    lay = layout_file(tmp_path, "tp2pp2", 4, tp=2, pp=2)
    save = tmp_path / "ckpt"
    report = run_train(tmp_path, "b", lay, "--model", "tiny-gpt", "--steps", STEPS, "--save", save,
                       "--save-every", 2, "--max-restarts", 1, fault="2:3:hang")
    np.testing.assert_allclose(losses(report), reference, rtol=1e-5)
    (restart,) = report["restarts"]
    assert restart["resumed_from"] == 2 and restart["checkpoint"] == str(save / "step_2")
    assert restart["kind"] in ("error", "timeout", "stopped", "crash"), restart


@pytest.mark.multiprocess
def test_restarts_exhausted_exit_nonzero_naming_the_failure(tmp_path):
    one = layout_file(tmp_path, "one", 1)
    os.environ[faults.FAULT_ENV] = "0:2:raise:*"
    try:
        result = invoke(one, "--model", "tiny-gpt", "--steps", 3, "--max-restarts", 1, "--mode", MODE,
                        "--format", "json", "--log-dir", tmp_path / "logs_c")
    finally:
        del os.environ[faults.FAULT_ENV]
    assert result.exit_code == 1, result.output[-3000:]
    out = json.loads(result.stdout)
    assert len(out["restarts"]) == 1 and out["restarts"][0]["resumed_from"] == 0
    assert out["failure"].endswith("InjectedFault: MSDIST_FAULT: injected fault 0:2:raise"), out["failure"]
    assert out["failures"][0]["rank"] == 0 and "InjectedFault" in out["failures"][0]["reason"]
    assert "1 restart(s) ran; the last launch failed too" in result.stderr
    assert out["log_dir"].endswith("restart_1")
    assert_nothing_left(tmp_path)


@pytest.mark.multiprocess
def test_sigterm_saves_every_rank_then_async_resume_survives_a_kill_during_the_write(tmp_path, reference):
    dp2 = layout_file(tmp_path, "dp2", 2)
    save = tmp_path / "ckpt"
    common = ("--model", "tiny-gpt", "--save", save, "--save-every", 2, "--async-save", "--keep-last", 2)
    stopped = run_train(tmp_path, "d1", dp2, *common, "--steps", STEPS, fault="1:3:term", code=3)
    assert stopped["stopped"]["step"] == 3 and stopped["stopped"]["saved"] == str(save / "step_3")
    assert [s["step"] for s in stopped["steps"]] == [1, 2, 3]
    manifest = json.loads((save / "step_3" / "manifest.json").read_text())
    assert manifest["step"] == 3 and manifest["layout"]["world_size"] == 2  # both ranks' parts merged
    assert sorted(os.listdir(save)) == ["step_2", "step_3"]

    resumed = run_train(tmp_path, "d2", dp2, *common, "--steps", STEPS - 3, "--resume", save,
                        "--max-restarts", 1, fault="1:4:save-kill")
    (restart,) = resumed["restarts"]
    assert restart["resumed_from"] == 3  # step 4's checkpoint never became visible
    assert [s["step"] for s in resumed["steps"]] == [4, 5, 6]
    # the reference's own layout: a stop, an async resume and a restart change no bit of it
    np.testing.assert_array_equal(losses(stopped) + losses(resumed), reference)
    assert sorted(os.listdir(save)) == ["step_4", "step_6"]  # --keep-last 2


@pytest.mark.multiprocess
def test_sigterm_to_msdist_train_stops_after_a_step_with_it_saved(signalled):
    """The reference run (see ``signalled``): stopped on the SIGTERM msdist train got after step 6,
    with the step it stopped after saved."""
    report, save = signalled
    step = report["stopped"]["step"]
    assert STEPS < step < 20 and report["stopped"]["signal"] == signal.SIGTERM
    assert report["stopped"]["saved"] == str(save / f"step_{step}")
    assert [s["step"] for s in report["steps"]] == list(range(1, step + 1))
    assert json.loads((save / f"step_{step}" / "manifest.json").read_text())["step"] == step
    assert os.listdir(save) == [f"step_{step}"]


@pytest.mark.multiprocess
def test_elastic_two_loopback_nodes_finish_on_the_node_left(tmp_path, reference):
    lay = layout_file(tmp_path, "tp2dp2", 4, tp=2)
    save = tmp_path / "ckpt"
    report = run_train(tmp_path, "e", lay, "--model", "tiny-gpt", "--steps", STEPS, "--save", save,
                       "--save-every", 3, "--loopback-nodes", 2, "--max-restarts", 1, "--elastic",
                       "--rejoin-timeout", 1, fault="2:4:node")
    np.testing.assert_allclose(losses(report), reference, rtol=1e-5)
    (restart,) = report["restarts"]
    assert restart["resumed_from"] == 3 and restart["nodes"] == [0]
    assert restart["layout"]["world_size"] == 2 and "node(s) 1 did not rejoin within 1 s" in restart["why"]
    assert report["layout"]["world_size"] == 2
