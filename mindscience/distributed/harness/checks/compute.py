"""Compute probe: the dense matmul rate of each device, for ``--calibrate``.

Each rank multiplies two ``(n, n)`` matrices in the run's dtype ``iters`` times after a
warm-up, synchronizes, and reports ``2 n^3 * iters / seconds`` as TFLOP/s. All ranks run
it at the same moment, so on a shared machine (CPU ranks) each one measures the rate it
gets while the others compute too, which is what a training step sees. The product is
also checked: the inputs are small integers, so every dot product is exact in float32
and the error measures only the output dtype's rounding.

The report keeps the slowest rank's rate (``compute.tflops``); ``msdist plan/suggest
--calibrate report.json`` turns it into ``peak_tflops * compute_efficiency``.
"""

from __future__ import annotations

import time

import numpy as np

from ..registry import CheckContext, check

# Relative error allowed on the output, per dtype: the rounding of one output element.
RTOL = {"float32": 0.0, "float16": 2.0**-10, "bfloat16": 2.0**-7}


def _operands(n: int) -> tuple[np.ndarray, np.ndarray]:
    # Values in -2..2: |dot products| <= 4n, exact in float32 for any n used here.
    i = np.arange(n * n, dtype=np.int64)
    a = ((i * 7) % 5 - 2).reshape(n, n)
    b = ((i * 3 + 1) % 5 - 2).reshape(n, n)
    return a.astype(np.float32), b.astype(np.float32)


@check("compute.matmul")
def compute_matmul(ctx: CheckContext, size: int = 1024, iters: int = 3, warmup: int = 1, dtype: str = "float32"):
    """Time ``iters`` (size x size) @ (size x size) products; one record with ``tflops``."""
    import mindspore as ms
    from mindspore import ops

    a_np, b_np = _operands(int(size))
    expected = a_np.astype(np.float64) @ b_np.astype(np.float64)
    used = dtype
    a, b = ms.Tensor(a_np, getattr(ms, dtype)), ms.Tensor(b_np, getattr(ms, dtype))
    try:
        ops.matmul(a, b).asnumpy()
    except (RuntimeError, TypeError, ValueError):
        # CPU has no half-precision matmul kernel: measure float32, and say so in the record.
        used = "float32"
        a, b = ms.Tensor(a_np), ms.Tensor(b_np)
    ms.runtime.synchronize()
    for _ in range(int(warmup)):
        out = ops.matmul(a, b)
    ms.runtime.synchronize()
    start = time.perf_counter()
    for _ in range(int(iters)):
        out = ops.matmul(a, b)
    ms.runtime.synchronize()
    elapsed = time.perf_counter() - start
    got = out.astype(ms.float32).asnumpy()
    scale = np.maximum(np.abs(expected), 1.0)
    error = float(np.max(np.abs(got - expected) / scale))
    flops = 2.0 * size**3 * int(iters)
    return {
        "check": "compute.matmul",
        "group": "world",
        "passed": error <= RTOL[used],
        "max_error": error,
        "tflops": flops / elapsed / 1e12,
        "dtype": used,
        "requested_dtype": dtype,
        "shape": [int(size)] * 3,
        "time_us": elapsed / int(iters) * 1e6,
    }
