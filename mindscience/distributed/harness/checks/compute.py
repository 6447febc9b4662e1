"""Compute probe: the dense matmul rate of each device, for ``--calibrate``.

Each rank multiplies two ``(n, n)`` matrices in the run's dtype after a warm-up, times
enough products to measure the device rather than the launch of one kernel (at least
``iters``, and on an accelerator until ``min_seconds`` have passed, synchronizing before
reading the clock), and reports ``2 n^3 * products / seconds`` as TFLOP/s. The size
follows the backend (:func:`probe_settings`): a CPU rank multiplies 1024 x 1024 (a
fraction of a second); an Ascend or GPU device 8192 x 8192, where one product is ~1 TFLOP
and its ~10 us launch is noise, while 1024 would time mostly launches (~2 GFLOP a product
at hundreds of TFLOP/s is a few microseconds of work).

All ranks run it at the same moment, so on a shared machine (CPU ranks) each one
measures the rate it gets while the others compute too, which is what a training step
sees. The product is also checked on its first rows: the inputs are small integers, so
every dot product is exact in float32 and the error measures only the output dtype's
rounding.

The report keeps the slowest rank's rate (``compute.tflops``) and the shape used;
``msdist plan/suggest --calibrate report.json`` turns it into ``peak_tflops *
compute_efficiency``.
"""

from __future__ import annotations

import time

import numpy as np

from ..registry import CheckContext, check

# Relative error allowed on the output, per dtype: the rounding of one output element.
RTOL = {"float32": 0.0, "float16": 2.0**-10, "bfloat16": 2.0**-7}
# Per backend: matrix size, untimed products, least timed products, least timed seconds.
PROBE = {
    "CPU": {"size": 1024, "warmup": 1, "iters": 3, "min_seconds": 0.0},
    "accelerator": {"size": 8192, "warmup": 3, "iters": 10, "min_seconds": 0.2},
}
CHECKED_ROWS = 16  # rows of the product compared with float64 (all of them would cost O(n^3) on the host)
MAX_ITERS = 10_000


def probe_settings(device_target: str, size: int | None = None) -> dict:
    """``{"size", "warmup", "iters", "min_seconds"}`` of the probe on ``device_target``.

    ``CPU`` keeps the small probe; any other target (``Ascend``, ``GPU``) is an
    accelerator. ``size`` overrides the matrix size.

        >>> probe_settings("CPU")["size"], probe_settings("Ascend")["size"], probe_settings("GPU", 4096)["size"]
        (1024, 8192, 4096)
    """
    settings = dict(PROBE["CPU" if str(device_target).upper() == "CPU" else "accelerator"])
    if size is not None:
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ValueError(f"matmul size {size!r} is invalid: expected a positive integer, e.g. 4096.")
        settings["size"] = size
    return settings


def _operands(n: int) -> tuple[np.ndarray, np.ndarray]:
    """Two (n, n) float32 matrices of values in -2..2: |dot products| <= 4n, exact in float32.

    ``a[i, j] = (7 (i n + j)) mod 5 - 2`` and ``b[i, j] = (3 (i n + j) + 1) mod 5 - 2``,
    built from per-row and per-column residues so that an 8192 x 8192 probe needs no
    n^2 array of int64 indices.
    """
    rows, cols = np.arange(n, dtype=np.int64) * n, np.arange(n, dtype=np.int64)
    a = ((7 * rows % 5)[:, None] + (7 * cols % 5)[None, :]) % 5 - 2
    b = ((3 * rows % 5)[:, None] + ((3 * cols + 1) % 5)[None, :]) % 5 - 2
    return a.astype(np.float32), b.astype(np.float32)


def _timed(matmul, synchronize, iters: int, min_seconds: float) -> tuple[int, float, object]:
    """Run ``matmul`` at least ``iters`` times and until ``min_seconds`` passed; (count, seconds, last)."""
    count, elapsed, out = 0, 0.0, None
    batch = iters
    start = time.perf_counter()
    while True:
        for _ in range(batch):
            out = matmul()
        synchronize()  # an accelerator queues kernels: the clock means nothing before they finish
        count += batch
        elapsed = time.perf_counter() - start
        if elapsed >= min_seconds or count >= MAX_ITERS:
            return count, elapsed, out
        # Enough more products to reach min_seconds at the rate seen so far.
        batch = min(MAX_ITERS - count, max(1, int(count * (min_seconds / max(elapsed, 1e-9) - 1)) + 1))


@check("compute.matmul")
def compute_matmul(ctx: CheckContext, size: int | None = None, iters: int | None = None,
                   warmup: int | None = None, dtype: str = "float32", min_seconds: float | None = None):
    """Time (size x size) @ (size x size) products; one record with ``tflops`` and the ``shape`` used.

    Unset arguments come from :func:`probe_settings` for the rank's device target.
    """
    import mindspore as ms
    from mindspore import ops

    settings = probe_settings(ms.get_context("device_target"), size)
    size = settings["size"]
    iters = max(1, int(iters if iters is not None else settings["iters"]))
    warmup = max(0, int(warmup if warmup is not None else settings["warmup"]))
    min_seconds = float(min_seconds if min_seconds is not None else settings["min_seconds"])
    a_np, b_np = _operands(size)
    rows = min(CHECKED_ROWS, size)
    expected = a_np[:rows].astype(np.float64) @ b_np.astype(np.float64)
    used = dtype
    a, b = ms.Tensor(a_np, getattr(ms, dtype)), ms.Tensor(b_np, getattr(ms, dtype))
    try:
        ops.matmul(a, b).asnumpy()
    except (RuntimeError, TypeError, ValueError):
        # CPU has no half-precision matmul kernel: measure float32, and say so in the record.
        used = "float32"
        a, b = ms.Tensor(a_np), ms.Tensor(b_np)
    ms.runtime.synchronize()
    for _ in range(warmup):
        ops.matmul(a, b)
    ms.runtime.synchronize()
    count, elapsed, out = _timed(lambda: ops.matmul(a, b), ms.runtime.synchronize, iters, min_seconds)
    got = out[:rows].astype(ms.float32).asnumpy()
    scale = np.maximum(np.abs(expected), 1.0)
    error = float(np.max(np.abs(got - expected) / scale))
    flops = 2.0 * size**3 * count
    return {
        "check": "compute.matmul",
        "group": "world",
        "passed": error <= RTOL[used],
        "max_error": error,
        "tflops": flops / elapsed / 1e12,
        "dtype": used,
        "requested_dtype": dtype,
        "shape": [int(size)] * 3,
        "iters": count,
        "time_us": elapsed / count * 1e6,
    }
