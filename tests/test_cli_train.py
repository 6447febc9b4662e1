"""``msdist train``: errors before any rank starts, the report and the live step lines with the
launcher patched, and end to end on CPU ranks (losses at tp2 x dp2 with ZeRO stage 3, tp2 x pp2,
cp2 x dp2 equal the 1-rank run's; save, ``msdist checkpoint reshard``, resume at another layout
and stage)."""

import json
import os
import time

import numpy as np
import pytest
from typer.testing import CliRunner

import mindscience.distributed.harness as harness
from mindscience.distributed.harness import LaunchResult
from mscli.main import app

runner = CliRunner()


def layout_file(tmp_path, name, world, **sizes):
    path = tmp_path / f"{name}.yaml"
    path.write_text(f"world_size: {world}\nbackend: cpu\n" + "".join(f"{k}: {v}\n" for k, v in sizes.items()))
    return str(path)


def invoke(*args):
    return runner.invoke(app, ["train", *map(str, args)])


# ----------------------------------------------------------------------------- errors (no launch)
@pytest.fixture
def no_launch(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("a rank was launched although the input is bad")

    monkeypatch.setattr(harness, "launch", refuse)
    monkeypatch.setattr(harness, "launch_local_multinode", refuse)


def one_line_error(result, *fragments):
    assert result.exit_code == 2, result.output
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("msdist: error: "), result.stderr
    for fragment in fragments:
        assert fragment in lines[0], lines[0]
    return lines[0]


def test_a_model_the_layout_cannot_split(tmp_path, no_launch):
    tp4 = layout_file(tmp_path, "tp4", 4, tp=4)
    one_line_error(invoke(tp4, "--model", "tiny-llama"), "num_query_groups=2 is not divisible by tp=4",
                   "Use a tp that divides 2")
    pp8 = layout_file(tmp_path, "pp8", 8, pp=8)
    one_line_error(invoke(pp8, "--model", "tiny-gpt"), "num_layers", "pp=8")


def test_bad_batch_and_options(tmp_path, no_launch):
    dp4 = layout_file(tmp_path, "dp4", 4)
    one_line_error(invoke(dp4, "--model", "tiny-gpt", "--global-batch-size", "4"),
                   "--global-batch-size 4", "micro_batch_size x dp = 8")
    one_line_error(invoke(dp4, "--model", "tiny-gpt", "--zero-stage", "7"), "--zero-stage 7 is invalid")
    one_line_error(invoke(dp4, "--model", "tiny-gpt", "--save-every", "2"), "--save-every 2 needs --save DIR")
    one_line_error(invoke(dp4), "needs a model", "--model")
    one_line_error(invoke(dp4, "--model", "no-such-model"), "no-such-model", "tiny-gpt")


@pytest.mark.parametrize("array, fragments", [
    (None, ["no such file"]),
    (np.zeros((8, 65), np.int32), ["shape (8, 65)", "1-D"]),
    (np.zeros(10000, np.float32), ["float32", "integer token ids"]),
    (np.full(10000, 256, np.int32), ["holds id 256", "vocab_size is 256"]),
    (np.zeros(1000, np.int32), ["holds 1000 tokens = 15 sequences of 64 + 1", "the run reads 24"]),
])
def test_bad_data_files(tmp_path, no_launch, array, fragments):
    one = layout_file(tmp_path, "one", 1)
    path = tmp_path / "tokens.npy"
    if array is not None:
        np.save(path, array)
    one_line_error(invoke(one, "--model", "tiny-gpt", "--steps", "3", "--data", path), str(path), *fragments)


def test_bad_resume_directories(tmp_path, no_launch):
    one = layout_file(tmp_path, "one", 1)
    one_line_error(invoke(one, "--model", "tiny-gpt", "--resume", tmp_path / "missing"), "no such directory")
    (tmp_path / "empty").mkdir()
    one_line_error(invoke(one, "--model", "tiny-gpt", "--resume", tmp_path / "empty"), "holds no checkpoint")


def _save_cell(directory, optimizer=None, rows=256):
    """A one-process checkpoint of a cell holding a word embedding of ``rows`` x 64 (the
    name tiny-gpt's has), with a DistributedOptimizer of ``optimizer`` kind or none."""
    import mindspore as ms
    from mindspore import nn

    from mindscience.distributed import checkpoint
    from mindscience.distributed.optimizer import DistributedOptimizer

    class Emb(nn.Cell):
        def __init__(self):
            super().__init__()
            self.word_embeddings = nn.Cell()
            self.word_embeddings.weight = ms.Parameter(ms.Tensor(np.zeros((rows, 64), np.float32)),
                                                       name="weight")

    model = nn.Cell()
    model.embedding = Emb()
    cells = [model] + ([DistributedOptimizer(model.trainable_params(), optimizer=optimizer)] if optimizer else [])
    checkpoint.save(nn.CellList(cells), directory, step=2)


def test_resume_checkpoints_that_cannot_resume_the_run(tmp_path, no_launch):
    one = layout_file(tmp_path, "one", 1)
    _save_cell(tmp_path / "big", "adamw", rows=512)
    one_line_error(invoke(one, "--model", "tiny-gpt", "--resume", tmp_path / "big"),
                   "does not hold model tiny-gpt", "parameter '0.embedding.word_embeddings.weight' has shape "
                   "[512, 64] in the checkpoint, the model's is [256, 64]")
    _save_cell(tmp_path / "bare")
    one_line_error(invoke(one, "--model", "tiny-gpt", "--resume", tmp_path / "bare"),
                   "holds no optimizer state", "DistributedOptimizer(optimizer='adamw')")
    _save_cell(tmp_path / "sgd", "sgd")
    one_line_error(invoke(one, "--model", "tiny-gpt", "--resume", tmp_path / "sgd"),
                   "it holds the state of DistributedOptimizer(optimizer='sgd')")


def test_dry_run_prints_msrun_and_launches_nothing(tmp_path, no_launch):
    lay = layout_file(tmp_path, "tp2pp2", 4, tp=2, pp=2)
    result = invoke(lay, "--model", "tiny-gpt", "--dry-run", "--log-dir", tmp_path / "logs")
    assert result.exit_code == 0, result.output
    assert result.stdout.startswith("# node 0\nmsrun --worker_num=4 --local_worker_num=4")
    two = invoke(lay, "--model", "tiny-gpt", "--dry-run", "--loopback-nodes", "2")
    assert two.stdout.count("msrun --worker_num=4 --local_worker_num=2") == 2


# ----------------------------------------------------------------------------- report (launcher patched)
def rank_state(rank, stage, losses, times, memory, saved=()):
    records = [{"check": "layout.groups", "group": "tp", "passed": True},
               {"check": "train.setup", "group": "train", "passed": True, "first_step": 0}]
    for i, (loss, seconds) in enumerate(zip(losses, times)):
        records.append({"check": "train.step", "group": "train", "train_step": i + 1, "loss": loss,
                        "time_s": seconds, "passed": True})
    records.append({"check": "train.finish", "group": "train", "passed": True, "saved": list(saved),
                    "memory": {"stage": stage, **memory}})
    return {"rank": rank, "status": "done", "records": records}


class FakeLaunch:
    def __init__(self, ranks, failures=()):
        self.ranks, self.failures, self.calls = ranks, list(failures), []

    def __call__(self, spec, world_size, *args, **kwargs):
        self.calls.append({"spec": spec, "world_size": world_size, **kwargs})
        return LaunchResult(ok=not self.failures, returncode=0 if not self.failures else 1, timed_out=False,
                            duration_s=2.0, ranks=self.ranks, failures=self.failures, log_dir="/tmp/x",
                            command=["msrun"])


MEM = {"weights": 400000, "gradients": 400000, "optimizer": 800000}


def test_json_report_with_measured_and_predicted(tmp_path, monkeypatch):
    ranks = {r: rank_state(r, r // 2, [5.5, 5.4, 5.3], [3.0, 0.5 + r / 10, 0.4], MEM) for r in range(4)}
    fake = FakeLaunch(ranks)
    monkeypatch.setattr(harness, "launch", fake)
    lay = layout_file(tmp_path, "tp2pp2", 4, tp=2, pp=2)
    out = tmp_path / "report.json"
    result = invoke(lay, "--model", "tiny-gpt", "--steps", "3", "--zero-stage", "1", "--format", "json",
                    "-o", out)
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert json.loads(out.read_text()) == report
    spec = fake.calls[0]["spec"]
    assert [c["name"] for c in spec["checks"]] == ["layout.init", "train.setup"] + ["train.step"] * 3 + \
        ["train.finish"]
    assert spec["checks"][1]["params"]["options"]["zero_stage"] == 1
    assert {"steps", "measured", "predicted", "layout", "model", "training"} <= set(report)
    assert [s["step"] for s in report["steps"]] == [1, 2, 3]
    assert [s["loss"] for s in report["steps"]] == [5.5, 5.4, 5.3]
    assert report["steps"][1]["time_s"] == 0.8  # the slowest rank
    assert report["steps"][1]["tokens_per_s"] == pytest.approx(8 * 64 / 0.8)
    assert report["measured"]["step_time_s"] == pytest.approx(0.6)  # median of 0.8 and 0.4
    assert report["predicted"]["step_time_s"] > 0
    assert len(report["measured"]["memory"]) == len(report["predicted"]["memory"]) == 2
    assert report["measured"]["memory"][1] == {"stage": 1, "ranks": 2, "weights_bytes": 400000,
                                               "gradients_bytes": 400000, "optimizer_bytes": 800000}
    assert report["training"]["zero_stage"] == 1 and report["training"]["global_batch_size"] == 8
    assert report["model"]["name"] == "tiny-gpt" and report["layout"]["pp"] == 2
    assert report["cluster"]["device"] == "cpu"  # CPU ranks are priced on the cpu preset


def test_rich_report_and_a_failed_rank(tmp_path, monkeypatch):
    ranks = {r: rank_state(r, 0, [5.5, 5.25], [2.0, 0.5], MEM) for r in range(2)}
    monkeypatch.setattr(harness, "launch", FakeLaunch(ranks))
    lay = layout_file(tmp_path, "dp2", 2)
    result = invoke(lay, "--model", "tiny-gpt", "--steps", "2")
    assert result.exit_code == 0, result.output
    assert "step    2  loss 5.250000  500.00 ms" in result.stdout
    assert "measured vs predicted" in result.stdout and "optimizer (bytes)" in result.stdout
    failure = {"rank": 1, "kind": "crash", "reason": "rank 1 died (signal 9)", "log_tail": "Killed"}
    monkeypatch.setattr(harness, "launch", FakeLaunch(ranks, failures=[failure]))
    failed = invoke(lay, "--model", "tiny-gpt", "--steps", "2")
    assert failed.exit_code == 1
    assert "rank 1 failed: crash: rank 1 died (signal 9)" in failed.stderr


def snapshot_of(ranks, upto):
    """A harness snapshot where rank r has finished its checks up to record ``upto[r]``."""
    return {"ranks": {r: {"status": "running", "done": upto[r], "records": state["records"][:upto[r]]}
                      for r, state in ranks.items()}}


class LiveLaunch(FakeLaunch):
    """Calls the progress callback as the harness does while the ranks run, and keeps
    what stdout held after each call."""

    def __init__(self, ranks, progress):
        super().__init__(ranks)
        self.progress, self.seen = progress, []

    def __call__(self, spec, world_size, *args, **kwargs):
        import sys

        for upto in self.progress:
            kwargs["on_progress"](snapshot_of(self.ranks, upto))
            sys.stdout.flush()
            self.seen.append(sys.stdout.buffer.getvalue().decode())
        return super().__call__(spec, world_size, *args, **kwargs)


def test_rich_step_lines_are_printed_as_the_steps_finish(tmp_path, monkeypatch):
    # records: layout.groups, train.setup, step 1, step 2, step 3, train.finish
    ranks = {r: rank_state(r, 0, [5.5, 5.25, 5.0], [2.0, 0.5 + r, 0.25], MEM) for r in range(2)}
    live = LiveLaunch(ranks, progress=[{0: 3, 1: 2}, {0: 4, 1: 3}, {0: 4, 1: 4}, {0: 6, 1: 6}])
    monkeypatch.setattr(harness, "launch", live)
    lay = layout_file(tmp_path, "dp2", 2)
    result = invoke(lay, "--model", "tiny-gpt", "--steps", "3")
    assert result.exit_code == 0, result.output
    first, second, third, last = live.seen
    assert first.startswith("msdist train: tiny-gpt at tp=1 cp=1 dp=2 pp=1 (2 ranks)")
    assert "step " not in first  # rank 1 has not finished step 1 yet
    assert "step    1  loss 5.500000  2.00 s" in second and "step    2" not in second
    assert "step    2  loss 5.250000  1.50 s" in third  # the slowest rank's time
    assert "step    3  loss 5.000000  250.00 ms" in last and "measured vs predicted" not in last
    out = result.stdout
    assert out.startswith(last)  # the header and the lines came first, the report after
    for k in (1, 2, 3):
        assert out.count(f"step    {k}  loss") == 1
    assert out.index("step    3") < out.index("measured vs predicted")


def test_json_mode_prints_no_step_lines(tmp_path, monkeypatch):
    ranks = {r: rank_state(r, 0, [5.5, 5.25], [2.0, 0.5], MEM) for r in range(2)}
    live = LiveLaunch(ranks, progress=[{0: 3, 1: 3}, {0: 5, 1: 5}])
    monkeypatch.setattr(harness, "launch", live)
    lay = layout_file(tmp_path, "dp2", 2)
    result = invoke(lay, "--model", "tiny-gpt", "--steps", "2", "--format", "json")
    assert result.exit_code == 0, result.output
    assert live.seen == ["", ""]
    assert [s["loss"] for s in json.loads(result.stdout)["steps"]] == [5.5, 5.25]


def test_step_printer_waits_for_every_rank_and_prints_each_step_once():
    import io

    from rich.console import Console

    from mscli.commands.train import StepPrinter

    buffer = io.StringIO()
    printer = StepPrinter(tokens_per_step=512, flops_per_step=2e9, world_size=2, peak_tflops=1.0,
                          console=Console(file=buffer, width=200))
    ranks = {r: rank_state(r, 0, [4.0, 3.0], [1.0 + r, 0.5], MEM) for r in range(2)}
    printer(snapshot_of(ranks, {0: 4, 1: 2}))
    assert buffer.getvalue() == ""
    printer(snapshot_of(ranks, {0: 4, 1: 3}))
    assert buffer.getvalue().splitlines() == ["step    1  loss 4.000000  2.00 s  256 tokens/s  MFU 0.05%"]
    printer(snapshot_of(ranks, {0: 5, 1: 5}))
    printer(snapshot_of(ranks, {0: 5, 1: 5}))  # the same records again: nothing new
    lines = buffer.getvalue().splitlines()
    assert len(lines) == 2 and lines[1] == "step    2  loss 3.000000  500.00 ms  1.02 K tokens/s  MFU 0.20%"
    assert printer.printed == {1, 2}
    # ranks that disagree on a loss print nothing (the final report names them)
    ranks[1]["records"][2]["loss"] = 9.0
    other = StepPrinter(tokens_per_step=512, flops_per_step=1e9, world_size=2, peak_tflops=1.0,
                        console=Console(file=io.StringIO(), width=200))
    other(snapshot_of(ranks, {0: 5, 1: 5}))
    assert other.printed == set()


def test_live_lines_reach_stdout_past_the_progress_redirection(monkeypatch):
    """While the progress display runs, Rich routes sys.stdout through its stderr console;
    when stdout is not a terminal the step lines must still land on stdout."""
    import io
    import sys

    from rich.console import Console
    from rich.file_proxy import FileProxy

    from mscli import render_train

    real, display = io.StringIO(), Console(file=io.StringIO(), width=200)
    monkeypatch.setattr(sys, "stdout", FileProxy(display, real))
    render_train.print_steps([{"step": 7, "loss": 2.5, "time_s": 0.5, "tokens_per_s": 100.0, "mfu": 0.01}])
    assert real.getvalue() == "step    7  loss 2.500000  500.00 ms  100 tokens/s  MFU 1.00%\n"
    assert display.file.getvalue() == ""


# ----------------------------------------------------------------------------- end to end
# PyNative by default; one 4-rank launch (cp2 x dp2) runs msdist train's default --mode jit
# against the one-rank PyNative losses (compiling costs a minute or more per launch here).
MODE = "pynative"


def run_json(log_dir, *args, mode=MODE):
    result = invoke(*args, "--format", "json", "--timeout", 1500, "--mode", mode, "--log-dir", log_dir)
    assert result.exit_code == 0, result.output[-3000:]
    return json.loads(result.stdout)


def losses(report):
    return [s["loss"] for s in report["steps"]]


def resume_here(directory, steps, model="tiny-gpt", zero_stage=0):
    """Resume ``directory`` in this process (one rank, every group of size 1, tp = pp = 1)
    and train ``steps`` steps: ``(trainer, losses)``."""
    import mindspore as ms

    from mindscience.distributed.topology.layout import Layout
    from mindscience.distributed.training.loop import Trainer
    from mscli.commands.train import model_and_options

    ms.set_context(mode=ms.PYNATIVE_MODE)
    workload, opts = model_and_options(Layout(world_size=1), model, steps=steps, zero_stage=zero_stage, mode=MODE)
    trainer = Trainer(workload.model, workload.training, opts)
    trainer.resume(str(directory))
    return trainer, [trainer.train_step(k)["loss"] for k in trainer.remaining_steps()]


@pytest.mark.multiprocess
def test_layouts_match_the_one_rank_run_and_resume_after_reshard(tmp_path):
    """Five launches: tiny-gpt at 1 rank, at tp2 x dp2 with ZeRO stage 3 (saving), its
    checkpoint resharded offline and resumed at tp2 x pp2 with stage 1 (saving), that one
    resumed in this process at one rank with stage 0; tiny-llama at 1 rank and cp2 x dp2.

    So a stage-3 checkpoint (weights and AdamW moments as dim-0 shards over dp = 2)
    continues at another stage and layout, the tied output layer that pp = 1 does not
    have is set from the embedding at pp = 2, and a pp = 2 checkpoint (which has it)
    resumes at pp = 1: every loss is the one-rank run's."""
    started = time.perf_counter()
    one = layout_file(tmp_path, "one", 1)
    tp2pp2 = layout_file(tmp_path, "tp2pp2", 4, tp=2, pp=2)
    tp2dp2 = layout_file(tmp_path, "tp2dp2", 4, tp=2)
    cp2dp2 = layout_file(tmp_path, "cp2dp2", 4, cp=2)
    steps = 4
    dense = run_json(tmp_path / "logs1", one, "--model", "tiny-gpt", "--steps", steps + 1)
    want = losses(dense)
    assert len(want) == steps + 1 and len(set(want)) == steps + 1

    ckpt = tmp_path / "ckpt"
    sharded = run_json(tmp_path / "logs2", tp2dp2, "--model", "tiny-gpt", "--steps", steps, "--zero-stage", 3,
                       "--save", ckpt, "--save-every", 2)
    np.testing.assert_allclose(losses(sharded), want[:steps], rtol=1e-5)
    assert sorted(os.listdir(ckpt)) == ["step_2", "step_4"]
    manifest = json.loads((ckpt / "step_2" / "manifest.json").read_text())
    assert [(o["kind"], o["zero_stage"], o["group_size"]) for o in manifest["optimizers"]] == [("adamw", 3, 2)]
    assert manifest["extra"]["data_position"] == 2 * 8

    # a checkpoint of another model is refused before any rank starts
    refused = invoke(tp2dp2, "--model", "tiny-llama", "--resume", ckpt)
    assert refused.exit_code == 2 and "model.num_query_groups is 4 in the checkpoint, 2 here" in refused.stderr

    moved = tmp_path / "step_2_tp2pp2"
    reshard = runner.invoke(app, ["checkpoint", "reshard", str(ckpt / "step_2"), str(moved), "--to", tp2pp2])
    assert reshard.exit_code == 0, reshard.output
    piped_ckpt = tmp_path / "ckpt_pp2"
    piped = run_json(tmp_path / "logs3", tp2pp2, "--model", "tiny-gpt", "--steps", 2, "--zero-stage", 1,
                     "--resume", moved, "--save", piped_ckpt)
    assert [s["step"] for s in piped["steps"]] == [3, 4] and piped["resumed"]["step"] == 2
    np.testing.assert_allclose(losses(piped), want[2:steps], rtol=1e-5)
    assert [m["stage"] for m in piped["measured"]["memory"]] == [0, 1]
    saved = json.loads((piped_ckpt / "step_4" / "manifest.json").read_text())["parameters"]
    assert "0.output_layer.weight" in saved  # pp = 2 holds the tied copy

    trainer, here = resume_here(piped_ckpt / "step_4", 1)
    assert trainer.first_step == steps and int(trainer.optimizer.step.asnumpy()) == steps + 1
    np.testing.assert_allclose(here, want[steps:], rtol=1e-5)

    llama = losses(run_json(tmp_path / "logs4", one, "--model", "tiny-llama", "--steps", 2))
    context = run_json(tmp_path / "logs5", cp2dp2, "--model", "tiny-llama", "--steps", 2, mode="jit")
    np.testing.assert_allclose(losses(context), llama, rtol=1e-5)
    print(f"\n5 msdist train launches and a resume in this process took {time.perf_counter() - started:.1f} s")


def test_verify_model_adds_the_dense_comparison(tmp_path, monkeypatch):
    """``verify --model``: a train.dense_compare check in the spec, a 'train' family in the summary."""
    record = {"check": "train.dense_compare", "group": "tp2-cp1-dp2-pp1:tp-cp-dp-pp", "mode": "jit",
              "losses": [5.56, 5.55], "dense_losses": [5.56, 5.55], "max_error": 2e-7, "passed": True}
    ranks = {r: {"rank": r, "status": "done", "records": [dict(record, rank=r)]} for r in range(4)}
    fake = FakeLaunch(ranks)
    monkeypatch.setattr(harness, "launch", fake)
    lay = layout_file(tmp_path, "tp2dp2", 4, tp=2)
    result = runner.invoke(app, ["verify", lay, "--checks", "correctness", "--model", "tiny-llama",
                                 "--format", "json"])
    assert result.exit_code == 0, result.output
    check = fake.calls[0]["spec"]["checks"][-1]
    assert check["name"] == "train.dense_compare" and check["params"]["steps"] == 2
    assert check["params"]["model"]["num_query_groups"] == 2
    assert check["params"]["options"]["global_batch_size"] == 8
    summary = {row["family"]: row for row in json.loads(result.stdout)["summary"]}
    assert summary["train"]["passed"] == 1 and summary["train"]["max_error"] == 2e-7
    tp4 = layout_file(tmp_path, "tp4", 4, tp=4)
    refused = runner.invoke(app, ["verify", tp4, "--model", "tiny-llama"])
    assert refused.exit_code == 2 and "num_query_groups=2 is not divisible by tp=4" in refused.stderr


# ----------------------------------------------------------------------------- MoE (issue 36)
def test_moe_step_line_and_json_rows():
    """A MoE model's step line adds the aux loss, the load and the dropped assignments; the
    report's rows take them from the ranks' records (the same on every rank)."""
    from mindscience.distributed.training import report as tr
    from mscli import render_train

    row = {"step": 1, "loss": 5.5, "time_s": 0.5, "tokens_per_s": 100.0, "mfu": 0.01, "aux_loss": 0.0401,
           "max_load": 1.26, "dropped_tokens": 3}
    assert render_train.step_line(row) == ("step    1  loss 5.500000  500.00 ms  100 tokens/s  MFU 1.00%  "
                                           "aux 0.0401  load 1.26x  dropped 3")
    ranks = {r: {"rank": r, "records": [{"check": "train.step", "train_step": 1, "loss": 5.5, "time_s": 0.5 + r,
                                         "aux_loss": 0.0401, "max_load": 1.26, "dropped_tokens": 3}]}
             for r in range(2)}
    got = tr.collect(ranks)["steps"]
    rows = tr.step_rows(tr.merge_rank_steps(got), 512, 1e9, 2, 1.0, moe=tr.moe_by_step(got))
    assert [(r["step"], r["time_s"], r["aux_loss"], r["max_load"], r["dropped_tokens"]) for r in rows] == [
        (1, 1.5, 0.0401, 1.26, 3)]
    dense = tr.step_rows([(1, 5.5, 0.5)], 512, 1e9, 2, 1.0, moe=tr.moe_by_step({0: [{"step": 1, "loss": 5.5}]}))
    assert "aux_loss" not in dense[0]


@pytest.mark.multiprocess
def test_train_tiny_moe_end_to_end(tmp_path):
    """One launch: tiny-moe (8 experts top-2) at cpu-4-ep2 (dense tp2 x dp2, experts ep2 x edp2),
    one micro-batch of 4 sequences per dp rank, against the one-rank run in this process with the
    global batch of 8 in one micro-batch (the aux loss is the step's tokens on both sides)."""
    import mindspore as ms

    from mindscience.distributed.topology.layout import Layout
    from mindscience.distributed.training.loop import Trainer
    from mscli.commands.train import model_and_options

    from mindscience.distributed.models.config import resolve_model_file

    # tiny-moe at half its depth and sequence (the same 8 experts, top-2): a quicker launch
    text = resolve_model_file("tiny-moe").read_text()
    model = tmp_path / "tiny-moe.yaml"
    model.write_text(text.replace("num_layers: 4", "num_layers: 2").replace("seq_length: 64", "seq_length: 32"))
    report = run_json(tmp_path / "logs", "cpu-4-ep2", "--model", model, "--steps", 2, "--micro-batch-size", 4)
    assert (report["layout"]["ep"], report["layout"]["etp"], report["layout"]["tp"]) == (2, 1, 2)
    assert (report["model"]["num_moe_experts"], report["model"]["num_layers"]) == (8, 2)
    ms.set_context(mode=ms.PYNATIVE_MODE)
    workload, opts = model_and_options(Layout(world_size=1), str(model), steps=2, micro_batch_size=8, mode=MODE)
    trainer = Trainer(workload.model, workload.training, opts)
    want = [trainer.train_step(k) for k in range(2)]
    got = report["steps"]
    assert [s["step"] for s in got] == [1, 2]
    for g, w in zip(got, want):
        assert g["loss"] == pytest.approx(w["loss"], rel=1e-5)
        assert g["aux_loss"] == pytest.approx(w["aux_loss"], rel=1e-5)
        assert g["max_load"] == pytest.approx(w["max_load"], rel=1e-5)
        assert g["dropped_tokens"] == w["dropped_tokens"] == 0  # dropless
        assert 1.0 <= g["max_load"] <= 8.0 and g["aux_loss"] > 0
    # a rank holds 4 of the 8 experts and half of each dense matrix: the bytes the cost model
    # prices for experts over ep (its weights and optimizer rows)
    rows = {row["what"]: row for row in report["comparison"] if row["stage"] == 0}
    for what in ("weights (bytes)", "optimizer (bytes)"):
        assert rows[what]["ratio"] == pytest.approx(1.0, abs=0.01), rows[what]
    assert rows["weights (bytes)"]["measured"] < trainer.memory_bytes()["weights"] / 1.9
