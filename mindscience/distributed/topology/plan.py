"""Plain-data descriptions of a layout: what ``msdist plan`` prints.

Everything here returns dicts and lists of ints (JSON-ready); rendering lives in the CLI.
The runtime manager creates communicators for :data:`RUNTIME_KEYS`, so the
communicator count and buffer estimate below describe what a real job allocates.
"""

from __future__ import annotations

from .layout import Layout, parse_axis_key

# Groups the runtime manager always builds (mindscience.distributed.manager.STANDARD_KEYS):
# the dense ones, then the expert ones (ep, the expert tensor and data groups, and etp-ep,
# the group tokens are dispatched over). Expert groups equal to dense ones share their
# communicator, so a dense layout needs no more communicators than before.
RUNTIME_KEYS = ("tp", "cp", "dp", "pp", "dp-cp", "ep", "etp", "edp", "etp-ep")
# Columns of a rank row beside rank, node and local_rank.
RANK_AXES = ("tp", "cp", "dp", "pp", "ep", "etp", "edp")

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

    A key whose groups have size 1 needs none, and keys with the same groups (``dp-cp``
    and ``dp`` when cp == 1, ``edp`` and ``dp-cp`` in Megatron's default order: the same
    :meth:`~Layout.signature`) share one. Every rank joins the same number.

    Returns:
        The first key naming each communicator, e.g. ``["tp", "cp", "dp-cp"]``.
    """
    seen = {}
    for key in keys:
        signature = layout.signature(key)
        if signature and signature not in seen:
            seen[signature] = key
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
    checked = [("tp", "tensor"), ("cp", "context")]
    if layout.signature("etp") != layout.signature("tp"):
        checked.append(("etp", "expert tensor"))
    for key, what in checked:
        count = len(crossing.get(key, ()))
        if count:
            warnings.append(
                f"{count} of {layout.num_groups(key)} {key} groups cross node boundaries: "
                f"{what}-parallel traffic is on the critical path and the inter-node link is "
                f"slower. Put {key} first in 'order' or make {key} divide devices_per_node "
                f"({layout.devices_per_node})."
            )
    return warnings


def _expert_sizes(layout: Layout) -> dict:
    return {"etp": layout.etp, "ep": layout.ep, "edp": layout.edp}


def rank_rows(layout: Layout) -> list[dict]:
    """One dict per rank: rank, node, local_rank, its tp/cp/dp/pp and its ep/etp/edp coordinates.

    Built column-wise with list comprehensions: at 65,536 ranks this is the hot path.
    """
    world, dpn = layout.world_size, layout.devices_per_node
    ranks = range(world)
    columns = layout.axis_columns(RANK_AXES)
    nodes = [r // dpn for r in ranks]
    locals_ = [r % dpn for r in ranks]
    tp, cp, dp, pp, ep, etp, edp = (columns[a] for a in RANK_AXES)
    return [
        {"rank": r, "node": n, "local_rank": lr, "tp": a, "cp": b, "dp": c, "pp": d, "ep": e, "etp": f, "edp": g}
        for r, n, lr, a, b, c, d, e, f, g in zip(ranks, nodes, locals_, tp, cp, dp, pp, ep, etp, edp)
    ]


def build_plan(
    layout: Layout,
    extra_keys=(),
    buffsize_mb: int = DEFAULT_HCCL_BUFFSIZE_MB,
    include_ranks: bool = True,
) -> dict:
    """The full plan of a layout as plain data.

    Returns:
        ``{"name", "world_size", "order", "sizes", "expert_sizes" (etp, ep, edp),
        "devices_per_node", "nodes",
        "backend", "groups": {key: [[rank, ...], ...]}, "cross_node": {key: [group
        index, ...]}, "communicators": {...}, "warnings": [...], "ranks": [...]}``.
    """
    keys = plan_keys(extra_keys)
    # Keys with one signature have the same groups listed the same way (the expert keys
    # of a dense layout repeat tp and dp-cp): compute them once.
    by_signature: dict = {}
    groups, crossing = {}, {}
    for key in keys:
        signature = layout.signature(key)
        if signature not in by_signature:
            key_groups = layout.groups(key)
            # Members come in ascending rank order, so a group spans nodes exactly when its
            # first and last rank sit on different ones.
            dpn = layout.devices_per_node
            crosses = [i for i, g in enumerate(key_groups) if g[0] // dpn != g[-1] // dpn] \
                if layout.num_nodes > 1 and signature else []
            by_signature[signature] = (key_groups, crosses)
        groups[key], crossing[key] = by_signature[signature]
    plan = {
        "name": layout.name,
        "world_size": layout.world_size,
        "order": layout.order,
        "sizes": layout.sizes,
        "expert_sizes": _expert_sizes(layout),
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
    crossing = {key: layout.crossing_groups(key) for key in ("tp", "cp", "etp")}
    return {
        "rank": rank,
        "node": layout.node_of(rank),
        "local_rank": layout.local_rank_of(rank),
        "coords": coords,
        "expert_coords": {a: layout.group_rank(rank, a) for a in ("etp", "ep", "edp")},
        "world_size": layout.world_size,
        "order": layout.order,
        "sizes": layout.sizes,
        "expert_sizes": _expert_sizes(layout),
        "groups": groups,
        "communicators": memory_estimate(layout, keys, buffsize_mb),
        "warnings": node_warnings(layout, crossing),
    }
