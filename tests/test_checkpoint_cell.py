"""checkpoint.save / load of a MindSpore Cell in one process (tp = 1), errors, crash safety.

The layout changes on real ranks are in tests/test_mappings.py (checkpoint.layout_change).
"""

import os
import signal
import subprocess
import sys
import textwrap

import numpy as np
import pytest

ms = pytest.importorskip("mindspore")
from mindspore import nn, ops  # noqa: E402

from mindscience.distributed import checkpoint  # noqa: E402
from mindscience.distributed.checkpoint import CheckpointError, CheckpointIntegrityError  # noqa: E402
from mindscience.distributed.modules import ColumnParallelLinear, RowParallelLinear  # noqa: E402


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
