"""p2p and the pipeline runtime in one process: headers, no-ops, argument errors, and
``forward_backward`` on a one-stage pipeline against the dense model (every schedule)."""

from __future__ import annotations

import mindspore as ms
import numpy as np
import pytest
from mindspore import mint, nn

from mindscience.distributed import p2p
from mindscience.distributed.group import ParallelGroup
from mindscience.distributed.pipeline import PipelineError, forward_backward, stage_parameters

ONE = ParallelGroup.trivial("pp")


class _FakeLink:
    """``exchange`` returns what the other end would have sent."""

    me = 0

    def __init__(self, theirs):
        self.theirs = theirs

    def exchange(self, x):
        return ms.Tensor(np.asarray(self.theirs, np.float32))


def _header(send_shape, send_dtype, expect):
    mine = p2p._signature(send_shape, send_dtype)
    if expect is None:
        return mine + p2p._signature(None, None, 0.0)
    return mine + p2p._signature(expect[0], expect[1])


def test_header_mismatch_names_both_ends():
    x = ms.Tensor(np.zeros((2, 4), np.float32))
    # The other end expects (2, 5) and sends nothing.
    lk = _FakeLink(_header(None, None, ((2, 5), ms.float32)))
    with pytest.raises(p2p.P2PMismatchError, match=r"sends shape \(2, 4\) Float32 to rank 1, which "
                                                    r"expects shape \(2, 5\) Float32"):
        p2p.exchange_header(lk, x, None, "test", 0, 1)
    # dtype differs
    lk = _FakeLink(_header((2, 4), ms.bfloat16, None))
    with pytest.raises(p2p.P2PMismatchError, match="expects shape .2, 4. Float32 from rank 1, which sends "
                                                   "shape .2, 4. BFloat16"):
        p2p.exchange_header(lk, None, ((2, 4), ms.float32), "test", 0, 1)


def test_header_learns_the_shape():
    lk = _FakeLink(_header((3, 1, 8), ms.bfloat16, None))
    assert p2p.exchange_header(lk, None, ("any", None), "t", 0, 1) == ((3, 1, 8), ms.bfloat16)
    assert p2p.exchange_header(lk, None, ((3, 1, 8), None), "t", 0, 1) == ((3, 1, 8), ms.bfloat16)
    with pytest.raises(p2p.P2PMismatchError, match="any dtype"):
        p2p.exchange_header(lk, None, ((3, 8), None), "t", 0, 1)


def test_size1_groups_are_noops():
    x = ms.Tensor(np.arange(4, dtype=np.float32))
    assert p2p.ring_shift(x, ONE) is x
    assert p2p.send_forward(x, group=ONE) is None
    assert p2p.recv_forward((4,), group=ONE) is None
    assert p2p.send_forward_recv_backward(x, (4,), group=ONE) is None
    assert p2p.send_backward_recv_forward(x, (4,), group=ONE) is None
    with pytest.raises(TypeError, match="offset=0.5"):
        p2p.ring_shift(x, ONE, 0.5)


class _Lin(nn.Cell):
    def __init__(self, seeds):
        super().__init__()
        self.w = ms.ParameterTuple([
            ms.Parameter(ms.Tensor(np.random.default_rng(s).standard_normal((3, 3)).astype(np.float32) / 2),
                         name=f"w{s}") for s in seeds])

    def construct(self, x):
        for w in self.w:
            x = mint.tanh(mint.matmul(x, w))
        return x


def _mse(out, t):
    return mint.mean((out - t) ** 2)


@pytest.mark.parametrize("schedule,mode", [("1f1b", "pynative"), ("gpipe", "pynative"),
                                           ("interleaved", "pynative"), ("1f1b", "jit")])
def test_one_stage_pipeline_equals_dense(schedule, mode):
    rng = np.random.default_rng(1)
    m = 3
    xs = [ms.Tensor(rng.standard_normal((2, 3)).astype(np.float32)) for _ in range(m)]
    ts = [ms.Tensor(rng.standard_normal((2, 3)).astype(np.float32)) for _ in range(m)]
    dense = _Lin([0, 1])
    params = dense.trainable_params()

    def dense_loss(*a):
        return sum(_mse(dense(a[j]), a[m + j]) for j in range(m)) / m

    want_loss, want = ms.value_and_grad(dense_loss, None, params)(*xs, *ts)
    stage = [_Lin([0]), _Lin([1])] if schedule == "interleaved" else _Lin([0, 1])
    loss, grads = forward_backward(stage, xs, ts, _mse, schedule=schedule, mode=mode, group=ONE)
    assert len(grads) == len(stage_parameters(stage)) == 2
    assert abs(float(loss.asnumpy()) - float(want_loss.asnumpy())) < 1e-6
    for g, w in zip(grads, want):
        np.testing.assert_allclose(g.asnumpy(), w.asnumpy(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("kwargs,match", [
    (dict(schedule="zigzag"), "unknown"),
    (dict(schedule="interleaved"), "list of the v model chunks"),
    (dict(mode="graph"), "mode='graph' is invalid"),
])
def test_bad_arguments_raise_before_any_transfer(kwargs, match):
    x = [ms.Tensor(np.zeros((2, 3), np.float32))]
    with pytest.raises(PipelineError, match=match):
        forward_backward(_Lin([0]), x, [x[0]], _mse, group=ONE, **kwargs)


def test_targets_must_match_inputs():
    x = [ms.Tensor(np.zeros((2, 3), np.float32))] * 2
    with pytest.raises(PipelineError, match="as long as inputs .2 micro-batches"):
        forward_backward(_Lin([0]), x, [None], _mse, group=ONE)
    with pytest.raises(PipelineError, match="list of chunks needs schedule='interleaved'"):
        forward_backward([_Lin([0])], x, x, _mse, group=ONE)
