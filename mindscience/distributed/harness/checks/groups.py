"""Which groups a check runs on: one entry per distinct set of member ranks.

``dp-cp`` holds the same ranks as ``cp`` when dp == 1; running (or timing) both would
repeat the same communicator, so they run once under the label ``"cp=dp-cp"``. Size-1
groups are kept (each under its own key): mappings check that they are the identity.
"""

from __future__ import annotations

# "world" names the group of every rank: the key of all four axes.
WORLD_KEY = "tp-cp-dp-pp"
AXIS_KEYS = ("tp", "cp", "dp", "pp")


def distinct_groups(manager, keys) -> dict:
    """``{label: group}`` for ``keys``, in order, groups with the same ranks merged.

    Example, 4 ranks tp=2 cp=2: ``["tp", "cp", "dp-cp", "world"]`` ->
    ``{"tp": <tp>, "cp=dp-cp": <cp>, "world": <tp-cp-dp-pp>}``.
    """
    labelled: dict = {}
    for key in keys:
        group = manager.get_group(WORLD_KEY if key == "world" else key)
        ident = group.ranks if group.size > 1 else key
        if ident in labelled:
            labelled[ident][0] += f"={key}"
        else:
            labelled[ident] = [key, group]
    return {label: group for label, group in labelled.values()}


def groups_of(manager, keys) -> dict:
    """:func:`distinct_groups` for ``keys``; default every axis of size > 1."""
    if keys is None:
        lay = manager.get_layout()
        keys = [k for k in AXIS_KEYS if lay.size(k) > 1]
    return distinct_groups(manager, keys)


def ensure_manager(ctx):
    """The manager's state; initialized from ``ctx.layout`` when not yet done."""
    from mindscience.distributed import manager

    if not manager.is_initialized():
        if ctx.layout is None:
            raise RuntimeError(
                "the mapping checks need parallel groups: give the job a layout or call "
                "manager.initialize_parallel(...) before them"
            )
        manager.initialize_parallel(
            tensor_parallel_size=ctx.layout.tp,
            context_parallel_size=ctx.layout.cp,
            pipeline_parallel_size=ctx.layout.pp,
            order=ctx.layout.order,
            expert_model_parallel_size=ctx.layout.ep,
            expert_tensor_parallel_size=ctx.layout.etp,
        )
    return manager


def current_layout_args(manager):
    if not manager.is_initialized():
        return None
    lay = manager.get_layout()
    return dict(tensor_parallel_size=lay.tp, context_parallel_size=lay.cp,
                pipeline_parallel_size=lay.pp, order=lay.order,
                expert_model_parallel_size=lay.ep, expert_tensor_parallel_size=lay.etp)


def restore(manager, args) -> None:
    manager.destroy_parallel()
    if args is not None:
        manager.initialize_parallel(**args)


def reinit(manager, spec: dict):
    """Re-create the parallel groups as ``spec`` (``{"tp", "cp", "pp", "ep"}``, each default 1,
    and ``"etp"``, default tp) says, whatever was in force; returns the new layout."""
    if manager.is_initialized():
        manager.destroy_parallel()
    return manager.initialize_parallel(tensor_parallel_size=spec.get("tp", 1),
                                       context_parallel_size=spec.get("cp", 1),
                                       pipeline_parallel_size=spec.get("pp", 1),
                                       expert_model_parallel_size=spec.get("ep", 1),
                                       expert_tensor_parallel_size=spec.get("etp"))


def layout_label(lay) -> str:
    """``tp2-cp1-dp2-pp2:tp-cp-dp-pp``; with split experts ``...-ep2-etp1:tp-cp-ep-dp-pp``."""
    experts = f"-ep{lay.ep}-etp{lay.etp}" if lay.has_experts_split else ""
    return f"tp{lay.tp}-cp{lay.cp}-dp{lay.dp}-pp{lay.pp}{experts}:{lay.order}"
