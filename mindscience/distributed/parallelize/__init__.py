"""Tensor and sequence parallelism for a dense model the user wrote, by a plan.

    from mindscience.distributed.parallelize import (
        parallelize_module, ColwiseParallel, RowwiseParallel, SequenceParallel, VocabParallel,
        HeadParallel)

    parallelize_module(model, {"embed": VocabParallel(),
                               "layers.*.attn": HeadParallel("num_heads"),
                               "layers.*.attn.qkv": ColwiseParallel(chunks=3),
                               "layers.*.attn.proj": RowwiseParallel(),
                               "layers.*.fc1": ColwiseParallel(),
                               "layers.*.fc2": RowwiseParallel(),
                               "layers.*.norm*": SequenceParallel(),
                               "head": ColwiseParallel(gather_output=True)},
                       sequence_parallel=True)

* :mod:`.styles` (pure): the styles and the row arithmetic of fused projections;
* :mod:`.plan`: matching the patterns and validating the whole plan (nothing changes on
  error: one :class:`ParallelizePlanError`, a ``ValueError``);
* :mod:`.apply`: :func:`parallelize_module`, building the library's parallel layers from
  the dense weights and swapping them in with the dense parameter names.
"""

from .styles import (ColwiseParallel, HeadParallel, ParallelizePlanError, ParallelStyle,
                     RowwiseParallel, SequenceParallel, VocabParallel)
from .apply import parallelize_module

__all__ = ["parallelize_module", "ColwiseParallel", "RowwiseParallel", "VocabParallel",
           "SequenceParallel", "HeadParallel", "ParallelStyle", "ParallelizePlanError"]
