"""checkpoint.save / load of a MindSpore Cell in one process, errors, crash safety.

Most tests run at tp = 1. Those of optimizer state and of failing saves run 2 "ranks"
as threads of this process (``ThreadWorld``: each thread has its rank, and the world
all-reduce is a real sum between the threads, so a rank left waiting shows as a broken
barrier instead of a hang). The layout changes on real ranks are in
tests/test_mappings.py (checkpoint.layout_change).
"""

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading

import numpy as np
import pytest

ms = pytest.importorskip("mindspore")
from mindspore import nn, ops  # noqa: E402

from mindscience.distributed import checkpoint  # noqa: E402
from mindscience.distributed.checkpoint import CheckpointError, CheckpointIntegrityError  # noqa: E402
from mindscience.distributed.checkpoint import cell as cell_mod  # noqa: E402
from mindscience.distributed.modules import ColumnParallelLinear, RowParallelLinear  # noqa: E402
from mindscience.distributed.sharding import mark_sharding  # noqa: E402
from mindscience.distributed.topology.layout import Layout  # noqa: E402


class Net(nn.Cell):
    def __init__(self, hidden=8):
        super().__init__()
        self.layers = nn.CellList([ColumnParallelLinear(4, hidden, gather_output=False, compute_dtype=None),
                                   RowParallelLinear(hidden, 4, input_is_parallel=True, compute_dtype=None)])
        self.norm = ms.Parameter(ms.Tensor(np.linspace(0.5, 2, 4), ms.bfloat16), name="norm",
                                 requires_grad=False)

    def construct(self, x):
        y = self.layers[1](ops.tanh(self.layers[0](x)))
        return ((y * self.norm.astype(ms.float32)) ** 2).mean()


X = np.random.default_rng(0).standard_normal((3, 4)).astype(np.float32)


def _state(seed, hidden=8):
    ms.set_seed(seed)
    net = Net(hidden)
    opt = nn.AdamWeightDecay(net.trainable_params(), learning_rate=1e-2)
    return net, opt, nn.CellList([net, opt])


def _train(net, opt, steps):
    grad_fn = ms.value_and_grad(net, None, opt.parameters)
    out = []
    for _ in range(steps):
        loss, grads = grad_fn(ms.Tensor(X))
        opt(grads)
        out.append(float(loss.asnumpy()))
    return out


def _values(cell):
    return {n: p.astype(ms.float32).asnumpy().copy() for n, p, _ in checkpoint.named_parameters(cell)}


def test_save_load_resumes_exactly_with_optimizer_state(tmp_path):
    net, opt, state = _state(0)
    _train(net, opt, 2)
    checkpoint.save(state, tmp_path / "c", step=2, extra={"note": "x"})
    want = _train(net, opt, 3)
    net2, opt2, state2 = _state(5)
    info = checkpoint.load(state2, tmp_path / "c")
    assert info["step"] == 2 and info["extra"] == {"note": "x"} and info["layout"]["tp"] == 1
    assert any("adam_m" in n for n in info["loaded"]) and any("adam_v" in n for n in info["loaded"])
    assert _train(net2, opt2, 3) == want  # bit-identical continuation
    np.testing.assert_array_equal(net2.norm.astype(ms.float32).asnumpy(), np.linspace(0.5, 2, 4).astype(np.float32))


def test_named_parameters_sharding_and_global_layer_names():
    net, opt, state = _state(0)
    names = {n: s for n, _, s in checkpoint.named_parameters(state)}
    assert names["0.layers.0.weight"]["partition_dim"] == 0
    assert names["1.adam_m.layers.0.weight"] == names["0.layers.0.weight"]  # moments follow
    assert names["1.adam_v.layers.1.weight"]["partition_dim"] == 1
    assert names["1.adam_m.layers.1.bias"]["axis"] is None
    checkpoint.set_global_layer_names(state, first_layer=4)
    renamed = [n for n, _, _ in checkpoint.named_parameters(state)]
    assert "0.layers.5.weight" in renamed and "1.adam_v.layers.4.bias" in renamed


def _expect_untouched(state, directory, err, match):
    before = _values(state)
    with pytest.raises(err, match=match):
        checkpoint.load(state, directory)
    after = _values(state)
    assert all(np.array_equal(before[k], after[k]) for k in before)  # nothing modified


def test_load_errors_modify_nothing(tmp_path):
    net, opt, state = _state(0)
    _train(net, opt, 1)
    checkpoint.save(state, tmp_path / "c")
    _, _, other = _state(3)
    # a model with a different hidden size: shape mismatch names the parameter
    _, _, wide = _state(3, hidden=12)
    _expect_untouched(wide, tmp_path / "c", CheckpointError, r"'0.layers.0.weight'.*\(12, 4\)")
    # strict: a parameter missing from the checkpoint / one the model lacks
    extra_net = nn.CellList([other, nn.Dense(2, 2)])
    _expect_untouched(extra_net, tmp_path / "c", CheckpointError, "missing from the checkpoint")
    net1, _, _ = _state(3)
    _expect_untouched(nn.CellList([net1]), tmp_path / "c", CheckpointError, "no rank's model holds")
    checkpoint.load(nn.CellList([net1]), tmp_path / "c", strict=False)  # allowed without strict
    # corrupt data: checksum mismatch, truncated, missing file, unknown version
    path = tmp_path / "c" / "rank_00000.safetensors"
    data = bytearray(path.read_bytes())
    data[-3] ^= 1
    path.write_bytes(bytes(data))
    _expect_untouched(other, tmp_path / "c", CheckpointIntegrityError, "checksum mismatch")
    os.truncate(path, len(data) - 8)
    _expect_untouched(other, tmp_path / "c", CheckpointIntegrityError, "truncated")
    os.remove(path)
    _expect_untouched(other, tmp_path / "c", CheckpointIntegrityError, "missing rank file")
    (tmp_path / "c" / "manifest.json").write_text('{"format": "msdist-checkpoint", "format_version": 7}')
    _expect_untouched(other, tmp_path / "c", CheckpointError, "unknown format_version 7")


CRASH = textwrap.dedent("""
    import os, signal, sys
    import numpy as np
    import mindspore as ms
    from mindspore import nn
    from mindscience.distributed import checkpoint
    from mindscience.distributed.checkpoint import files
    net = nn.Dense(256, 256)
    net.weight.set_data(ms.Tensor(np.full((256, 256), 1.0, np.float32)))
    checkpoint.save(net, sys.argv[1], step=1)
    net.weight.set_data(ms.Tensor(np.full((256, 256), 2.0, np.float32)))
    real = files.SafetensorsWriter.write
    def write(self, name, chunk):  # die part-way through the data of the second save
        real(self, name, chunk)
        os.kill(os.getpid(), signal.SIGKILL)
    files.SafetensorsWriter.write = write
    checkpoint.save(net, sys.argv[1], step=2)
""")


def test_save_killed_part_way_leaves_previous_checkpoint(tmp_path):
    ckpt = tmp_path / "ckpt"
    proc = subprocess.run([sys.executable, "-c", CRASH, str(ckpt)], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
    data = checkpoint.inspect(str(ckpt))
    assert data["ok"] and data["step"] == 1
    net = nn.Dense(256, 256)
    assert checkpoint.load(net, ckpt)["step"] == 1
    np.testing.assert_array_equal(net.weight.asnumpy(), np.ones((256, 256), np.float32))
    partial = checkpoint.inspect(str(ckpt) + ".partial")
    assert not partial["ok"] and not partial["complete"]
    assert "incomplete: no manifest.json" in partial["problems"][0]
    cli = subprocess.run([sys.executable, "-m", "mscli.main", "checkpoint", "inspect", str(ckpt) + ".partial"],
                         capture_output=True, text=True, timeout=120)
    assert cli.returncode == 1 and "incomplete" in cli.stderr


class ThreadWorld:
    """``layout.world_size`` ranks as threads: ``cell._world`` returns each thread's rank
    and ``cell._world_sum`` sums the threads' vectors (two barriers, 60 s timeout).

    The threads take turns (one lock, given up only while waiting in a collective):
    MindSpore's PyNative ops abort the process when two threads run them at once."""

    def __init__(self, monkeypatch, layout):
        self.layout, self.local = layout, threading.local()
        self.slots = [None] * layout.world_size
        self.turn = threading.Lock()
        monkeypatch.setattr(cell_mod, "_world", lambda: (self.layout, self.local.rank))
        monkeypatch.setattr(cell_mod, "_world_sum", self._sum)

    def _sum(self, layout, values):
        self.slots[self.local.rank] = np.asarray(values, np.float64)
        self.turn.release()
        try:
            self.barrier.wait()
            total = np.sum(self.slots, axis=0)
            self.barrier.wait()
        finally:
            self.turn.acquire()
        return total.astype(np.float32)

    def run(self, fn):
        """``fn(rank)`` on every rank at once: (results, errors) by rank."""
        n = self.layout.world_size
        results, errors = [None] * n, [None] * n
        # A rank raising outside a collective leaves the others waiting in one: they break
        # out after the barrier's timeout (BrokenBarrierError: "would have hung").
        self.barrier = threading.Barrier(n, timeout=60)

        def target(rank):
            self.local.rank = rank
            with self.turn:
                try:
                    results[rank] = fn(rank)
                except BaseException as err:  # noqa: BLE001 - reported to the test
                    errors[rank] = err

        threads = [threading.Thread(target=target, args=(r,)) for r in range(n)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(180)
        assert not any(t.is_alive() for t in threads), "a rank hung"
        return results, errors


W = np.arange(24, dtype=np.float32).reshape(6, 4) / 8    # global [6, 4], split on dim 0
V = np.arange(24, dtype=np.float32).reshape(4, 6) / 16   # global [4, 6], split on dim 1


class ShardNet(nn.Cell):
    """tp rank ``rank`` of ``tp``'s slices of W (dim 0) and V (dim 1), a replicated b."""

    def __init__(self, rank=0, tp=2, scale=1.0):
        super().__init__()
        rows, cols = 6 // tp, 6 // tp
        self.w = mark_sharding(ms.Parameter(ms.Tensor(W[rank * rows:(rank + 1) * rows] * scale), name="w"),
                               "tp", 0)
        self.v = mark_sharding(ms.Parameter(ms.Tensor(V[:, rank * cols:(rank + 1) * cols] * scale), name="v"),
                               "tp", 1)
        self.b = ms.Parameter(ms.Tensor(np.full(4, 0.5, np.float32) * scale), name="b")


def _optimizer(kind, net):
    if kind == "mint.AdamW":
        opt = ms.mint.optim.AdamW(net.trainable_params(), lr=1e-2)
        return opt, {"w": opt.exp_avg[0], "v": opt.exp_avg[1]}, ("exp_avg", "exp_avg_sq")
    opt = nn.Adam(net.trainable_params(), learning_rate=1e-2)
    return opt, {"w": opt.moment1[0], "v": opt.moment1[1]}, ("moment1", "moment2")


def _moment(name, rank, tp=2):
    """The moment value rank ``rank`` holds: its slice of a global tensor + 100 x its tp rank
    is not what training gives, but makes every rank's slice distinct and known."""
    full = {"w": W * 10, "v": V * 10}[name]
    if name == "w":
        return full[rank * (6 // tp):(rank + 1) * (6 // tp)] + 0.25
    return full[:, rank * (6 // tp):(rank + 1) * (6 // tp)] + 0.25


@pytest.mark.parametrize("kind", ["mint.AdamW", "nn.Adam"])
def test_optimizer_moments_are_split_like_their_parameter(tmp_path, monkeypatch, kind):
    """At tp2 (two thread ranks) each rank's moments of the split W and V are its own
    slice: saved as such (merged = the global moment), and loaded back per rank, and at
    tp1 as the whole tensor. Before, mint.optim's ``exp_avg.*`` were saved as replicated:
    only rank 0's slice, recorded as the whole tensor."""
    world = ThreadWorld(monkeypatch, Layout(world_size=2, tp=2))
    states = []
    for rank in range(2):
        net = ShardNet(rank)
        opt, moments, prefixes = _optimizer(kind, net)
        for name, param in moments.items():
            param.set_data(ms.Tensor(_moment(name, rank)))
        states.append(nn.CellList([net, opt]))
    names = {n: s for n, _, s in checkpoint.named_parameters(states[0])}
    assert names[f"1.{prefixes[0]}.w"] == names["0.w"] and names[f"1.{prefixes[1]}.v"] == names["0.v"]
    assert names["1.moment1.v" if kind == "nn.Adam" else "1.exp_avg.v"]["partition_dim"] == 1
    _, errors = world.run(lambda r: checkpoint.save(states[r], tmp_path / "c", step=4))
    assert errors == [None, None]
    merged = tmp_path / "m.safetensors"
    checkpoint.merge(str(tmp_path / "c"), str(merged))
    from safetensors.numpy import load_file

    full = load_file(str(merged))
    np.testing.assert_array_equal(full[f"1.{prefixes[0]}.w"], W * 10 + 0.25)
    np.testing.assert_array_equal(full[f"1.{prefixes[0]}.v"], V * 10 + 0.25)
    np.testing.assert_array_equal(full["0.w"], W)
    # Reload at tp2 into other values: each rank gets its own slice back.
    fresh = []
    for rank in range(2):
        net = ShardNet(rank, scale=3.0)
        opt, moments, _ = _optimizer(kind, net)
        fresh.append((nn.CellList([net, opt]), moments))
    _, errors = world.run(lambda r: checkpoint.load(fresh[r][0], tmp_path / "c"))
    assert errors == [None, None]
    for rank in range(2):
        for name, param in fresh[rank][1].items():
            np.testing.assert_array_equal(param.asnumpy(), _moment(name, rank))
    # And at tp1 (this process alone): the whole moments.
    monkeypatch.setattr(cell_mod, "_world", lambda: (Layout(world_size=1), 0))
    monkeypatch.setattr(cell_mod, "_world_sum", lambda layout, values: values)
    net = ShardNet(0, tp=1, scale=3.0)
    opt, moments, _ = _optimizer(kind, net)
    checkpoint.load(nn.CellList([net, opt]), tmp_path / "c")
    np.testing.assert_array_equal(moments["w"].asnumpy(), W * 10 + 0.25)
    np.testing.assert_array_equal(moments["v"].asnumpy(), V * 10 + 0.25)


class HandOptimizer(nn.Cell):
    """An optimizer of its own kind: a moment for the 2-d weight ``w`` only (a
    ParameterTuple shorter than its parameters, so not matched position by position)."""

    def __init__(self, params, named=True):
        super().__init__()
        self.parameters = ms.ParameterTuple(params)
        w = params[0]
        zeros = ms.Tensor(np.zeros(w.shape, np.float32))
        # "m.<name>": what ParameterTuple.clone(prefix="m") names each parameter's state
        self.m = ms.ParameterTuple([ms.Parameter(zeros, name=f"m.{w.name}" if named else "buf0")])


def test_optimizer_state_by_name_or_a_clear_error():
    net = ShardNet(0)
    named = nn.CellList([net, HandOptimizer(net.trainable_params())])
    names = {n: s for n, _, s in checkpoint.named_parameters(named)}
    assert names["1.m.w"] == names["0.w"]  # "1.m.w" and "1.w": matched by name and shape
    net = ShardNet(0)
    opt = HandOptimizer(net.trainable_params(), named=False)
    state = nn.CellList([net, opt])
    with pytest.raises(CheckpointError, match=r"optimizer state '1.buf0' \(local shape \(3, 4\)\) cannot be "
                                              r"matched.*sharded parameter.*mark_sharding"):
        checkpoint.named_parameters(state)
    mark_sharding(opt.m[0], "tp", 0)  # the user says how it is split
    assert {n: s for n, _, s in checkpoint.named_parameters(state)}["1.buf0"]["partition_dim"] == 0
    # A one-element state (nn.Adam's global_step, shape (1,)) is a counter, even beside a
    # sharded bias of one element per rank: replicated, no error.
    net = ShardNet(0)
    net.tiny = mark_sharding(ms.Parameter(ms.Tensor(np.ones(1, np.float32)), name="tiny"), "tp", 0)
    names = {n: s for n, _, s in checkpoint.named_parameters(nn.CellList([net, nn.Adam(net.trainable_params())]))}
    assert names["1.global_step"]["axis"] is None and names["1.moment1.tiny"] == names["0.tiny"]


def _two_ranks(monkeypatch):
    world = ThreadWorld(monkeypatch, Layout(world_size=2, tp=2))
    return world, [nn.CellList([ShardNet(r)]) for r in range(2)]


def test_save_accepts_numpy_step_and_checks_arguments_on_every_rank(tmp_path, monkeypatch):
    world, states = _two_ranks(monkeypatch)
    _, errors = world.run(lambda r: checkpoint.save(states[r], tmp_path / "c", step=np.int64(5),
                                                    extra={"lr": 0.5}))
    assert errors == [None, None]
    manifest = json.loads((tmp_path / "c" / "manifest.json").read_text())
    assert manifest["step"] == 5 and manifest["extra"] == {"lr": 0.5}
    for kwargs, match in [({"step": "5"}, r"step='5' \(str\) is invalid: expected an int or None"),
                          ({"step": 2.0}, r"step=2.0 \(float\)"),
                          ({"step": True}, r"step=True"),
                          ({"extra": {"f": object()}}, r"extra=.* is not JSON-serializable"),
                          ({"extra": {"x": float("nan")}}, r"not JSON-serializable")]:
        _, errors = world.run(lambda r: checkpoint.save(states[r], tmp_path / "d", **kwargs))
        assert all(isinstance(e, CheckpointError) and e.args[0] == errors[0].args[0] for e in errors)
        assert errors[0] is not None and __import__("re").search(match, str(errors[0])), errors
        assert not (tmp_path / "d").exists() and not (tmp_path / "d.partial").exists()


@pytest.mark.parametrize("where", ["write_rank", "finish"])
def test_a_save_failing_on_one_rank_fails_on_every_rank(tmp_path, monkeypatch, where):
    """Rank 1's disk is full while writing (or rank 0's while writing the manifest): no
    rank hangs at a barrier, every rank raises naming the failing rank, and the previous
    checkpoint is still the one in place."""
    world, states = _two_ranks(monkeypatch)
    _, errors = world.run(lambda r: checkpoint.save(states[r], tmp_path / "c", step=1))
    assert errors == [None, None]
    bad = 1 if where == "write_rank" else 0
    real = getattr(cell_mod, where)

    def failing(*args, **kwargs):
        if world.local.rank == bad:
            raise OSError(28, "No space left on device")
        return real(*args, **kwargs)

    monkeypatch.setattr(cell_mod, where, failing)
    _, errors = world.run(lambda r: checkpoint.save(states[r], tmp_path / "c", step=2))
    assert all(isinstance(e, CheckpointError) for e in errors), errors
    assert f"failed on rank {bad} while" in str(errors[bad])
    assert "No space left on device" in str(errors[bad])
    assert f"failed on rank(s) {bad} while" in str(errors[1 - bad])
    monkeypatch.setattr(cell_mod, where, real)
    assert json.loads((tmp_path / "c" / "manifest.json").read_text())["step"] == 1
    if where == "write_rank":
        assert not (tmp_path / "c.partial").exists()
    _, errors = world.run(lambda r: checkpoint.load(states[r], tmp_path / "c"))
    assert errors == [None, None]


def test_load_reads_the_complete_partial_left_between_two_renames(tmp_path):
    """A save whose fallback was stopped between its two renames (no DIR, the previous
    checkpoint in DIR.old, the new complete one in DIR.partial): load reads the new one,
    says so, and the next save puts it in place first."""
    net = nn.Dense(3, 2)
    net.weight.set_data(ms.Tensor(np.full((2, 3), 1.0, np.float32)))
    checkpoint.save(net, tmp_path / "c", step=1)
    net.weight.set_data(ms.Tensor(np.full((2, 3), 2.0, np.float32)))
    checkpoint.save(net, tmp_path / "new", step=2)
    os.rename(tmp_path / "c", tmp_path / "c.old")
    os.rename(tmp_path / "new", tmp_path / "c.partial")
    other = nn.Dense(3, 2)
    with pytest.warns(UserWarning, match="c.partial is complete"):
        info = checkpoint.load(other, tmp_path / "c")
    assert info["step"] == 2 and "stopped while moving it into place" in info["note"]
    np.testing.assert_array_equal(other.weight.asnumpy(), np.full((2, 3), 2.0, np.float32))
    checkpoint.save(net, tmp_path / "c", step=3)
    assert sorted(os.listdir(tmp_path)) == ["c"]
    assert checkpoint.load(other, tmp_path / "c")["step"] == 3
