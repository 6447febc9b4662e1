"""ColumnParallelLinear / RowParallelLinear / initialize_affine_weight.

In-process tests run without ``mindspore.communication.init()`` (a plain process): tp = 1,
or a hand-made ParallelGroup of size > 1 for what needs no communication (construction,
shard shapes, seed exactness of every rank's shard, argument errors). The multiprocess
tests read the shared 4-rank job (see ``_layers_job.py``).
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest

import mindspore as ms
from mindspore import Parameter, Tensor, mint, ops
from mindspore.common.initializer import initializer

import _layers_job
from mindscience.distributed import collectives, manager
from mindscience.distributed.group import ParallelGroup
from mindscience.distributed.harness.checks.layers import compare_with_dense
from mindscience.distributed.modules import (
    ColumnParallelLinear,
    RowParallelLinear,
    initialize_affine_weight,
)

F32 = ms.float32


def fake_group(size: int, rank: int) -> ParallelGroup:
    """A group of ``size`` ranks seen from ``rank``; fine for anything that does not
    communicate (construction, argument checks)."""
    return ParallelGroup(key="tp", ranks=tuple(range(size)), rank=rank, backend_name="unused")


def x_of(*shape, seed=0, dtype=np.float32):
    return Tensor(np.random.default_rng(seed).standard_normal(shape).astype(dtype))


@pytest.fixture(autouse=True)
def _plain_process():
    assert not manager.is_initialized()
    ms.set_context(mode=ms.PYNATIVE_MODE)


# --------------------------------------------------------------------------- seed exactness
@pytest.mark.parametrize("cls", [ColumnParallelLinear, RowParallelLinear])
@pytest.mark.parametrize("in_f,out_f,bias", [(16, 24, True), (48, 8, True), (12, 20, False)])
def test_tp1_parameters_equal_mint_linear(cls, in_f, out_f, bias):
    ms.set_seed(11)
    dense = mint.nn.Linear(in_f, out_f, bias=bias)
    ms.set_seed(11)
    layer = cls(in_f, out_f, bias=bias)
    assert layer.group.size == 1 and layer.group.key == "tp"
    np.testing.assert_array_equal(layer.weight.asnumpy(), dense.weight.asnumpy())
    if bias:
        np.testing.assert_array_equal(layer.bias.asnumpy(), dense.bias.asnumpy())
    else:
        assert layer.bias is None
    assert [name for name, _ in layer.parameters_and_names()] == ["weight"] + (["bias"] if bias else [])
    # the RNG stream after construction is where mint.nn.Linear leaves it, too
    after_layer = np.random.rand()
    ms.set_seed(11)
    mint.nn.Linear(in_f, out_f, bias=bias)
    assert np.random.rand() == after_layer


@pytest.mark.parametrize("tp", [2, 4, 8])
@pytest.mark.parametrize("dtype", [ms.float32, ms.bfloat16])
def test_shards_of_all_ranks_reassemble_to_mint_linear(tp, dtype):
    in_f, out_f = 8 * tp, 4 * tp
    ms.set_seed(5)
    dense = mint.nn.Linear(in_f, out_f, dtype=dtype)
    cols, rows = [], []
    for rank in range(tp):
        ms.set_seed(5)
        cols.append(ColumnParallelLinear(in_f, out_f, param_init_dtype=dtype, group=fake_group(tp, rank)))
        ms.set_seed(5)
        rows.append(RowParallelLinear(in_f, out_f, param_init_dtype=dtype, group=fake_group(tp, rank)))
    assert cols[0].weight.shape == (out_f // tp, in_f) and cols[0].bias.shape == (out_f // tp,)
    assert rows[0].weight.shape == (out_f, in_f // tp) and rows[0].bias.shape == (out_f,)
    f = lambda t: t.float().asnumpy()  # noqa: E731
    np.testing.assert_array_equal(np.concatenate([f(c.weight) for c in cols], 0), f(dense.weight))
    np.testing.assert_array_equal(np.concatenate([f(c.bias) for c in cols], 0), f(dense.bias))
    np.testing.assert_array_equal(np.concatenate([f(r.weight) for r in rows], 1), f(dense.weight))
    for r in rows:
        np.testing.assert_array_equal(f(r.bias), f(dense.bias))


def test_custom_inits_reassemble_to_mint_linear():
    ms.set_seed(3)
    dense = mint.nn.Linear(8, 12, weight_init="XavierUniform", bias_init="normal")
    shards = []
    for rank in range(2):
        ms.set_seed(3)
        shards.append(ColumnParallelLinear(8, 12, weight_init="XavierUniform", bias_init="normal",
                                           group=fake_group(2, rank)))
    np.testing.assert_array_equal(np.concatenate([s.weight.asnumpy() for s in shards]), dense.weight.asnumpy())
    np.testing.assert_array_equal(np.concatenate([s.bias.asnumpy() for s in shards]), dense.bias.asnumpy())


# --------------------------------------------------------------------------- initialize_affine_weight
@pytest.mark.parametrize("init", ["XavierUniform", "normal", "TruncatedNormal"])
@pytest.mark.parametrize("dim", [0, 1, -1])
def test_initialize_affine_weight_slices_the_master(init, dim):
    shape = (8, 12)
    ms.set_seed(9)
    full = Parameter(initializer(init, shape, F32)).asnumpy()
    for rank in range(4):
        ms.set_seed(9)
        shard = initialize_affine_weight(shape, 4, dim, init, tp_rank=rank)
        assert isinstance(shard, Parameter)
        np.testing.assert_array_equal(shard.asnumpy(), np.split(full, 4, axis=dim)[rank])


def test_initialize_affine_weight_tp1_is_the_full_parameter():
    ms.set_seed(1)
    full = Parameter(initializer("XavierUniform", (6, 4), F32)).asnumpy()
    ms.set_seed(1)
    p = initialize_affine_weight((6, 4), 1, 0, name="w")
    assert p.name == "w"
    np.testing.assert_array_equal(p.asnumpy(), full)


def test_initialize_affine_weight_slices_a_given_tensor():
    full = np.arange(24, dtype=np.float32).reshape(4, 6)
    shard = initialize_affine_weight((4, 6), 3, 1, Tensor(full), tp_rank=2)
    np.testing.assert_array_equal(shard.asnumpy(), full[:, 4:6])


@pytest.mark.parametrize("kwargs,error,words", [
    (dict(init_shape=(6, 4), tp_world_size=4, partition_dim=0, tp_rank=0), ValueError, ["6", "not divisible", "4"]),
    (dict(init_shape=(8, 4), tp_world_size=2, partition_dim=2, tp_rank=0), ValueError, ["partition_dim=2"]),
    (dict(init_shape=(8, 4), tp_world_size=2, partition_dim=0, tp_rank=2), ValueError, ["tp_rank=2"]),
    (dict(init_shape=(8, 4), tp_world_size=0, partition_dim=0), ValueError, ["tp_world_size=0"]),
    (dict(init_shape=(8, 4), tp_world_size=2, partition_dim=0), RuntimeError, ["initialize_parallel", "tp_rank"]),
])
def test_initialize_affine_weight_errors(kwargs, error, words):
    with pytest.raises(error) as info:
        initialize_affine_weight(**kwargs)
    for word in words:
        assert word in str(info.value)


# --------------------------------------------------------------------------- forward / backward at tp=1
@pytest.mark.parametrize("kind", ["column", "row"])
@pytest.mark.parametrize("bias,split,sp,skip", [
    *[(b, s, sp, False) for b, s, sp in itertools.product((True, False), repeat=3)],
    (True, True, False, True), (True, False, False, True),
])
def test_tp1_forward_backward_equal_mint_linear(kind, bias, split, sp, skip):
    flag = {"gather_output": split} if kind == "column" else {"input_is_parallel": split}
    record = compare_with_dense(kind, ParallelGroup.trivial("tp"), bias=bias, sequence_parallel=sp,
                                skip_bias_add=skip, **flag)
    assert record["passed"], record
    assert record["init_exact"]


@pytest.mark.parametrize("kind", ["column", "row"])
@pytest.mark.parametrize("split,seq_len", [("auto", 2), ([5], 5)])
def test_tp1_split_sizes_are_recorded(kind, split, seq_len):
    record = compare_with_dense(kind, ParallelGroup.trivial("tp"), sequence_parallel=True, split_sizes=split)
    assert record["passed"], record
    assert record["split"] == "uneven" and record["split_sizes"] == [seq_len]
    assert f"split_sizes=[{seq_len}]" in record["case"]
    even = compare_with_dense(kind, ParallelGroup.trivial("tp"), sequence_parallel=True)
    assert even["split"] == "even" and even["split_sizes"] is None


@pytest.mark.parametrize("kwargs,words", [
    (dict(split_sizes=[2, 1]), ["split_sizes=[2, 1]", "sequence_parallel=True"]),
    (dict(split_sizes=[2, 1], sequence_parallel=True), ["expected 'auto' or a list of 1"]),
    (dict(split_sizes=[-1], sequence_parallel=True), ["integers >= 0"]),
    (dict(split_sizes="even", sequence_parallel=True), ["'even'", "'auto'"]),
])
def test_split_sizes_errors(kwargs, words):
    with pytest.raises(ValueError) as info:
        compare_with_dense("column", ParallelGroup.trivial("tp"), **kwargs)
    for word in words:
        assert word in str(info.value)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("kind,flag", [("column", {"gather_output": False}), ("row", {"input_is_parallel": False})])
def test_tp1_low_precision_compute_is_close_to_float32(dtype, kind, flag):
    record = compare_with_dense(kind, ParallelGroup.trivial("tp"), compute_dtype=dtype, **flag)
    assert record["passed"], record
    assert 0 < record["max_error"] <= record["atol"]


def test_row_bias_gradient_of_an_empty_shard_is_zero():
    """A rank holding no rows of an uneven sequence (split_sizes[r] == 0) gets an empty
    output and a zero bias gradient. MindSpore 2.10's CPU ReduceSum of an empty tensor
    returns uninitialized memory, and the gradient of a broadcast add onto an empty
    tensor is such a sum, so the layer skips that add. (bfloat16 compute takes the
    unfused bias add that tp > 1 uses; the weight gradient of an empty input, a matmul
    over zero rows, is just as uninitialized in MindSpore, but never happens at tp > 1,
    where the weight gradient comes from the all-gathered sequence.)"""
    layer = RowParallelLinear(8, 6, use_sequence_parallel=True)  # compute_dtype bfloat16
    x, cot = x_of(0, 2, 8), x_of(0, 2, 6)
    assert layer(x).shape == (0, 2, 6)
    for _ in range(3):
        (grad,) = ms.grad(lambda t: (layer(t) * cot).sum(), grad_position=None, weights=[layer.bias])(x)
        np.testing.assert_array_equal(grad.asnumpy(), np.zeros(6, np.float32))


def test_no_communication_at_tp1():
    before = collectives.call_count()
    layer = RowParallelLinear(8, 4, use_sequence_parallel=True, compute_dtype=F32)
    layer(x_of(4, 2, 8))
    ColumnParallelLinear(8, 4, use_sequence_parallel=True, compute_dtype=F32)(x_of(4, 8))
    assert collectives.call_count() == before


# --------------------------------------------------------------------------- dtypes
def _bf16_round(a):
    return ops.cast(ops.cast(Tensor(a), ms.bfloat16), F32).asnumpy()


@pytest.mark.parametrize("cls", [ColumnParallelLinear, RowParallelLinear])
def test_default_bf16_compute_keeps_the_input_dtype(cls):
    ms.set_seed(0)
    layer = cls(16, 8)  # compute_dtype=bfloat16 by default; CPU has no bf16 MatMul
    assert layer.compute_dtype == ms.bfloat16 and layer.weight.dtype == F32
    x = x_of(4, 16)
    y = layer(x)
    assert y.dtype == F32
    w, xb = _bf16_round(layer.weight.asnumpy()), _bf16_round(x.asnumpy())
    b = layer.bias.asnumpy()
    if cls is ColumnParallelLinear:  # bias added inside the bf16 matmul, result rounded once
        want = _bf16_round(xb @ w.T + _bf16_round(b))
    else:  # bias added after the reduction, in the output (input) dtype
        want = _bf16_round(xb @ w.T) + b
    np.testing.assert_allclose(y.asnumpy(), want, rtol=1e-6, atol=1e-6)
    dense = x.asnumpy() @ layer.weight.asnumpy().T + b
    assert np.max(np.abs(y.asnumpy() - dense)) < 5e-2  # bf16 precision, not float32
    assert np.max(np.abs(y.asnumpy() - dense)) > 1e-6


def test_bf16_input_gives_bf16_output_and_float32_grads():
    layer = ColumnParallelLinear(16, 8)
    x = ops.cast(x_of(4, 16), ms.bfloat16)
    assert layer(x).dtype == ms.bfloat16
    grads = ms.grad(lambda inp: ops.cast(layer(inp), F32).sum(), grad_position=None,
                    weights=layer.trainable_params())(x)
    assert [g.dtype for g in grads] == [F32, F32]


def test_compute_dtype_none_computes_in_the_input_dtype():
    layer = RowParallelLinear(16, 8, compute_dtype=None)
    x16 = ops.cast(x_of(4, 16), ms.float16)
    assert layer(x16).dtype == ms.float16
    np.testing.assert_allclose(layer(x_of(4, 16)).asnumpy(),
                               mint.nn.functional.linear(x_of(4, 16), layer.weight, layer.bias).asnumpy(),
                               rtol=1e-6, atol=1e-6)


# --------------------------------------------------------------------------- skip_bias_add, attributes
def test_skip_bias_add_returns_output_and_bias():
    ms.set_seed(2)
    dense = mint.nn.Linear(8, 6)
    for cls in (ColumnParallelLinear, RowParallelLinear):
        ms.set_seed(2)
        layer = cls(8, 6, compute_dtype=F32, skip_bias_add=True)
        out, bias = layer(x_of(3, 8))
        assert bias is layer.bias
        np.testing.assert_allclose((out + bias).asnumpy(), dense(x_of(3, 8)).asnumpy(), rtol=1e-6, atol=1e-6)
    out, bias = ColumnParallelLinear(8, 6, bias=False, skip_bias_add=True)(x_of(3, 8))
    assert bias is None


def test_sequence_parallel_row_bias_is_marked():
    assert RowParallelLinear(8, 4, use_sequence_parallel=True).bias.sequence_parallel is True
    assert not getattr(RowParallelLinear(8, 4).bias, "sequence_parallel", False)


def test_group_is_resolved_at_construction():
    layer = ColumnParallelLinear(8, 4, group=fake_group(2, 1))
    assert (layer.tp_size, layer.tp_rank) == (2, 1)
    assert ColumnParallelLinear(8, 4).group == ParallelGroup.trivial("tp")
    assert "tp=2" in repr(layer)


# --------------------------------------------------------------------------- errors
@pytest.mark.parametrize("make,words", [
    (lambda: ColumnParallelLinear(8, 10, group=fake_group(4, 0)), ["out_features=10", "4", "multiple of 4"]),
    (lambda: RowParallelLinear(10, 8, group=fake_group(4, 0)), ["in_features=10", "4", "multiple of 4"]),
    (lambda: ColumnParallelLinear(0, 8), ["in_features=0"]),
])
def test_construction_errors(make, words):
    with pytest.raises(ValueError) as info:
        make()
    for word in words:
        assert word in str(info.value)


@pytest.mark.parametrize("make,shape,words", [
    (lambda g: ColumnParallelLinear(8, 4, group=g), (4, 7), ["last dim is 7", "expected 8"]),
    (lambda g: RowParallelLinear(8, 4, group=g), (4, 4), ["last dim is 4", "expected 8", "input_is_parallel=True"]),
    (lambda g: RowParallelLinear(8, 4, input_is_parallel=True, group=g), (4, 8),
     ["last dim is 8", "expected 4", "input_is_parallel=False"]),
    (lambda g: RowParallelLinear(8, 4, use_sequence_parallel=True, group=g), (5, 8),
     ["sequence dim (dim 0) is 5", "not divisible", "Pad the sequence"]),
    (lambda g: ColumnParallelLinear(8, 4, use_sequence_parallel=True, group=g), (8,), ["(S, ..., H)"]),
])
def test_call_errors_come_before_any_communication(make, shape, words):
    layer = make(fake_group(2, 0))
    before = collectives.call_count()
    with pytest.raises(ValueError) as info:
        layer(Tensor(np.ones(shape, np.float32)))
    assert collectives.call_count() == before
    for word in words:
        assert word in str(info.value)


# --------------------------------------------------------------------------- 4 ranks
@pytest.fixture(scope="module")
def job():
    result = _layers_job.run_job()
    assert result.ok, _layers_job.describe_failures(result)
    return result


def _assert_all_passed(job, prefix, expected_count):
    records = _layers_job.records_of(job, prefix)
    failed = [r for r in records if not r["passed"]]
    assert not failed, "\n".join(
        f"rank {r['rank']} {r['check']} {r.get('case')}: {r.get('errors') or r.get('message')}" for r in failed
    )
    assert len(records) == expected_count * _layers_job.WORLD_SIZE
    return records


@pytest.mark.multiprocess
def test_4ranks_init_is_seed_exact(job):
    records = _assert_all_passed(job, "layers.init_exact", 2 * 18)
    assert all(r["max_error"] == 0.0 for r in records)


@pytest.mark.multiprocess
def test_4ranks_every_configuration_equals_the_dense_layer(job):
    # tp=4: 16 configurations + 4 skip_bias_add + 2 bfloat16 + 6 uneven; tp=2 (subgroups): 16
    records = (_assert_all_passed(job, "layers.column", 11 + 3 + 8)
               + _assert_all_passed(job, "layers.row", 11 + 3 + 8))
    assert all(r["init_exact"] for r in records)
    records = [r for r in records if r["split"] == "even"]
    assert all(r["split_sizes"] is None for r in records)
    f32 = [r for r in records if r["compute_dtype"] == "float32"]
    assert len(f32) == 36 * _layers_job.WORLD_SIZE
    assert max(r["max_error"] for r in f32) <= 1e-4
    sp_bias = [r for r in f32 if "grad bias (this rank's share)" in r["errors"]]
    assert len(sp_bias) == 2 * 2 * _layers_job.WORLD_SIZE  # 2 row SP+bias configs x 2 layouts


@pytest.mark.multiprocess
def test_4ranks_uneven_sequence_equals_the_dense_layer(job):
    """Both layers with sequence parallelism on an uneven sequence (tp=4): a zero-length
    shard [3, 0, 2, 1] and the ragged "auto" split [2, 1, 1, 1] in float32, [3, 0, 2, 1] in
    bfloat16; each rank's input (Column) / output (Row) is its uneven shard of the dense
    one, and output, input gradient and weight/bias gradients equal the dense layer's."""
    records = [r for r in _layers_job.records_of(job, "layers.") if r.get("split") == "uneven"]
    failed = [r for r in records if not r["passed"]]
    assert not failed, [(r["rank"], r["check"], r["case"], r["errors"]) for r in failed]
    want = {(kind, tuple(split), dtype)
            for kind in ("layers.column", "layers.row")
            for split, dtype in ((_layers_job.UNEVEN_SPLIT, "float32"), (_layers_job.AUTO_SPLIT, "float32"),
                                 (_layers_job.UNEVEN_SPLIT, "bfloat16"))}
    seen = {}
    for r in records:
        seen.setdefault((r["check"], tuple(r["split_sizes"]), r["compute_dtype"]), set()).add(r["rank"])
        assert r["tp"] == 4 and r["init_exact"]
        assert "split_sizes=[" + ",".join(map(str, r["split_sizes"])) + "]" in r["case"]
        assert {"output", "grad input", "grad weight"} <= set(r["errors"])
    # every case, on every rank, exactly once
    assert {k: sorted(v) for k, v in seen.items()} == {k: list(range(_layers_job.WORLD_SIZE)) for k in want}
    assert len(records) == len(want) * _layers_job.WORLD_SIZE
    f32 = [r for r in records if r["compute_dtype"] == "float32"]
    assert max(r["max_error"] for r in f32) <= 1e-5
    bf16 = [r for r in records if r["compute_dtype"] == "bfloat16"]
    assert all(r["error"].startswith("scaled") and r["max_error"] <= r["atol"] for r in bf16)
    # the bias of the sequence-parallel Row layer: each rank's share of its own rows
    # (zero rows on rank 1: a zero share), summing over tp to the dense gradient
    rows = [r for r in records if r["check"] == "layers.row"]
    assert all("grad bias (sum over tp)" in r["errors"] for r in rows)


@pytest.mark.multiprocess
@pytest.mark.parametrize("mode, configs", [("jit", 20), ("jit-construct", 5), ("graph", 5)])
def test_4ranks_layers_compiled_equal_pynative_and_dense(job, mode, configs):
    """Column/Row compiled (tp=2 subgroups, cp=2): every configuration under ms.jit of the
    grad function, 5 representative ones with construct = ms.jit(construct) and in
    GRAPH_MODE; <= 1e-6 from PyNative and <= 1e-4 from the dense layer, forward and
    every gradient."""
    records = [r for r in _layers_job.records_of(job, "layers.modes.") if r["mode"] == mode]
    assert len(records) == configs * _layers_job.WORLD_SIZE
    failed = [r for r in records if not r["passed"]]
    assert not failed, failed[:2]
    assert max(r["pynative_diff"] for r in records) <= 1e-6
    assert max(r["max_error"] for r in records) <= 1e-4
    assert {r["check"] for r in records} == {"layers.modes.column", "layers.modes.row"}
    assert any("sequence_parallel=True" in r["case"] for r in records)


@pytest.mark.multiprocess
def test_4ranks_errors_before_communication(job):
    records = _assert_all_passed(job, "layers.errors", 2 * 7)
    assert all(r["collective_calls"] == 0 for r in records)


# --------------------------------------------------------------------------- issue 17 layers, 4 ranks
@pytest.mark.multiprocess
def test_4ranks_vocab_parallel_embedding_equals_the_dense_lookup(job):
    """tp=4: all-reduced and sequence-parallel (even and uneven) lookups; the shard of the
    table is exact, output and table gradient equal the dense gather's (float32 exactly,
    bfloat16 within its rounding), in PyNative, ms.jit and GRAPH_MODE."""
    records = _assert_all_passed(job, "vocab.embedding", 6 + 3 + 3)
    assert all(r["init_exact"] for r in records)
    assert {(r["mode"], r["dtype"]) for r in records} == {
        ("pynative", "float32"), ("pynative", "bfloat16"), ("jit", "float32"), ("graph", "bfloat16")}
    assert max(r["max_error"] for r in records if r["dtype"] == "float32") <= 1e-6
    assert any("sequence_parallel=True split=uneven" in r["case"] for r in records)


@pytest.mark.multiprocess
def test_4ranks_vocab_parallel_cross_entropy_equals_ops_cross_entropy(job):
    records = _assert_all_passed(job, "vocab.cross_entropy", 4 + 1 + 1)
    assert {(r["mode"], r["dtype"]) for r in records} >= {("jit", "bfloat16"), ("graph", "float32")}
    assert {"label_smoothing=0.1" in r["case"] for r in records} == {True, False}
    assert max(r["max_error"] for r in records if r["dtype"] == "float32") <= 1e-5
    assert max(r["max_error"] for r in records if r["dtype"] == "bfloat16") <= 2e-2


@pytest.mark.multiprocess
def test_4ranks_vocab_errors_before_communication(job):
    records = _assert_all_passed(job, "vocab.errors", 6)
    assert all(r["collective_calls"] == 0 and r["raised"] == "ValueError" for r in records)


@pytest.mark.multiprocess
def test_4ranks_rng_tracker(job):
    """Dropout masks equal over tp outside fork(), different inside, replayed by
    set_states; the seeds follow Megatron's rule; a tp MLP with dropout trains identically
    twice."""
    records = _assert_all_passed(job, "random.tracker", 6)
    losses = [r["losses"] for r in records if "losses" in r]
    assert losses and all(a == b and len(a) == 3 for a, b in losses)


METHODS = {"ring", "ulysses", "allgather_kv"}


@pytest.mark.multiprocess
def test_4ranks_context_parallel_attention_every_method(job):
    """cp=4, PyNative: ring, ulysses and allgather_kv x causal x GQA x even/uneven, and the
    zigzag ring with and without GQA (float32, within 1e-5 of dense attention: output and
    q/k/v gradients); one custom softmax_scale per method; each method causal GQA uneven in
    bfloat16 (within 2e-2)."""
    # 26 eager float32 + 3 eager bfloat16, 4 under ms.jit, 3 in GRAPH_MODE
    records = _assert_all_passed(job, "attention.methods", 26 + 3 + 4 + 3)
    eager = [r for r in records if r["mode"] == "pynative"]
    assert len(eager) == 29 * _layers_job.WORLD_SIZE
    fp32 = [r for r in eager if r["dtype"] == "float32"]
    assert {(r["method"], r["causal"], r["gqa"], r["split"]) for r in fp32} >= {
        (m, c, g, s) for m in METHODS for c in (False, True) for g in (False, True)
        for s in ("even", "uneven")}
    assert {r["gqa"] for r in fp32 if r["split"] == "zigzag"} == {False, True}
    assert {r["method"] for r in fp32 if r["softmax_scale"] is not None} == METHODS
    assert max(r["max_error"] for r in fp32) <= 1e-5
    assert {r["method"] for r in eager if r["dtype"] == "bfloat16"} == METHODS
    assert max(r["max_error"] for r in eager if r["dtype"] == "bfloat16") <= 2e-2
    assert {"output", "grad q", "grad k", "grad v"} == set(eager[0]["errors"])


@pytest.mark.multiprocess
def test_4ranks_context_parallel_attention_compiled(job):
    """cp=4, each compiled mode's cases in ONE graph: every method under ms.jit (non-causal
    MHA even, plus the zigzag ring) and in GRAPH_MODE (causal GQA uneven), in complementary
    dtypes, so that across the two modes every method meets causal and not, MHA and GQA,
    even and uneven, float32 and bfloat16; within 1e-5 (float32) / 2e-2 (bfloat16)."""
    records = [r for r in _layers_job.records_of(job, "attention.methods") if r["mode"] != "pynative"]
    assert all(r["passed"] for r in records), [r for r in records if not r["passed"]][:2]
    for mode, cases in (("jit", 4), ("graph", 3)):
        mine = [r for r in records if r["mode"] == mode]
        assert len(mine) == cases * _layers_job.WORLD_SIZE
        assert all(r["compiled_with"] == cases for r in mine)
        assert {r["method"] for r in mine} == METHODS
        assert {r["dtype"] for r in mine} == {"float32", "bfloat16"}
    for method in METHODS:
        mine = [r for r in records if r["method"] == method and r["split"] != "zigzag"]
        assert {r["mode"] for r in mine} == {"jit", "graph"}
        assert {r["causal"] for r in mine} == {False, True}
        assert {r["gqa"] for r in mine} == {False, True}
        assert {r["split"] for r in mine} == {"even", "uneven"}
        assert {r["dtype"] for r in mine} == {"float32", "bfloat16"}
    assert {r["mode"] for r in records if r["split"] == "zigzag"} == {"jit"}
    assert max(r["max_error"] for r in records if r["dtype"] == "float32") <= 1e-5
    assert all(r["max_error"] <= 2e-2 for r in records if r["dtype"] == "bfloat16")


@pytest.mark.multiprocess
def test_4ranks_context_parallel_attention_layer_and_errors(job):
    layer = _assert_all_passed(job, "attention.layer", 3)
    assert {r["case"].split()[2] for r in layer} == {"ring", "ulysses", "allgather_kv"}
    errors = _assert_all_passed(job, "attention.errors", 9)
    assert all(r["collective_calls"] == 0 for r in errors)
