"""What the distributed optimizer overlaps, and the bytes of its main weights (pure Python).

The cost model reads these functions (through ``importlib``) to price what
:class:`~mindscience.distributed.optimizer.DistributedOptimizer` really runs, and the
optimizer itself asks them before it overlaps anything, so both always agree.

Gradient reduction (``overlap_grad_reduce=True``): the dp-cp reduction of a bucket (an
all-reduce at stage 0, a reduce-scatter at stages 1-2, the same buckets as without
overlap) is launched as an asynchronous collective as soon as every gradient of the
bucket is final, and waited on inside the optimizer step:

* ``pp == 1``, PyNative: during the last micro-batch's backward. A
  ``Parameter.register_hook`` on each parameter sees its (whole, accumulated over uses)
  gradient as the backward produces it; the hook adds the earlier micro-batches' sum and,
  when the bucket is complete, launches its collective (buckets complete in backprop
  order, the last layers' first).
* ``pp == 1``, compiled (``mode="jit"``): not overlapped by the library. The backward of a
  micro-batch is one compiled graph whose parameter hooks do not run eagerly; the
  reduction is launched after it (in GRAPH_MODE the graph scheduler decides what
  overlaps inside one graph).
* ``pp > 1`` (either mode): after a stage chunk's last backward, while the rest of the
  schedule runs (the other chunks' backwards with the interleaved schedule, the last
  transfers); no finer than a chunk.
* stage 3: nothing to overlap here: ``fully_shard``'s backward reduce-scatters.

"Launched during the backward" is what these functions report; whether the collective then
runs concurrently with compute is the backend's: on CPU with synchronous PyNative
(``pynative_synchronize=True``, how the harness runs ranks) launching the asynchronous
all-reduce blocks for about as long as the all-reduce takes (87-104 %), so the reduction moves into the backward without
running beside it; with asynchronous PyNative the launch returns at once (measured,
``bench/bench_overlap.py``, docs/BENCHMARKS.md). Ascend / GPU: not measured here.

Parameter all-gather (``overlap_param_gather=True``, stages 1-2): not overlapped; the
updated weights are all-gathered at the end of the step, as without the option.

Main weights (issue 37, part 4): float32 parameters use their own storage as the
float32 main weight (stages 1-2: the rank's rows of the full parameter, read, updated
and all-gathered; stage 3: the shard Parameter updated in place); only parameters of
another dtype (bf16, fp16) keep an fp32 main copy, divided by ``d`` at stages 1-3.
"""

from __future__ import annotations

__all__ = ["MODES", "grad_reduce_overlap", "param_gather_overlap", "main_weight_bytes"]

MODES = ("pynative", "jit")


def _check(mode: str, zero_stage: int) -> None:
    if mode not in MODES:
        raise ValueError(f"mode={mode!r} is invalid: expected one of {', '.join(MODES)}.")
    if isinstance(zero_stage, bool) or zero_stage not in (0, 1, 2, 3):
        raise ValueError(f"zero_stage={zero_stage!r} is invalid: expected 0, 1, 2 or 3.")


def grad_reduce_overlap(mode: str, zero_stage: int, pp: int = 1) -> tuple:
    """Whether ``overlap_grad_reduce=True`` launches the dp-cp reduction during the backward.

    Args:
        mode: ``"pynative"`` or ``"jit"`` (how the model's ``forward_backward`` runs).
        zero_stage: The optimizer's ZeRO stage, 0-3.
        pp: The pipeline-parallel size (1: no pipeline).

    Returns:
        ``(overlapped, sentence)``: True when the reduction is launched before the end of
        the backward, and one sentence saying how, or why not.

    Raises:
        ValueError: ``mode``, ``zero_stage`` or ``pp`` is invalid.

    Example::

        grad_reduce_overlap("pynative", 1)
        # (True, "each bucket's reduce-scatter is launched asynchronously from a gradient hook ...")
        grad_reduce_overlap("jit", 0)[0]   # False
    """
    _check(mode, zero_stage)
    if isinstance(pp, bool) or not isinstance(pp, int) or pp < 1:
        raise ValueError(f"pp={pp!r} is invalid: expected an integer >= 1.")
    op = "all-reduce" if zero_stage == 0 else "reduce-scatter"
    if zero_stage == 3:
        return False, ("zero_stage=3: fully_shard's backward reduce-scatters the gradients; the "
                       "optimizer has no dp-cp reduction to overlap.")
    if pp > 1:
        return True, (f"each bucket's {op} is launched asynchronously after the last backward of "
                      "the stage chunks holding it, overlapping the rest of the pipeline "
                      "schedule, and waited on in the optimizer step.")
    if mode == "pynative":
        return True, (f"each bucket's {op} is launched asynchronously from a gradient hook as "
                      "soon as the last micro-batch's backward has produced its gradients, and "
                      "waited on in the optimizer step.")
    return False, ("mode='jit': a micro-batch's backward is one compiled graph, whose parameter "
                   "hooks do not run eagerly; the reduction runs after it (inside one graph the "
                   "graph scheduler decides what overlaps).")


def param_gather_overlap(mode: str, zero_stage: int) -> tuple:
    """Whether ``overlap_param_gather=True`` overlaps the updated weights' all-gather with
    the next forward.

    Args:
        mode: ``"pynative"`` or ``"jit"``.
        zero_stage: The optimizer's ZeRO stage, 0-3.

    Returns:
        ``(overlapped, sentence)``: PyNative at stages 1-2 yes (the step launches each
        bucket's gather asynchronously and a forward pre-hook of the next forward waits on
        it, ``DistributedOptimizer.attach_param_gather``); compiled no (the gather is part
        of the step's graph).

    Raises:
        ValueError: ``mode`` or ``zero_stage`` is invalid.
    """
    _check(mode, zero_stage)
    if zero_stage not in (1, 2):
        return False, (f"zero_stage={zero_stage}: there is no all-gather of updated weights "
                       "(stage 0 updates whole parameters, stage 3 the shards in place).")
    if mode == "jit":
        return False, ("compiled: the updated weights' all-gather is part of the step's graph "
                       "and ends before the step returns (forward pre-hooks do not run in a "
                       "compiled forward).")
    return True, ("the step launches each bucket's all-gather asynchronously; the next "
                  "forward waits on a bucket just before the first layer that uses it.")


def main_weight_bytes(param_bytes: int, zero_stage: int) -> int:
    """Bytes per parameter element of fp32 main weights a rank keeps, before dividing by d.

    Float32 parameters are their own main weights at every stage (0); parameters of
    another dtype keep an fp32 copy (4), divided by the group size at stages 1-3 by the
    caller.

    Args:
        param_bytes: Bytes of the model dtype (2 for bf16/fp16, 4 for fp32).
        zero_stage: The ZeRO stage, 0-3.

    Returns:
        4 or 0.

    Raises:
        ValueError: ``param_bytes`` is not a positive integer or ``zero_stage`` is invalid.

    Example::

        main_weight_bytes(2, 1)  # 4: bf16 weights, an fp32 copy (4/d per rank)
        main_weight_bytes(4, 3)  # 0: the fp32 shard is the main weight
    """
    if isinstance(param_bytes, bool) or not isinstance(param_bytes, int) or param_bytes < 1:
        raise ValueError(f"param_bytes={param_bytes!r} is invalid: expected a positive integer "
                         "(2 for bf16/fp16, 4 for fp32).")
    _check("pynative", zero_stage)
    return 0 if param_bytes == 4 else 4
