"""Plain-data descriptions of a layout: what ``msdist plan`` prints.

Everything here returns dicts and lists of ints (JSON-ready); rendering lives in the CLI.
The runtime manager creates communicators for :data:`RUNTIME_KEYS`, so the
communicator count and buffer estimate below describe what a real job allocates.
"""

from __future__ import annotations

from .layout import AXES, Layout, parse_axis_key

# Groups the runtime manager always builds (mindscience.distributed.manager.STANDARD_KEYS).
RUNTIME_KEYS = ("tp", "cp", "dp", "pp", "dp-cp")

# HCCL reserves 2 x HCCL_BUFFSIZE (MB, default 200) per communicator.
DEFAULT_HCCL_BUFFSIZE_MB = 200


def plan_keys(extra_keys=()) -> list[str]:
    """The runtime keys followed by any extra keys, without repeats (validated)."""
    keys = list(RUNTIME_KEYS)
    for key in extra_keys:
        parse_axis_key(key)
        if key not in keys:
            keys.append(key)
    return keys


def communicators(layout: Layout, keys) -> list[str]:
    """Distinct communicators each rank joins for ``keys``.

    A key whose groups have size 1 needs none, and keys with the same effective axes
    (``dp-cp`` and ``dp`` when cp == 1) share one. Every rank joins the same number.

    Returns:
        The first key naming each communicator, e.g. ``["tp", "cp", "dp-cp"]``.
    """
    seen = {}
    for key in keys:
        effective = layout.effective_axes(key)
        if effective and effective not in seen:
            seen[effective] = key
    return list(seen.values())


def memory_estimate(layout: Layout, keys, buffsize_mb: int = DEFAULT_HCCL_BUFFSIZE_MB) -> dict:
    comms = communicators(layout, keys)
    return {
        "per_rank": len(comms),
        "groups": comms,
        "hccl_buffsize_mb": buffsize_mb,
        "buffer_mb_per_rank": len(comms) * 2 * buffsize_mb,
    }


def node_warnings(layout: Layout, crossing: dict) -> list[str]:
    """Warnings for latency-critical axes whose groups span nodes."""
    warnings = []
    for key, what in (("tp", "tensor"), ("cp", "context")):
        count = len(crossing.get(key, ()))
        if count:
            warnings.append(
                f"{count} of {layout.num_groups(key)} {key} groups cross node boundaries: "
                f"{what}-parallel traffic is on the critical path and the inter-node link is "
                f"slower. Put {key} first in 'order' or make {key} divide devices_per_node "
                f"({layout.devices_per_node})."
            )
    return warnings


def rank_rows(layout: Layout) -> list[dict]:
    """One dict per rank: rank, node, local_rank and its tp/cp/dp/pp coordinates.

    Built column-wise with list comprehensions: at 65,536 ranks this is the hot path.
    """
    world, dpn = layout.world_size, layout.devices_per_node
    ranks = range(world)
    columns = {}
    for axis in AXES:
        stride, size = layout.stride(axis), getattr(layout, axis)
        columns[axis] = [(r // stride) % size for r in ranks]
    nodes = [r // dpn for r in ranks]
    locals_ = [r % dpn for r in ranks]
    tp, cp, dp, pp = (columns[a] for a in AXES)
    return [
        {"rank": r, "node": n, "local_rank": lr, "tp": a, "cp": b, "dp": c, "pp": d}
        for r, n, lr, a, b, c, d in zip(ranks, nodes, locals_, tp, cp, dp, pp)
    ]


def build_plan(
    layout: Layout,
    extra_keys=(),
    buffsize_mb: int = DEFAULT_HCCL_BUFFSIZE_MB,
    include_ranks: bool = True,
) -> dict:
    """The full plan of a layout as plain data.

    Returns:
        ``{"name", "world_size", "order", "sizes", "devices_per_node", "nodes",
        "backend", "groups": {key: [[rank, ...], ...]}, "cross_node": {key: [group
        index, ...]}, "communicators": {...}, "warnings": [...], "ranks": [...]}``.
    """
    keys = plan_keys(extra_keys)
    groups = {key: layout.groups(key) for key in keys}
    crossing = {}
    if layout.num_nodes > 1:
        for key, key_groups in groups.items():
            crossing[key] = [i for i, g in enumerate(key_groups) if layout.crosses_nodes(g)]
    else:
        crossing = {key: [] for key in keys}
    plan = {
        "name": layout.name,
        "world_size": layout.world_size,
        "order": "-".join(layout.axes),
        "sizes": layout.sizes,
        "devices_per_node": layout.devices_per_node,
        "nodes": layout.num_nodes,
        "backend": layout.backend,
        "groups": groups,
        "cross_node": crossing,
        "communicators": memory_estimate(layout, keys, buffsize_mb),
        "warnings": node_warnings(layout, crossing),
    }
    if include_ranks:
        plan["ranks"] = rank_rows(layout)
    return plan


def rank_plan(layout: Layout, rank: int, extra_keys=(), buffsize_mb: int = DEFAULT_HCCL_BUFFSIZE_MB) -> dict:
    """One rank's coordinates and every group it belongs to."""
    keys = plan_keys(extra_keys)
    coords = layout.coords(rank)
    groups = {}
    for key in keys:
        members = layout.group_of(rank, key)
        groups[key] = {
            "index": layout.group_index(rank, key),
            "group_rank": layout.group_rank(rank, key),
            "size": len(members),
            "ranks": members,
            "cross_node": layout.crosses_nodes(members),
        }
    crossing = {key: layout.crossing_groups(key) for key in ("tp", "cp")}
    return {
        "rank": rank,
        "node": layout.node_of(rank),
        "local_rank": layout.local_rank_of(rank),
        "coords": coords,
        "world_size": layout.world_size,
        "order": "-".join(layout.axes),
        "sizes": layout.sizes,
        "groups": groups,
        "communicators": memory_estimate(layout, keys, buffsize_mb),
        "warnings": node_warnings(layout, crossing),
    }
