"""Checks of the vocabulary-parallel layers and of the tensor-parallel RNG.

* ``vocab.embedding``: ``VocabParallelEmbedding`` against a dense ``ops.gather`` of the full
  table (drawn from the same seed): the shard of the table (exact), the output (all-reduced,
  or this rank's rows with ``sequence_parallel``) and the table gradient of ``sum(out * C)``.
  The loss is differentiated with respect to ``C`` too, whose gradient is the output.
* ``vocab.cross_entropy``: ``vocab_parallel_cross_entropy`` against ``ops.cross_entropy`` on
  the full logits (``reduction="none"``): per-token loss and this rank's columns of the
  logits' gradient, with and without label smoothing, float32 and bfloat16.
* ``vocab.errors``: indivisible vocabulary, ids / targets out of range, mismatched shapes:
  ValueError before any collective.
* ``random.tracker``: dropout masks equal over tp outside ``fork()``, different inside,
  equal again after ``set_states``; a tp MLP with dropout trains identically twice.

All take ``tp`` (and ``cp``) and ``modes`` (``pynative``, ``jit``, ``graph``; the compiled
modes differentiate every case of one check as ONE graph).
"""

from __future__ import annotations

import itertools

import numpy as np

from ..registry import CheckContext, check
from .layers import LOW_PRECISION_TOL, _chunk, _ensure_parallel, _err, _seq_chunk, error_outcome

F32_TOL = 1e-5


def _run_cases(mode, losses, xs, weights_per_case):
    """``[(aux, dx, weight grads)]`` of every case; compiled modes as one graph."""
    import mindspore as ms

    from .modes import _COMPILED_KEEP_ALIVE, differentiate_batch

    _COMPILED_KEEP_ALIVE.extend(losses)
    if mode == "pynative":
        out = []
        for loss, x, ws in zip(losses, xs, weights_per_case):
            fn = ms.value_and_grad(loss, grad_position=0, weights=ws or None, has_aux=True)
            (_, aux), grads = fn(x)
            dx, wg = (grads if ws else (grads, ()))
            out.append((aux, dx, tuple(wg)))
        return out
    weights = [w for ws in weights_per_case for w in ws]
    _, auxs, dxs, wgs = differentiate_batch(mode, losses, xs, weights=weights or None)
    # One input (one weight) comes back as a tensor, not a 1-tuple.
    dxs = dxs if isinstance(dxs, tuple) else (dxs,)
    wgs = wgs if wgs is None or isinstance(wgs, tuple) else (wgs,)
    out, start = [], 0
    for aux, dx, ws in zip(auxs, dxs, weights_per_case):
        out.append((aux, dx, tuple(wgs[start:start + len(ws)]) if ws else ()))
        start += len(ws)
    return out


# ----------------------------------------------------------------------------- embedding
def _embedding_case(group, i, sequence_parallel, split, dtype, seed=0, vocab=None, dim=8,
                    seq_len=None, batch=2):
    import mindspore as ms
    from mindspore import Parameter
    from mindspore.common.initializer import initializer

    from mindscience.distributed.mappings import even_split_sizes
    from mindscience.distributed.modules import VocabParallelEmbedding

    n = group.size
    V = vocab or 4 * n
    S = seq_len or (2 * n + (1 if split == "uneven" else 0))
    sizes = even_split_sizes(S, n) if split == "uneven" else None
    rng = np.random.default_rng(seed + 3)
    ids = rng.integers(0, V, (S, batch)).astype(np.int32)
    cot_full = rng.standard_normal((S, batch, dim)).astype(np.float32)
    dt = getattr(ms, dtype)
    ms.set_seed(seed)
    table = Parameter(initializer("normal", (V, dim), dt)).float().asnumpy()
    ms.set_seed(seed)
    layer = VocabParallelEmbedding(V, dim, sequence_parallel=sequence_parallel,
                                   param_init_dtype=dt, group=group)
    layer.weight.name = f"emb{i}.weight"
    want_out = table[ids]
    want_grad = np.zeros_like(table)
    np.add.at(want_grad, ids.reshape(-1), cot_full.reshape(-1, dim))
    if sequence_parallel:
        want_out = _seq_chunk(want_out, group, sizes)
        cot = _seq_chunk(cot_full, group, sizes)
    else:
        cot = cot_full
    ids_t = ms.Tensor(ids)

    def loss_fn(c):
        out = layer(ids_t) if sizes is None else layer(ids_t, split_sizes=sizes)
        out = out.astype(ms.float32)
        return (out * c).sum(), out

    desc = (f"tp={n} V={V} sequence_parallel={sequence_parallel} split={split} {dtype}")
    return dict(layer=layer, loss=loss_fn, x=ms.Tensor(cot), desc=desc, dtype=dtype,
                init=_err(layer.weight.float(), _chunk(table, group, 0)),
                want=(want_out, _chunk(want_grad, group, 0)), split_sizes=sizes)


@check("vocab.embedding")
def embedding(ctx: CheckContext, tp=None, cp=None, modes=("pynative",), dtypes=("float32",),
              **sizes) -> list:
    """Every (sequence_parallel, even/uneven) case per dtype in each mode."""
    group = _ensure_parallel(ctx, tp, cp)
    configs = [(False, "even"), (True, "even"), (True, "uneven")]
    records = []
    for mode in modes:
        cases = [_embedding_case(group, i, sp, split, dt, **sizes)
                 for i, ((sp, split), dt) in enumerate(itertools.product(configs, dtypes))]
        results = _run_cases(mode, [c["loss"] for c in cases], [c["x"] for c in cases],
                             [[c["layer"].weight] for c in cases])
        for c, (out, _, grads) in zip(cases, results):
            scaled = c["dtype"] != "float32"
            errors = {"output": _err(out, c["want"][0], scaled),
                      "grad weight": _err(grads[0].float() if scaled else grads[0], c["want"][1], scaled)}
            tol = LOW_PRECISION_TOL.get(c["dtype"], F32_TOL)
            max_error = max(errors.values())
            records.append({"check": "vocab.embedding", "group": "tp", "case": c["desc"],
                            "mode": mode, "dtype": c["dtype"], "init_exact": c["init"] == 0.0,
                            "passed": bool(c["init"] == 0.0 and max_error <= tol),
                            "max_error": max_error, "errors": {"init weight": c["init"], **errors},
                            "atol": tol, "compiled_with": len(cases) if mode != "pynative" else 1})
    return records


# ----------------------------------------------------------------------------- cross-entropy
def _ce_case(group, smoothing, dtype, seed=0, vocab=None, tokens=(3, 2)):
    import mindspore as ms
    from mindspore import ops

    from mindscience.distributed.modules import vocab_parallel_cross_entropy

    n = group.size
    V = vocab or 5 * n
    rng = np.random.default_rng(seed + 11)
    logits = (4 * rng.standard_normal(tokens + (V,))).astype(np.float32)
    logits[..., 0] += 60.0  # a large logit: the max subtraction must hold
    target = rng.integers(0, V, tokens).astype(np.int32)
    cot = rng.standard_normal(tokens).astype(np.float32)
    dt = getattr(ms, dtype)
    if dtype != "float32":
        logits = ms.Tensor(logits).astype(dt).float().asnumpy()
    t_full, c_full = ms.Tensor(target.reshape(-1)), ms.Tensor(cot.reshape(-1))

    def dense(x):
        loss = ops.cross_entropy(x.reshape(-1, V), t_full, reduction="none", label_smoothing=smoothing)
        return (loss * c_full).sum(), loss

    (_, want_loss), want_grad = ms.value_and_grad(dense, has_aux=True)(ms.Tensor(logits))
    t = ms.Tensor(target)
    cot_t = ms.Tensor(cot)

    def loss_fn(x):
        loss = vocab_parallel_cross_entropy(x.astype(dt), t, smoothing, group=group)
        return (loss * cot_t).sum(), loss

    return dict(loss=loss_fn, x=ms.Tensor(_chunk(logits, group, -1)), dtype=dtype,
                desc=f"tp={n} V={V} label_smoothing={smoothing} {dtype}",
                want=(want_loss.asnumpy().reshape(tokens), _chunk(want_grad.asnumpy(), group, -1)))


@check("vocab.cross_entropy")
def cross_entropy(ctx: CheckContext, tp=None, cp=None, modes=("pynative",),
                  dtypes=("float32", "bfloat16"), smoothings=(0.0, 0.1)) -> list:
    """Each label smoothing x dtype in each mode against ops.cross_entropy."""
    group = _ensure_parallel(ctx, tp, cp)
    records = []
    for mode in modes:
        cases = [_ce_case(group, s, dt) for s, dt in itertools.product(smoothings, dtypes)]
        results = _run_cases(mode, [c["loss"] for c in cases], [c["x"] for c in cases],
                             [[] for _ in cases])
        for c, (loss, dx, _) in zip(cases, results):
            scaled = c["dtype"] != "float32"
            errors = {"loss": _err(loss, c["want"][0], scaled), "grad logits": _err(
                dx.float() if scaled else dx, c["want"][1], scaled)}
            tol = LOW_PRECISION_TOL.get(c["dtype"], F32_TOL)
            max_error = max(errors.values())
            records.append({"check": "vocab.cross_entropy", "group": "tp", "case": c["desc"],
                            "mode": mode, "dtype": c["dtype"], "passed": bool(max_error <= tol),
                            "max_error": max_error, "errors": errors, "atol": tol,
                            "compiled_with": len(cases) if mode != "pynative" else 1})
    return records


@check("vocab.errors")
def errors(ctx: CheckContext, tp=None, cp=None) -> list:
    """Bad arguments raise ValueError (naming the fix) before any collective."""
    import mindspore as ms

    from mindscience.distributed.modules import VocabParallelEmbedding, vocab_parallel_cross_entropy

    group = _ensure_parallel(ctx, tp, cp)
    n = group.size

    def ids(*values):
        return ms.Tensor(np.array(values, np.int32))

    logits = ms.Tensor(np.zeros((2, 3), np.float32))
    cases = {
        "vocab not divisible": (lambda: VocabParallelEmbedding(4 * n + 1, 8, group=group), "Pad"),
        "id out of range": (lambda: VocabParallelEmbedding(4 * n, 8, group=group)(ids(0, 4 * n)),
                            "[0,"),
        "negative id": (lambda: VocabParallelEmbedding(4 * n, 8, group=group)(ids(-1, 0)), "[0,"),
        "target out of range": (lambda: vocab_parallel_cross_entropy(
            logits, ids(0, 3 * n), group=group), "[0,"),
        "target shape mismatch": (lambda: vocab_parallel_cross_entropy(
            logits, ids(0, 1, 2), group=group), "expected"),
        "label_smoothing out of range": (lambda: vocab_parallel_cross_entropy(
            logits, ids(0, 1), 1.5, group=group), "[0, 1)"),
    }
    records = []
    for name, (fn, words) in cases.items():
        if n == 1 and "divisible" in name:
            continue
        outcome, message, calls = error_outcome(fn)
        records.append({"check": "vocab.errors", "group": "tp", "case": f"tp={n} {name}",
                        "passed": outcome == "ValueError" and calls == 0 and words in message,
                        "max_error": 0.0, "raised": outcome, "collective_calls": calls,
                        "message": message})
    return records


# ----------------------------------------------------------------------------- RNG
def _masks(shape, draws):
    import mindspore as ms
    from mindspore import ops

    x = ms.Tensor(np.ones(shape, np.float32))
    return [(ops.dropout(x, 0.5).asnumpy() > 0).astype(np.float32) for _ in range(draws)]


def _train_mlp(group, seed, steps=3):
    """Loss curve of a tp MLP (Column -> dropout in fork() -> Row -> dropout) under SGD."""
    import mindspore as ms
    from mindspore import nn, ops

    from mindscience.distributed import random as msrandom
    from mindscience.distributed.modules import ColumnParallelLinear, RowParallelLinear

    msrandom.model_parallel_seed(seed)
    f32 = dict(compute_dtype=ms.float32, group=group)

    class MLP(nn.Cell):
        def __init__(self):
            super().__init__()
            self.fc1 = ColumnParallelLinear(8, 16, gather_output=False, **f32)
            self.fc2 = RowParallelLinear(16, 8, input_is_parallel=True, **f32)

        def construct(self, x):
            h = ops.relu(self.fc1(x))
            with msrandom.get_rng_tracker().fork():
                h = ops.dropout(h, 0.3)
            return ops.dropout(self.fc2(h), 0.1)

    net = MLP()
    opt = nn.SGD(net.trainable_params(), learning_rate=0.1)
    x = ms.Tensor(np.random.default_rng(seed).standard_normal((4, 8)).astype(np.float32))

    def loss_fn(inp):
        return (net(inp) ** 2).mean()

    grad_fn = ms.value_and_grad(loss_fn, None, opt.parameters)
    losses = []
    for _ in range(steps):
        loss, grads = grad_fn(x)
        opt(grads)
        losses.append(float(loss.asnumpy()))
    return losses


@check("random.tracker")
def tracker(ctx: CheckContext, tp=None, cp=None, seed=1234) -> list:
    """Masks over tp outside/inside fork(), replay by set_states, two identical trainings."""
    from mindscience.distributed import collectives, manager
    from mindscience.distributed import random as msrandom

    group = _ensure_parallel(ctx, tp, cp)
    n = group.size
    seeds = msrandom.model_parallel_seed(seed)
    tracker_ = msrandom.get_rng_tracker()
    saved = tracker_.get_states()
    outside = np.stack(_masks((64,), 2))
    with tracker_.fork():
        inside = np.stack(_masks((64,), 2))
    after = np.stack(_masks((64,), 1))
    tracker_.set_states(saved)
    with tracker_.fork():
        replay = np.stack(_masks((64,), 2))

    def gathered(a):
        import mindspore as ms

        return collectives.all_gather(ms.Tensor(a[None]), group, dim=0).asnumpy()

    msrandom.model_parallel_seed(seed)
    no_fork = _masks((64,), 3)  # the default stream when nothing is forked
    out_all, in_all = gathered(outside), gathered(inside)
    same_outside = all((out_all[i] == out_all[0]).all() for i in range(n))
    differ_inside = all((in_all[i] != in_all[j]).any() for i in range(n) for j in range(i))
    rule = msrandom.seeds_for(seed, manager.get_tensor_parallel_rank(),
                              manager.get_pipeline_parallel_rank())
    first, second = _train_mlp(group, seed), _train_mlp(group, seed)
    checks = {
        "outside fork: equal masks over tp": bool(same_outside),
        "inside fork: different masks per tp rank": bool(differ_inside or n == 1),
        "set_states replays the forked masks": bool((replay == inside).all()),
        "fork leaves the default stream alone": bool((after[0] == no_fork[2]).all()),
        "seeds follow the documented rule": seeds == rule,
        "tp MLP with dropout trains identically twice": first == second,
    }
    return [{"check": "random.tracker", "group": "tp", "case": f"tp={n} {name}",
             "passed": ok, "max_error": 0.0 if ok else 1.0,
             **({"losses": [first, second]} if "MLP" in name else {})}
            for name, ok in checks.items()]
