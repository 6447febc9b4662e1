"""Harness checks of GPTModel with MoE layers, run inside the ranks of tests/_moe_model_job.py.

``moe_model.parity``: under one layout (tp, cp, pp, ep, etp), each case's GPTModel (this
rank's part) and the dense model (``parallel=False``: one rank's model, every expert
here) built in the rank from the same seed run one ``forward_backward`` on the same
global batch; the parallel gradients are finalized (``GradientFinalizer``: expert ones
over edp, dense ones over dp-cp), gathered to their global shapes (tp slices over tp,
experts over the etp x ep dispatch group) and compared with the dense gradient of the
same name. One record per case and rank: losses, aux losses (``moe_metrics``), the
largest relative gradient error, whether the global weights are identical.

Micro-batches: the aux loss is computed over the tokens of the micro-batch of every
dp-cp rank at once (``MoELayer``: the routing statistics are summed over dp-cp), so a
case with an aux loss runs ONE micro-batch per rank against the dense model's ONE
micro-batch of the whole global batch; a capacity case (capacity per rank's tokens) runs
micro-batches of the same rows on both sides and no aux loss.

``moe_model.train``: ``Trainer`` (DistributedOptimizer, AdamW) steps at a layout and ZeRO
stage; the records carry the losses and MoE statistics, compared by the test with the
one-rank run of the same steps in the pytest process.

``moe_model.checkpoint``: train at ep4 and save; rank 0 reshards the checkpoint offline
to ep2 x etp2 (tp2); resume there and train on: the losses of the resumed steps.
"""

from __future__ import annotations

import os
import time

import numpy as np

from mindscience.distributed.harness.checks.groups import ensure_manager
from mindscience.distributed.harness.registry import CheckContext, check

# tiny-moe at a size every case runs in seconds on a loaded 2-core machine.
SMALL = {"hidden_size": 32, "num_attention_heads": 4, "num_query_groups": 2, "ffn_hidden_size": 32,
         "seq_length": 16, "vocab_size": 64, "num_layers": 2, "moe_ffn_hidden_size": 16,
         "num_moe_experts": 4}
AUX = {"moe_aux_loss_coeff": 0.01, "moe_z_loss_coeff": 0.001}
# Training also moves the expert bias (aux-loss-free balancing) after every step.
TRAIN = {**AUX, "moe_router_enable_expert_bias": True, "moe_router_bias_update_rate": 1e-2}
MICRO_BATCH = 2
GLOBAL_BATCH = 8  # training: the same 8 sequences a step at every layout


def small_config(**overrides):
    from mindscience.distributed.models import TransformerConfig

    return TransformerConfig.from_model_spec("tiny-moe", **{**SMALL, **overrides})


def init_layout(manager, layout: dict):
    """Re-create the groups as ``layout`` says (tp, cp, pp, ep, etp; each default 1/tp)."""
    if manager.is_initialized():
        manager.destroy_parallel()
    return manager.initialize_parallel(
        tensor_parallel_size=layout.get("tp", 1), context_parallel_size=layout.get("cp", 1),
        pipeline_parallel_size=layout.get("pp", 1), expert_model_parallel_size=layout.get("ep", 1),
        expert_tensor_parallel_size=layout.get("etp"))


def _label(layout: dict) -> str:
    return "x".join(f"{k}{v}" for k, v in layout.items() if k in ("tp", "cp", "pp", "ep", "etp"))


def global_batch(cfg, rows: int, seed: int):
    rng = np.random.default_rng(seed + 7)
    ids = rng.integers(0, cfg.vocab_size, (rows, cfg.seq_length)).astype(np.int32)
    labels = rng.integers(0, cfg.vocab_size, (rows, cfg.seq_length)).astype(np.int32)
    return ids, labels


def _index(full_len: int, size: int, rank: int, stride: int) -> np.ndarray:
    block = full_len // stride
    per = block // size
    return np.concatenate([np.arange(s * block + rank * per, s * block + (rank + 1) * per)
                           for s in range(stride)])


def gather_global(manager, param, value: np.ndarray, full_shape) -> np.ndarray:
    """``value`` (this rank's piece of ``param``) at its global shape: tp slices summed
    over tp, expert slices (dim 0 over ep, the etp mark) over the etp x ep group."""
    import mindspore as ms

    from mindscience.distributed import collectives as C
    from mindscience.distributed.sharding import get_sharding

    if tuple(value.shape) == tuple(full_shape):
        return value
    s = get_sharding(param)
    full = np.zeros(full_shape, np.float32)
    index = [slice(None)] * value.ndim
    if getattr(param, "expert_parallel", False):
        ep = manager.get_expert_model_parallel_group()
        n = value.shape[0]
        index[0] = slice(ep.rank * n, (ep.rank + 1) * n)
        group = manager.get_group("etp-ep")
        if s["axis"] == "etp":
            etp = manager.get_expert_tensor_parallel_group()
            dim = s["partition_dim"]
            index[dim] = _index(full_shape[dim], etp.size, etp.rank, s["partition_stride"])
    else:
        group = manager.get_tensor_parallel_group()
        dim = s["partition_dim"]
        index[dim] = _index(full_shape[dim], group.size, group.rank, s["partition_stride"])
    full[tuple(np.ix_(*[np.arange(n)[i] if isinstance(i, slice) else i
                        for n, i in zip(full_shape, index)]))] = value
    return C.all_reduce(ms.Tensor(full), group).asnumpy()


def _rel(a, b) -> float:
    return float(np.max(np.abs(a - b)) / max(float(np.max(np.abs(b))), 1e-30))


def _parity_case(manager, case: dict, seed: int) -> dict:
    from mindscience.distributed import collectives as C
    from mindscience.distributed.finalize import GradientFinalizer
    from mindscience.distributed.models import GPTModel

    started = time.perf_counter()
    m = int(case.get("microbatches", 1))
    mode = case.get("mode", "pynative")
    cfg = small_config(**case.get("config", {}))
    dp = manager.get_data_parallel_group()
    ids, labels = global_batch(cfg, dp.size * m * MICRO_BATCH, seed)
    rows = m * MICRO_BATCH
    mine = slice(dp.rank * rows, (dp.rank + 1) * rows)
    model = GPTModel(cfg, seed=seed)
    loss, grads = model.forward_backward(ids[mine], labels[mine], num_microbatches=m, mode=mode)
    metrics = model.moe_metrics()
    params = model.trainable_params()
    grads = GradientFinalizer(params)(tuple(grads))
    pp = manager.get_pipeline_parallel_group()
    last = pp.rank == pp.size - 1
    import mindspore as ms

    value = ms.Tensor(np.array([float(loss.asnumpy()) if last else 0.0], np.float32))
    if pp.size > 1:
        value = C.all_reduce(value, pp)
    loss = float(C.all_reduce(value, dp).asnumpy()[0]) / dp.size
    parallel_s = time.perf_counter() - started
    # The dense model: the whole global batch in dp * m micro-batches of the same rows
    # (capacity), or in one (aux loss over the step's tokens).
    dense = GPTModel(cfg, seed=seed, parallel=False)
    dense_m = dp.size * m if case.get("same_microbatches") else 1
    dense_loss, dense_grads = dense.forward_backward(ids, labels, num_microbatches=dense_m,
                                                     mode="pynative")
    dense_metrics = dense.moe_metrics()
    want = {p.name: (p, g.asnumpy()) for p, g in zip(dense.trainable_params(), dense_grads)}
    errors, weight_errors = {}, {}
    for p, g in zip(params, grads):
        dense_p, dense_g = want[p.name]
        shape = tuple(dense_p.shape)
        errors[p.name] = _rel(gather_global(manager, p, g.asnumpy(), shape), dense_g)
        weight_errors[p.name] = float(np.max(np.abs(
            gather_global(manager, p, p.asnumpy(), shape) - dense_p.asnumpy())))
    worst = max(errors, key=errors.get)
    dense_loss = float(dense_loss.asnumpy())
    loss_err = abs(loss - dense_loss) / abs(dense_loss)
    # The aux loss of each MoE layer here against the dense model's same layer.
    aux = {int(i): float(a) for i, a in zip(metrics["layers"], metrics["aux_loss"])}
    dense_aux = {int(i): float(a) for i, a in zip(dense_metrics["layers"], dense_metrics["aux_loss"])}
    aux_err = max((abs(aux[i] - dense_aux[i]) / max(abs(dense_aux[i]), 1e-30) for i in aux), default=0.0)
    expert_names = sorted(p.name for p in params if getattr(p, "expert_parallel", False))
    ok = (loss_err <= 1e-5 and errors[worst] <= 1e-5 and max(weight_errors.values()) == 0.0
          and aux_err <= 1e-5 and len(expert_names) > 0)
    return {
        "check": "moe_model.parity", "group": "world", "case": case["name"], "mode": mode,
        "microbatches": m, "dense_microbatches": dense_m, "layer_indices": list(model.layer_indices),
        "loss": loss, "dense_loss": dense_loss, "loss_rel_err": loss_err,
        "aux_loss": aux, "dense_aux_loss": dense_aux, "aux_rel_err": aux_err,
        "tokens": metrics["tokens"].tolist(), "dropped": metrics["dropped"].tolist(),
        "dense_dropped": dense_metrics["dropped"].tolist(),
        "max_grad_rel_err": errors[worst], "worst_param": worst, "expert_params": expert_names,
        "local_expert_shape": [list(p.shape) for p in params if getattr(p, "expert_parallel", False)][:1],
        "max_weight_err": max(weight_errors.values()), "compared": sorted(errors),
        "dense_params": sorted(want), "parallel_s": round(parallel_s, 2),
        "seconds": round(time.perf_counter() - started, 2), "passed": bool(ok),
    }


@check("moe_model.parity")
def parity(ctx: CheckContext, layout=None, cases=(), seed: int = 3) -> list:
    """Each case's MoE GPTModel step at ``layout`` vs the dense model (losses, aux, gradients)."""
    manager = ensure_manager(ctx)
    init_layout(manager, layout or {})
    out = [_parity_case(manager, c, seed) for c in cases]
    for r in out:
        r["layout"] = _label(layout or {})
    return out


# ------------------------------------------------------------------ training, checkpoints
def train_specs(**model_overrides):
    """(ModelSpec, TrainingSpec) of the small tiny-moe."""
    from dataclasses import replace

    from mindscience.distributed.costmodel.spec import load_workload
    from mindscience.distributed.models.config import resolve_model_file

    work = load_workload(resolve_model_file("tiny-moe"))
    fields = {**SMALL, **TRAIN, **model_overrides}
    return replace(work.model, **fields), work.training


def options(**kw):
    from mindscience.distributed.training.options import TrainOptions

    base = {"steps": 5, "micro_batch_size": MICRO_BATCH, "global_batch_size": GLOBAL_BATCH,
            "mode": "pynative", "seed": 5, "lr": 1e-3}
    return TrainOptions(**{**base, **kw})


def _steps(trainer, first: int, count: int) -> list:
    rows = []
    for k in range(first, first + count):
        row = trainer.train_step(k)
        rows.append({key: row.get(key) for key in ("step", "loss", "aux_loss", "max_load", "dropped_tokens")})
    return rows


@check("moe_model.train")
def train(ctx: CheckContext, layout=None, zero_stage: int = 0, steps: int = 5, model=None,
          global_batch_size: int = GLOBAL_BATCH) -> list:
    """``steps`` steps of ``Trainer`` at ``layout`` and ``zero_stage``: one micro-batch of
    ``global_batch_size / dp`` rows per dp rank (the aux loss is the global batch's)."""
    import mindspore as ms

    from mindscience.distributed.training.loop import Trainer

    manager = ensure_manager(ctx)
    lay = init_layout(manager, layout or {})
    ms.set_context(mode=ms.PYNATIVE_MODE)
    started = time.perf_counter()
    opts = options(steps=steps, zero_stage=zero_stage, micro_batch_size=global_batch_size // lay.dp,
                   global_batch_size=global_batch_size)
    trainer = Trainer(*train_specs(**(model or {})), opts)
    rows = _steps(trainer, 0, steps)
    ok = all(np.isfinite(r["loss"]) and r["aux_loss"] is not None for r in rows)
    return [{"check": "moe_model.train", "group": "world", "layout": _label(layout or {}),
             "zero_stage": zero_stage, "steps": rows, "global_batch_size": opts.global_batch_size,
             "seconds": round(time.perf_counter() - started, 2), "passed": bool(ok)}]


@check("moe_model.checkpoint")
def checkpoint_resume(ctx: CheckContext, folder: str, first: dict, then: dict, save_after: int = 3,
                      steps: int = 5, zero_stage: int = 1, global_batch_size: int = GLOBAL_BATCH) -> list:
    """Train ``save_after`` steps at ``first`` (ZeRO ``zero_stage``) and save; rank 0
    reshards the checkpoint to ``then`` offline; resume at ``then`` and train to ``steps``."""
    import mindspore as ms

    from mindscience.distributed import checkpoint
    from mindscience.distributed.topology.layout import Layout
    from mindscience.distributed.training.loop import Trainer

    manager = ensure_manager(ctx)
    ms.set_context(mode=ms.PYNATIVE_MODE)
    started = time.perf_counter()
    specs = train_specs()
    lay = init_layout(manager, first)
    opts = options(steps=steps, zero_stage=zero_stage, micro_batch_size=global_batch_size // lay.dp,
                   global_batch_size=global_batch_size)
    trainer = Trainer(*specs, opts)
    before = _steps(trainer, 0, save_after)
    saved = trainer.save(os.path.join(folder, "first"), save_after)
    resharded = os.path.join(folder, "resharded")
    target = Layout(world_size=lay.world_size, tp=then.get("tp", 1), cp=then.get("cp", 1),
                    pp=then.get("pp", 1), ep=then.get("ep", 1), etp=then.get("etp"))
    if ctx.rank == 0:
        checkpoint.reshard(saved, resharded, target)
    lay2 = init_layout(manager, then)  # its collectives wait for rank 0's reshard
    opts2 = options(steps=steps, zero_stage=0, micro_batch_size=opts.global_batch_size // lay2.dp,
                    global_batch_size=opts.global_batch_size)
    resumed = Trainer(*specs, opts2)
    info = resumed.resume(resharded)
    after = _steps(resumed, resumed.first_step, steps - save_after)
    return [{"check": "moe_model.checkpoint", "group": "world", "first": _label(first),
             "then": _label(then), "saved": saved, "resharded": resharded,
             "resumed_step": info["step"], "saved_layout": info["layout"], "steps": before + after,
             "loaded": len(info["loaded"]), "seconds": round(time.perf_counter() - started, 2),
             "passed": bool(info["step"] == save_after and all(np.isfinite(r["loss"]) for r in after))}]


@check("moe_model.errors")
def errors(ctx: CheckContext, layout=None) -> list:
    """Experts not divisible by ep: a typed error on every rank, before any collective."""
    from mindscience.distributed.models import GPTModel

    manager = ensure_manager(ctx)
    init_layout(manager, layout or {})
    try:
        GPTModel(small_config(num_moe_experts=6), seed=0)
        raised, message = None, ""
    except ValueError as err:
        raised, message = type(err).__name__, str(err)
    return [{"check": "moe_model.errors", "group": "world", "case": "experts_vs_ep", "raised": raised,
             "message": message, "passed": raised is not None}]
