"""Bandwidth sweep of the four collectives on every group, nccl-tests style.

Sizes follow nccl-tests' meaning of "size" (``bytes`` below):

* all_reduce: the buffer each rank reduces (input = output = bytes);
* all_gather: the gathered output (each rank contributes bytes / G);
* reduce_scatter: the input each rank reduces (each rank keeps bytes / G);
* all_to_all: each rank's send buffer (= its receive buffer).

The expert groups of a Mixture-of-Experts layout (``a2a_groups``: ``ep``, ``etp-ep``) get
all-to-all rows only (a MoE layer's token dispatch and combine), in each of ``a2a_modes``:
PyNative, and ``ms.jit`` where the all-to-all is one compiled graph. busbw is nccl-tests'
alltoall_perf: ``algbw * (n-1)/n``.

Each rank times ``iters`` back-to-back calls after ``warmup`` calls and one barrier,
synchronizing the device at the end, and reports its mean time per call; the parent
keeps the slowest rank's time, as nccl-tests does. The last output is checked against
the exact expected values ("wrong" = number of mismatching elements): inputs are small
integers, exact in float32, float16 and bfloat16.
"""

from __future__ import annotations

import time

import numpy as np

from ..registry import CheckContext, check
from .groups import distinct_groups

OPS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all")
A2A_MODES = ("pynative", "jit")
DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}
# Relative tolerance per dtype: values are exact small integers; this only absorbs
# rounding when sums grow past what bfloat16/float16 hold exactly in huge groups.
DTYPE_RTOL = {"float32": 0.0, "float16": 2.0**-10, "bfloat16": 2.0**-7}


def _value(rank: int, j) -> np.ndarray:
    # Small positive integers that differ by rank and position; <= 8 so that sums over
    # 32 ranks stay exact in bfloat16.
    return (np.asarray(j) * 3 + rank * 5) % 8 + 1


def _inputs(op: str, g, numel: int) -> tuple[np.ndarray, np.ndarray]:
    """(this rank's input, its exact expected output) for ``op`` on group ``g``.

    ``numel`` is the element count of the nccl-tests size and is a multiple of G.
    """
    G, r = g.size, g.rank
    if op == "all_reduce":
        j = np.arange(numel)
        x = _value(r, j)
        expected = sum(_value(k, j) for k in range(G))
    elif op == "all_gather":
        n = numel // G
        x = _value(r, np.arange(n))
        expected = np.concatenate([_value(k, np.arange(n)) for k in range(G)])
    elif op == "reduce_scatter":
        j = np.arange(numel)
        x = _value(r, j)
        n = numel // G
        expected = sum(_value(k, j) for k in range(G))[r * n:(r + 1) * n]
    elif op == "all_to_all":
        # (m, G): column j goes to group rank j; rank r receives column r of every
        # rank, stacked along dim 0 -> (G*m, 1).
        m = numel // G
        x = _value(r, np.arange(m * G)).reshape(m, G)
        expected = np.concatenate([_value(k, np.arange(m * G)).reshape(m, G)[:, r:r + 1] for k in range(G)], 0)
    else:
        raise ValueError(f"unknown op {op!r}: expected one of {', '.join(OPS)}")
    return x.astype(np.float32), expected.astype(np.float32)


def _run(op: str, x, g):
    from mindscience.distributed import collectives as C

    if op == "all_reduce":
        return C.all_reduce(x, g)
    if op == "all_gather":
        return C.all_gather(x, g, 0)
    if op == "reduce_scatter":
        return C.reduce_scatter(x, g)
    return C.all_to_all(x, g, -1, 0)


# Compiled all-to-alls stay referenced for the life of the process: MindSpore caches
# compiled functions by object identity (see modes._COMPILED_KEEP_ALIVE).
_COMPILED: dict = {}


def _compiled_all_to_all(g):
    """``ms.jit`` of the all-to-all of :func:`_run` on ``g`` (the compiled kernel, one graph)."""
    import mindspore as ms

    from mindscience.distributed import collectives as C

    key = (g.backend_name, g.size, g.rank)
    fn = _COMPILED.get(key)
    if fn is None:
        kernels = C.kernels(g, True)

        def all_to_all(x):
            return kernels.all_to_all(x, 1, 0)

        fn = _COMPILED[key] = ms.jit(all_to_all)
    return fn


def _plan(label: str, dense_keys, a2a_keys, ops, a2a_modes) -> list[tuple[str, str]]:
    """``(op, mode)`` pairs to time on a group labelled ``label`` (``"tp=ep=etp-ep"``).

    A group any dense key (or ``world``) names gets every op eagerly; an expert group
    gets the all-to-all in each of ``a2a_modes`` (once when it is also a dense group).
    """
    keys = label.split("=")
    pairs = [(op, "pynative") for op in ops] if any(k in dense_keys for k in keys) else []
    if any(k in a2a_keys for k in keys):
        pairs += [("all_to_all", mode) for mode in a2a_modes if ("all_to_all", mode) not in pairs]
    return pairs


def _numel(nbytes: int, dtype: str, group_size: int) -> int:
    # Round down to whole elements, a multiple of the group size, at least G.
    n = max(nbytes // DTYPE_BYTES[dtype], group_size)
    return n - n % group_size


@check("bandwidth.sweep")
def bandwidth_sweep(
    ctx: CheckContext,
    groups=("tp", "cp", "dp", "pp", "dp-cp", "world"),
    ops=OPS,
    sizes=(1024, 65536, 1048576),
    iters=5,
    warmup=1,
    dtype="float32",
    a2a_groups=(),
    a2a_modes=("pynative",),
):
    """Time each op on each group and size; return one record per measurement.

    ``a2a_groups`` (e.g. ``("ep", "etp-ep")``) are timed with the all-to-all only, in each
    of ``a2a_modes`` (``pynative``, ``jit``); a group with the same ranks as one of
    ``groups`` is timed once under a label naming both (``"tp=ep=etp-ep"``).
    """
    import mindspore as ms

    from mindscience.distributed import collectives as C

    ms_dtype = getattr(ms, dtype)
    rtol = DTYPE_RTOL[dtype]
    records = []
    # The first synchronize() of a CPU process returns at once (it only logs that CPU is
    # "not supported"); spend it here so that every timed loop below really waits.
    ms.runtime.synchronize()
    from mindscience.distributed import manager

    bad_modes = [m for m in a2a_modes if m not in A2A_MODES]
    if bad_modes:
        raise ValueError(f"a2a_modes {list(a2a_modes)!r} are invalid: expected a subset of {', '.join(A2A_MODES)}")
    for label, g in distinct_groups(manager, list(groups) + list(a2a_groups)).items():
        if g.size == 1:
            continue  # nothing moves
        barrier = ms.Tensor(np.ones(g.size, np.float32))
        for op, mode in _plan(label, groups, a2a_groups, ops, a2a_modes):
            run = (lambda _op, x, g: _compiled_all_to_all(g)(x)) if mode == "jit" else _run
            for nbytes in sizes:
                numel = _numel(int(nbytes), dtype, g.size)
                x_np, expected = _inputs(op, g, numel)
                x = ms.Tensor(x_np, ms_dtype)
                for _ in range(max(int(warmup), 1 if mode == "jit" else 0)):  # jit: compile first
                    run(op, x, g)
                C.all_reduce(barrier, g).asnumpy()  # start together
                start = time.perf_counter()
                for _ in range(int(iters)):
                    out = run(op, x, g)
                ms.runtime.synchronize()
                got = out.astype(ms.float32).asnumpy().reshape(expected.shape)
                elapsed = (time.perf_counter() - start) / int(iters)
                diff = np.abs(got - expected)
                wrong = int(np.count_nonzero(diff > rtol * np.abs(expected)))
                records.append(
                    {
                        "check": "bandwidth",
                        "op": op,
                        "mode": mode,
                        "group": label,
                        "group_size": g.size,
                        "bytes": numel * DTYPE_BYTES[dtype],
                        "dtype": dtype,
                        "time_us": elapsed * 1e6,
                        "wrong": wrong,
                        "composed": C.is_composed(op),
                        "passed": wrong == 0,
                        "max_error": float(diff.max()) if diff.size else 0.0,
                    }
                )
    return records
