"""``jobs.enter``: the check that opens each family's part of a shared launch (``_jobs.py``).

The families of one launch run one after the other in the same rank processes. Each
was written for a fresh rank, so before a family's first check this one puts back what a
fresh rank has: no parallel groups (the family's checks create theirs, or read the spec
layout through ``ctx.layout``), PyNative, the RNG streams of a fresh process (MindSpore's
global seed, op-seed counters and default generator, the RNG tracker's streams, numpy's
and Python's generators, as they were when the first family started) and an empty
``ctx.scratch``. It also collects the previous family's garbage: Cells hold reference
cycles, and the ranks of a shared launch would otherwise carry every family's models.
"""

from __future__ import annotations

import gc
import random

import numpy as np

from mindscience.distributed.harness.registry import CheckContext, check

_FRESH: dict = {}  # the RNG state before the first family ran


@check("jobs.enter")
def enter(ctx: CheckContext, family: str, layout=None) -> None:
    """Give ``family`` a fresh rank's state (see the module docstring); no records."""
    import mindspore as ms

    from mindscience.distributed import manager
    from mindscience.distributed import random as ms_random
    from mindscience.distributed.topology import Layout

    if manager.is_initialized():
        manager.destroy_parallel()
    ms.set_context(mode=ms.PYNATIVE_MODE)
    if not _FRESH:
        _FRESH.update(streams=ms_random._stream_state(), numpy=np.random.get_state(),
                      python=random.getstate())
    else:
        ms_random._install_stream_state(_FRESH["streams"])
        np.random.set_state(_FRESH["numpy"])
        random.setstate(_FRESH["python"])
    ctx.layout = Layout(**layout) if layout else None
    ctx.scratch.clear()
    ctx.scratch["family"] = family
    gc.collect()
    return None
