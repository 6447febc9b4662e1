"""Test-only harness checks of gradient finalization (``msdist verify`` runs none of them).

Imported by the worker through ``spec["modules"]`` (``["_training_checks"]``, tests/ on the
ranks' PYTHONPATH; see tests/test_mappings.py):

* ``training.finalize``: :class:`~mindscience.distributed.finalize.GradientFinalizer`
  on known per-rank gradients (float32 and bfloat16, some parameters marked
  ``sequence_parallel``), per-tensor and bucketed, in each execution mode, against the
  numpy sum over tp and mean over dp-cp computed from the plan's groups. Exact: the
  inputs are small integers times powers of two.
* ``training.finalize_embedding``: with pp, tied (``shared_embedding``) gradients summed
  over the embedding group (first + last stage), then every gradient averaged over dp-cp,
  against numpy, under ``layout`` (default: the layout in force).
"""

from __future__ import annotations

import numpy as np

from mindscience.distributed.harness.checks.groups import ensure_manager, layout_label
from mindscience.distributed.harness.checks.modes import check_mode
from mindscience.distributed.harness.checks.p2p import under_layout
from mindscience.distributed.harness.registry import CheckContext, check

# (shape, dtype, sequence_parallel): > 2 buckets' worth of small tensors when the bucket
# is 64 bytes, one large tensor, a bfloat16 one.
FINALIZE_PARAMS = (
    ((4, 3), "float32", False),
    ((5,), "float32", True),
    ((2, 2, 2), "float32", False),
    ((7,), "bfloat16", True),
    ((3,), "float32", True),
    ((6, 4), "float32", False),
    ((4,), "bfloat16", False),
)


def _grad_values(world_rank: int, index: int, shape) -> np.ndarray:
    n = int(np.prod(shape))
    # Small integers: sums over <= 8 ranks and the division by a power of two are exact
    # in float32 and bfloat16 (|values| <= 64 keep 8 significant bits).
    return ((np.arange(n) % 5 + world_rank + index) % 8).reshape(shape).astype(np.float32)


def finalize_reference(layout, world_rank: int, params=FINALIZE_PARAMS) -> list:
    """The finalized gradients of ``world_rank`` from the layout's groups (numpy)."""
    dpcp = layout.group_of(world_rank, "dp-cp")
    out = []
    for i, (shape, _, sp) in enumerate(params):
        acc = np.zeros(shape, np.float64)
        for member in dpcp:
            if sp and layout.tp > 1:
                acc += sum(_grad_values(k, i, shape) for k in layout.group_of(member, "tp"))
            else:
                acc += _grad_values(member, i, shape)
        out.append(acc / len(dpcp))
    return out


@check("training.finalize")
def finalize(ctx: CheckContext, modes=("pynative", "jit"), bucket_sizes_mb=(0, 6.1e-5, 32.0)) -> list:
    """GradientFinalizer vs numpy for each mode x bucket size (0 = one per tensor).

    ``6.1e-5`` MiB (64 bytes) splits the small parameters over several buckets.
    """
    import mindspore as ms

    from mindscience.distributed.finalize import GradientFinalizer

    manager = ensure_manager(ctx)
    layout = manager.get_layout()
    dtypes = {"float32": ms.float32, "bfloat16": ms.bfloat16}
    params = []
    for i, (shape, dt, sp) in enumerate(FINALIZE_PARAMS):
        p = ms.Parameter(ms.Tensor(np.zeros(shape, np.float32), dtypes[dt]), name=f"p{i}")
        if sp:
            p.sequence_parallel = True
        params.append(p)
    grads = tuple(ms.Tensor(_grad_values(ctx.rank, i, shape), dtypes[dt])
                  for i, (shape, dt, _) in enumerate(FINALIZE_PARAMS))
    want = finalize_reference(layout, ctx.rank)
    records = []
    for mode in modes:
        check_mode(mode)
        for mb in bucket_sizes_mb:
            fin = GradientFinalizer(params, bucket_size_mb=mb)
            got = _call(fin, grads, mode)
            errors = []
            dtype_ok = True
            for g, w, p in zip(got, want, params):
                dtype_ok = dtype_ok and g.dtype == p.dtype and tuple(g.shape) == tuple(p.shape)
                errors.append(float(np.max(np.abs(g.astype(ms.float32).asnumpy() - w))))
            err = max(errors)
            records.append({
                "check": "training.finalize", "group": "tp+dp-cp", "mode": mode,
                "bucket_size_mb": mb, "buckets": [len(fin.tp_buckets), len(fin.dp_buckets)],
                "layout": layout_label(layout), "max_error": err,
                "passed": bool(err == 0.0 and dtype_ok), "dtypes_kept": bool(dtype_ok),
            })
    return records


def _call(fin, grads, mode):
    import mindspore as ms

    if mode == "jit":
        return ms.jit(fin.construct)(grads)
    if mode == "graph":
        ms.set_context(mode=ms.GRAPH_MODE)
        try:
            return fin(grads)
        finally:
            ms.set_context(mode=ms.PYNATIVE_MODE)
    return fin(grads)


@check("training.finalize_embedding")
def finalize_embedding(ctx: CheckContext, modes=("pynative", "jit"), layout=None) -> list:
    """GradientFinalizer with pp: tied (``shared_embedding``) gradients summed over the
    embedding group (first + last stage), then every gradient averaged over dp-cp, vs numpy."""
    return under_layout(ctx, layout, lambda manager: _finalize_embedding(ctx, manager, modes))


def _gvals(world_rank, index, shape):
    n = int(np.prod(shape))
    return ((np.arange(n) % 5 + world_rank + 3 * index) % 8).reshape(shape).astype(np.float32)


def _finalize_embedding(ctx, manager, modes):
    import mindspore as ms

    from mindscience.distributed.finalize import GradientFinalizer

    lay = manager.get_layout()
    shapes = ((4, 3), (5,), (2, 2))
    tied = (True, False, True)
    params = []
    for k, (shape, t) in enumerate(zip(shapes, tied)):
        prm = ms.Parameter(ms.Tensor(np.zeros(shape, np.float32)), name=f"e{k}")
        if t:
            prm.shared_embedding = True
        params.append(prm)
    grads = tuple(ms.Tensor(_gvals(ctx.rank, k, s)) for k, s in enumerate(shapes))

    def ends(rank):
        pp = lay.group_of(rank, "pp")
        return [pp[0], pp[-1]] if len(pp) > 1 and rank in (pp[0], pp[-1]) else [rank]

    dpcp = lay.group_of(ctx.rank, "dp-cp")
    want = []
    for k, (shape, t) in enumerate(zip(shapes, tied)):
        acc = np.zeros(shape, np.float64)
        for d in dpcp:
            acc += sum(_gvals(e, k, shape) for e in ends(d)) if t else _gvals(d, k, shape)
        want.append(acc / len(dpcp))
    emb = manager.get_embedding_group()
    records = []
    for mode in modes:
        fin = GradientFinalizer(params)
        got = _call(fin, grads, mode)
        err = max(float(np.abs(g.asnumpy() - w).max()) for g, w in zip(got, want))
        records.append({"check": "training.finalize_embedding", "group": "embedding+dp-cp",
                        "mode": mode, "embedding_group": list(emb.ranks), "max_error": err,
                        "passed": bool(err == 0.0)})
    return records
