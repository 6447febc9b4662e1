"""Checks of the harness itself, and fault injection to prove the launcher stops a job.

``basic.ping``: is every rank up with the right rank number. ``basic.allreduce``: does a
world all-reduce add up. ``fault.crash`` / ``fault.hang``: a crash or a hang on chosen
ranks.

Fault checks misbehave only on the ranks listed in ``ranks``; the other ranks return a
passing record at once and go on to the next check, where they typically block in a
collective waiting for the faulty rank, which is exactly the situation the launcher
must detect and clean up.
"""

from __future__ import annotations

import os
import signal
import socket
import time

from ..registry import CheckContext, check

CRASH_MODES = ("raise", "segfault", "exit")


@check("basic.ping")
def ping(ctx: CheckContext) -> dict:
    """Report this rank's identity; passes when the rank lies in ``[0, world_size)``.

    Also compares with msrun's ``RANK_ID`` so a rank-assignment mix-up shows.
    """
    env_rank = os.environ.get("RANK_ID")
    consistent = env_rank is None or int(env_rank) == ctx.rank
    return {
        "check": "basic.ping",
        "group": "world",
        "passed": bool(0 <= ctx.rank < ctx.world_size and consistent),
        "max_error": 0.0,
        "world_size": ctx.world_size,
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "rank_id_env": env_rank,
    }


@check("basic.allreduce")
def allreduce(ctx: CheckContext, size: int = 8, dtype: str = "float32", atol: float = 0.0) -> dict:
    """SUM all-reduce over the world group with ``ops.AllReduce``, compared with numpy.

    Inputs are small integers (``i % 7 + rank``), which float16/float32 hold exactly,
    so the default tolerance is 0.

    Args:
        ctx: The rank's context.
        size: Number of elements.
        dtype: numpy dtype name (``ops.AllReduce`` on CPU takes float16/float32).
        atol: Largest accepted absolute error.
    """
    import mindspore as ms
    import numpy as np
    from mindspore import ops

    def local(rank):
        return (np.arange(size) % 7 + rank).astype(dtype)

    got = ops.AllReduce(ops.ReduceOp.SUM)(ms.Tensor(local(ctx.rank))).asnumpy()
    want = sum(local(r).astype(np.float64) for r in range(ctx.world_size))
    max_error = float(np.max(np.abs(got.astype(np.float64) - want))) if size else 0.0
    return {
        "check": "basic.allreduce",
        "group": "world",
        "dtype": dtype,
        "shape": [size],
        "passed": bool(got.shape == want.shape and max_error <= atol),
        "max_error": max_error,
    }


def _targets(ctx: CheckContext, ranks) -> bool:
    return ctx.rank in {int(r) for r in (ranks or [])}


@check("fault.crash")
def crash(ctx: CheckContext, ranks=(0,), mode: str = "raise", code: int = 7) -> dict:
    """Make the listed ranks fail; the others pass.

    Args:
        ctx: The rank's context.
        ranks: Global ranks that fail.
        mode: ``"raise"`` (a Python exception), ``"segfault"`` (SIGSEGV, no Python
            error, like a crash in a kernel) or ``"exit"`` (``os._exit(code)``, like a
            process that quits without reporting).
        code: Exit code for ``mode="exit"``.
    """
    if mode not in CRASH_MODES:
        raise ValueError(f"mode={mode!r} is invalid: expected one of {', '.join(CRASH_MODES)}.")
    if _targets(ctx, ranks):
        if mode == "raise":
            raise RuntimeError(f"injected fault on rank {ctx.rank}")
        if mode == "segfault":
            os.kill(os.getpid(), signal.SIGSEGV)
            time.sleep(60)  # the signal is delivered asynchronously; never return
        os._exit(code)
    return {"check": "fault.crash", "group": "world", "passed": True, "max_error": 0.0}


@check("fault.hang")
def hang(ctx: CheckContext, ranks=(0,), seconds: float = 3600.0) -> dict:
    """Make the listed ranks sleep ``seconds`` (a stand-in for a stuck collective)."""
    if _targets(ctx, ranks):
        time.sleep(float(seconds))
    return {"check": "fault.hang", "group": "world", "passed": True, "max_error": 0.0}
