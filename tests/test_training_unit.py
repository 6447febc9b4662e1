"""``mindscience.distributed.training``: the pure parts (data cutting, options, the report), and
the Trainer in one process (every group of size 1): a ZeRO stage-3 checkpoint resumed at stage 1."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from mindscience.distributed.training import data, options, report
from mindscience.distributed.training.data import DataError
from mindscience.distributed.training.options import TrainOptionError, TrainOptions


# ----------------------------------------------------------------------------- data
def test_dp_shares_tile_the_global_batch_in_order():
    for dp in (1, 2, 4, 8):
        rows = [r for k in range(dp) for r in data.dp_rows(3, 8, k, dp)]
        assert rows == list(range(24, 32))


def test_synthetic_batch_does_not_depend_on_the_layout():
    whole = data.batch_rows(5, 8, 0, 1, seq_length=16, vocab_size=100, seed=7)
    halves = np.concatenate([data.batch_rows(5, 8, r, 2, 16, 100, seed=7) for r in range(2)])
    quarters = np.concatenate([data.batch_rows(5, 8, r, 4, 16, 100, seed=7) for r in range(4)])
    assert whole.shape == (8, 17) and whole.dtype == np.int32
    np.testing.assert_array_equal(whole, halves)
    np.testing.assert_array_equal(whole, quarters)
    assert whole.min() >= 0 and whole.max() < 100
    other_step = data.batch_rows(6, 8, 0, 1, 16, 100, seed=7)
    other_seed = data.batch_rows(5, 8, 0, 1, 16, 100, seed=8)
    assert not np.array_equal(whole, other_step) and not np.array_equal(whole, other_seed)


def test_dp_rows_refuses_an_uneven_split():
    with pytest.raises(DataError, match="global batch 6 does not split over dp=4"):
        data.dp_rows(0, 6, 0, 4)


def test_token_file_is_cut_in_order_with_shifted_labels(tmp_path):
    path = tmp_path / "tokens.npy"
    np.save(path, np.arange(1000, dtype=np.uint16) % 50)
    tf = data.open_token_file(str(path), vocab_size=50, seq_length=10, sequences_needed=99)
    assert (tf.tokens, tf.sequences, tf.max_id, tf.dtype) == (1000, 99, 49, "uint16")
    # step 2 of G = 4 on dp = 2, rank 1: sequences 10 and 11 = tokens 100..110 and 110..120
    rows = data.batch_rows(2, 4, 1, 2, seq_length=10, vocab_size=50, token_file=tf)
    np.testing.assert_array_equal(rows[0], np.arange(100, 111) % 50)
    np.testing.assert_array_equal(rows[1], np.arange(110, 121) % 50)
    inputs, labels = data.inputs_and_labels(rows)
    np.testing.assert_array_equal(inputs[:, 1:], labels[:, :-1])
    # the data position shifts the cut (a resumed run starts where the saved one stopped)
    moved = data.batch_rows(0, 4, 1, 2, 10, 50, token_file=tf, first_sequence=8)
    np.testing.assert_array_equal(moved, rows)


@pytest.mark.parametrize("array, fragment", [
    (np.zeros((4, 5), np.int32), "shape (4, 5): expected a 1-D array"),
    (np.zeros(100, np.float32), "holds float32 values: expected integer token ids"),
    (np.array([1, 2, 300] * 40, np.int32), "holds id 300, but the model's vocab_size is 256"),
    (np.array([1, -2, 3] * 40, np.int32), "negative id -2"),
    (np.arange(100, dtype=np.int32), "holds 100 tokens = 9 sequences of 11 + 1, but the run reads 10"),
])
def test_bad_token_files_are_one_line_errors(tmp_path, array, fragment):
    path = tmp_path / "t.npy"
    np.save(path, array)
    with pytest.raises(DataError) as err:
        data.open_token_file(str(path), vocab_size=256, seq_length=11, sequences_needed=10)
    assert fragment in str(err.value) and str(path) in str(err.value)


def test_missing_and_unreadable_token_files(tmp_path):
    with pytest.raises(DataError, match="no such file"):
        data.open_token_file(str(tmp_path / "nope.npy"), 256, 8)
    junk = tmp_path / "junk.npy"
    junk.write_text("not numpy")
    with pytest.raises(DataError, match="not a .npy array"):
        data.open_token_file(str(junk), 256, 8)


def test_sequences_in_counts_whole_sequences():
    assert [data.sequences_in(n, 64) for n in (0, 1, 64, 65, 129, 1000)] == [0, 0, 0, 1, 2, 15]


# ----------------------------------------------------------------------------- options
def test_options_defaults_and_microbatches():
    opts = TrainOptions(steps=2, micro_batch_size=2, global_batch_size=8)
    assert [options.microbatches(opts, dp) for dp in (1, 2, 4)] == [4, 2, 1]
    with pytest.raises(TrainOptionError, match="multiple of micro_batch_size x dp = 16"):
        options.microbatches(opts, 8)


def test_stage3_saves_and_resumes():
    # stage-3 checkpoints go through checkpoint.save/load like any stage's (checkpoint.zero)
    opts = TrainOptions(zero_stage=3, save="ck", save_every=2, resume="ck/step_2")
    assert (opts.zero_stage, opts.save, opts.resume) == (3, "ck", "ck/step_2")


@pytest.mark.parametrize("kwargs, fragment", [
    ({"steps": 0}, "--steps 0 is invalid"),
    ({"zero_stage": 4}, "--zero-stage 4 is invalid"),
    ({"recompute": "some"}, "--recompute 'some' is invalid"),
    ({"mode": "graph"}, "--mode 'graph' is invalid"),
    ({"lr": float("nan")}, "--lr nan is invalid"),
    ({"micro_batch_size": 3, "global_batch_size": 8}, "not a multiple of --micro-batch-size 3"),
    ({"save_every": 2}, "--save-every 2 needs --save DIR"),
])
def test_bad_options_name_the_option(kwargs, fragment):
    with pytest.raises(TrainOptionError) as err:
        TrainOptions(**kwargs)
    assert fragment in str(err.value)


def test_checkpoint_steps_and_directories(tmp_path):
    assert options.checkpoint_steps(6, 0, 2) == [2, 4, 6]
    assert options.checkpoint_steps(5, 0, 0) == [5]
    assert options.checkpoint_steps(3, 2, 2) == [4, 5]
    for k in (2, 10, 4):
        os.makedirs(tmp_path / f"step_{k}")
        (tmp_path / f"step_{k}" / "manifest.json").write_text("{}")
    os.makedirs(tmp_path / "step_99")  # no manifest: an interrupted save, not a checkpoint
    assert options.resolve_resume(str(tmp_path)) == str(tmp_path / "step_10")
    assert options.resolve_resume(str(tmp_path / "step_4")) == str(tmp_path / "step_4")
    with pytest.raises(TrainOptionError, match="holds no checkpoint"):
        options.resolve_resume(str(tmp_path / "step_99"))
    with pytest.raises(TrainOptionError, match="no such directory"):
        options.resolve_resume(str(tmp_path / "missing"))


def test_checkpoint_difference_names_the_first_difference():
    gpt = {"num_layers": 4, "hidden_size": 64, "vocab_size": 256, "activation": "gelu"}
    assert options.checkpoint_difference(gpt, dict(gpt), {"0.layers.3.x": [1]}) is None
    assert options.checkpoint_difference(gpt, {**gpt, "activation": "swiglu"}, {}) == \
        "model.activation is 'swiglu' in the checkpoint, 'gelu' here"
    found = options.checkpoint_difference(gpt, None, {"0.embedding.word_embeddings.weight": [512, 64]})
    assert found == ("parameter '0.embedding.word_embeddings.weight' has shape [512, 64] in the checkpoint, "
                     "the model's is [256, 64]")


# ----------------------------------------------------------------------------- report
ESTIMATE = {
    "time": {"step_time_s": 0.2, "tokens_per_s": 2560.0, "mfu": 0.01, "model_flops_per_step": 4e9,
             "breakdown": {"compute_s": 0.2}},
    "memory": {"stages": [
        {"stage": 0, "layers": 2, "weights_bytes": 400, "gradients_bytes": 400, "optimizer_bytes": 800,
         "activations_bytes": 1000},
        {"stage": 1, "layers": 2, "weights_bytes": 300, "gradients_bytes": 300, "optimizer_bytes": 600,
         "activations_bytes": 2000}]},
}


def test_merge_rank_steps_takes_the_slowest_rank_and_checks_agreement():
    ranks = {0: [{"step": 1, "loss": 5.0, "time_s": 0.5}, {"step": 2, "loss": 4.0, "time_s": 0.2}],
             1: [{"step": 1, "loss": 5.0, "time_s": 0.7}, {"step": 2, "loss": 4.0, "time_s": 0.1}]}
    assert report.merge_rank_steps(ranks) == [(1, 5.0, 0.7), (2, 4.0, 0.2)]
    ranks[1][1]["loss"] = 4.5
    with pytest.raises(ValueError, match="step 2: rank 1 reports loss 4.5, rank 0 4.0"):
        report.merge_rank_steps(ranks)


def test_finished_steps_waits_for_the_slowest_rank():
    ranks = {0: [{"step": 3, "loss": 5.0, "time_s": 0.5}, {"step": 4, "loss": 4.0, "time_s": 0.2}],
             1: [{"step": 3, "loss": 5.0, "time_s": 0.7}],
             2: []}
    assert report.finished_steps(ranks, [0, 1, 2]) == []  # rank 2 has not finished step 3
    assert report.finished_steps(ranks, [0, 1]) == [(3, 5.0, 0.7)]
    ranks[1].append({"step": 4, "loss": 4.0, "time_s": 0.3})
    assert report.finished_steps(ranks, [0, 1]) == [(3, 5.0, 0.7), (4, 4.0, 0.3)]
    assert report.finished_steps(ranks, []) == []
    ranks[1][1]["loss"] = 4.5
    with pytest.raises(ValueError, match="step 4: rank 1 reports loss 4.5"):
        report.finished_steps(ranks, [0, 1])


def test_build_report_measured_vs_predicted():
    steps = report.step_rows([(1, 5.5, 2.0), (2, 5.0, 0.25), (3, 4.5, 0.3), (4, 4.0, 0.2)],
                             tokens_per_step=512, flops_per_step=4e9, world_size=4, peak_tflops=0.1)
    rank_memory = {0: {"stage": 0, "weights": 400, "gradients": 400, "optimizer": 800},
                   1: {"stage": 0, "weights": 400, "gradients": 400, "optimizer": 808},
                   2: {"stage": 1, "weights": 320, "gradients": 300, "optimizer": 600},
                   3: {"stage": 1, "weights": 320, "gradients": 300, "optimizer": 600}}
    out = report.build_report(layout={"tp": 2, "pp": 2}, model={"name": "m"}, training={"zero_stage": 1},
                              steps=steps, rank_memory=rank_memory, estimate=ESTIMATE, tokens_per_step=512,
                              world_size=4, peak_tflops=0.1)
    assert out["ok"] is True
    assert [s["step"] for s in out["steps"]] == [1, 2, 3, 4]
    assert steps[1]["tokens_per_s"] == 2048.0 and steps[1]["mfu"] == pytest.approx(4e9 / 0.25 / 4e11)
    measured = out["measured"]
    assert measured["step_time_s"] == 0.25  # median of 0.25, 0.3, 0.2: the compiling step 1 left out
    assert measured["tokens_per_s"] == 2048.0
    assert measured["memory"] == [
        {"stage": 0, "ranks": 2, "weights_bytes": 400, "gradients_bytes": 400, "optimizer_bytes": 808},
        {"stage": 1, "ranks": 2, "weights_bytes": 320, "gradients_bytes": 300, "optimizer_bytes": 600}]
    assert out["predicted"]["step_time_s"] == 0.2 and len(out["predicted"]["memory"]) == 2
    rows = {(r["what"], r["stage"]): r for r in out["comparison"]}
    assert rows[("step time (s)", None)]["ratio"] == pytest.approx(1.25)
    assert rows[("optimizer (bytes)", 0)]["ratio"] == pytest.approx(808 / 800)
    assert rows[("weights (bytes)", 1)]["ratio"] == pytest.approx(320 / 300)
    assert rows[("activations (bytes)", 1)]["measured"] is None and rows[("activations (bytes)", 1)]["ratio"] is None
    json.dumps(out)  # the JSON report


def test_collect_reads_the_train_records():
    ranks = {0: {"records": [
        {"check": "layout.groups", "passed": True},
        {"check": "train.setup", "first_step": 2, "passed": True},
        {"check": "train.step", "train_step": 3, "loss": 4.0, "time_s": 0.1, "step": 2},
        {"check": "train.finish", "memory": {"stage": 0, "weights": 1, "gradients": 2, "optimizer": 3},
         "saved": ["/c/step_3"]}]},
        1: None}
    got = report.collect(ranks)
    assert got["steps"] == {0: [{"step": 3, "loss": 4.0, "time_s": 0.1}]}
    assert got["memory"][0]["optimizer"] == 3 and got["saved"] == ["/c/step_3"]
    assert got["setup"][0]["first_step"] == 2


def test_pure_modules_do_not_import_mindspore():
    code = ("import sys; import mindscience.distributed.training.data, mindscience.distributed.training.options, "
            "mindscience.distributed.training.report; print('mindspore' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


# ----------------------------------------------------------------------------- Trainer, one process
MINI = dict(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=16, vocab_size=64,
            num_query_groups=4, ffn_hidden_size=64, name="mini")


def _trainer(tmp_path, stage, steps, **kwargs):
    import mindspore as ms

    from mindscience.distributed.costmodel.spec import ModelSpec, TrainingSpec
    from mindscience.distributed.training.loop import Trainer

    ms.set_context(mode=ms.PYNATIVE_MODE)
    opts = TrainOptions(steps=steps, micro_batch_size=2, global_batch_size=4, zero_stage=stage, mode="pynative",
                        data=str(tmp_path / "tokens.npy"), **kwargs)
    return Trainer(ModelSpec(**MINI), TrainingSpec(), opts)


def test_stage3_checkpoint_resumes_at_stage1_where_the_run_stopped(tmp_path):
    """checkpoint.save of the model + DistributedOptimizer at stage 3 (fully_shard), loaded
    at stage 1: the step counter, the data position and the state continue the run."""
    np.save(tmp_path / "tokens.npy", np.random.default_rng(3).integers(0, 64, 2000).astype(np.int32))
    ckpt = tmp_path / "ck"
    run = _trainer(tmp_path, 3, 2, save=str(ckpt), save_every=1)
    rows = []
    for k in run.remaining_steps():
        rows.append(run.train_step(k))
        run.maybe_save(k)
    assert run.saved == [str(ckpt / "step_1"), str(ckpt / "step_2")]
    assert rows[0]["loss"] != rows[1]["loss"]
    manifest = json.loads((ckpt / "step_1" / "manifest.json").read_text())
    assert manifest["step"] == 1 and manifest["extra"]["data_position"] == 4
    assert [(o["kind"], o["zero_stage"]) for o in manifest["optimizers"]] == [("adamw", 3)]
    names = sorted(manifest["parameters"])
    assert len([n for n in names if n.endswith(".exp_avg_sq")]) == len(run.params)
    assert not [n for n in names if n.endswith((".main", ".grad_buffer"))]  # fp32: mains = weights

    resumed = _trainer(tmp_path, 1, 1)
    info = resumed.resume(str(ckpt / "step_1"))
    assert info["step"] == 1 and resumed.first_step == 1 and list(resumed.remaining_steps()) == [1]
    assert int(resumed.optimizer.step.asnumpy()) == 1
    np.testing.assert_array_equal(resumed.batch(1)[0], run.batch(1)[0])
    row = resumed.train_step(1)
    assert row["step"] == 2
    assert abs(row["loss"] - rows[1]["loss"]) <= 1e-6 * abs(rows[1]["loss"]), (row, rows)
    want = {p.name: p.asnumpy() for p in run.model.trainable_params()}
    got = {p.name: p.asnumpy() for p in resumed.model.trainable_params()}
    assert sorted(got) == sorted(want)
    for name, value in got.items():
        np.testing.assert_allclose(value, want[name].reshape(value.shape), rtol=0, atol=1e-6, err_msg=name)
