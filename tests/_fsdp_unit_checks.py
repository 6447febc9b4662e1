"""Worker-side check of ``fully_shard``'s units (FSDP2): ``fsdp.units``, in the fsdp job.

The parity model of ``_fsdp_checks`` with three blocks, each block its own unit and the
root (embedding, head) one more. For each (reshard_after_forward, prefetch) asked, one
warm-up step records the unit order (prefetch needs the previous forward's), then one
measured step gives: the loss and every gradient shard against the whole model's
(GradientFinalizer), each unit's gathers and reduce-scatters, the backend collectives of
the step (one per unit gather and one per unit reduce-scatter: not one per parameter),
and the peak of gathered bytes against ``rules.peak_gathered_bytes``.

Kept out of _fsdp_checks.py to keep that file under ~500 lines.
"""

from __future__ import annotations

import numpy as np

from mindscience.distributed.harness.registry import check

from _fsdp_checks import _KEEP, _build, _data, _layout, _shard_error, _value_and_grad


def _measure(net, params, mode, ids, tgt):
    """(loss, finalized shard gradients, per-unit counts, collectives, peak, alive after)."""
    from mindscience.distributed import GradientFinalizer, counters
    from mindscience.distributed.fsdp import (gathered_bytes, peak_gathered_bytes,
                                              reset_gathered_bytes, units_of)

    _value_and_grad(mode, net, params, ids, tgt)  # records the order (and compiles)
    reset_gathered_bytes()
    calls = counters.call_count()
    loss, grads = _value_and_grad(mode, net, params, ids, tgt)
    calls = counters.call_count() - calls
    grads = GradientFinalizer(params)(grads)
    counts = [dict(u.counts) for u in units_of(net)]
    return loss, grads, counts, calls, peak_gathered_bytes(), gathered_bytes()


@check("fsdp.units")
def units(ctx, tp=1, combos=((True, True), (True, False), (False, True), (False, False)),
          modes=("pynative",), layers=3):
    """Per-unit gathers, reshard and prefetch vs the whole model (values and counts)."""
    import mindspore as ms

    from mindscience.distributed import GradientFinalizer, manager
    from mindscience.distributed.fsdp import rules, units_of

    _layout(tp=tp)
    sp = tp > 1
    dp_rank = manager.get_data_context_parallel_group().rank
    ids, tgt = (ms.Tensor(a) for a in _data(dp_rank))
    ref = _build(7, sp, layers=layers)
    ref_params = ref.trainable_params()
    ref_loss, ref_grads = _value_and_grad("pynative", ref, ref_params, ids, tgt)
    ref_grads = GradientFinalizer(ref_params)(ref_grads)
    ref_by_name = {p.name: g.asnumpy() for p, g in zip(ref_params, ref_grads)}
    records = []
    for mode in modes:
        for rs, pf in combos:
            net = _build(7, sp, shard=True, reshard=rs, prefetch=pf, units=True, layers=layers)
            _KEEP.append(net)
            params = net.trainable_params()
            loss, grads, counts, calls, peak, alive = _measure(net, params, mode, ids, tgt)
            worst = 0.0
            for p, g in zip(params, grads):
                worst = max(worst, _shard_error(ref_by_name[p.name], g.asnumpy(), p.fsdp)[0])
            found = units_of(net)
            leaves = [u for u in found if u.cell is not net]  # registration = forward order
            root = [u for u in found if u.cell is net]
            figure = rules.peak_gathered_bytes([u.bytes for u in leaves], root[0].bytes, rs, pf)
            records.append({
                "check": "fsdp.units", "group": f"tp{tp}-dp{ctx.world_size // tp}", "mode": mode,
                "reshard": rs, "prefetch": pf, "loss": float(loss), "ref_loss": float(ref_loss),
                "loss_error": abs(float(loss) - float(ref_loss)) / abs(float(ref_loss)),
                "max_error": worst, "params": len(params), "units": len(found),
                "unit_reshards": [u.reshard for u in found], "unit_bytes": [u.bytes for u in found],
                "counts": counts, "collectives": calls, "peak_bytes": peak, "figure": figure,
                "alive_after": alive, "grads": {p.name: float(np.abs(g.asnumpy()).sum())
                                                for p, g in zip(params, grads)},
                "passed": worst < 1e-6 and (mode != "pynative" or (peak == figure and alive == 0)),
            })
    return records
