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
                                           ("interleaved", "pynative"), ("1f1b", "jit"),
                                           ("interleaved", "jit")])
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


@pytest.mark.parametrize("mode", ["pynative", "jit"])
def test_one_rank_interleaved_keeps_its_first_chunk(mode):
    """p = 1, v = 2: chunk 0's kept forward hands its output to chunk 1 on the same rank (no
    transfer); kept (recompute="none") equals the dense model and the recomputing run."""
    from mindscience.distributed.pipeline.runtime import last_recompute

    rng = np.random.default_rng(2)
    m = 3
    xs = [ms.Tensor(rng.standard_normal((2, 3)).astype(np.float32)) for _ in range(m)]
    ts = [ms.Tensor(rng.standard_normal((2, 3)).astype(np.float32)) for _ in range(m)]
    dense = _Lin([0, 1])
    params = dense.trainable_params()

    def dense_loss(*a):
        return sum(_mse(dense(a[j]), a[m + j]) for j in range(m)) / m

    want_loss, want = ms.value_and_grad(dense_loss, None, params)(*xs, *ts)
    stage = [_Lin([0]), _Lin([1])]
    for recompute in ("none", "full"):
        loss, grads = forward_backward(stage, xs, ts, _mse, schedule="interleaved", mode=mode,
                                       group=ONE, recompute=recompute)
        assert last_recompute()[0] == recompute
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


# ------------------------------------------------------------------ cache, loss_fn, freezing
def _data(m=3, rows=2, seed=1):
    rng = np.random.default_rng(seed)
    xs = [ms.Tensor(rng.standard_normal((rows, 3)).astype(np.float32)) for _ in range(m)]
    ts = [ms.Tensor(rng.standard_normal((rows, 3)).astype(np.float32)) for _ in range(m)]
    return xs, ts


def _l1(out, t):
    return mint.mean(mint.abs(out - t))


def _dense(seeds, loss_fn, xs, ts, frozen=()):
    """Loss and gradients of the mean loss over micro-batches, computed on one model."""
    dense = _Lin(seeds)
    for k in frozen:
        dense.trainable_params()[k].requires_grad = False
    m = len(xs)

    def mean_loss(*a):
        return sum(loss_fn(dense(a[j]), a[m + j]) for j in range(m)) / m

    loss, grads = ms.value_and_grad(mean_loss, None, dense.trainable_params())(*xs, *ts)
    return float(loss.asnumpy()), [g.asnumpy() for g in grads]


def _assert_matches(got, want):
    loss, grads = got
    assert abs(float(loss.asnumpy()) - want[0]) < 1e-6
    assert len(grads) == len(want[1])
    for g, w in zip(grads, want[1]):
        np.testing.assert_allclose(g.asnumpy(), w, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("mode", ["pynative", "jit"])
def test_a_new_loss_fn_is_used_on_the_same_stage(mode):
    # Audit finding: the second call with an L1 loss returned the first call's MSE.
    xs, ts = _data()
    stage = _Lin([0, 1])
    mse = _dense([0, 1], _mse, xs, ts)
    l1 = _dense([0, 1], _l1, xs, ts)
    assert abs(mse[0] - l1[0]) > 0.1  # the two losses are told apart
    _assert_matches(forward_backward(stage, xs, ts, _mse, mode=mode, group=ONE), mse)
    _assert_matches(forward_backward(stage, xs, ts, _l1, mode=mode, group=ONE), l1)
    _assert_matches(forward_backward(stage, xs, ts, _mse, mode=mode, group=ONE), mse)


@pytest.mark.parametrize("mode", ["pynative", "jit"])
def test_a_parameter_frozen_later_drops_out_of_the_gradients(mode):
    xs, ts = _data()
    stage = _Lin([0, 1])
    _assert_matches(forward_backward(stage, xs, ts, _mse, mode=mode, group=ONE),
                    _dense([0, 1], _mse, xs, ts))
    stage.trainable_params()[0].requires_grad = False
    assert len(stage_parameters(stage)) == 1
    _assert_matches(forward_backward(stage, xs, ts, _mse, mode=mode, group=ONE),
                    _dense([0, 1], _mse, xs, ts, frozen=(0,)))


def test_the_cache_lives_on_the_stage_and_dies_with_it():
    import gc
    import weakref

    from mindscience.distributed.pipeline import stage_fns

    xs, ts = _data()
    stage = _Lin([0])
    ref = weakref.ref(stage)
    forward_backward(stage, xs, ts, _mse, group=ONE)
    cache = stage.__dict__[stage_fns._ATTR]
    assert len(cache.chunks) == 1 and len(cache.losses) == 1 and len(cache.learned) == 1
    del stage, cache
    gc.collect()
    assert ref() is None  # PyNative: nothing of the process keeps the stage alive


def test_the_stage_can_be_deep_copied_after_a_call():
    import copy

    xs, ts = _data()
    stage = _Lin([0])
    forward_backward(stage, xs, ts, _mse, mode="jit", group=ONE)
    twin = copy.deepcopy(stage)
    _assert_matches(forward_backward(twin, xs, ts, _l1, group=ONE), _dense([0], _l1, xs, ts))


# ------------------------------------------------------------------ argument errors
@pytest.mark.parametrize("shape,match", [
    (5, r"activation_shape=5 is invalid: expected a tuple or list of positive ints"),
    ((2, "a"), r"activation_shape=\(2, 'a'\) is invalid"),
    ((2, 0), r"activation_shape=\(2, 0\) is invalid"),
    ((), r"activation_shape=\(\) is invalid"),
    ((2, True), r"activation_shape=\(2, True\) is invalid"),
])
def test_bad_activation_shape_is_named(shape, match):
    xs, ts = _data()
    with pytest.raises(PipelineError, match=match):
        forward_backward(_Lin([0]), xs, ts, _mse, activation_shape=shape, group=ONE)


def test_activation_shape_as_a_list_of_numpy_ints_is_accepted():
    xs, ts = _data()
    got = forward_backward(_Lin([0]), xs, ts, _mse, activation_shape=[np.int64(2), 3], group=ONE)
    _assert_matches(got, _dense([0], _mse, xs, ts))


def test_bad_containers_are_named():
    xs, ts = _data()
    with pytest.raises(PipelineError, match=r"got Tensor \(a single tensor: split it"):
        forward_backward(_Lin([0]), xs[0], ts, _mse, group=ONE)
    with pytest.raises(PipelineError, match="got an empty list"):
        forward_backward(_Lin([0]), [], [], _mse, group=ONE)
    with pytest.raises(PipelineError, match="model chunks .nn.Cell. this rank holds, got an empty list"):
        forward_backward([], xs, ts, _mse, schedule="interleaved", group=ONE)
    with pytest.raises(PipelineError, match=r"stage\[1\] is int, expected an nn.Cell"):
        forward_backward([_Lin([0]), 3], xs, ts, _mse, schedule="interleaved", group=ONE)
    with pytest.raises(PipelineError, match="loss_fn must be callable.*got str"):
        forward_backward(_Lin([0]), xs, ts, "mse", group=ONE)


def test_missing_micro_batches_are_named_before_any_compute():
    xs, ts = _data()
    with pytest.raises(PipelineError, match=r"inputs\[1\] is None on the first pipeline stage "
                                            r"\(pipeline rank 0 of 1\).*pass a Tensor"):
        forward_backward(_Lin([0]), [xs[0], None, xs[2]], ts, _mse, group=ONE)
    with pytest.raises(PipelineError, match=r"targets\[2\] is ndarray on the last pipeline stage"):
        forward_backward(_Lin([0]), xs, [ts[0], ts[1], ts[2].asnumpy()], _mse, group=ONE)
    odd = ms.Tensor(np.zeros((4, 3), np.float32))
    with pytest.raises(PipelineError, match=r"inputs\[2\] has shape \(4, 3\) Float32.*inputs\[0\] "
                                            r"has \(2, 3\) Float32"):
        forward_backward(_Lin([0]), [xs[0], xs[1], odd], ts, _mse, group=ONE)


# ------------------------------------------------------------------ a 2-stage pipeline, rank 0
class _NextStage:
    """Pipeline rank 1 of 2 as rank 0's link sees it: it takes every activation, answers
    each with the output gradient ``dy = 1``, and swaps headers like the real one."""

    me = 0

    def __init__(self):
        self.headers = 0
        self.sent = []
        self.shape = None

    def exchange(self, x):
        if tuple(x.shape) == (2 * p2p._SIG,):  # a header: [what I send | what I expect]
            self.headers += 1
            mine = x.asnumpy().tolist()
            sends, expects = mine[:p2p._SIG], mine[p2p._SIG:]
            if sends[0]:
                self.shape = tuple(int(d) for d in sends[2:2 + int(sends[1])])
            theirs = (p2p._signature(self.shape, ms.float32) if expects[0] else
                      p2p._signature(None, None))
            theirs += p2p._signature(None, None, 2.0 if sends[0] else 0.0)
            return ms.Tensor(np.asarray(theirs, np.float32))
        self.sent.append(x.asnumpy())
        return ms.Tensor(np.ones(x.shape, np.float32))

    def send(self, x):
        self.sent.append(x.asnumpy())
        return x

    def recv(self, zeros):
        return ms.Tensor(np.ones(zeros.shape, np.float32))


@pytest.fixture
def two_stages(monkeypatch):
    """forward_backward as pipeline rank 0 of 2, rank 1 simulated by :class:`_NextStage`."""
    from mindscience.distributed.pipeline import runtime

    peer = _NextStage()
    monkeypatch.setattr(runtime, "_agree", lambda *a: None)
    monkeypatch.setattr(runtime, "_links", lambda g, p, i, ring: {1: peer})
    monkeypatch.setattr(runtime.C, "all_reduce", lambda t, g: t)
    return ParallelGroup(key="pp", ranks=(0, 1), rank=0, backend_name="fake-pp"), peer


def _first_stage_grads(xs):
    """Rank 0's gradients when every output gradient is 1: d/dW sum_j sum(stage(x_j))."""
    dense = _Lin([0])
    params = dense.trainable_params()
    return [g.asnumpy() for g in ms.grad(lambda *a: sum(dense(x).sum() for x in a), None, params)(*xs)]


@pytest.mark.parametrize("mode", ["pynative", "jit"])
def test_first_stage_of_two_and_a_changed_activation_shape(two_stages, mode):
    group, peer = two_stages
    xs, _ = _data(m=4)
    nones = [None] * 4
    stage = _Lin([0])
    for call in range(2):  # the first call swaps headers, the second moves payloads only
        before = peer.headers
        peer.sent.clear()
        loss, grads = forward_backward(stage, xs, nones, _mse, mode=mode, group=group)
        assert (peer.headers > before) == (call == 0)
        assert float(loss.asnumpy()) == 0.0  # the loss lives on the last stage (all-reduce stubbed)
        for g, w in zip(grads, _first_stage_grads(xs)):
            np.testing.assert_allclose(g.asnumpy(), w, rtol=1e-5, atol=1e-6)
        want = [np.tanh(x.asnumpy() @ stage.w[0].asnumpy()) for x in xs]
        assert len(peer.sent) == 4
        for s, w in zip(peer.sent, want):
            np.testing.assert_allclose(s, w, rtol=1e-5, atol=1e-6)
    # The micro-batch grows: rank 1 would receive (2, 3) and wait or read garbage.
    big, _ = _data(m=4, rows=5)
    peer.sent.clear()
    with pytest.raises(PipelineError, match=r"pipeline rank 0 \(model stage 0, 1f1b\) is about to "
                                            r"send the activation of micro-batch 0 with shape "
                                            r"\(5, 3\) Float32 to pipeline rank 1, which receives "
                                            r"shape \(2, 3\) Float32.*activation_shape"):
        forward_backward(stage, big, nones, _mse, mode=mode, group=group)
    assert peer.sent == []  # raised before anything moved
    # A new activation_shape is a new configuration: shapes are exchanged again, and it runs.
    before = peer.headers
    loss, grads = forward_backward(stage, big, nones, _mse, mode=mode, group=group,
                                   activation_shape=(5, 3))
    assert peer.headers > before
    for g, w in zip(grads, _first_stage_grads(big)):
        np.testing.assert_allclose(g.asnumpy(), w, rtol=1e-5, atol=1e-6)


def test_first_stage_checks_its_inputs_before_the_agreement(two_stages, monkeypatch):
    from mindscience.distributed.pipeline import runtime

    group, peer = two_stages
    calls = []
    monkeypatch.setattr(runtime, "_agree", lambda g, m, v, s, problem: calls.append(problem))
    xs, _ = _data()
    with pytest.raises(PipelineError, match=r"inputs\[0\] is None on the first pipeline stage "
                                            r"\(pipeline rank 0 of 2\)"):
        forward_backward(_Lin([0]), [None] + xs[1:], [None] * 3, _mse, group=group)
    # The bad rank still joins the first call's agreement (so every rank raises), with its problem.
    assert len(calls) == 1 and calls[0].startswith("inputs[0] is None")
    assert peer.headers == 0 and peer.sent == []


def test_agreement_raises_on_every_rank(monkeypatch):
    """``_agree`` as rank 0 of 2, given what the sum over the group returned."""
    from mindscience.distributed.pipeline import runtime

    group = ParallelGroup(key="pp", ranks=(0, 1), rank=0, backend_name="fake-pp")

    def summed(rank1_row):
        def all_reduce(t, g):
            rows = t.asnumpy().copy()
            rows[1] = rank1_row
            return ms.Tensor(rows)
        return all_reduce

    monkeypatch.setattr(runtime.C, "all_reduce", summed([4, 1, 1, 0]))  # 1f1b, m = 4: agrees
    runtime._agree(group, 4, 1, "1f1b", None)
    monkeypatch.setattr(runtime.C, "all_reduce", summed([4, 1, 1, 1]))  # rank 1: bad targets
    with pytest.raises(PipelineError, match=r"pipeline rank\(s\) \[1\] of 2 passed bad micro-batches"):
        runtime._agree(group, 4, 1, "1f1b", None)
    with pytest.raises(PipelineError, match="inputs.0. is None"):  # this rank's own problem first
        runtime._agree(group, 4, 1, "1f1b", "inputs[0] is None ...")
    monkeypatch.setattr(runtime.C, "all_reduce", summed([8, 1, 1, 0]))
    with pytest.raises(PipelineError, match="pipeline rank 0: m=4 v=1 1f1b; pipeline rank 1: m=8"):
        runtime._agree(group, 4, 1, "1f1b", None)


def test_in_place_accumulation_and_its_fallback_give_the_same_sums(monkeypatch):
    from mindscience.distributed.pipeline import stage_fns

    assert stage_fns._assign_add_works()  # MindSpore 2.10 CPU: ops.assign_add on a Tensor works
    xs, ts = _data(m=4)
    want = _dense([0, 1], _mse, xs, ts)
    _assert_matches(forward_backward(_Lin([0, 1]), xs, ts, _mse, group=ONE), want)
    monkeypatch.setitem(stage_fns._IN_PLACE, "ok", False)  # a backend where it would not
    _assert_matches(forward_backward(_Lin([0, 1]), xs, ts, _mse, group=ONE), want)


class _Double(nn.Cell):
    def construct(self, x):
        return x * 2.0


def test_compiled_middle_stage_backward_accumulates_as_pynative():
    """A stage that is neither first nor last (its input gradient and its parameters'): the
    compiled backward (gradients summed into the accumulators in one HyperMap) equals the
    PyNative one over two micro-batches, bit for bit; a stage without parameters returns only
    the input gradient."""
    from mindscience.distributed.pipeline.stage_fns import stage_fns

    rng = np.random.default_rng(4)
    xs = [ms.Tensor(rng.standard_normal((2, 3)).astype(np.float32)) for _ in range(2)]
    dys = [ms.Tensor(rng.standard_normal((2, 3)).astype(np.float32)) for _ in range(2)]
    got = {}
    for mode in ("pynative", "jit"):
        fns = stage_fns(_Lin([5, 6]), None, mode, False, False)
        acc, dxs = fns.zeros(), []
        for x, dy in zip(xs, dys):
            dx, acc = fns.backward(x, dy, acc)
            dxs.append(dx.asnumpy())
        empty = stage_fns(_Double(), None, mode, False, False)
        dx_empty, acc_empty = empty.backward(xs[0], dys[0], empty.zeros())
        assert acc_empty == () and np.array_equal(dx_empty.asnumpy(), dys[0].asnumpy() * 2.0)
        got[mode] = dxs + [a.asnumpy() for a in acc]
    assert len(got["jit"]) == 4
    for a, b in zip(got["pynative"], got["jit"]):
        assert np.array_equal(a, b)
