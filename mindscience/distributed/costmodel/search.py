"""``msdist suggest``: every layout of a world that fits a model, fastest communication first.

The search enumerates every ``(tp, cp, pp)`` whose product divides the world (``dp`` is
the rest), drops the sizes that break a model constraint (counted under the first broken
one) or whose busiest stage does not fit the device, and for each remaining size tries
every order that places the ranks differently (:func:`distinct_orders`). An order changes
only which groups span nodes, so the traffic is computed once per size and each order
only re-prices it with the intra- or inter-node bandwidth. Each size keeps its fastest
order (ties: the default ``tp-cp-dp-pp``, then the earliest permutation). Candidates are sorted by estimated step
communication time, then by peak memory.

Example: a 16-layer model on 16 devices, 8 per node; with the pipeline over both nodes
only its small point-to-point messages cross, and the gradients stay inside a node::

    >>> from mindscience.distributed.costmodel.spec import ModelSpec, Workload
    >>> m = ModelSpec(num_layers=16, hidden_size=1024, num_attention_heads=16,
    ...               seq_length=2048, vocab_size=32000)
    >>> best = suggest(Workload(model=m), world_size=16)["candidates"][0]
    >>> (best["tp"], best["cp"], best["dp"], best["pp"], best["order"])
    (1, 1, 2, 8, 'tp-cp-dp-pp')
"""

from __future__ import annotations

import itertools
from dataclasses import replace

from ..topology.layout import DEFAULT_ORDER, Layout
from ..topology.plan import DEFAULT_HCCL_BUFFSIZE_MB
from .comm import crossing_flags, timed, traffic
from .constraints import violations
from .errors import ModelError
from .report import communicator_bytes
from .memory import num_microbatches, pipeline_bubble, stage_rows
from .spec import DEFAULT_DEVICES_PER_NODE, GIB, Workload

MEMORY = "does not fit device memory"


def size_choices(world_size: int):
    """Every ``(tp, cp, pp, dp)`` with ``tp * cp * pp * dp == world_size``."""
    divisors = [d for d in range(1, world_size + 1) if world_size % d == 0]
    for tp in divisors:
        for cp in (d for d in divisors if (world_size // tp) % d == 0):
            for pp in (d for d in divisors if (world_size // (tp * cp)) % d == 0):
                yield tp, cp, pp, world_size // (tp * cp * pp)


def distinct_orders(sizes: dict) -> list[str]:
    """Orders that place ranks differently: one per arrangement of the axes larger than 1.

    Size-1 axes do not move any rank, so each arrangement is written with them last, and
    the default order's own arrangement as the default order (listed first).

        >>> distinct_orders({"tp": 2, "cp": 1, "dp": 1, "pp": 4})
        ['tp-cp-dp-pp', 'pp-tp-cp-dp']
    """
    axes = DEFAULT_ORDER.split("-")
    big = tuple(a for a in axes if sizes[a] > 1)
    rest = tuple(a for a in axes if sizes[a] == 1)
    return [DEFAULT_ORDER if perm == big else "-".join(perm + rest) for perm in itertools.permutations(big)]


def _gib(n: float) -> str:
    return f"{n / GIB:.1f} GiB"


def _closest(workload: Workload, best: dict, sizes: tuple, buffers: int) -> dict:
    """Why the lowest-memory valid size misses the device, and what would save how much."""
    model, training, device = workload.model, workload.training, workload.cluster.device_memory_bytes
    stage = max(best["stages"], key=lambda s: s["total_bytes"])
    parts = ", ".join(f"{k.replace('_bytes', '')} {stage[k] / GIB:.1f}" for k in (
        "weights_bytes", "gradients_bytes", "optimizer_bytes", "activations_bytes", "communicator_bytes"))
    why = (f"stage {stage['stage']} needs {_gib(stage['total_bytes'])} ({parts} GiB) of "
           f"{_gib(device)}: {_gib(stage['total_bytes'] - device)} over")
    hints = []
    tries = []
    if not training.distributed_optimizer and sizes[1] * sizes[3] > 1:
        tries.append(("training.distributed_optimizer: true", replace(training, distributed_optimizer=True)))
    for mode in ("selective", "full")[("none", "selective", "full").index(training.recompute):]:
        tries.append((f"training.recompute: {mode}", replace(training, recompute=mode)))
    for label, other in tries:
        peak = max(s["total_bytes"] for s in stage_rows(model, other, *sizes, buffers))
        hints.append(f"{label} would need {_gib(peak)}")
    hints.append("or more devices, or devices with more memory (--device-memory-gb)")
    tp, cp, pp, dp = sizes
    return {"tp": tp, "cp": cp, "dp": dp, "pp": pp, "order": DEFAULT_ORDER, "peak_bytes": best["peak"], "fits": False,
        "peak_stage": stage["stage"], "over_bytes": stage["total_bytes"] - device, "why": why, "hints": hints}


def suggest(workload: Workload, world_size: int, devices_per_node: int | None = None,
            top: int | None = None, buffsize_mb: int = DEFAULT_HCCL_BUFFSIZE_MB) -> dict:
    """Rank the layouts of ``world_size`` devices that fit ``workload``.

    Args:
        workload: The model, training and cluster (``cluster.device_memory_gb`` decides
            what fits).
        world_size: Devices.
        devices_per_node: Devices per node; default ``cluster.devices_per_node``, else
            8 (or the world when smaller).
        top: Keep the best ``top`` candidates (None: all).
        buffsize_mb: HCCL_BUFFSIZE for the communicator memory.

    Returns:
        ``{"world_size", "devices_per_node", "device_memory_bytes", "candidates": [{"tp",
        "cp", "dp", "pp", "order", "peak_bytes", "fits", "est_time_s", "bottleneck",
        "cross_node": {"tp", "cp"}, "pipeline_bubble"}, ...], "valid": count before ``top``, "rejected":
        {reason: count}, "closest": None or the lowest-memory size that breaks no
        constraint, with "why" and "hints"}``. Candidates are best first.

    Raises:
        ModelError: no model. LayoutError: a bad world or devices per node.
    """
    model, training, cluster = workload.model, workload.training, workload.cluster
    if model is None:
        raise ModelError("no model to suggest layouts for: pass --model FILE or a preset name.")
    if devices_per_node is None:
        devices_per_node = cluster.devices_per_node
    if devices_per_node is None and isinstance(world_size, int) and not isinstance(world_size, bool):
        devices_per_node = min(world_size, DEFAULT_DEVICES_PER_NODE) if world_size > 0 else 1
    Layout(world_size=world_size, devices_per_node=devices_per_node)  # validates both
    device = cluster.device_memory_bytes
    candidates, rejected, lowest = [], {}, None
    for tp, cp, pp, dp in size_choices(world_size):
        broken = violations(model, training, tp, cp, pp, dp)
        if broken:
            rejected[broken[0][0]] = rejected.get(broken[0][0], 0) + 1
            continue
        sizes = {"tp": tp, "cp": cp, "dp": dp, "pp": pp}
        layout = Layout(world_size=world_size, tp=tp, cp=cp, pp=pp, devices_per_node=devices_per_node)
        buffers = communicator_bytes(layout, buffsize_mb)
        stages = stage_rows(model, training, tp, cp, pp, dp, buffers)
        peak = max(s["total_bytes"] for s in stages)
        if peak > device:
            rejected[MEMORY] = rejected.get(MEMORY, 0) + 1
            if lowest is None or peak < lowest[0]["peak"]:
                lowest = ({"peak": peak, "stages": stages}, (tp, cp, pp, dp), buffers)
            continue
        rows = traffic(model, training, tp, cp, pp, dp)
        best = None
        for order in distinct_orders(sizes) if layout.num_nodes > 1 else [layout.order]:
            placed = replace(layout, order=order) if order != layout.order else layout
            flags = crossing_flags(placed)
            comm = timed(rows, flags, cluster)
            if best is None or comm["est_time_s"] < best[1]["est_time_s"]:
                best = (order, comm, flags)
        order, comm, flags = best
        candidates.append({**sizes, "order": order, "peak_bytes": peak, "fits": True,
                           "est_time_s": comm["est_time_s"], "bottleneck": comm["bottleneck"],
                           "cross_node": {"tp": flags["tp"], "cp": flags["cp"]},
                           "pipeline_bubble": pipeline_bubble(pp, num_microbatches(training, dp, world_size))})
    candidates.sort(key=lambda c: (c["est_time_s"], c["peak_bytes"], c["pp"], c["cp"], c["tp"]))
    closest = None
    if not candidates and lowest is not None:
        closest = _closest(workload, *lowest)
    return {
        "world_size": world_size,
        "devices_per_node": devices_per_node,
        "device_memory_bytes": device,
        "candidates": candidates[:top] if top else candidates,
        "valid": len(candidates),
        "rejected": rejected,
        "closest": closest,
    }
