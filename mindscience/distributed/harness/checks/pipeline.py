"""Checks of the pipeline runtime (:mod:`mindscience.distributed.pipeline`).

``pipeline.step``
    One ``forward_backward`` step of a toy stage (a linear layer and tanh per stage, 4
    micro-batches) for each schedule and mode against the dense model computed by every
    rank in numpy-free MindSpore on its own (the loss and this stage's gradients), plus
    the memory bound: the runtime's peak of kept micro-batches equals the schedule's.

``pipeline.errors``
    Bad data at the first call of a configuration: stage 0 passes a None micro-batch, or
    the last stage a None target: EVERY rank raises ``PipelineError`` (the bad rank its own
    message, the others one naming it), nobody waits in a transfer; a bad
    ``activation_shape`` raises on every rank before any collective. Then, on the same
    stage, a step with the MSE loss and one with an L1 loss: each against the dense model
    (a new ``loss_fn`` is used, not the first call's). Records ``pipeline.error.<name>``.
"""

from __future__ import annotations

import numpy as np

from ..registry import CheckContext, check
from .p2p import _raises, under_layout


def _toy(seed, layer, dim):
    rng = np.random.default_rng(seed + 17 * layer)
    return (rng.standard_normal((dim, dim)) / np.sqrt(dim)).astype(np.float32)


@check("pipeline.step")
def pipeline_step(ctx: CheckContext, schedules=("1f1b", "gpipe", "interleaved"),
                  modes=("pynative", "jit"), microbatches=4, dim=4, layout=None) -> list:
    """A toy pipeline step per schedule x mode vs the dense model on this rank."""
    return under_layout(ctx, layout, lambda manager: _steps(manager, schedules, modes,
                                                            microbatches, dim))


def _toy_model(dim):
    """``(Toy, mse)``: a stage of ``tanh(x @ w_k)`` layers (weights :func:`_toy`), a loss."""
    import mindspore as ms
    from mindspore import mint, nn

    class Toy(nn.Cell):
        def __init__(self, layers, seed):
            super().__init__()
            self.w = ms.ParameterTuple([
                ms.Parameter(ms.Tensor(_toy(seed, k, dim)), name=f"w{k}") for k in layers])

        def construct(self, x):
            for w in self.w:
                x = mint.tanh(mint.matmul(x, w))
            return x

    def loss_fn(out, t):
        return mint.mean((out - t) ** 2)

    return Toy, loss_fn


def _steps(manager, schedules, modes, m, dim):
    import mindspore as ms

    from mindscience.distributed.pipeline import forward_backward, runtime
    from mindscience.distributed.pipeline.schedules import build

    Toy, loss_fn = _toy_model(dim)

    g = manager.get_pipeline_parallel_group()
    p, i = g.size, g.rank
    rng = np.random.default_rng(5)
    xs = [rng.standard_normal((2, dim)).astype(np.float32) for _ in range(m)]
    ts = [rng.standard_normal((2, dim)).astype(np.float32) for _ in range(m)]
    records = []
    for schedule in schedules:
        v = 2 if schedule == "interleaved" else 1
        if schedule == "interleaved" and m % p:
            continue
        n_layers = p * v
        dense = Toy(range(n_layers), 0)
        params = dense.trainable_params()

        def dense_loss(*args):
            total = 0.0
            for j in range(m):
                total = total + loss_fn(dense(args[j]), args[m + j])
            return total / m

        want_loss, want_grads = ms.value_and_grad(dense_loss, None, params)(
            *[ms.Tensor(a) for a in xs + ts])
        chunks = [Toy([c * p + i], 0) for c in range(v)]
        stage = chunks if schedule == "interleaved" else chunks[0]
        mine = [c * p + i for c in range(v)]
        for mode in modes:
            inputs = [ms.Tensor(a) if i == 0 else None for a in xs]
            targets = [ms.Tensor(a) if i == p - 1 else None for a in ts]
            loss, grads = forward_backward(stage, inputs, targets, loss_fn, schedule=schedule,
                                           mode=mode)
            gerr = max(float(np.abs(gr.asnumpy() - want_grads[k].asnumpy()).max())
                       for gr, k in zip(grads, mine))
            lerr = abs(float(loss.asnumpy()) - float(want_loss.asnumpy()))
            expect_peak = build(schedule, p, m, v).peak_in_flight[i]
            peak = runtime.last_peak()
            records.append({
                "check": "pipeline.step", "group": "pp", "group_size": p, "schedule": schedule,
                "mode": mode, "microbatches": m, "virtual_stages": v, "loss_error": lerr,
                "grad_error": gerr, "max_error": max(lerr, gerr), "peak_in_flight": peak,
                "schedule_peak": expect_peak,
                "passed": bool(max(lerr, gerr) <= 1e-5 and peak == expect_peak),
            })
    return records


@check("pipeline.errors")
def pipeline_errors(ctx: CheckContext, microbatches=4, dim=4, layout=None) -> list:
    """Bad first-call data raises on every rank; a new loss_fn on the same stage is used."""
    return under_layout(ctx, layout, lambda manager: _errors(manager, microbatches, dim))


def _errors(manager, m, dim):
    import mindspore as ms
    from mindspore import mint

    from mindscience.distributed.pipeline import PipelineError, forward_backward

    Toy, mse = _toy_model(dim)

    def l1(out, t):
        return mint.mean(mint.abs(out - t))

    g = manager.get_pipeline_parallel_group()
    p, i = g.size, g.rank
    rng = np.random.default_rng(7)
    xs = [ms.Tensor(rng.standard_normal((2, dim)).astype(np.float32)) for _ in range(m)]
    ts = [ms.Tensor(rng.standard_normal((2, dim)).astype(np.float32)) for _ in range(m)]
    inputs = xs if i == 0 else [None] * m
    targets = ts if i == p - 1 else [None] * m
    records = []

    def rec(name, ok, msg, err=0.0):
        records.append({"check": f"pipeline.error.{name}", "group": "pp", "group_size": p,
                        "passed": bool(ok), "max_error": err if ok else None, "message": msg})

    # Each case on a new stage: the first call of its configuration (headers, agreement).
    bad_in = [None] + inputs[1:] if i == 0 else inputs
    want = "inputs[0] is None" if i == 0 else f"pipeline rank(s) [0] of {p}"
    rec("bad_input_every_rank", *_raises(
        lambda: forward_backward(Toy([i], 0), bad_in, targets, mse), PipelineError, want))
    bad_t = targets[:-1] + [None] if i == p - 1 else targets
    want = f"targets[{m - 1}] is None" if i == p - 1 else f"pipeline rank(s) [{p - 1}] of {p}"
    rec("bad_target_every_rank", *_raises(
        lambda: forward_backward(Toy([i], 0), inputs, bad_t, mse), PipelineError, want))
    rec("bad_activation_shape", *_raises(
        lambda: forward_backward(Toy([i], 0), inputs, targets, mse, activation_shape=5),
        PipelineError, "activation_shape=5 is invalid"))
    # One stage, two losses: each step against the dense model of the p layers.
    stage = Toy([i], 0)
    dense = Toy(range(p), 0)
    params = dense.trainable_params()
    for name, loss_fn in (("mse", mse), ("l1_after_mse", l1), ("mse_again", mse)):
        def dense_loss(*a, loss_fn=loss_fn):
            return sum(loss_fn(dense(a[j]), a[m + j]) for j in range(m)) / m

        want_loss, want_grads = ms.value_and_grad(dense_loss, None, params)(*xs, *ts)
        loss, grads = forward_backward(stage, inputs, targets, loss_fn)
        lerr = abs(float(loss.asnumpy()) - float(want_loss.asnumpy()))
        gerr = float(np.abs(grads[0].asnumpy() - want_grads[i].asnumpy()).max())
        err = max(lerr, gerr)
        rec(f"loss_fn_{name}", err <= 1e-5, f"loss {float(loss.asnumpy()):.6f} vs dense "
            f"{float(want_loss.asnumpy()):.6f}, grad error {gerr:.2e}", err)
    return records
