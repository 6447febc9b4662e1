"""GPTModel with MoE layers: in this process (the MoE block, the aux loss's gradient, the
statistics, checkpoints at one rank), and ONE family of the shared 4-rank launch
(tests/_moe_model_job.py) against the one-rank model: ep4, ep2, ep2 x tp2 (etp 1 and 2),
ep2 x pp2, ep2 x cp2, training with DistributedOptimizer stages 0-3, a checkpoint
ep4 -> reshard -> ep2 x etp2 -> resume, and loaded here at one rank.
"""

from __future__ import annotations

import os
import shutil

import numpy as np
import pytest

ms = pytest.importorskip("mindspore")

import _moe_model_checks as mc  # noqa: E402
import _moe_model_job as job  # noqa: E402


# --------------------------------------------------------------------------- one process
def _one_rank_run(steps=5, resume=None, **model):
    """The uninterrupted one-rank run of the family's training: the whole global batch of 8
    sequences in ONE micro-batch, as the ranks' aux loss sees it (one micro-batch per dp rank)."""
    from mindscience.distributed.training.loop import Trainer

    ms.set_context(mode=ms.PYNATIVE_MODE)
    opts = mc.options(steps=steps, micro_batch_size=mc.GLOBAL_BATCH, global_batch_size=mc.GLOBAL_BATCH)
    trainer = Trainer(*mc.train_specs(**model), opts)
    first = 0
    if resume:
        first = trainer.resume(resume)["step"]
    return trainer, [trainer.train_step(k) for k in range(first, steps)]


@pytest.fixture(scope="module")
def one_rank():
    return _one_rank_run()[1]


def test_moe_block_aux_gradient_and_statistics():
    """The aux loss reaches the gradients exactly as ``loss + aux`` of every micro-batch
    would (weight 1/m each), and the statistics count every token once per expert pick."""
    from mindscience.distributed.models import GPTModel
    from mindscience.distributed.models.gpt import _Head

    ms.set_context(mode=ms.PYNATIVE_MODE)
    cfg = mc.small_config(moe_aux_loss_coeff=0.1, moe_z_loss_coeff=0.01)
    model = GPTModel(cfg, seed=1)
    assert sorted(model.moe_blocks) == [0, 1]
    ids, labels = mc.global_batch(cfg, 4, 3)
    loss, grads = model.forward_backward(ids, labels, num_microbatches=2, mode="pynative")
    metrics = model.moe_metrics()
    params = model.trainable_params()
    head = _Head(model.final_norm, model.output_layer, model.tp, False)

    def objective(x, t):
        h, aux = model.embedding(x), 0.0
        for i in (0, 1):
            layer = model.layers._cells[str(i)]
            h = h + layer.attention(layer.input_norm(h))
            y, a, _ = layer.mlp.moe(layer.post_attention_norm(h))
            h, aux = h + y, aux + a
        return model.loss_fn(head(h), t) + aux

    grad_fn = ms.value_and_grad(objective, None, params)
    x, t = model.shard_batch(ids), model.shard_batch(labels)
    want = [np.zeros(p.shape, np.float32) for p in params]
    for j in range(2):
        _, g = grad_fn(ms.Tensor(x[:, 2 * j:2 * j + 2]), ms.Tensor(t[:, 2 * j:2 * j + 2]))
        want = [w + a.asnumpy() / 2 for w, a in zip(want, g)]
    errs = [float(np.abs(a.asnumpy() - w).max() / max(np.abs(w).max(), 1e-30)) for a, w in zip(grads, want)]
    assert max(errs) < 1e-6
    # 4 rows x 16 tokens, top-2: 128 assignments per layer, none dropped (dropless)
    assert metrics["layers"] == [0, 1]
    assert metrics["tokens"].shape == (2, 4)
    np.testing.assert_array_equal(metrics["tokens"].sum(axis=1), [128, 128])
    np.testing.assert_array_equal(metrics["dropped"], [0, 0])
    assert all(a > 0 for a in metrics["aux_loss"])
    # the buffers are not state: a checkpoint leaves them out
    from mindscience.distributed.checkpoint import named_parameters

    names = [n for n, _, _ in named_parameters(model)]
    assert "layers.0.mlp.moe.router.expert_bias" in names
    assert not any(n.endswith(("mlp.tokens", "mlp.calls", "mlp.aux_sum", "mlp.aux_scale")) for n in names)


def test_checkpoint_of_a_moe_trainer_round_trips_in_one_process(tmp_path):
    """Weights, AdamW moments (named after their expert) and the expert bias come back; the
    statistics buffers are not saved, and a float32 model keeps no main weights (its
    parameters are their own main weights at every ZeRO stage)."""
    from mindscience.distributed.checkpoint import offline
    from mindscience.distributed.training.loop import Trainer

    ms.set_context(mode=ms.PYNATIVE_MODE)
    opts = mc.options(steps=1, zero_stage=1, micro_batch_size=mc.GLOBAL_BATCH, global_batch_size=mc.GLOBAL_BATCH)
    first = Trainer(*mc.train_specs(), opts)
    first.train_step(0)
    first.save(str(tmp_path / "ckpt"), 1)
    names = {p["name"] for p in offline.inspect(str(tmp_path / "ckpt"))["parameters"]}
    assert {"0.layers.1.mlp.moe.experts.3.w1", "0.layers.1.mlp.moe.router.expert_bias"} <= names
    assert any(n.endswith("layers.1.mlp.moe.experts.3.w1.exp_avg") for n in names)  # after its expert
    assert not any("experts.w1" in n or n.endswith((".tokens", ".calls", ".aux_sum")) for n in names)
    second = Trainer(*mc.train_specs(), opts)
    assert second.resume(str(tmp_path / "ckpt"))["step"] == 1
    bias = first.model.moe_blocks[1].moe.router.expert_bias.asnumpy()
    assert np.abs(bias).max() > 0  # moved by the step (enable_expert_bias)
    from mindscience.distributed.checkpoint import named_parameters

    # every tensor of the model and optimizer
    want = {n: p.asnumpy() for n, p, _ in named_parameters(first.checkpoint_cell)}
    got = {n: p.asnumpy() for n, p, _ in named_parameters(second.checkpoint_cell)}
    assert sorted(got) == sorted(want) and any(n.endswith("experts.w1.exp_avg") for n in got)
    assert not any(n.endswith(".main") for n in got)  # float32: no second copy
    for name, value in want.items():
        np.testing.assert_array_equal(got[name], value, err_msg=name)
    np.testing.assert_array_equal(second.model.moe_blocks[1].moe.router.expert_bias.asnumpy(), bias)


def test_another_expert_count_is_one_typed_error(tmp_path):
    from mindscience.distributed.checkpoint import CheckpointExpertCountError
    from mindscience.distributed.training.loop import Trainer

    ms.set_context(mode=ms.PYNATIVE_MODE)
    opts = mc.options(steps=1, micro_batch_size=mc.GLOBAL_BATCH, global_batch_size=mc.GLOBAL_BATCH)
    Trainer(*mc.train_specs(), opts).save(str(tmp_path / "ckpt"), 0)
    other = Trainer(*mc.train_specs(num_moe_experts=8), opts)
    before = other.model.moe_blocks[0].moe.experts.w1.asnumpy()
    with pytest.raises(CheckpointExpertCountError, match=r"holds 4 experts, this model 8 \(num_moe_experts\).*"
                                                         r"num_moe_experts=4"):
        other.resume(str(tmp_path / "ckpt"))
    np.testing.assert_array_equal(other.model.moe_blocks[0].moe.experts.w1.asnumpy(), before)  # untouched
    # msdist train --resume checks it before any rank starts (and takes the expert optimizer's state)
    from dataclasses import replace

    from mindscience.distributed.costmodel.spec import Workload
    from mscli.commands.train import check_resume
    from mscli.errors import UsageError

    model, training = mc.train_specs()
    assert check_resume(str(tmp_path / "ckpt"), Workload(model=model, training=training), opts)["step"] == 0
    with pytest.raises(UsageError, match="model.num_moe_experts is 4 in the checkpoint, 8 here"):
        check_resume(str(tmp_path / "ckpt"), Workload(model=replace(model, num_moe_experts=8), training=training),
                     opts)


def test_moe_layers_follow_moe_layer_freq():
    from mindscience.distributed.models import GPTModel
    from mindscience.distributed.models.layers import MLP, MoEBlock

    cfg = mc.small_config(num_layers=3, moe_layer_freq=[0, 1, 1])
    model = GPTModel(cfg, seed=0)
    kinds = [type(model.layers._cells[str(i)].mlp) for i in range(3)]
    assert kinds == [MLP, MoEBlock, MoEBlock]
    w1 = model.layers._cells["1"].mlp.moe.experts.w1
    assert tuple(w1.shape) == (4, 32, 32)  # every expert here, SwiGLU [gate | up] of width 16


# --------------------------------------------------------------------------- the 4-rank family
@pytest.fixture(scope="module")
def result():
    res = job.run_job()
    yield res
    for r in job.records_of(res, "moe_model.checkpoint")[:1]:
        shutil.rmtree(os.path.dirname(r["saved"]), ignore_errors=True)


@pytest.mark.multiprocess
def test_family_ran(result):
    assert result.ok, job.describe_failures(result)


@pytest.mark.multiprocess
def test_gptmodel_moe_equals_the_one_rank_model(result):
    records = job.records_of(result, "moe_model.parity")
    cases = {(r["layout"], r["case"]) for r in records}
    assert cases == {("ep4", "dropless_aux"), ("ep4", "dropless_aux_jit"), ("ep4", "capacity"),
                     ("ep2", "shared_experts"), ("tp2xep2xetp1", "tp2_etp1"), ("tp2xep2xetp2", "tp2_etp2"),
                     ("pp2xep2", "pp2_capacity"), ("cp2xep2", "cp2")}
    assert len(records) == 4 * len(cases)
    for r in records:
        where = f"{r['layout']} {r['case']} rank {r['rank']}"
        assert r["loss_rel_err"] <= 1e-5, where
        assert r["max_grad_rel_err"] <= 1e-5, (where, r["worst_param"])
        assert r["max_weight_err"] == 0.0, where
        assert r["aux_rel_err"] <= 1e-5, (where, r["aux_loss"], r["dense_aux_loss"])
        assert r["compared"] == sorted(n for n in r["dense_params"] if n in r["compared"])
        assert r["expert_params"], where
        assert r["passed"], where
    # ep4: one expert of 4 per rank; ep2 x etp2: 2 experts, half the SwiGLU width each
    shapes = {(r["layout"], r["case"]): r["local_expert_shape"][0] for r in records if r["local_expert_shape"]}
    assert shapes[("ep4", "dropless_aux")] == [1, 32, 32]
    assert shapes[("tp2xep2xetp2", "tp2_etp2")] == [2, 32, 16]
    # the capacity cases really dropped, on both sides alike (the losses and gradients above)
    cap = [r for r in records if r["case"] in ("capacity", "pp2_capacity")]
    assert all(sum(r["dense_dropped"]) > 0 for r in cap)
    assert sum(sum(r["dropped"]) for r in cap if r["case"] == "capacity") > 0
    # the aux loss of a layer is the same number on every rank (it is the global batch's)
    for key in cases:
        auxes = [r["aux_loss"] for r in records if (r["layout"], r["case"]) == key]
        for a in auxes[1:]:
            for i, v in a.items():
                if i in auxes[0]:
                    assert abs(v - auxes[0][i]) <= 1e-6 * abs(v), key


@pytest.mark.multiprocess
def test_moe_errors_on_every_rank(result):
    records = job.records_of(result, "moe_model.errors")
    assert len(records) == 4
    for r in records:
        assert r["raised"] is not None and "num_experts=6" in r["message"] and "ep=4" in r["message"]


def _assert_steps_equal(got, want, where):
    assert [r["step"] for r in got] == [w["step"] for w in want], where
    for r, w in zip(got, want):
        assert abs(r["loss"] - w["loss"]) <= 1e-5 * abs(w["loss"]), (where, r, w)
        assert abs(r["aux_loss"] - w["aux_loss"]) <= 1e-5 * abs(w["aux_loss"]) + 1e-9, (where, r, w)
        assert abs(r["max_load"] - w["max_load"]) <= 1e-5 * w["max_load"], (where, r, w)
        assert r["dropped_tokens"] == w["dropped_tokens"] == 0, where


@pytest.mark.multiprocess
def test_training_with_distributed_optimizer_stages_equals_one_rank(result, one_rank):
    records = job.records_of(result, "moe_model.train")
    assert {(r["layout"], r["zero_stage"]) for r in records} == {
        ("ep4", 0), ("tp2xep2xetp2", 1), ("pp2xep2", 2), ("ep2", 3)}
    assert len(records) == 16
    assert len({round(w["loss"], 6) for w in one_rank}) == 5  # every step moved the weights
    for r in records:
        _assert_steps_equal(r["steps"], one_rank, f"{r['layout']} stage {r['zero_stage']} rank {r['rank']}")


@pytest.mark.multiprocess
def test_checkpoint_ep4_reshard_ep2_etp2_resume_equals_uninterrupted(result, one_rank):
    from mindscience.distributed.checkpoint import CheckpointExpertCountError, offline
    from mindscience.distributed.checkpoint.plan import expert_name

    records = job.records_of(result, "moe_model.checkpoint")
    assert len(records) == 4
    for r in records:
        assert (r["first"], r["then"], r["resumed_step"]) == ("ep4", "tp2xep2xetp2", 3)
        _assert_steps_equal(r["steps"], one_rank, f"rank {r['rank']}")
    saved, resharded = records[0]["saved"], records[0]["resharded"]
    info = offline.inspect(resharded)
    assert info["ok"], info["problems"]
    assert (info["layout"]["ep"], info["layout"]["etp"], info["layout"]["tp"]) == (2, 2, 2)
    params = {p["name"]: p for p in info["parameters"]}
    w1 = expert_name("0.layers.1.mlp.moe.experts.w1", 3)
    assert params[w1]["shape"] == [32, 32] and params[w1]["shards"] == 2  # etp halves of expert 3
    assert params[w1]["sharding"]["expert"] == {"index": 3, "count": 4}
    assert not any(n.endswith(("mlp.tokens", "mlp.calls")) for n in params)
    # the ep4 checkpoint resumed at ONE rank in this process: the uninterrupted run
    _, rows = _one_rank_run(resume=saved)
    _assert_steps_equal([{k: row[k] for k in ("step", "loss", "aux_loss", "max_load", "dropped_tokens")}
                         for row in rows], one_rank[3:], "one rank")
    # another expert count: one typed error naming both counts and the fix
    with pytest.raises(CheckpointExpertCountError, match=r"holds 4 experts, this model 8.*num_moe_experts=4"):
        _one_rank_run(steps=4, resume=saved, num_moe_experts=8)
