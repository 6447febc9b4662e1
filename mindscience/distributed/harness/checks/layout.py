"""Build the job's layout with ``initialize_parallel`` and prove every group is the plan.

The proof goes through the backend: each rank all-gathers its global rank over each
created communicator, so a communicator bound to the wrong ranks, or ranks in another
order, shows up as a mismatch against ``Layout.group_of`` (what ``msdist plan`` prints).
"""

from __future__ import annotations

import numpy as np

from ..registry import CheckContext, check

# The manager's standard keys: the dense groups, then the expert ones.
KEYS = ("tp", "cp", "dp", "pp", "dp-cp", "ep", "etp", "edp", "etp-ep")


def members_over_backend(group) -> list[int]:
    """Global ranks of the group's members as the backend sees them, by group rank."""
    import mindspore as ms

    from mindscience.distributed import collectives

    mine = ms.Tensor(np.array([group.global_rank], np.float32))
    return [int(v) for v in collectives.all_gather(mine, group, 0).asnumpy()]


@check("layout.init")
def layout_init(ctx: CheckContext, extra_keys=()):
    """``initialize_parallel`` from the job's layout, then check each group.

    Returns one record per key: passed when the runtime group's members, the planned
    members and the members observed over the backend all agree.
    """
    from mindscience.distributed import manager
    from mindscience.distributed.topology import Layout

    layout = ctx.layout
    if layout is None:
        raise ValueError("layout.init needs the job's layout in the spec ('layout': {...})")
    if not isinstance(layout, Layout):
        layout = Layout(**layout)
    if manager.is_initialized():
        manager.destroy_parallel()
    runtime = manager.initialize_parallel(layout.tp, layout.cp, layout.pp, layout.order,
                                          expert_model_parallel_size=layout.ep,
                                          expert_tensor_parallel_size=layout.etp)
    records = []
    for key in (*KEYS, *extra_keys):
        group = manager.get_group(key)
        planned = layout.group_of(ctx.rank, key)
        observed = members_over_backend(group) if group.size > 1 else [ctx.rank]
        ok = list(group.ranks) == planned == observed and group.rank == layout.group_rank(ctx.rank, key)
        records.append(
            {
                "check": "layout.groups",
                "group": key,
                "passed": ok,
                "max_error": 0.0 if ok else 1.0,
                "planned": planned,
                "observed": observed,
                "backend_name": group.backend_name,
            }
        )
    records.append(
        {
            "check": "layout.communicators",
            "group": "all",
            "passed": runtime.sizes == layout.sizes and runtime.axes == layout.axes
            and runtime.expert_sizes == layout.expert_sizes and runtime.order == layout.order,
            "max_error": 0.0,
            "created": manager.get_created_group_count(),
        }
    )
    return records
