"""Bench check of kept stage forwards: ``bench.pipeline_kept`` (see bench_pipeline_kept.py)."""

from __future__ import annotations

import statistics
import time

import numpy as np

from mindscience.distributed.harness.registry import CheckContext, check


def _compile_both(model, x0, t0):
    """Compile each chunk's kept and recomputing paths here, with only its own peers (a
    stage compiling inside the pipeline makes its neighbour's transfer time out on CPU)."""
    import mindspore as ms
    from mindspore import ops

    from mindscience.distributed.pipeline.stage_fns import stage_fns

    p, stages = model.pp.size, model.pp.size * model.virtual_stages
    rows = int(x0.shape[0])
    if model.init.sequence_parallel:  # tp > 1: each stage hands on its own rows
        rows //= model.tp.size
    hidden = ops.zeros((rows, int(x0.shape[1]), model.config.hidden_size), model.init.dtype)
    for c, chunk in enumerate(model.chunks):
        k = c * p + model.pp.rank
        first, last = k == 0, k == stages - 1
        fns = stage_fns(chunk, model.loss_fn, "jit", first, last)
        x = x0 if first else hidden
        if last:
            fns.loss(x, t0, ms.Tensor(0.0, ms.float32), fns.zeros(), ops.zeros((), ms.float32))
            continue
        y, pending = fns.keep(x)
        fns.backward_kept(pending, ops.zeros(y.shape, y.dtype), fns.zeros())
        y = fns.forward(x)
        fns.backward(x, ops.zeros(y.shape, y.dtype), fns.zeros())


@check("bench.pipeline_kept")
def pipeline_kept(ctx: CheckContext, layout=None, preset="tiny-gpt", microbatches=8,
                  micro_batch=2, schedule="1f1b", mode="pynative", steps=6, warmup=1) -> list:
    """tiny-gpt's pipeline step (``GPTModel``'s stages through ``forward_backward``) with the
    stage forwards kept (``recompute="none"``) and recomputed (``"full"``), steps in turn."""
    import mindspore as ms

    from mindscience.distributed.harness.checks.p2p import under_layout
    from mindscience.distributed.models import GPTModel, TransformerConfig
    from mindscience.distributed.pipeline import runtime
    from mindscience.distributed.pipeline.runtime import forward_backward

    def body(manager):
        cfg = TransformerConfig.from_model_spec(preset)
        model = GPTModel(cfg, seed=3)
        dp = manager.get_data_parallel_group()
        rows = microbatches * micro_batch
        rng = np.random.default_rng(7 + dp.rank)
        ids = rng.integers(0, cfg.vocab_size, (rows, cfg.seq_length)).astype(np.int32)
        labels = rng.integers(0, cfg.vocab_size, (rows, cfg.seq_length)).astype(np.int32)
        xs = [ms.Tensor(a) for a in np.split(model.shard_batch(ids), microbatches, axis=1)]
        ts = [ms.Tensor(a) for a in np.split(model.shard_batch(labels), microbatches, axis=1)]
        stage = model.chunks if schedule == "interleaved" else model.chunks[0]
        if mode == "jit":
            _compile_both(model, xs[0], ts[0])
        times = {"none": [], "full": []}
        losses, what = {}, {}
        for k in range(warmup + steps):
            for how in ("none", "full"):
                ms.runtime.synchronize()
                t0 = time.perf_counter()
                loss, _ = forward_backward(stage, xs, ts, model.loss_fn, schedule=schedule,
                                           mode=mode, group=model.pp, recompute=how)
                loss = float(loss.asnumpy())
                dt = time.perf_counter() - t0
                what[how] = runtime.last_recompute()[0]
                losses[how] = loss
                if k >= warmup:
                    times[how].append(dt)
        kept, full = statistics.median(times["none"]), statistics.median(times["full"])
        return [{"check": "bench.pipeline_kept", "group": "world", "pp": model.pp.size,
                 "schedule": schedule, "mode": mode, "microbatches": microbatches,
                 "kept_s": kept, "full_s": full, "ratio": kept / full,
                 "kept_all": times["none"], "full_all": times["full"],
                 "what_runs": what, "loss_kept": losses["none"], "loss_full": losses["full"],
                 "passed": what["none"] == "none" and what["full"] == "full"
                 and abs(losses["none"] - losses["full"]) <= 1e-5 * abs(losses["full"])}]

    return under_layout(ctx, layout, body)
