"""Worker-side check of GPTModel at ZeRO stage 3 (``fully_shard``), in the fsdp job.

``fsdp.gpt``: at each layout, a small GPTModel (tied embedding and head, learned
positions, sequence parallelism at tp > 1, vocabulary and rows that the dp group does
not divide, so shards are padded) is trained ``steps`` AdamW steps on one batch twice from
the same seed: with ``DistributedOptimizer(zero_stage=0)``, and after
``fully_shard(model)`` with ``zero_stage=3``. Per mode, the record holds both loss
curves of this rank (the last pipeline stage's; None elsewhere) and the largest
difference between the stage-3 weights, gathered, and the stage-0 weights after the
last step.

Kept out of _fsdp_checks.py only to keep that file under ~500 lines; the job imports
both modules.
"""

from __future__ import annotations

import time

import numpy as np

from mindscience.distributed.harness.registry import check

GPT = dict(num_layers=2, hidden_size=16, num_attention_heads=4, ffn_hidden_size=24,
           seq_length=8, vocab_size=34)
ROWS, MICRO = 4, 2  # sequences per dp rank and step, micro-batches
# Small, as fsdp.train's: Adam moves an entry whose gradient is ~0 by ~lr whatever the
# rounding of the two reductions.
LR = 1e-3


def _batch(dp_rank):
    rng = np.random.default_rng(100 + dp_rank)
    ids = rng.integers(0, GPT["vocab_size"], (ROWS, GPT["seq_length"])).astype(np.int32)
    return ids, np.roll(ids, -1, axis=1)


def _train(stage, mode, steps, dp_rank):
    from mindscience.distributed.fsdp import fully_shard
    from mindscience.distributed.models import GPTModel, TransformerConfig
    from mindscience.distributed.optimizer import DistributedOptimizer

    model = GPTModel(TransformerConfig(**GPT), seed=3)
    if stage == 3:
        fully_shard(model)
    params = model.trainable_params()
    opt = DistributedOptimizer(params, optimizer="adamw", lr=LR, zero_stage=stage)
    ids, labels = _batch(dp_rank)  # the same batch every step: the loss must fall
    losses = []
    t0 = time.perf_counter()
    for _ in range(steps):
        loss, grads = model.forward_backward(ids, labels, num_microbatches=MICRO, mode=mode)
        opt(grads)
        losses.append(None if loss is None else float(loss.asnumpy()))
    seconds = time.perf_counter() - t0
    weights = {}
    for p in params:
        info = getattr(p, "fsdp", None)
        full = p if info is None or info.group.size == 1 else p._fsdp_gathers[0](p)
        value = full.asnumpy()
        weights[p.name] = value.reshape(info.full_shape) if info is not None else value
    return losses, weights, seconds


@check("fsdp.gpt")
def gpt(ctx, layouts=({"tp": 1}, {"tp": 2}, {"tp": 1, "pp": 2}), modes=("pynative", "jit"),
        steps=3):
    """GPTModel at ZeRO stage 3 vs stage 0: losses and weights (see the module doc).

    ``layouts``: ``{"tp", "pp"}`` sizes (dp the rest), each with optional ``"modes"``
    (default ``modes``)."""
    from _fsdp_checks import _layout  # noqa: PLC0415 - the sibling check module

    from mindscience.distributed import manager

    records = []
    for spec in layouts:
        tp, pp = spec.get("tp", 1), spec.get("pp", 1)
        _layout(tp=tp, pp=pp)
        dp = manager.get_data_context_parallel_group()
        for mode in spec.get("modes", modes):
            ref_losses, ref_w, ref_s = _train(0, mode, steps, dp.rank)
            losses, w, s = _train(3, mode, steps, dp.rank)
            have = [x for x in ref_losses if x is not None]
            loss_error = max((abs(a - b) / abs(b) for a, b in zip(losses, ref_losses) if b is not None),
                             default=0.0)
            weight_error = max(float(np.max(np.abs(w[k] - ref_w[k]))) / max(1.0, float(np.max(np.abs(ref_w[k]))))
                               for k in ref_w)
            records.append({
                "check": "fsdp.gpt", "group": f"tp{tp}-dp{dp.size}-pp{pp}", "mode": mode,
                "losses": losses, "ref_losses": ref_losses, "loss_error": loss_error,
                "max_error": weight_error, "names_same": sorted(w) == sorted(ref_w),
                "seconds": {"stage0": round(ref_s, 2), "stage3": round(s, 2)},
                "passed": sorted(w) == sorted(ref_w) and loss_error <= 1e-5 and weight_error <= 1e-5
                and (not have or have[-1] < have[0]),
            })
    return records
