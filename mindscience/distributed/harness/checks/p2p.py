"""Checks of the point-to-point transfers (:mod:`mindscience.distributed.p2p`).

Every value is known to every rank: group rank r's input is ``x_r = r + 1 + arange``
(small integers, exact in float32 and bfloat16) and the cotangent of the output is
``C_r = 2 (r + 1) + arange % 3``.

``p2p.ring``
    ``ring_shift`` forward and backward on each group, offset, dtype and mode against
    numpy: rank r must get ``x_{(r - off) mod n}`` and the gradient ``C_{(r + off) mod n}``.
    Params: ``groups`` (manager keys or ``"world"``, default ``["pp"]``), ``offsets``,
    ``dtypes``, ``modes``, ``shape``.

``p2p.pipeline``
    Megatron's six pipeline calls on the pp group, every neighbour pair in both
    directions (forward: activations to the next stage; backward: gradients to the
    previous one; the two combined exchanges), float32 and bfloat16, against numpy;
    the first/last stage's missing neighbour returns None.

``p2p.errors``
    A receiver that expects another shape, or dtype, than the sender sends: both ends
    raise ``P2PMismatchError`` (no hang); ring ranks with different shapes: every rank
    raises; a bad offset raises TypeError. Afterwards a correct transfer still works.
"""

from __future__ import annotations

import time

import mindspore as ms
import numpy as np

from ..registry import CheckContext, check
from .groups import WORLD_KEY, current_layout_args, ensure_manager, layout_label, restore
from .modes import check_mode, value_and_grad

_DT = {"float32": ms.float32, "bfloat16": ms.bfloat16, "float16": ms.float16}


def _x(r, shape):
    n = int(np.prod(shape))
    return (np.arange(n) % 7 + r + 1).reshape(shape).astype(np.float32)


def _c(r, shape):
    n = int(np.prod(shape))
    return (np.arange(n) % 3 + 2 * (r + 1)).reshape(shape).astype(np.float32)


def under_layout(ctx, layout, body):
    """``body(manager)`` under ``layout`` (dict of sizes, e.g. ``{"tp": 2, "pp": 4}``) when
    given, restoring the layout in force afterwards; records gain a ``layout`` label."""
    manager = ensure_manager(ctx)
    previous = current_layout_args(manager) if layout else None
    if layout:
        manager.destroy_parallel()
        manager.initialize_parallel(
            tensor_parallel_size=layout.get("tp", 1), context_parallel_size=layout.get("cp", 1),
            pipeline_parallel_size=layout.get("pp", 1),
            order=layout.get("order", "tp-cp-dp-pp"))
    try:
        records = body(manager)
        label = layout_label(manager.get_layout())
        for r in records:
            r.setdefault("layout", label)
        return records
    finally:
        if layout:
            restore(manager, previous)


def _group(manager, key):
    return manager.get_group(WORLD_KEY if key == "world" else key)


def _ring_loss(p2p, group, off, c):
    def loss(t):
        out = p2p.ring_shift(t, group, off)
        return (out.astype(ms.float32) * c).sum(), out

    return loss


@check("p2p.ring")
def ring(ctx: CheckContext, groups=("pp",), offsets=(1, -1, 2), dtypes=("float32", "bfloat16"),
         modes=("pynative", "jit", "graph"), shape=(2, 3), layout=None) -> list:
    """ring_shift vs numpy on every group x offset x dtype x mode."""
    return under_layout(ctx, layout, lambda manager: _ring(manager, groups, offsets, dtypes,
                                                           modes, shape))


def _ring(manager, groups, offsets, dtypes, modes, shape):
    from mindscience.distributed import p2p

    records = []
    shape = tuple(shape)
    for key in groups:
        g = _group(manager, key)
        n, r = g.size, g.rank
        for mode in modes:
            check_mode(mode)
            for dt in dtypes:
                for off in offsets:
                    c = ms.Tensor(_c(r, shape))
                    x = ms.Tensor(_x(r, shape), _DT[dt])
                    t0 = time.perf_counter()
                    (value, out), grad = value_and_grad(mode, _ring_loss(p2p, g, off, c), x)
                    elapsed = time.perf_counter() - t0
                    want_out = _x((r - off) % n, shape)
                    want_grad = _c((r + off) % n, shape)
                    fwd = float(np.abs(out.astype(ms.float32).asnumpy() - want_out).max())
                    bwd = float(np.abs(grad.astype(ms.float32).asnumpy() - want_grad).max())
                    want_value = float((want_out * _c(r, shape)).sum())
                    val_err = abs(float(value.asnumpy()) - want_value)
                    records.append({
                        "check": "p2p.ring_shift", "group": key, "group_size": n, "mode": mode,
                        "dtype": dt, "offset": off, "shape": list(shape),
                        "direction": "forward+backward", "forward_error": fwd,
                        "backward_error": bwd, "max_error": max(fwd, bwd, val_err),
                        "passed": bool(fwd == 0 and bwd == 0 and val_err == 0
                                       and out.dtype == x.dtype),
                        "time_s": round(elapsed, 4),
                    })
    return records


@check("p2p.pipeline")
def pipeline(ctx: CheckContext, dtypes=("float32", "bfloat16"), shape=(2, 4), layout=None) -> list:
    """The six Megatron calls between every pair of neighbouring stages, both ways."""
    return under_layout(ctx, layout, lambda manager: _pipeline(manager, dtypes, shape))


def _pipeline(manager, dtypes, shape):
    from mindscience.distributed import p2p

    g = manager.get_pipeline_parallel_group()
    p, i = g.size, g.rank
    shape = tuple(shape)
    records = []
    for dt in dtypes:
        mdt = _DT[dt]
        act = ms.Tensor(_x(i, shape), mdt)          # stage i's activation
        grd = ms.Tensor(_c(i, shape), mdt)          # stage i's input gradient
        errs = {}

        def err(got, want, name, present):
            if not present:
                errs[name] = 0.0 if got is None else float("inf")
                return
            if got is None or got.dtype != mdt or tuple(got.shape) != shape:
                errs[name] = float("inf")
                return
            errs[name] = float(np.abs(got.astype(ms.float32).asnumpy() - want).max())

        # forward: stage i sends, stage i+1 receives (all at once along the pipeline:
        # a stage first sends to its next, then receives from its previous, in the
        # order of the pairs (0,1), (1,2), ... which every rank agrees on).
        if i % 2 == 0:
            p2p.send_forward(act)
            got = p2p.recv_forward(shape, mdt)
        else:
            got = p2p.recv_forward(shape, mdt)
            p2p.send_forward(act)
        err(got, _x(i - 1, shape), "recv_forward", i > 0)
        if i % 2 == 0:
            p2p.send_backward(grd)
            got = p2p.recv_backward(shape, mdt)
        else:
            got = p2p.recv_backward(shape, mdt)
            p2p.send_backward(grd)
        err(got, _c(i + 1, shape), "recv_backward", i < p - 1)
        # combined: even stages exchange with the next first, odd ones with the previous.
        if i % 2 == 0:
            a = p2p.send_forward_recv_backward(act, shape, mdt)
            b = p2p.send_backward_recv_forward(grd, shape, mdt)
        else:
            b = p2p.send_backward_recv_forward(grd, shape, mdt)
            a = p2p.send_forward_recv_backward(act, shape, mdt)
        err(a, _c(i + 1, shape), "send_forward_recv_backward", i < p - 1)
        err(b, _x(i - 1, shape), "send_backward_recv_forward", i > 0)
        worst = max(errs.values())
        records.append({
            "check": "p2p.pipeline", "group": "pp", "group_size": p, "dtype": dt,
            "mode": "pynative", "shape": list(shape), "direction": "forward+backward",
            "calls": errs, "max_error": worst, "passed": bool(worst == 0.0),
        })
    return records


def _raises(fn, exc_type, must_contain):
    try:
        fn()
    except exc_type as exc:
        return must_contain in str(exc), str(exc)
    except Exception as exc:  # noqa: BLE001 - the wrong exception type is a failure
        return False, f"{type(exc).__name__}: {exc}"
    return False, "no exception"


@check("p2p.errors")
def errors(ctx: CheckContext, layout=None) -> list:
    """Mismatched ends raise on both ends; the link keeps working afterwards."""
    return under_layout(ctx, layout, _errors)


def _errors(manager):
    from mindscience.distributed import p2p

    g = manager.get_pipeline_parallel_group()
    p, i = g.size, g.rank
    records = []

    def rec(name, ok, msg):
        records.append({"check": f"p2p.error.{name}", "group": "pp", "group_size": p,
                        "passed": bool(ok), "max_error": 0.0 if ok else None, "message": msg})

    # Pair (0, 1): stage 0 sends (2, 4) float32, stage 1 expects (2, 5), then the dtype.
    if i == 0:
        x = ms.Tensor(np.ones((2, 4), np.float32))
        rec("shape_sender", *_raises(lambda: p2p.send_forward(x), p2p.P2PMismatchError, "(2, 5)"))
        rec("dtype_sender", *_raises(lambda: p2p.send_forward(x), p2p.P2PMismatchError, "BFloat16"))
        p2p.send_forward(x)
    elif i == 1:
        rec("shape_receiver", *_raises(lambda: p2p.recv_forward((2, 5), ms.float32),
                                       p2p.P2PMismatchError, "(2, 4)"))
        rec("dtype_receiver", *_raises(lambda: p2p.recv_forward((2, 4), ms.bfloat16),
                                       p2p.P2PMismatchError, "Float32"))
        got = p2p.recv_forward((2, 4), ms.float32)
        rec("after_mismatch", bool((got.asnumpy() == 1).all()), "the next transfer is correct")
    # ring with a shape that differs on the last rank
    shape = (3,) if i == p - 1 else (2,)
    x = ms.Tensor(np.zeros(shape, np.float32))
    rec("ring_shape", *_raises(lambda: p2p.ring_shift(x, g), p2p.P2PMismatchError,
                               "same shape and dtype"))
    rec("ring_offset", *_raises(lambda: p2p.ring_shift(x, g, 1.5), TypeError, "offset=1.5"))
    return records


@check("bandwidth.sendrecv")
def sendrecv(ctx: CheckContext, sizes=(1024, 262144), iters=3, warmup=1, dtype="float32",
             layout=None) -> list:
    """nccl-tests' sendrecv per neighbouring pipeline pair: both ranks send ``bytes`` to each
    other at once (one exchange), pair after pair; the other ranks wait. One record per pair
    and size, ``"group": "pp:<a>-<b>"`` (global ranks), ``"op": "sendrecv"``."""
    return under_layout(ctx, layout, lambda manager: _sendrecv(manager, sizes, iters, warmup, dtype))


def _sendrecv(manager, sizes, iters, warmup, dtype):
    from mindscience.distributed import p2p

    g = manager.get_pipeline_parallel_group()
    p, i = g.size, g.rank
    me = g.ranks[i]
    itemsize = 4 if dtype == "float32" else 2
    records = []
    layout = manager.get_layout()
    for s in range(p - 1):
        if i not in (s, s + 1):
            continue
        other = g.ranks[s + 1] if i == s else g.ranks[s]
        lk = p2p.link(me, other, me, False)
        label = f"pp:{min(me, other)}-{max(me, other)}"
        for size in sizes:
            n = max(1, int(size) // itemsize)
            x = ms.Tensor(_x(me, (n,)) % 8, _DT[dtype])
            want = _x(other, (n,)) % 8
            for _ in range(warmup):
                lk.exchange(x)
            t0 = time.perf_counter()
            for _ in range(iters):
                y = lk.exchange(x)
            y.asnumpy()
            elapsed = (time.perf_counter() - t0) / iters
            wrong = int((y.astype(ms.float32).asnumpy() != want).sum())
            records.append({
                "check": "bandwidth", "op": "sendrecv", "group": label, "group_size": 2,
                "bytes": n * itemsize, "dtype": dtype, "time_us": elapsed * 1e6, "wrong": wrong,
                "composed": p2p.C.get_backend().name == "composed",
                "stages": [s, s + 1],
                "crosses_nodes": layout.node_of(me) != layout.node_of(other),
            })
    return records
