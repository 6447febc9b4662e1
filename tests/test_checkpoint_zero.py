"""Checkpoints of sharded optimizer state (ZeRO 1-3) and fully sharded parameters.

Pure arithmetic of :mod:`mindscience.distributed.checkpoint.zero` (consolidate / shard_of,
the optimizer record comparison); one-process save/load of DistributedOptimizer state
(what is and is not saved, the step counter, main weights, a kind mismatch, the record
through an offline reshard); and (multiprocess) one 4-rank launch
(tests/_checkpoint_zero_checks.py): stage 3 + fully_shard at dp4 -> stage 1 at tp2 x dp2
-> stage 0 at tp1, and an offline reshard of a stage-2 checkpoint, against an
uninterrupted run.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

import _checkpoint_zero_job as job_mod
from mindscience.distributed.checkpoint import CheckpointError
from mindscience.distributed.checkpoint.zero import consolidate, record_mismatch, shard_of
from mindscience.distributed.optimizer.layout import shard_range

ADAMW = {"class": "DistributedOptimizer", "kind": "adamw", "state": ["exp_avg", "exp_avg_sq"],
         "zero_stage": 3, "group_size": 4}
SGD = {"class": "DistributedOptimizer", "kind": "sgd", "state": ["momentum"], "zero_stage": 0,
       "group_size": 4}


# ----------------------------------------------------------------------------- pure
def test_zero_module_imports_no_mindspore():
    code = ("import sys, mindscience.distributed.checkpoint.zero; "
            "print('mindspore' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


@pytest.mark.parametrize("shape,d", [((5, 3), 4), ((8, 2), 4), ((1,), 3), ((7,), 1), ((), 2),
                                     ((3, 2, 2), 2)])
def test_shard_of_is_the_c1_shard_and_consolidate_inverts_it(shape, d):
    full = np.arange(1, int(np.prod(shape)) + 1, dtype=np.float32).reshape(shape)
    rows = shape[0] if shape else 1
    c = -(-rows // d)
    shards = [shard_of(full, d, k) for k in range(d)]
    for k, shard in enumerate(shards):
        start, stop = shard_range(rows, d, k)
        assert shard.shape == (c,) + tuple(shape[1:])
        np.testing.assert_array_equal(shard[: stop - start],
                                      full.reshape((rows,) + tuple(shape[1:]))[start:stop])
        assert not np.any(shard[stop - start:])  # padding rows are zeros
    # stacked (d*c, *rest) and flattened (d, c*rest) gathers both give the tensor back
    np.testing.assert_array_equal(consolidate(np.concatenate(shards), shape), full)
    flat = np.stack([s.reshape(-1) for s in shards])
    back = consolidate(flat, shape)
    assert back.shape == tuple(shape)
    np.testing.assert_array_equal(back, full)


def test_shard_of_five_rows_over_four_ranks():
    full = np.arange(10, dtype=np.float32).reshape(5, 2)
    assert shard_of(full, 4, 2).tolist() == [[8.0, 9.0], [0.0, 0.0]]
    assert shard_of(full, 4, 3).tolist() == [[0.0, 0.0], [0.0, 0.0]]


def test_consolidate_refuses_too_few_rows():
    with pytest.raises(CheckpointError, match="fewer than the 5"):
        consolidate(np.zeros((4, 2)), (5, 2))
    with pytest.raises(CheckpointError, match="not whole rows"):
        consolidate(np.zeros(7), (5, 2))


def test_record_mismatch_names_the_first_difference():
    line = record_mismatch([ADAMW], [SGD], "ck")
    assert line is not None and "\n" not in line
    assert "optimizer kind" in line and "'adamw'" in line and "'sgd'" in line
    assert "DistributedOptimizer(optimizer='adamw')" in line
    # another stage or group size is what a reshard is for
    assert record_mismatch([ADAMW], [dict(ADAMW, zero_stage=1, group_size=2)], "ck") is None
    # SGD with and without momentum
    line = record_mismatch([SGD], [dict(SGD, state=[])], "ck")
    assert "optimizer state" in line and "(momentum)" in line and "(no state)" in line
    assert "optimizer class" in record_mismatch([{"class": "Adam"}], [ADAMW], "ck")
    assert "2 optimizer(s)" in record_mismatch([ADAMW, ADAMW], [ADAMW], "ck")
    # an older checkpoint (no record) or a cell without optimizers: names decide
    assert record_mismatch(None, [ADAMW], "ck") is None
    assert record_mismatch([ADAMW], [], "ck") is None


# ----------------------------------------------------------------------------- one process
def _build(kind="adamw", stage=1, dtype=None, seed=1):
    """Two dense layers whose parameters may be bf16 (computed in float32: CPU MatMul
    has no bfloat16), their DistributedOptimizer, and the cell to save."""
    import mindspore as ms
    from mindspore import nn, ops

    from mindscience.distributed.optimizer import DistributedOptimizer

    rng = np.random.default_rng(seed)

    class Dense(nn.Cell):
        def __init__(self, n_in, n_out):
            super().__init__()
            self.weight = ms.Parameter(ms.Tensor(rng.standard_normal((n_out, n_in)).astype(np.float32)),
                                       name="weight")
            self.bias = ms.Parameter(ms.Tensor(rng.standard_normal(n_out).astype(np.float32)),
                                     name="bias")

        def construct(self, x):
            w, b = ops.cast(self.weight, ms.float32), ops.cast(self.bias, ms.float32)
            return ops.matmul(x, w.T) + b

    net = nn.SequentialCell([Dense(4, 3), Dense(3, 2)])
    if dtype is not None:
        for p in net.trainable_params():
            p.set_dtype(dtype)
    params = net.trainable_params()
    opt = DistributedOptimizer(params, optimizer=kind, lr=0.05, zero_stage=stage)
    return net, opt, params, nn.CellList([net, opt])


def _train(net, opt, params, steps=2):
    import mindspore as ms

    grad_fn = ms.value_and_grad(lambda x: net(x).sum(), None, params)
    x = ms.Tensor(np.linspace(-1, 1, 8, dtype=np.float32).reshape(2, 4))
    for _ in range(steps):
        _, grads = grad_fn(x)
        opt(grads)


def _states(opt):
    return [p.asnumpy() for group in opt.moments for p in group]


def test_save_leaves_out_buffers_and_fp32_mains_and_records_the_optimizer(tmp_path):
    from mindscience.distributed import checkpoint

    net, opt, params, cell = _build(stage=1)
    _train(net, opt, params)
    checkpoint.save(cell, tmp_path / "ck", step=2)
    manifest = json.loads((tmp_path / "ck" / "manifest.json").read_text())
    names = sorted(manifest["parameters"])
    assert not [n for n in names if n.endswith((".main", ".grad_buffer"))]
    assert len([n for n in names if n.endswith(".exp_avg")]) == 4
    assert len([n for n in names if n.endswith(".exp_avg_sq")]) == 4
    steps = [n for n in names if n.endswith("step")]
    assert len(steps) == 1 and manifest["parameters"][steps[0]]["base"] is None
    # each moment is linked to its parameter (an offline reshard moves it with it)
    for name, entry in manifest["parameters"].items():
        if name.endswith((".exp_avg", ".exp_avg_sq")):
            assert entry["base"] in manifest["parameters"]
            assert entry["shape"] == manifest["parameters"][entry["base"]]["shape"]
    assert manifest["optimizers"] == [{"class": "DistributedOptimizer", "kind": "adamw",
                                       "state": ["exp_avg", "exp_avg_sq"], "zero_stage": 1,
                                       "group_size": 1}]


def test_stage1_checkpoint_resumes_at_stage0_and_back(tmp_path):
    """Step counter, moments and weights cross stages; the main weights the checkpoint
    lacks are set from the loaded weights; the next steps match the uninterrupted run."""
    from mindscience.distributed import checkpoint

    net, opt, params, cell = _build(stage=1)
    _train(net, opt, params, steps=2)
    checkpoint.save(cell, tmp_path / "s1", step=2)
    _train(net, opt, params, steps=2)
    want = [p.asnumpy() for p in params]

    net0, opt0, params0, cell0 = _build(stage=0, seed=5)
    info = checkpoint.load(cell0, tmp_path / "s1")
    assert info["step"] == 2 and int(opt0.step.asnumpy()) == 2
    checkpoint.save(cell0, tmp_path / "s0", step=2)

    net1, opt1, params1, cell1 = _build(stage=1, seed=9)
    info = checkpoint.load(cell1, tmp_path / "s0")
    assert int(opt1.step.asnumpy()) == 2
    assert not [n for n in info["loaded"] if n.endswith(".main")]
    for main, p in zip(opt1.mains, params1):
        np.testing.assert_array_equal(main.asnumpy().reshape(p.shape), p.asnumpy())
    for a, b in zip(_states(opt1), _states(opt0)):
        np.testing.assert_array_equal(a, b)
    _train(net1, opt1, params1, steps=2)
    for got, ref in zip(params1, want):
        np.testing.assert_allclose(got.asnumpy(), ref, rtol=0, atol=1e-6)


def test_bf16_main_weights_are_saved_and_loaded(tmp_path):
    import mindspore as ms

    from mindscience.distributed import checkpoint

    net, opt, params, cell = _build(stage=1, dtype=ms.bfloat16)
    _train(net, opt, params)
    checkpoint.save(cell, tmp_path / "ck", step=2)
    manifest = json.loads((tmp_path / "ck" / "manifest.json").read_text())
    mains = {n: e for n, e in manifest["parameters"].items() if n.endswith(".main")}
    assert len(mains) == 4 and {e["dtype"] for e in mains.values()} == {"F32"}
    assert {manifest["parameters"][e["base"]]["dtype"] for e in mains.values()} == {"BF16"}

    net2, opt2, params2, cell2 = _build(stage=0, dtype=ms.bfloat16, seed=3)
    checkpoint.load(cell2, tmp_path / "ck")
    for a, b in zip(opt2.mains, opt.mains):  # fp32 masters, not the rounded bf16 weights
        np.testing.assert_array_equal(a.asnumpy(), b.asnumpy())
    for a, b in zip(params2, params):
        np.testing.assert_array_equal(a.astype(ms.float32).asnumpy(), b.astype(ms.float32).asnumpy())


def test_loading_another_optimizer_kind_fails_in_one_line(tmp_path):
    from mindscience.distributed import checkpoint

    net, opt, params, cell = _build(kind="adamw")
    _train(net, opt, params, steps=1)
    checkpoint.save(cell, tmp_path / "ck", step=1)
    net2, opt2, params2, cell2 = _build(kind="sgd", seed=4)
    before = [p.asnumpy().copy() for p in params2]
    with pytest.raises(CheckpointError) as err:
        checkpoint.load(cell2, tmp_path / "ck")
    message = str(err.value)
    assert "\n" not in message
    assert "optimizer kind differs: saved 'adamw', this model's 'sgd'" in message
    for p, b in zip(params2, before):  # nothing was modified
        np.testing.assert_array_equal(p.asnumpy(), b)


def test_offline_reshard_keeps_the_optimizer_record(tmp_path):
    from mindscience.distributed import checkpoint
    from mindscience.distributed.checkpoint import offline
    from mindscience.distributed.topology.layout import Layout

    net, opt, params, cell = _build(kind="sgd", stage=2)
    _train(net, opt, params, steps=1)
    checkpoint.save(cell, tmp_path / "ck", step=1)
    offline.reshard(str(tmp_path / "ck"), str(tmp_path / "out"), Layout(world_size=1))
    report = offline.inspect(str(tmp_path / "out"))
    assert report["ok"]
    assert report["optimizers"] == [{"class": "DistributedOptimizer", "kind": "sgd",
                                     "state": ["momentum"], "zero_stage": 2, "group_size": 1}]
    net2, opt2, params2, cell2 = _build(kind="sgd", stage=0, seed=6)
    checkpoint.load(cell2, tmp_path / "out")
    for a, b in zip(_states(opt2), _states(opt)):
        np.testing.assert_array_equal(a, b)


# ----------------------------------------------------------------------------- 4 ranks
@pytest.fixture(scope="module")
def job():
    result = job_mod.run_job()
    assert result.ok, job_mod.describe_failures(result)
    return result


def _by_leg(result, check):
    out = {}
    for rank, record in job_mod.records_of(result, check):
        out.setdefault(record["leg"], []).append((rank, record))
    return out


@pytest.mark.multiprocess
def test_reference_run_is_the_same_on_every_rank(job):
    records = job_mod.records_of(job, "ckzero.reference")
    assert len(records) == job_mod.WORLD_SIZE
    losses = [r["losses"] for _, r in records]
    assert all(len(curve) == job_mod.STEPS for curve in losses)
    assert all(curve == losses[0] for curve in losses)
    assert losses[0][-1] < losses[0][0]  # it trains


@pytest.mark.multiprocess
def test_stage3_dp4_to_stage1_tp2_to_stage0_tp1_continues_as_uninterrupted(job):
    legs = _by_leg(job, "ckzero.chain")
    assert sorted(legs) == [0, 1, 2]
    a, b = job_mod.SPEC["checks"][1]["params"]["legs"]
    want_steps = {0: a, 1: a + b, 2: job_mod.STEPS}
    expect = {0: ("tp1-cp1-dp4", 3, 4), 1: ("tp2-cp1-dp2", 1, 2), 2: ("tp1-cp1-dp4", 0, 4)}
    for leg, records in legs.items():
        assert len(records) == job_mod.WORLD_SIZE
        for rank, r in records:
            label, stage, group = expect[leg]
            assert r["layout"].startswith(label) and (r["stage"], r["group_size"]) == (stage, group)
            assert len(r["losses"]) == len(r["want"]) > 0
            assert r["loss_rel"] < 1e-6, (leg, rank, r["losses"], r["want"])
            assert r["padding_abs"] == 0.0
            assert r["opt_step"] == want_steps[leg]
            if leg > 0:
                assert r["loaded_step"] == want_steps[leg - 1]
    # fully_shard really sharded the stage-3 leg (dp4: 50 rows -> 13, 18 -> 5)
    shapes = legs[0][0][1]["fsdp_shapes"]
    assert shapes["1.embedding.weight"] == [[13, 18], [50, 18]]
    assert shapes["1.ln.weight"] == [[5], [18]]
    for _, r in legs[2]:
        assert r["weights_same_names"]
        assert r["weights_rel"] < 1e-6, r["weights_max_diff"]


@pytest.mark.multiprocess
def test_offline_reshard_of_a_stage2_checkpoint_loads_and_continues(job):
    legs = _by_leg(job, "ckzero.offline")
    first = job_mod.SPEC["checks"][2]["params"]["first"]
    for _, r in legs[0]:
        assert (r["stage"], r["group_size"]) == (2, 2) and r["loss_rel"] < 1e-6
    for rank, r in legs[1]:
        assert r["resharded_layout"]["tp"] == 1 and r["resharded_layout"]["dp"] == 4
        assert r["optimizers"][0]["zero_stage"] == 2 and r["optimizers"][0]["kind"] == "adamw"
        # 8 parameters, two moments each, no main weights (fp32) nor gradient buffers
        assert r["state_suffixes"] == ["exp_avg", "exp_avg_sq"] and r["state_count"] == 16
        assert (r["stage"], r["group_size"]) == (1, 4)
        assert r["loaded_step"] == first and r["opt_step"] == job_mod.STEPS
        assert r["loss_rel"] < 1e-6, (rank, r["losses"], r["want"])
        assert r["padding_abs"] == 0.0
        assert r["weights_same_names"] and r["weights_rel"] < 1e-6
