"""Activation recompute: the pure :mod:`pipeline.recompute`, the RNG replay and the
attention core's selective recompute in one process, and the 4-rank job
(``_recompute_job.py``): the layer set, dropout masks and the pipeline runtime.
"""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

import _recompute_job
from mindscience.distributed.pipeline import recompute as R
from mindscience.distributed.pipeline import schedules as S


# --------------------------------------------------------------------------- pure module
def test_pure_module_imports_no_mindspore():
    code = ("import sys; import mindscience.distributed.pipeline.recompute as r; "
            "r.runtime_recompute('gpipe', 'jit', 'none', 2); r.kept_schedule(3, 4); "
            "print('mindspore' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


@pytest.mark.parametrize("pp", [2, 4, 8])
def test_gpipe_runs_what_is_asked_in_pynative(pp):
    for asked in ("none", "selective", "full"):
        what, reason = R.runtime_recompute("gpipe", "pynative", asked, pp)
        assert what == asked
        assert reason


@pytest.mark.parametrize("schedule,v", [("gpipe", 1), ("1f1b", 1), ("interleaved", 2)])
@pytest.mark.parametrize("asked", ["none", "selective"])
def test_jit_keeps_with_and_without_collectives(schedule, v, asked):
    # Compiled stages with tp / cp collectives keep their forwards too (the mappings copy
    # their output out of the shared bprop cells; recompute.pipeline at tp2 x pp2 jit
    # compares the kept pipeline with the dense model).
    for model_parallel in (1, 2, 8):
        what, reason = R.runtime_recompute(schedule, "jit", asked, 2, v,
                                           model_parallel=model_parallel)
        assert what == asked
        assert schedule in reason and "keeps" in reason and "mode='jit'" in reason
    assert R.runtime_recompute(schedule, "jit", "full", 2, v, model_parallel=2)[0] == "full"


@pytest.mark.parametrize("schedule,v", [("gpipe", 1), ("1f1b", 1), ("interleaved", 2)])
@pytest.mark.parametrize("asked", ["none", "selective"])
def test_jit_with_cp_recomputes(schedule, v, asked):
    # Two ring-attention layers in a kept compiled stage do not compile (measured): jit at
    # cp > 1 recomputes and says why; PyNative keeps.
    what, reason = R.runtime_recompute(schedule, "jit", asked, 2, v, model_parallel=4,
                                       context_parallel=2)
    assert what == "full"
    assert "cp=2" in reason and repr(asked) in reason and "mode='pynative'" in reason
    assert R.runtime_recompute(schedule, "pynative", asked, 2, v, model_parallel=4,
                               context_parallel=2)[0] == asked
    # one model stage: nothing to keep across micro-batches, nothing forced
    assert R.runtime_recompute(schedule, "jit", asked, 1, 1, 4, context_parallel=2)[0] == asked
    with pytest.raises(R.RecomputeError, match="context_parallel=0 is invalid"):
        R.runtime_recompute(schedule, "jit", asked, 2, v, context_parallel=0)


@pytest.mark.parametrize("schedule,v", [("1f1b", 1), ("interleaved", 2)])
@pytest.mark.parametrize("asked", ["none", "selective"])
def test_1f1b_and_interleaved_keep_their_forwards(schedule, v, asked):
    # The backward of the oldest kept forward first: what MindSpore 2.10 could not do with
    # mindspore.vjp, and does with GradOperation on a set_grad cell (any order, measured).
    for model_parallel in (1, 8):
        what, reason = R.runtime_recompute(schedule, "pynative", asked, 4, v,
                                           model_parallel=model_parallel)
        assert what == asked
        assert schedule in reason and "keeps" in reason and repr(asked) in reason


def test_one_model_stage_recomputes_nothing():
    assert R.runtime_recompute("1f1b", "pynative", "full", 1)[0] == "none"
    assert R.runtime_recompute("gpipe", "jit", "selective", 1)[0] == "selective"
    # one rank with two chunks is two model stages: interleaved keeps its first chunk's forward
    assert R.runtime_recompute("interleaved", "pynative", "none", 1, 2)[0] == "none"
    assert R.runtime_recompute("interleaved", "pynative", "full", 1, 2)[0] == "full"


@pytest.mark.parametrize("asked,want", [("none", "none"), ("selective", "selective"),
                                        ("full", "selective")])
def test_model_request_keeps_the_stage_forwards(asked, want):
    # GPTModel marks its own cells; the runtime keeps the stage forwards around them.
    assert R.model_request(asked) == want
    with pytest.raises(R.RecomputeError, match="recompute='some' is invalid"):
        R.model_request("some")


@pytest.mark.parametrize("args,match", [
    (("gpipe", "pynative", "partial", 2), "recompute='partial' is invalid: expected one of full, selective, none"),
    (("zb", "pynative", "none", 2), "schedule='zb' is unknown"),
    (("gpipe", "graph", "none", 2), "mode='graph' is invalid: expected one of pynative, jit"),
    (("gpipe", "jit", "none", 0), "pp=0 is invalid: expected an integer >= 1"),
    (("gpipe", "jit", "none", True), "pp=True is invalid"),
    (("gpipe", "jit", "none", 2, 0), "virtual_stages=0 is invalid"),
    (("gpipe", "jit", "none", 2, 1, 0), "model_parallel=0 is invalid: expected an integer >= 1"),
])
def test_bad_arguments_name_the_value(args, match):
    with pytest.raises(R.RecomputeError, match=match):
        R.runtime_recompute(*args)


@pytest.mark.parametrize("p,m", [(1, 1), (2, 4), (3, 5), (4, 8)])
def test_kept_schedule_runs_backwards_newest_first(p, m):
    kept = R.kept_schedule(p, m)
    plain = S.build("gpipe", p, m)
    assert kept.name == "gpipe"
    # the same bubble and the same peak of micro-batches in flight as GPipe's oldest-first
    assert kept.makespan == plain.makespan == 3 * (m + p - 1)
    assert kept.peak_in_flight == plain.peak_in_flight == [m] * p
    for r, rank in enumerate(kept.steps):
        computes = [(a.kind, a.microbatch) for step in rank for a in step if a.kind in ("F", "B")]
        assert computes == [("F", j) for j in range(m)] + [("B", j) for j in reversed(range(m))]
        # every transfer of the plain schedule is still there, once
        moves = sorted(str(a) for step in rank for a in step if a.kind not in ("F", "B"))
        want = sorted(str(a) for step in plain.steps[r] for a in step if a.kind not in ("F", "B"))
        assert moves == want


def test_forward_backward_rejects_a_bad_recompute():
    from mindscience.distributed.pipeline.arguments import PipelineError, check_recompute

    assert check_recompute("selective") == "selective"
    with pytest.raises(PipelineError, match=r"recompute='partial' is invalid: expected one of "
                                            r"full, selective, none"):
        check_recompute("partial")
    with pytest.raises(PipelineError, match="recompute=None is invalid"):
        check_recompute(None)


# --------------------------------------------------------------------------- one process
def _dropout_net(masks):
    import mindspore as ms
    from mindspore import mint, nn, ops

    from mindscience.distributed import random as msrandom

    class Block(nn.Cell):
        def __init__(self):
            super().__init__()
            rng = np.random.default_rng(0)
            self.w = ms.Parameter(ms.Tensor(rng.standard_normal((8, 8)).astype(np.float32)),
                                  name="w")

        def construct(self, x):
            h = mint.matmul(x, self.w)
            with msrandom.get_rng_tracker().fork():
                h = ops.dropout(h, p=0.5)
            masks.append((h == 0).asnumpy())
            return mint.tanh(ops.dropout(h, p=0.3))

    class Net(nn.Cell):
        def __init__(self):
            super().__init__()
            self.block = Block()

        def construct(self, x):
            y = ops.dropout(self.block(x), p=0.2)
            return (y * y).sum()

    return Net()


def _dropout_steps(way, steps=3):
    import mindspore as ms

    from mindscience.distributed import random as msrandom

    ms.set_context(mode=ms.PYNATIVE_MODE)
    msrandom.model_parallel_seed(7)
    masks = []
    net = _dropout_net(masks)
    if way == "library":
        msrandom.recompute(net.block)
    elif way == "plain":
        net.block.recompute()
    x = ms.Tensor(np.random.default_rng(1).standard_normal((4, 8)).astype(np.float32))
    fn = ms.value_and_grad(net, 0, net.trainable_params())
    out = []
    for _ in range(steps):
        loss, (gx, (gw,)) = fn(x)
        out.append((float(loss.asnumpy()), gx.asnumpy(), gw.asnumpy()))
    return out, masks


def test_random_recompute_replays_every_stream():
    base, base_masks = _dropout_steps("none")
    got, masks = _dropout_steps("library")
    assert len(base_masks) == 3 and len(masks) == 6  # the block ran twice per step
    for s in range(3):
        np.testing.assert_array_equal(masks[2 * s], masks[2 * s + 1])  # recomputed forward
        np.testing.assert_array_equal(masks[2 * s], base_masks[s])
        assert 0.3 < masks[2 * s].mean() < 0.7
        assert got[s][0] == base[s][0]
        np.testing.assert_array_equal(got[s][1], base[s][1])
        np.testing.assert_array_equal(got[s][2], base[s][2])


def test_plain_cell_recompute_draws_other_masks_in_pynative():
    """Why random.recompute exists (MindSpore 2.10): if this starts failing, MindSpore
    replays ops.dropout's seeds itself and random.recompute may become cell.recompute()."""
    base, _ = _dropout_steps("none", steps=2)
    got, masks = _dropout_steps("plain", steps=2)
    assert len(masks) == 4
    assert not np.array_equal(masks[0], masks[1])
    assert max(float(np.abs(g[2] - b[2]).max()) for g, b in zip(got, base)) > 1e-3


def test_random_recompute_rejects_a_function():
    from mindscience.distributed import random as msrandom

    with pytest.raises(TypeError, match="cell must be an nn.Cell, got function"):
        msrandom.recompute(_dropout_steps)


@pytest.mark.parametrize("method", ["ring", "ulysses", "allgather_kv"])
def test_attention_recompute_runs_the_core_twice_with_the_same_gradients(method, monkeypatch):
    """cp = 1 (every method is plain attention there): the core's forward runs again in
    the PyNative backward with recompute=True, once without; gradients equal."""
    import mindspore as ms

    from mindscience.distributed.modules import ContextParallelAttention
    from mindscience.distributed.modules.attention import core

    calls = []
    dense = core.AttentionMath.dense

    def counted(self, *args):
        calls.append(1)
        return dense(self, *args)

    monkeypatch.setattr(core.AttentionMath, "dense", counted)
    ms.set_context(mode=ms.PYNATIVE_MODE)
    x = ms.Tensor(np.random.default_rng(0).standard_normal((8, 2, 16)).astype(np.float32))
    results = []
    for recompute in (False, True):
        ms.set_seed(3)
        layer = ContextParallelAttention(16, 4, num_query_groups=2, causal=True, method=method,
                                         recompute=recompute)

        def loss(x):
            return (layer(x) ** 2).sum()

        calls.clear()
        value, (gx, gw) = ms.value_and_grad(loss, 0, layer.trainable_params())(x)
        results.append((len(calls), float(value.asnumpy()), gx.asnumpy(),
                        [g.asnumpy() for g in gw]))
    (n0, l0, gx0, gw0), (n1, l1, gx1, gw1) = results
    assert (n0, n1) == (1, 2)
    assert l0 == l1
    np.testing.assert_array_equal(gx0, gx1)
    for a, b in zip(gw0, gw1):
        np.testing.assert_array_equal(a, b)


def test_attention_recompute_must_be_a_bool():
    from mindscience.distributed.modules import ContextParallelAttention

    with pytest.raises(ValueError, match="recompute='yes' must be True or False"):
        ContextParallelAttention(16, 4, recompute="yes")


# --------------------------------------------------------------------------- the 4-rank job
@pytest.fixture(scope="module")
def job():
    result = _recompute_job.run_job()
    assert result.ok, _recompute_job.describe_failures(result)
    return result


def _by_group(records):
    out = {}
    for r in records:
        out.setdefault(r["group"], []).append(r)
    return out


@pytest.mark.multiprocess
def test_layer_set_gradients_equal_with_recompute(job):
    groups = _by_group(_recompute_job.records_of(job, "recompute.layers"))
    assert set(groups) == set(_recompute_job.LAYER_GROUPS)
    for name, recs in groups.items():
        assert len(recs) == _recompute_job.WORLD_SIZE, name
        for r in recs:
            # the input gradient and the parameters': embedding, per attention qkv/out
            # weight and bias, fc1/fc2 weight and bias, head
            assert r["grads"] == 1 + 1 + 4 * len(r["methods"]) + 4 + 1, r
            assert r["max_error"] <= 1e-6, r
            assert abs(r["loss"] - r["loss_ref"]) <= 1e-6 and 0.5 < r["loss"] < 10, r


@pytest.mark.multiprocess
def test_dropout_masks_replayed_under_the_tracker(job):
    groups = _by_group(_recompute_job.records_of(job, "recompute.rng"))
    lib = groups["pynative.library"]
    assert len(lib) == _recompute_job.WORLD_SIZE
    for r in lib:
        assert r["max_error"] <= 1e-6, r
        assert r["forwards"] == 2 * r["steps"] and r["base_forwards"] == r["steps"], r
        assert r["mask_replay_diff"] == 0.0 and r["mask_vs_none_diff"] == 0.0, r
        assert 0.3 < r["dropped"] < 0.7, r
    for mode in ("jit", "graph"):  # compiled: Cell.recompute() replays the traced seeds
        assert len(groups[f"{mode}.plain"]) == _recompute_job.WORLD_SIZE
        for r in groups[f"{mode}.plain"]:
            assert r["max_error"] <= 1e-6, r


@pytest.mark.multiprocess
def test_pipeline_kept_activations_equal_recomputed(job):
    """Every schedule x mode x recompute on tp2 x pp2 and pp2 x dp2 equals the dense model;
    kept stage forwards run once per micro-batch (counted), recomputed ones twice."""
    groups = _by_group(_recompute_job.records_of(job, "recompute.pipeline"))
    want = {f"{layout}.{mode}.{schedule}.{recompute}" for layout in ("tp2pp2", "pp2dp2")
            for mode in ("pynative", "jit") for schedule in ("1f1b", "interleaved", "gpipe")
            for recompute in ("none", "selective", "full")}
    assert set(groups) == want
    for name, recs in groups.items():
        layout, mode, schedule, recompute = name.split(".")
        assert len(recs) == _recompute_job.WORLD_SIZE, name
        for r in recs:
            assert r["rel_error"] <= 1e-5, r
            # 2 MLPs x (fc1, fc2) x (weight, bias) per chunk
            assert r["grads"] == 8 * (2 if schedule == "interleaved" else 1), r
            # Kept in both modes, also compiled with the tp collectives in the stage.
            assert r["what_runs"] == recompute, r
            if mode == "pynative":
                runs = 2 if recompute == "full" else 1
                assert r["forward_calls"] == [4 * (runs if k != r["stages"] - 1 else 1)
                                              for k in r["model_stages"]], r
                assert r["warnings"] == 0, r
            if schedule == "gpipe":
                assert r["peak"] == 4, r  # every micro-batch in flight
            assert r["passed"], r
