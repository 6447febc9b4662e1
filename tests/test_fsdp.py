"""fully_shard (ZeRO-3 / FSDP): shard arithmetic and argument errors in this process,
then parity with the whole model on 4 ranks (ONE launch, tests/_fsdp_job.py)."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from mindscience.distributed.fsdp import (FullyShardError, full_param_numpy, shard_range,
                                          shard_rows, shard_shape)


# ----------------------------------------------------------------------------- arithmetic
@pytest.mark.parametrize("rows", [1, 2, 3, 7, 10, 15, 64, 257])
@pytest.mark.parametrize("size", [1, 2, 3, 4, 8])
def test_shard_ranges_tile_the_rows(rows, size):
    c = shard_rows(rows, size)
    assert c == -(-rows // size)
    covered = []
    for rank in range(size):
        start, stop = shard_range(rows, size, rank)
        assert 0 <= stop - start <= c
        assert start == min(rank * c, rows)
        covered.extend(range(start, stop))
    assert covered == list(range(rows))  # every row once, in group-rank order


def test_shard_examples():
    assert [shard_range(10, 4, r) for r in range(4)] == [(0, 3), (3, 6), (6, 9), (9, 10)]
    assert shard_range(2, 4, 3) == (2, 2)  # a rank past the end holds only padding
    assert shard_shape((10, 64), 4) == (3, 64)
    assert shard_shape((15,), 2) == (8,)
    assert shard_shape((), 4) == (1,)  # 0-d parameters are treated as shape (1,)


def test_full_param_numpy_drops_padding():
    full = np.arange(30, dtype=np.float32).reshape(10, 3)
    shards = []
    for rank in range(4):
        start, stop = shard_range(10, 4, rank)
        shard = np.full((3, 3), -7.0, np.float32)  # padding rows hold garbage
        shard[: stop - start] = full[start:stop]
        shards.append(shard)
    np.testing.assert_array_equal(full_param_numpy(shards, (10, 3)), full)
    np.testing.assert_array_equal(full_param_numpy([np.array([5.0])] * 4, ()), np.array(5.0))


@pytest.mark.parametrize("bad", [(-1, 4), (3, 0), (2.5, 2), (True, 2)])
def test_shard_rows_rejects_bad_numbers(bad):
    with pytest.raises(FullyShardError, match="must be an integer"):
        shard_rows(*bad)


def test_runtime_rules():
    from mindscience.distributed.fsdp import fsdp_runtime
    from mindscience.distributed.fsdp.rules import peak_gathered_bytes, unit_reshards

    assert fsdp_runtime("pynative") == {"reshard_after_forward": True, "prefetch": True,
                                        "gathers_per_unit": 2, "units_alive": 2, "reason": None}
    assert fsdp_runtime("pynative", True, False)["units_alive"] == 1
    off = fsdp_runtime("pynative", False, True)
    assert (off["gathers_per_unit"], off["units_alive"], off["prefetch"]) == (1, None, True)
    for mode in ("jit", "graph"):  # compiled: per-parameter gathers kept to the backward
        got = fsdp_runtime(mode)
        assert (got["reshard_after_forward"], got["prefetch"], got["gathers_per_unit"],
                got["units_alive"]) == (False, False, 1, None)
        assert "reshard_after_forward and prefetch run in PyNative only" in got["reason"]
    assert fsdp_runtime("jit", False, False)["reason"] is None
    assert unit_reshards(True, False) and not unit_reshards(True, True)
    assert peak_gathered_bytes([100, 100, 40], 10) == 210
    assert peak_gathered_bytes([100, 100, 40], 10, True, False) == 110
    assert peak_gathered_bytes([100, 100, 40], 10, False) == 250
    with pytest.raises(ValueError, match="mode='eager'"):
        fsdp_runtime("eager")
    with pytest.raises(ValueError, match="prefetch=1 must be True or False"):
        fsdp_runtime("pynative", True, 1)


def test_arithmetic_imports_without_mindspore():
    code = ("import sys; from mindscience.distributed.fsdp import shard_rows, shard_range; "
            "from mindscience.distributed.fsdp.rules import fsdp_runtime; fsdp_runtime('jit'); "
            "assert shard_rows(10, 4) == 3; assert 'mindspore' not in sys.modules, 'imported'")
    subprocess.run([sys.executable, "-c", code], check=True)


# ----------------------------------------------------------------------------- one process
def _group(size=4, rank=3):
    from mindscience.distributed.group import ParallelGroup

    # A group record only: nothing below starts a collective (no backend is initialized).
    return ParallelGroup(key="dp-cp", ranks=tuple(range(size)), rank=rank,
                         backend_name="fsdp-test" if size > 1 else None)


def _dense_model(seed=1):
    import mindspore as ms
    from mindspore import nn

    ms.set_seed(seed)
    return nn.SequentialCell([nn.Dense(6, 10), nn.LayerNorm((10,))])


def test_shards_hold_this_ranks_rows_and_keep_names():
    net = _dense_model()
    before = {p.name: p.asnumpy().copy() for p in net.trainable_params()}
    from mindscience.distributed import fully_shard

    assert fully_shard(net, _group(4, 3)) is net
    names = [n for n, _ in net.parameters_and_names()]
    assert names == ["0.weight", "0.bias", "1.gamma", "1.beta"]
    assert [p.name for p in net.trainable_params()] == names
    for p in net.trainable_params():
        info = p.fsdp
        assert info.full_shape == before[p.name].shape
        assert (info.rows, info.shard_rows, info.pad) == (10, 3, 2)
        assert tuple(p.shape) == (3,) + info.full_shape[1:]
        # group rank 3 holds row 9, then two zero rows of padding
        np.testing.assert_array_equal(p.asnumpy()[0], before[p.name][9])
        assert not p.asnumpy()[1:].any()
    # Outside a forward the attribute is the shard Parameter itself (no communication):
    assert net[0].weight is net[0]._params["weight"]
    assert "shape=(3,)" in repr(net)


def test_bfloat16_shards_keep_dtype_and_values():
    import mindspore as ms
    from mindspore import nn
    from mindscience.distributed import fully_shard

    ms.set_seed(2)
    dense = nn.Dense(4, 7, dtype=ms.bfloat16)
    full = dense.weight.asnumpy().astype(np.float32)
    fully_shard(dense, _group(4, 1))  # rows 2-3 of 7, no padding on group rank 1
    assert dense.weight.dtype == ms.bfloat16 and tuple(dense.weight.shape) == (2, 4)
    np.testing.assert_array_equal(dense.weight.asnumpy().astype(np.float32), full[2:4])


def test_tp_marks_survive():
    from mindscience.distributed import fully_shard
    from mindscience.distributed.modules import ColumnParallelLinear, RowParallelLinear
    from mindscience.distributed.sharding import get_sharding
    import mindspore as ms
    from mindspore import nn

    class TwoLayers(nn.Cell):
        def __init__(self):
            super().__init__()
            self.col = ColumnParallelLinear(4, 6, gather_output=False)
            self.row = RowParallelLinear(6, 4, input_is_parallel=True)

        def construct(self, x):
            return self.row(self.col(x))

    ms.set_seed(3)
    net = TwoLayers()
    marks = {p.name: get_sharding(p) for p in net.trainable_params()}
    fully_shard(net, _group(2, 0))
    assert {p.name: get_sharding(p) for p in net.trainable_params()} == marks
    assert isinstance(net.col, ColumnParallelLinear)  # a subclass: isinstance still holds


def test_size_one_group_changes_nothing_but_metadata():
    import mindspore as ms
    from mindscience.distributed import fully_shard

    net, ref = _dense_model(), _dense_model()
    fully_shard(net, _group(1, 0))
    x = ms.Tensor(np.random.default_rng(0).standard_normal((5, 6)).astype(np.float32))
    np.testing.assert_array_equal(net(x).asnumpy(), ref(x).asnumpy())
    assert all(p.fsdp.pad == 0 and tuple(p.shape) == p.fsdp.full_shape
               for p in net.trainable_params())


def _unchanged(net, shapes):
    return [tuple(p.shape) for p in net.trainable_params()] == shapes and not any(
        hasattr(p, "fsdp") for p in net.trainable_params())


def test_errors_before_any_change():
    import mindspore as ms
    from mindspore import nn
    from mindscience.distributed import fully_shard
    from mindscience.distributed.group import ParallelGroup

    with pytest.raises(FullyShardError, match="expected a mindspore.nn.Cell"):
        fully_shard("model", _group())

    net = _dense_model()
    shapes = [tuple(p.shape) for p in net.trainable_params()]
    with pytest.raises(FullyShardError, match="expected a ParallelGroup"):
        fully_shard(net, 4)
    with pytest.raises(FullyShardError, match="is not a group of this process"):
        fully_shard(net, ParallelGroup(key="dp-cp", ranks=(0, 1), rank=5, backend_name="x"))
    with pytest.raises(FullyShardError, match="reshard_after_forward=1 must be True or False"):
        fully_shard(net, _group(), reshard_after_forward=1)
    with pytest.raises(FullyShardError, match="prefetch='yes' must be True or False"):
        fully_shard(net, _group(), prefetch="yes")
    net[1].gamma.msdist_optimizer_built = True
    with pytest.raises(FullyShardError, match="DistributedOptimizer was already built over "
                                              "parameter '1.gamma'"):
        fully_shard(net, _group())
    assert _unchanged(net, shapes) and type(net[0]) is nn.Dense

    del net[1].gamma.msdist_optimizer_built
    fully_shard(net, _group())
    with pytest.raises(FullyShardError, match="already passed to fully_shard"):
        fully_shard(net, _group())
    with pytest.raises(FullyShardError, match="'0.weight' .* is already fully sharded"):
        fully_shard(net[0], _group())

    bn = nn.SequentialCell([nn.Dense(4, 4), nn.BatchNorm1d(4)])
    shapes = [tuple(p.shape) for p in bn.trainable_params()]
    with pytest.raises(FullyShardError, match="requires_grad=False"):
        fully_shard(bn, _group())
    assert _unchanged(bn, shapes)

    class OwnBprop(nn.Cell):
        def __init__(self):
            super().__init__()
            self.w = ms.Parameter(ms.Tensor(np.ones(4, np.float32)), name="w")

        def construct(self, x):
            return x * self.w

        def bprop(self, x, out, dout):
            return (dout,)

    with pytest.raises(FullyShardError, match="defines its own bprop"):
        fully_shard(OwnBprop(), _group())


def test_group_none_needs_the_manager():
    from mindscience.distributed import fully_shard, manager

    if manager.is_initialized():
        pytest.skip("parallel groups initialized in this process")
    with pytest.raises(FullyShardError, match="initialize_parallel"):
        fully_shard(_dense_model())


def test_nested_calls_shard_each_parameter_once():
    from mindscience.distributed import fully_shard

    net = _dense_model()
    fully_shard(net[0], _group())
    fully_shard(net, _group())  # shards the LayerNorm; the Dense is skipped
    assert all(tuple(p.shape)[0] == 3 for p in net.trainable_params())


# ----------------------------------------------------------------------------- 4 ranks
@pytest.fixture(scope="module")
def job():
    from _fsdp_job import describe_failures, run_job

    result = run_job()
    assert result.ok, describe_failures(result)
    return result


def _records(job, name, n_min):
    from _fsdp_job import records_of

    records = records_of(job, name)
    assert len(records) >= n_min, f"{name}: {len(records)} records"
    return records


@pytest.mark.multiprocess
def test_parity_dp4_pynative_jit_and_reshard(job):
    records = [r for r in _records(job, "fsdp.parity", 4) if r["group"] == "tp1-dp4"]
    # 4 ranks x (pynative, pynative + reshard_after_forward, jit with the default flags,
    # which compiled code runs as reshard_after_forward=False)
    assert len(records) == 12
    assert {(r["mode"], r["reshard"]) for r in records} == {
        ("pynative", False), ("pynative", True), ("jit", True)}
    for r in records:
        assert r["names_same"], r
        assert r["loss_error"] <= 1e-6 and r["max_error"] < 1e-6, r
        assert r["pad_grad"] == 0.0, r
        # the embedding (30 rows over 4 ranks) and a norm (10 rows) need padding
        assert r["shard_shapes"]["embed.weight"] == [8, 10]
        assert r["full_shapes"]["embed.weight"] == [30, 10]
        assert r["shard_shapes"]["block.norm.weight"] == [3]
    # the last rank's padding rows were set to 1e3 before the step: still the same loss
    assert all(r["poisoned"] > 0 for r in records if r["rank"] == 3)
    losses = {r["rank"]: r["ref_loss"] for r in records}
    assert len(set(losses.values())) == 4  # each dp rank saw its own batch


@pytest.mark.multiprocess
def test_parity_tp2_dp2_sequence_parallel_graph_mode(job):
    records = [r for r in _records(job, "fsdp.parity", 4) if r["group"] == "tp2-dp2"]
    assert {r["mode"] for r in records} == {"pynative", "graph"} and len(records) == 8
    for r in records:
        assert r["loss_error"] <= 1e-6 and r["max_error"] < 1e-6 and r["pad_grad"] == 0.0, r
        # tp splits first (15 vocabulary rows per tp rank), then dp2 shards: 8 rows
        assert r["full_shapes"]["embed.weight"] == [15, 10]
        assert r["shard_shapes"]["embed.weight"] == [8, 10]
        assert r["full_shapes"]["block.fc1.weight"] == [6, 10]
        assert r["full_shapes"]["block.fc2.weight"] == [10, 6]


@pytest.mark.multiprocess
def test_pipeline_stage_fully_sharded(job):
    records = _records(job, "fsdp.pipeline", 12)
    assert {(r["mode"], r["schedule"]) for r in records} == {
        ("pynative", "1f1b"), ("pynative", "gpipe"), ("jit", "1f1b")}
    for r in records:
        assert r["group"] == "pp2-dp2"
        assert r["loss_error"] <= 1e-6 and r["max_error"] < 1e-6 and r["pad_grad"] == 0.0, r
        assert r["shard_shapes"]["dense.weight"] == [5, 9]  # 9 rows over dp2: one pad row


@pytest.mark.multiprocess
def test_zero3_training_matches_reference_adamw(job):
    records = _records(job, "fsdp.train", 4)
    for r in records:
        assert r["steps"] == 5 and len(r["losses"]) == 5
        assert r["loss_error"] <= 1e-6, r
        assert r["max_error"] <= 1e-6, r  # gathered parameters vs the numpy AdamW
        assert r["pad_weight"] == 0.0
        assert r["losses"][-1] < r["losses"][0]
        # contract C2, fp32 AdamW at stage 3: 4/d weights + 4/d gradients + 8/d state (the
        # fp32 shard is its own main weight: no copy, issue 37)
        mem = r["memory_bytes"]
        assert mem["optimizer"] == 2 * mem["weights"] and mem["gradients"] == mem["weights"]


UNIT_COUNTS = {  # (forward, backward gathers, prefetched, reduce-scatters) of the measured step
    # three block units (forward order), then the root (embedding, head)
    (True, True): [(1, 1, 2, 1), (1, 1, 2, 1), (1, 1, 1, 1), (1, 0, 0, 1)],
    (True, False): [(1, 1, 0, 1)] * 3 + [(1, 0, 0, 1)],
    (False, True): [(1, 0, 1, 1)] * 3 + [(1, 0, 0, 1)],
    (False, False): [(1, 0, 0, 1)] * 4,
}


@pytest.mark.multiprocess
def test_units_reshard_and_prefetch_match_the_whole_model(job):
    """FSDP2 units: every (reshard_after_forward, prefetch) gives the whole model's loss
    and gradients; one all-gather per unit (two for a resharding block: one in the
    backward) and one reduce-scatter, not one per parameter; the peak of gathered bytes
    is the root + the two largest neighbouring blocks with reshard and prefetch."""
    records = _records(job, "fsdp.units", 20)
    assert {(r["group"], r["reshard"], r["prefetch"]) for r in records} == {
        ("tp1-dp4", True, True), ("tp1-dp4", True, False), ("tp1-dp4", False, True),
        ("tp1-dp4", False, False), ("tp2-dp2", True, True)}
    grads = {}
    for r in records:
        assert r["loss_error"] <= 1e-6 and r["max_error"] < 1e-6, r
        assert r["units"] == 4 and r["params"] == 35, r
        assert r["unit_reshards"] == [r["reshard"]] * 3 + [False]  # the root keeps its weights
        counts = [(c["forward_gathers"], c["backward_gathers"], c["prefetched"],
                   c["reduce_scatters"]) for c in r["counts"]]
        assert counts == UNIT_COUNTS[(r["reshard"], r["prefetch"])], r
        assert r["peak_bytes"] == r["figure"] and r["alive_after"] == 0, r
        grads.setdefault((r["group"], r["rank"]), []).append(r["grads"])
        if r["group"] == "tp1-dp4":
            # fp32 bytes of 3 blocks (2048 each: norm 10, fc 12x10+12, 10x12+10, ln 20,
            # dense 110, linear 110 = 512 floats) and the root (embedding 30x10, head 30x10)
            assert r["unit_bytes"] == [2048, 2048, 2048, 2400]
            assert r["peak_bytes"] == {(True, True): 2400 + 2 * 2048, (True, False): 2400 + 2048,
                                       (False, True): 2400 + 3 * 2048,
                                       (False, False): 2400 + 3 * 2048}[(r["reshard"], r["prefetch"])]
            # backend collectives of the step: a gather per unit (and per resharding
            # block again) + a reduce-scatter per unit; 35 parameters
            assert r["collectives"] == (11 if r["reshard"] else 8), r
    for key, runs in grads.items():  # the flags change when weights move, not the sums
        assert all(run == runs[0] for run in runs), key


@pytest.mark.multiprocess
def test_bfloat16_parameters_pynative_and_jit(job):
    records = _records(job, "fsdp.bf16", 8)
    assert {r["mode"] for r in records} == {"pynative", "jit"}
    for r in records:
        assert r["dtypes"] == ["BFloat16"], r  # shards and their gradients stay bfloat16
        assert r["loss_error"] <= 1e-6 and r["max_error"] <= 2.0 ** -8, r
        assert r["pad_grad"] == 0.0
        assert r["shard_shapes"]["fc1.weight"] == [4, 9]  # 14 rows over dp4: 2 pad rows


@pytest.mark.multiprocess
def test_gpt_model_at_zero3_trains_like_zero0(job):
    """GPTModel (tied embedding and head, padded shards) with fully_shard + stage 3: the
    same losses and weights as stage 0 (before the fix the head read its 1/d shard)."""
    records = _records(job, "fsdp.gpt", 16)
    assert {(r["group"], r["mode"]) for r in records} == {
        ("tp1-dp4-pp1", "pynative"), ("tp1-dp4-pp1", "jit"), ("tp2-dp2-pp1", "pynative"),
        ("tp1-dp2-pp2", "jit")}
    for r in records:
        assert r["names_same"], r
        assert r["loss_error"] <= 1e-5 and r["max_error"] <= 1e-5, r
        assert len(r["losses"]) == 2 and r["losses"][1] < r["losses"][0], r
        assert r["passed"], r
