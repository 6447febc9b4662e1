"""parallelize_module: plans, slicing, names, marks and errors in one process (fake tp
groups: construction only), then the 4-rank job (``_parallelize_job.py``): parity with
the dense model at tp2 x dp2 and tp4 with and without sequence parallelism, a tp2
checkpoint loaded into the dense model here, and examples/parallelize_dense.py."""

from __future__ import annotations

import numpy as np
import pytest

import mindspore as ms
from mindspore import mint, nn

import _parallelize_checks as P
import _parallelize_job
from mindscience.distributed import checkpoint, manager
from mindscience.distributed.group import ParallelGroup
from mindscience.distributed.modules import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding
from mindscience.distributed.parallelize import (ColwiseParallel, HeadParallel, ParallelizePlanError,
                                                 RowwiseParallel, SequenceParallel, VocabParallel,
                                                 parallelize_module)
from mindscience.distributed.parallelize.styles import chunk_widths, column_order, column_rows
from mindscience.distributed.sharding import get_sharding

pytestmark = pytest.mark.filterwarnings("ignore:parallelize_module.*unequal chunks:UserWarning")


def fake_group(size: int, rank: int) -> ParallelGroup:
    """A tp group seen from ``rank``: enough for construction (no communication)."""
    return ParallelGroup(key="tp", ranks=tuple(range(size)), rank=rank, backend_name="unused")


@pytest.fixture(autouse=True)
def _plain_process():
    assert not manager.is_initialized()
    ms.set_context(mode=ms.PYNATIVE_MODE)


def dense_values(model) -> dict:
    return {n: p.asnumpy().copy() for n, p in model.parameters_and_names()}


def parallel_copies(tp, plan=None, sequence_parallel=False, seed=0, gqa=True):
    """One parallelized copy of the test model per tp rank (fake groups)."""
    return [parallelize_module(P.build(seed, gqa), plan or P.plan(gqa), sequence_parallel,
                               tp_group=fake_group(tp, rank)) for rank in range(tp)]


# --------------------------------------------------------------------------- pure arithmetic
def test_row_arithmetic():
    assert chunk_widths(None, 12) == (12,)
    assert chunk_widths(3, 12) == (4, 4, 4)
    assert chunk_widths((8, 2, 2), 12) == (8, 2, 2)
    with pytest.raises(ValueError, match="does not divide"):
        chunk_widths(5, 12)
    with pytest.raises(ValueError, match="sum to 11"):
        chunk_widths((8, 2, 1), 12)
    assert column_rows((8, 4, 4), 2, 1) == [(4, 8), (10, 12), (14, 16)]
    assert column_order((2, 2, 2), 2) == [0, 2, 4, 1, 3, 5]
    assert column_order((6,), 3) == list(range(6))
    # every row is held by exactly one rank
    assert sorted(column_order((8, 4, 4), 4)) == list(range(16))


@pytest.mark.parametrize("make, match", [
    (lambda: ColwiseParallel(chunks=0), "chunks=0"),
    (lambda: ColwiseParallel(chunks=(4, -1)), r"chunks=\(4, -1\)"),
    (lambda: ColwiseParallel(gather_output="yes"), "gather_output='yes'"),
    (lambda: RowwiseParallel(sequence_parallel=1), "sequence_parallel=1"),
    (lambda: HeadParallel(3), "attribute 3"),
    (lambda: HeadParallel("num_heads", "num_heads"), "twice"),
])
def test_style_arguments_checked(make, match):
    with pytest.raises(ParallelizePlanError, match=match):
        make()


# --------------------------------------------------------------------------- slicing and names
@pytest.mark.parametrize("tp", [2, 4])
def test_weights_are_the_dense_slices(tp):
    full = dense_values(P.build(0))
    for rank, model in enumerate(parallel_copies(tp)):
        got = dict(model.parameters_and_names())
        assert list(got) == list(full)
        assert [p.name for p in got.values()] == list(full)  # Parameter names unchanged too
        h, f, v = P.HIDDEN, P.FFN, P.VOCAB
        n = lambda size: slice(rank * size // tp, (rank + 1) * size // tp)  # noqa: E731
        np.testing.assert_array_equal(got["embed.embedding_table"].asnumpy(), full["embed.embedding_table"][n(v)])
        np.testing.assert_array_equal(got["layers.0.fc1.weight"].asnumpy(), full["layers.0.fc1.weight"][n(f)])
        np.testing.assert_array_equal(got["layers.0.fc1.bias"].asnumpy(), full["layers.0.fc1.bias"][n(f)])
        np.testing.assert_array_equal(got["layers.1.fc2.weight"].asnumpy(), full["layers.1.fc2.weight"][:, n(f)])
        np.testing.assert_array_equal(got["layers.1.fc2.bias"].asnumpy(), full["layers.1.fc2.bias"])
        np.testing.assert_array_equal(got["layers.0.attn.proj.weight"].asnumpy(),
                                      full["layers.0.attn.proj.weight"][:, n(h)])
        np.testing.assert_array_equal(got["head.weight"].asnumpy(), full["head.weight"][n(v)])
        np.testing.assert_array_equal(got["norm.gamma"].asnumpy(), full["norm.gamma"])
        # chunks=3: whole heads of q, k and v; GQA (32, 16, 16): 1/tp of each chunk
        for layer, widths in ((0, (h, h, h)), (1, (h, h // 2, h // 2))):
            for kind in ("weight", "bias"):
                dense = full[f"layers.{layer}.attn.qkv.{kind}"]
                q, k, vv = np.split(dense, np.cumsum(widths)[:-1])
                want = np.concatenate([q[n(widths[0])], k[n(widths[1])], vv[n(widths[2])]])
                np.testing.assert_array_equal(got[f"layers.{layer}.attn.qkv.{kind}"].asnumpy(), want)
        assert sorted(n for n, _, _ in checkpoint.named_parameters(model)) == sorted(full)


def test_layers_marks_and_heads():
    model = parallel_copies(2, sequence_parallel=True)[1]
    cells = dict(model.cells_and_names())
    assert type(cells["embed"]).__mro__[1] is VocabParallelEmbedding
    assert isinstance(cells["layers.0.fc1"], ColumnParallelLinear)
    assert isinstance(cells["layers.0.fc2"], RowParallelLinear)
    assert isinstance(cells["layers.0.fc1.activation"], nn.GELU)  # nn.Dense's activation kept
    assert cells["layers.0.fc1"].use_sequence_parallel and cells["embed"].sequence_parallel
    assert (cells["layers.0.attn"].num_heads, cells["layers.1.attn"].num_kv_heads) == (4, 2)
    params = dict(model.parameters_and_names())
    assert get_sharding(params["layers.0.attn.qkv.weight"]) == {
        "axis": "tp", "partition_dim": 0, "partition_stride": 3, "sequence_parallel": False}
    assert params["layers.1.attn.qkv.weight"].partition_chunks == (32, 16, 16)
    assert get_sharding(params["layers.0.fc2.weight"])["partition_dim"] == 1
    assert get_sharding(params["embed.embedding_table"])["partition_dim"] == 0
    marked = sorted(n for n, p in params.items() if getattr(p, "sequence_parallel", False))
    norms = [f"layers.{i}.norm{j}.{k}" for i in (0, 1) for j in (1, 2) for k in ("beta", "gamma")]
    biases = [f"layers.{i}.{m}.bias" for i in (0, 1) for m in ("attn.proj", "fc2")]
    assert marked == sorted(norms + biases + ["norm.beta", "norm.gamma"])
    # Without sequence parallelism the norms see the whole sequence: nothing is marked.
    plain = parallel_copies(2)[0]
    assert not [n for n, p in plain.parameters_and_names() if getattr(p, "sequence_parallel", False)]


def test_mint_embedding_and_plain_dense():
    class Net(nn.Cell):
        def __init__(self):
            super().__init__()
            self.tok = mint.nn.Embedding(8, 6)
            self.out = nn.Dense(6, 4, has_bias=False)

        def construct(self, ids):
            return self.out(self.tok(ids))

    ms.set_seed(3)
    dense = Net()
    full = dense_values(dense)
    for rank in range(2):
        ms.set_seed(3)
        net = parallelize_module(Net(), {"tok": VocabParallel(), "out": RowwiseParallel(input_is_parallel=False)},
                                 tp_group=fake_group(2, rank))
        got = dict(net.parameters_and_names())
        assert list(got) == ["tok.weight", "out.weight"] and net.out.bias is None
        np.testing.assert_array_equal(got["tok.weight"].asnumpy(), full["tok.weight"][rank * 4:(rank + 1) * 4])
        np.testing.assert_array_equal(got["out.weight"].asnumpy(), full["out.weight"][:, rank * 3:(rank + 1) * 3])


def test_bfloat16_fused_projection_slices():
    ms.set_seed(4)
    dense = mint.nn.Linear(8, 12, dtype=ms.bfloat16)
    full_w, full_b = dense.weight.float().asnumpy(), dense.bias.float().asnumpy()
    for rank in range(2):
        ms.set_seed(4)
        net = nn.SequentialCell([mint.nn.Linear(8, 12, dtype=ms.bfloat16)])
        parallelize_module(net, {"0": ColwiseParallel(chunks=3)}, tp_group=fake_group(2, rank))
        layer = net.cell_list[0]
        assert layer.weight.dtype == ms.bfloat16 and layer.weight.shape == (6, 8)
        rows = [4 * c + 2 * rank + i for c in range(3) for i in range(2)]  # q_r, k_r, v_r
        np.testing.assert_array_equal(layer.weight.float().asnumpy(), full_w[rows])
        np.testing.assert_array_equal(layer.bias.float().asnumpy(), full_b[rows])


@pytest.mark.parametrize("mode", ["pynative", "jit"])
def test_tp1_is_the_dense_model(mode):
    """Without parallel groups the plan runs on a size-1 group: exactly the dense numbers."""
    dense, model = P.build(0), parallelize_module(P.build(0), P.plan(), sequence_parallel=True)
    ids, x, cot = P.data(0)
    _, _, out_d, dx_d, dw_d = P.grads_of(dense, ids, x, cot)
    _, _, out_p, dx_p, dw_p = P.grads_of(model, ids, x, cot, mode)
    np.testing.assert_allclose(out_p.asnumpy(), out_d.asnumpy(), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(dx_p.asnumpy(), dx_d.asnumpy(), rtol=1e-6, atol=1e-6)
    for a, b in zip(dw_p, dw_d):
        np.testing.assert_allclose(a.asnumpy(), b.asnumpy(), rtol=1e-5, atol=1e-6)


# --------------------------------------------------------------------------- bad plans
class _TiedNet(nn.Cell):
    def __init__(self):
        super().__init__()
        self.a = nn.Dense(4, 4)
        self.b = nn.Dense(4, 4)
        self.b.weight = self.a.weight


class _MyDense(nn.Dense):
    pass


class _SharedNet(nn.Cell):
    def __init__(self):
        super().__init__()
        shared = nn.Dense(4, 4)
        self.a = nn.SequentialCell([shared])
        self.b = nn.SequentialCell([shared])


def _with(make_cell, attr):
    def build():
        model = P.build(0)
        setattr(model.layers[0], attr, make_cell())
        return model
    return build


BAD_PLANS = [  # (model builder, plan, tp, expected message parts)
    ("nothing matched", P.build, {"layers.*.fc3": ColwiseParallel()}, 2,
     ["'layers.*.fc3' matches no submodule", "'layers.0.fc1'", "Fix the pattern"]),
    ("norm as a linear", P.build, {"layers.0.norm1": ColwiseParallel()}, 2,
     ["'layers.0.norm1'", "mindspore.nn.LayerNorm", "Dense or mindspore.mint.nn.Linear"]),
    ("embedding as a linear", P.build, {"embed": RowwiseParallel()}, 2,
     ["'embed'", "table [vocab, dim] = (64, 32)", "use VocabParallel()"]),
    ("linear as an embedding", P.build, {"head": VocabParallel()}, 2,
     ["'head'", "mindspore.nn.Dense, weight [out, in] = (64, 32)", "ColwiseParallel/RowwiseParallel"]),
    ("dense subclass", _with(lambda: _MyDense(32, 64), "fc1"), {"layers.0.fc1": ColwiseParallel()}, 2,
     ["'layers.0.fc1'", "_MyDense", "exact types"]),
    ("colwise not divisible", P.build, {"layers.*.fc1": ColwiseParallel()}, 3,
     ["'layers.0.fc1'", "(64, 32)", "out_features=64 not divisible by the tensor-parallel size 3"]),
    ("rowwise not divisible", P.build, {"layers.*.fc2": RowwiseParallel()}, 3,
     ["'layers.0.fc2'", "in_features=64", "multiple of 3"]),
    ("vocab not divisible", P.build, {"embed": VocabParallel()}, 3,
     ["'embed'", "vocabulary 64", "e.g. 66"]),
    ("heads not divisible", P.build, {"layers.*.attn": HeadParallel("num_heads", "num_kv_heads")}, 3,
     ["'layers.0.attn'", "num_heads=8", "tp size that divides 8"]),
    ("chunk widths not divisible", P.build, {"layers.1.attn.qkv": ColwiseParallel(chunks=(32, 16, 16))}, 32,
     ["'layers.1.attn.qkv'", "(32, 16, 16)", "each chunk is split over tp"]),
    ("chunks not summing", P.build, {"layers.1.attn.qkv": ColwiseParallel(chunks=(32, 32, 32))}, 2,
     ["'layers.1.attn.qkv'", "(64, 32)", "sum to 96"]),
    ("chunks gathered", P.build, {"layers.0.attn.qkv": ColwiseParallel(chunks=3, gather_output=True)}, 2,
     ["'layers.0.attn.qkv'", "rank order", "Keep gather_output=False"]),
    ("two styles", P.build, {"layers.0.fc1": ColwiseParallel(), "layers.?.fc1": RowwiseParallel()}, 2,
     ["'layers.0.fc1'", "two plan entries", "'layers.?.fc1'", "narrow one of the patterns"]),
    ("nested", P.build, {"layers.0": SequenceParallel(), "layers.0.fc1": ColwiseParallel()}, 2,
     ["'layers.0.fc1'", "inside module 'layers.0'", "either the parent or its children"]),
    ("missing attribute", P.build, {"layers.*.attn": HeadParallel("n_heads")}, 2,
     ["'layers.0.attn'", "no integer attribute 'n_heads'"]),
    ("activation with parameters", _with(lambda: nn.Dense(32, 64, activation=nn.PReLU()), "fc1"),
     {"layers.0.fc1": ColwiseParallel()}, 2, ["'layers.0.fc1'", "PReLU has parameters", "activation=None"]),
    ("padding_idx", _with(lambda: mint.nn.Embedding(8, 4, padding_idx=0), "extra"),
     {"layers.0.extra": VocabParallel()}, 2, ["'layers.0.extra'", "padding_idx=0"]),
    ("tied weights", _TiedNet, {"a": ColwiseParallel()}, 2, ["'a'", "shared with b.weight", "Untie"]),
    ("shared module", _SharedNet, {"a.0": ColwiseParallel()}, 2,
     ["'a.0'", "also 'b.0'", "Build separate modules"]),
    ("root", lambda: nn.Dense(4, 4), {"*": ColwiseParallel()}, 2, ["root cell", "Wrap the layer"]),
    ("empty pattern", P.build, {"": ColwiseParallel()}, 2, ["plan key ''", "non-empty fnmatch pattern"]),
    ("not a style", P.build, {"head": ColwiseParallel}, 2, ["plan['head']", "note the parentheses"]),
    ("empty plan", P.build, {}, 2, ["non-empty dict"]),
]


@pytest.mark.parametrize("case, build, plan, tp, parts", BAD_PLANS, ids=[c[0] for c in BAD_PLANS])
def test_bad_plans_raise_before_any_change(case, build, plan, tp, parts):
    model = build()
    # A valid entry first: it must not be applied when a later entry is wrong.
    full_plan = plan
    if isinstance(model, P.DenseLM) and plan and case != "nested":
        full_plan = {"norm": SequenceParallel(), **plan}
    cells_before = [(n, id(c)) for n, c in model.cells_and_names()]
    values_before = dense_values(model)
    heads_before = model.layers[0].attn.num_heads if isinstance(model, P.DenseLM) else None
    with pytest.raises(ParallelizePlanError) as info:
        parallelize_module(model, full_plan, sequence_parallel=True, tp_group=fake_group(tp, 0))
    assert isinstance(info.value, ValueError)
    for part in parts:
        assert part in str(info.value), (part, str(info.value))
    assert [(n, id(c)) for n, c in model.cells_and_names()] == cells_before
    for name, value in dense_values(model).items():
        np.testing.assert_array_equal(value, values_before[name])
    if heads_before is not None:
        assert model.layers[0].attn.num_heads == heads_before
    assert not any(getattr(p, "sequence_parallel", False) for p in model.get_parameters())


def test_arguments_checked():
    with pytest.raises(ParallelizePlanError, match="sequence_parallel='yes' is invalid"):
        parallelize_module(P.build(0), P.plan(), sequence_parallel="yes")
    with pytest.raises(ParallelizePlanError, match="model=dict is not a mindspore.nn.Cell"):
        parallelize_module({}, P.plan())


def test_sequential_cell_children_are_replaced():
    """SequentialCell runs a cached list of its children: the replacement must be in it."""
    ms.set_seed(2)
    net = nn.SequentialCell([nn.Dense(4, 8), nn.ReLU(), mint.nn.Linear(8, 4)])
    x = ms.Tensor(np.random.default_rng(0).standard_normal((3, 4)).astype(np.float32))
    want = net(x).asnumpy()
    parallelize_module(net, {"0": ColwiseParallel(), "2": RowwiseParallel()})
    assert [type(c).__name__ for c in net.cell_list] == ["ColumnParallelLinear", "ReLU", "RowParallelLinear"]
    assert [n for n, _ in net.parameters_and_names()] == ["0.weight", "0.bias", "2.weight", "2.bias"]
    np.testing.assert_allclose(net(x).asnumpy(), want, rtol=1e-6, atol=1e-7)


def test_head_parallel_refuses_a_second_pass():
    model = parallelize_module(P.build(0), {"layers.*.attn": HeadParallel("num_heads")},
                               tp_group=fake_group(2, 0))
    with pytest.raises(ParallelizePlanError, match="already divided by tp=2"):
        parallelize_module(model, {"layers.*.attn": HeadParallel("num_heads")}, tp_group=fake_group(2, 0))
    assert model.layers[0].attn.num_heads == P.HEADS // 2


def test_replaced_layers_are_refused_on_a_second_pass():
    model = parallelize_module(P.build(0), {"layers.*.fc1": ColwiseParallel()}, tp_group=fake_group(2, 0))
    with pytest.raises(ParallelizePlanError, match="'layers.0.fc1': it is already a ColumnParallelLinear"):
        parallelize_module(model, {"layers.*.fc1": ColwiseParallel()}, tp_group=fake_group(2, 0))


def test_unequal_chunks_warn_about_checkpoints():
    with pytest.warns(UserWarning, match=r"'layers.1.attn.qkv' is a fused projection of unequal chunks"):
        parallelize_module(P.build(0), {"layers.1.attn.qkv": ColwiseParallel(chunks=(32, 16, 16))},
                           tp_group=fake_group(2, 0))


def test_example_in_a_plain_process(capsys, monkeypatch):
    """``python examples/parallelize_dense.py``: tp1, the parallelized model is the dense one."""
    monkeypatch.syspath_prepend(_parallelize_job.EXAMPLES_DIR)
    import parallelize_dense

    assert parallelize_dense.main(["--steps", "2"]) == 0
    out = capsys.readouterr().out
    assert "PASSED on all ranks" in out and "(tp=1, dp=1)" in out
    record = parallelize_dense.run(steps=2, sequence_parallel=True)
    assert record["parallel_losses"] == record["dense_losses"], record


# --------------------------------------------------------------------------- the 4-rank job
@pytest.fixture(scope="module")
def job():
    result, folder = _parallelize_job.run_job()
    assert result.ok, _parallelize_job.describe_failures(result)
    return result, folder


@pytest.mark.multiprocess
@pytest.mark.parametrize("tp, sequence_parallel, mode", _parallelize_job.PARITY_CASES)
def test_parity_with_the_dense_model(job, tp, sequence_parallel, mode):
    records = [r for r in _parallelize_job.records_of(job[0], "parallelize.parity")
               if (r["tp"], r["sequence_parallel"], r["mode"]) == (tp, sequence_parallel, mode)]
    assert sorted(r["rank"] for r in records) == list(range(_parallelize_job.WORLD_SIZE))
    for r in records:
        assert r["dp"] == _parallelize_job.WORLD_SIZE // tp
        assert r["errors"]["weights"] == 0.0  # the dense values, sliced
        for key in ("output", "input_grad", "weight_grads"):
            assert r["errors"][key] <= P.REL_TOL, (r["rank"], key, r["errors"], r["worst_grad"])
        assert r["names_equal"] and r["checkpoint_names_equal"] and r["passed"]
        shapes = r["local_shapes"]
        assert shapes["layers.0.fc1.weight"] == [P.FFN // tp, P.HIDDEN]
        assert shapes["layers.0.attn.qkv.weight"] == [3 * P.HIDDEN // tp, P.HIDDEN]
        assert shapes["layers.1.attn.qkv.weight"] == [2 * P.HIDDEN // tp, P.HIDDEN]
        assert shapes["embed.embedding_table"] == [P.VOCAB // tp, P.HIDDEN]
        assert shapes["norm.gamma"] == [P.HIDDEN]
        if sequence_parallel:
            assert "norm.gamma" in r["sequence_parallel_params"]
            assert "layers.1.fc2.bias" in r["sequence_parallel_params"]
        else:
            assert r["sequence_parallel_params"] == []


@pytest.mark.multiprocess
def test_tp2_checkpoint_loads_into_the_dense_model(job):
    result, folder = job
    records = _parallelize_job.records_of(result, "parallelize.checkpoint")
    assert len(records) == _parallelize_job.WORLD_SIZE and all(r["passed"] for r in records)
    assert records[0]["local_shapes"]["layers.0.attn.qkv.weight"] == [3 * P.HIDDEN // 2, P.HIDDEN]
    want = dense_values(P.build(1, gqa=False))
    model = P.build(7, gqa=False)  # other values, overwritten by the load
    info = checkpoint.load(model, f"{folder}/tp2")
    assert (info["layout"]["tp"], info["layout"]["dp"]) == (2, 2)
    got = dense_values(model)
    assert sorted(got) == sorted(want)
    for name in want:
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)


@pytest.mark.multiprocess
def test_example_trains_like_the_dense_model(job):
    records = _parallelize_job.records_of(job[0], "parallelize.example")
    assert len(records) == _parallelize_job.WORLD_SIZE
    for r in records:
        assert (r["tp"], r["dp"]) == (2, 2) and r["passed"], r
        assert len(r["parallel_losses"]) == _parallelize_job.EXAMPLE_STEPS
        for p, d in zip(r["parallel_losses"], r["dense_losses"]):
            assert abs(p - d) <= 1e-5 * abs(d)
        assert r["dense_losses"][-1] < r["dense_losses"][0]
        assert max(v for k, v in r["errors"].items() if k.startswith("final")) <= 1e-4
