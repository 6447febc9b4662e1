"""Harness checks of GPTModel against the dense model, run inside the ranks of tests/_models_job.py.

``models.parity`` builds, under one layout, each case's GPTModel (this rank's part) and
the dense model (``parallel=False``, every group of size 1, the same seed) in the rank
itself, runs one ``forward_backward`` step on the same global batch (each dp rank its
rows; the dense model all of them), finalizes the parallel gradients with
``GradientFinalizer`` (sequence-parallel ones summed over tp, tied embeddings over the
embedding group, all averaged over dp-cp), gathers each to its global shape over tp and
compares it with the dense gradient of the same global name. One record per case and
rank: the losses, the largest relative gradient error (max |parallel - dense| / max
|dense| per tensor), the names compared, and whether the global weights are identical.

``models.errors``: bad configs raise ``ModelConstraintError`` on every rank before any
collective.
"""

from __future__ import annotations

import time

import numpy as np

from mindscience.distributed.harness.checks.p2p import under_layout
from mindscience.distributed.harness.registry import CheckContext, check

# Small shapes of the two presets: every case runs in seconds on a loaded 2-core machine.
SMALL = {"hidden_size": 32, "num_attention_heads": 4, "ffn_hidden_size": 64, "seq_length": 16,
         "vocab_size": 64, "num_layers": 2}
MICRO_BATCH = 2


def small_config(preset: str, **overrides):
    from mindscience.distributed.models import TransformerConfig

    return TransformerConfig.from_model_spec(preset, **{**SMALL, **overrides})


def global_batch(cfg, rows: int, seed: int):
    rng = np.random.default_rng(seed + 7)
    ids = rng.integers(0, cfg.vocab_size, (rows, cfg.seq_length)).astype(np.int32)
    labels = rng.integers(0, cfg.vocab_size, (rows, cfg.seq_length)).astype(np.int32)
    return ids, labels


def _global_index(full_len: int, size: int, rank: int, stride: int) -> np.ndarray:
    """Indices along the split dim that tp rank ``rank`` holds (stride blocks)."""
    block = full_len // stride
    per = block // size
    return np.concatenate([np.arange(s * block + rank * per, s * block + (rank + 1) * per)
                           for s in range(stride)])


def gather_global(param, value: np.ndarray, full_shape, tp) -> np.ndarray:
    """This tp-sharded tensor at its global shape: each rank's slice put into zeros, summed over tp."""
    import mindspore as ms

    from mindscience.distributed import collectives as C
    from mindscience.distributed.sharding import get_sharding

    s = get_sharding(param)
    if s["axis"] != "tp" or tp.size == 1 or tuple(value.shape) == tuple(full_shape):
        return value
    dim = s["partition_dim"] % value.ndim
    full = np.zeros(full_shape, np.float32)
    index = [slice(None)] * value.ndim
    index[dim] = _global_index(full_shape[dim], tp.size, tp.rank, s["partition_stride"])
    full[tuple(index)] = value
    return C.all_reduce(ms.Tensor(full), tp).asnumpy()


def _rel(a, b) -> float:
    return float(np.max(np.abs(a - b)) / max(float(np.max(np.abs(b))), 1e-30))


def _case(manager, case: dict, seed: int) -> dict:
    import mindspore as ms

    from mindscience.distributed import collectives as C
    from mindscience.distributed.finalize import GradientFinalizer
    from mindscience.distributed.models import GPTModel

    started = time.perf_counter()
    m = int(case.get("microbatches", 1))
    mode = case.get("mode", "pynative")
    cfg = small_config(case["preset"], **case.get("config", {}))
    dp = manager.get_data_parallel_group()
    tp = manager.get_tensor_parallel_group()
    ids, labels = global_batch(cfg, dp.size * m * MICRO_BATCH, seed)
    rows = m * MICRO_BATCH
    mine = slice(dp.rank * rows, (dp.rank + 1) * rows)

    model = GPTModel(cfg, seed=seed)
    loss, grads = model.forward_backward(ids[mine], labels[mine], num_microbatches=m,
                                         schedule=case.get("schedule"), mode=mode)
    what_runs = None
    if manager.get_pipeline_parallel_group().size > 1:
        from mindscience.distributed.pipeline import runtime as pipeline_runtime

        what_runs = pipeline_runtime.last_recompute()[0]  # kept stage forwards or "full"
    params = model.trainable_params()
    grads = GradientFinalizer(params)(tuple(grads))
    loss = float(C.all_reduce(loss, dp).asnumpy()) / dp.size
    parallel_s = time.perf_counter() - started

    dense = GPTModel(cfg, seed=seed, parallel=False)
    dense_loss, dense_grads = dense.forward_backward(ids, labels, num_microbatches=1,
                                                     mode="pynative")
    want = {p.name: (p, g.asnumpy()) for p, g in zip(dense.trainable_params(), dense_grads)}

    errors, weight_errors, names = {}, {}, []
    for p, g in zip(params, grads):
        name = "embedding.word_embeddings.weight" if getattr(p, "shared_embedding", False) else p.name
        dense_p, dense_g = want[name]
        shape = tuple(dense_p.shape)
        errors[p.name] = _rel(gather_global(p, g.asnumpy(), shape, tp), dense_g)
        weight_errors[p.name] = float(np.max(np.abs(
            gather_global(p, p.asnumpy(), shape, tp) - dense_p.asnumpy())))
        names.append(name)
    worst = max(errors, key=errors.get)
    loss_err = abs(loss - float(dense_loss.asnumpy())) / abs(float(dense_loss.asnumpy()))
    return {
        "check": "models.parity", "group": "world", "case": case["name"], "mode": mode,
        "preset": case["preset"], "microbatches": m, "schedule": case.get("schedule"),
        "recompute": cfg.recompute, "what_runs": what_runs,
        "stage_layers": cfg.stage_layers(manager.get_pipeline_parallel_group().size),
        "layer_indices": list(model.layer_indices),
        "loss": loss, "dense_loss": float(dense_loss.asnumpy()), "loss_rel_err": loss_err,
        "max_grad_rel_err": errors[worst], "worst_param": worst,
        "max_weight_err": max(weight_errors.values()), "compared": sorted(set(names)),
        "dense_params": sorted(want), "grad_errors": errors,
        "parallel_s": parallel_s, "seconds": time.perf_counter() - started,
        "passed": bool(loss_err <= 1e-5 and errors[worst] <= 1e-5
                       and max(weight_errors.values()) == 0.0),
    }


@check("models.parity")
def parity(ctx: CheckContext, layout=None, cases=(), seed: int = 3) -> list:
    """Each case's GPTModel step at ``layout`` vs the dense model (loss, every gradient)."""
    return under_layout(ctx, layout, lambda manager: [_case(manager, c, seed) for c in cases])


def _errors(manager) -> list:
    from mindscience.distributed.costmodel.errors import ModelConstraintError
    from mindscience.distributed.models import GPTModel

    bad = {
        "vocab": ("tiny-gpt", {"vocab_size": 63}),
        "groups": ("tiny-llama", {"num_query_groups": 1}),
        "seq": ("tiny-gpt", {"seq_length": 18}),
        "ulysses": ("tiny-llama", {"context_parallel_method": "ulysses"}),
    }
    out = []
    for name, (preset, over) in bad.items():
        try:
            GPTModel(small_config(preset, **over), seed=0)
            raised, message = None, ""
        except ModelConstraintError as err:
            raised, message = type(err).__name__, str(err)
        out.append({"check": "models.errors", "group": "world", "case": name, "raised": raised,
                    "message": message, "passed": raised is not None})
    return out


@check("models.errors")
def errors(ctx: CheckContext, layout=None) -> list:
    """Bad configs at ``layout`` raise a typed error on every rank, no collective started."""
    return under_layout(ctx, layout, _errors)


def _dropout_step(cfg, ids, labels, mode, seed):
    """One step with every stream seeded alike (``random.model_parallel_seed``)."""
    from mindscience.distributed import random as msrandom
    from mindscience.distributed.models import GPTModel

    msrandom.model_parallel_seed(11)
    model = GPTModel(cfg, seed=seed)
    loss, grads = model.forward_backward(ids, labels, num_microbatches=1, mode=mode)
    return model, loss, grads


def _masks_over_tp(tp, parallel: bool):
    """Do the tp ranks draw different masks from ``Dropout(0.5, parallel)``?"""
    import mindspore as ms

    from mindscience.distributed import collectives as C
    from mindscience.distributed import random as msrandom
    from mindscience.distributed.models.layers import Dropout

    msrandom.model_parallel_seed(11)
    drop = Dropout(0.5, parallel)
    drop.set_train(True)
    mask = (drop(ms.Tensor(np.ones((1, 256), np.float32))).asnumpy() > 0).astype(np.float32)
    every = C.all_gather(ms.Tensor(mask), tp, dim=0).asnumpy()
    return bool((every != every[:1]).any())


def _dropout(manager, modes, seed) -> list:
    from mindscience.distributed import collectives as C
    from mindscience.distributed import random as msrandom
    from mindscience.distributed.finalize import GradientFinalizer
    from mindscience.distributed.models import GPTModel

    dp, tp = manager.get_data_parallel_group(), manager.get_tensor_parallel_group()
    out = []
    for sp in (True, False):
        cfg = small_config("tiny-gpt", dropout=0.2, sequence_parallel=sp)
        ids, labels = global_batch(cfg, dp.size * MICRO_BATCH, seed)
        mine = slice(dp.rank * MICRO_BATCH, (dp.rank + 1) * MICRO_BATCH)
        for mode in (modes if sp else ("pynative",)):
            started = time.perf_counter()
            model, loss, grads = _dropout_step(cfg, ids[mine], labels[mine], mode, seed)
            _, loss_rc, grads_rc = _dropout_step(cfg.replace(recompute="full"), ids[mine],
                                                 labels[mine], mode, seed)
            recompute_err = max(float(np.max(np.abs(a.asnumpy() - b.asnumpy())))
                                for a, b in zip(grads_rc, grads))
            record = {"check": "models.dropout", "group": "world", "sequence_parallel": sp,
                      "mode": mode, "loss": float(loss.asnumpy()),
                      "loss_recompute": float(loss_rc.asnumpy()), "recompute_grad_max_diff": recompute_err,
                      "tp_masks_differ": _masks_over_tp(tp, sp)}
            ok = recompute_err == 0.0 and record["loss"] == record["loss_recompute"]
            ok = ok and record["tp_masks_differ"] == (sp and tp.size > 1)
            if not sp:
                # Replicated activations draw the default stream: the same masks as the
                # dense model on this dp rank's rows, hence its loss and gradients.
                msrandom.model_parallel_seed(11)
                dense = GPTModel(cfg, seed=seed, parallel=False)
                d_loss, d_grads = dense.forward_backward(ids[mine], labels[mine], num_microbatches=1,
                                                         mode="pynative")
                params = model.trainable_params()
                finalized = GradientFinalizer(params)(tuple(grads))
                want = {p.name: (p, C.all_reduce(g, dp).asnumpy() / dp.size)
                        for p, g in zip(dense.trainable_params(), d_grads)}
                errs = [_rel(gather_global(p, g.asnumpy(), tuple(want[p.name][0].shape), tp), want[p.name][1])
                        for p, g in zip(params, finalized)]
                record["dense_loss"] = float(d_loss.asnumpy())
                record["loss_rel_err"] = abs(record["loss"] - record["dense_loss"]) / abs(record["dense_loss"])
                record["max_grad_rel_err"] = max(errs)
                ok = ok and record["loss_rel_err"] <= 1e-5 and record["max_grad_rel_err"] <= 1e-5
            record["seconds"] = round(time.perf_counter() - started, 1)
            record["passed"] = bool(ok)
            out.append(record)
    return out


@check("models.dropout")
def dropout(ctx: CheckContext, layout=None, modes=("pynative", "jit"), seed: int = 3) -> list:
    """Dropout at ``layout`` (tp2): full recompute gives the same gradients (sequence
    parallel: PyNative and jit); sequence-parallel masks differ over tp, replicated ones
    do not and equal the dense model's (its loss and gradients on this dp rank's rows)."""
    return under_layout(ctx, layout, lambda manager: _dropout(manager, modes, seed))
