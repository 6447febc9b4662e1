"""Test-only harness checks of the group manager, run inside every rank (``msdist verify``
checks the groups with ``layout.init`` instead; the worker imports this module through
``spec["modules"]``, ``["_manager_checks"]``, with tests/ on the ranks' PYTHONPATH).

``manager.reinit``
    For each layout of ``layouts`` (``[{"tp": 2, "cp": 2, "pp": 1, "order": ...}]``, optionally
    with ``"ep"`` and ``"etp"``):
    ``destroy_parallel()`` + ``initialize_parallel(...)``, then every group of
    ``keys`` (default tp, cp, dp, pp, dp-cp) is compared with the plan
    (``Layout.group_of``): member ranks, group rank, the backend's own size and rank,
    and the member ranks gathered over the backend communicator. Then ``mappings.all``
    runs on that layout's axis groups of size > 1 (``dtypes``/``shapes``/``mappings``/
    ``modes``/``split_sizes`` params; ``mappings=[]`` checks the groups only). Records
    carry ``"layout"`` and ``"case"`` (both e.g. ``"tp2-cp2-dp1-pp1:cp-tp-dp-pp"``). The
    layout in force before is restored.

``manager.errors``
    Getters before ``initialize_parallel`` raise RuntimeError, so do a second
    ``initialize_parallel``, sizes that do not fit the world, a bad order, and
    ``group_name`` of a size-1 group; ``initialize_parallel`` without
    ``communication.init()`` raises RuntimeError. The layout in force before is restored.
"""

from __future__ import annotations

import numpy as np

from mindscience.distributed.harness.checks.groups import current_layout_args, groups_of, layout_label, restore
from mindscience.distributed.harness.checks.mapping_reference import MAPPING_NAMES
from mindscience.distributed.harness.checks.mappings import run_mappings
from mindscience.distributed.harness.registry import CheckContext, check


# ------------------------------------------------------------------ manager.reinit
def check_groups_against_plan(manager, rank: int, keys, extra=None) -> list[dict]:
    """Compare every runtime group of ``keys`` with ``Layout.group_of`` of a fresh plan."""
    import mindspore as ms
    from mindspore.communication import get_group_size
    from mindspore.communication import get_rank as backend_rank

    from mindscience.distributed import collectives as C
    from mindscience.distributed.topology import Layout

    lay = manager.get_layout()
    plan = Layout(world_size=lay.world_size, tp=lay.tp, cp=lay.cp, pp=lay.pp, order=lay.order,
                  ep=lay.ep, etp=lay.etp)
    records = []
    for key in keys:
        planned = plan.group_of(rank, key)
        group = manager.get_group(key)
        problems = []
        if list(group.ranks) != planned:
            problems.append(f"ParallelGroup.ranks {list(group.ranks)} != plan {planned}")
        if group.rank != planned.index(rank):
            problems.append(f"ParallelGroup.rank {group.rank} != plan {planned.index(rank)}")
        gathered = list(group.ranks)
        if group.size > 1:
            name = group.group_name
            if get_group_size(name) != len(planned):
                problems.append(f"backend size {get_group_size(name)} != {len(planned)}")
            if backend_rank(name) != planned.index(rank):
                problems.append(f"backend rank {backend_rank(name)} != {planned.index(rank)}")
            got = C.all_gather(ms.Tensor(np.array([rank], np.float32)), group, 0).asnumpy()
            gathered = [int(v) for v in got]
            if gathered != planned:
                problems.append(f"ranks gathered over {name} {gathered} != plan {planned}")
        elif group.backend_name is not None:
            problems.append(f"size-1 group has backend name {group.backend_name}")
        all_planned = plan.groups(key)
        index = plan.group_index(rank, key)
        if all_planned[index] != gathered:
            problems.append(f"plan.groups({key!r})[{index}] = {all_planned[index]} != {gathered}")
        records.append({
            "check": "manager.group_members", "group": key, "group_size": len(planned),
            "group_index": index, "plan_groups": all_planned,
            "planned": planned, "runtime": gathered,
            "backend_name": group.backend_name,
            "passed": not problems, "max_error": 0.0,
            **({"error": "; ".join(problems)} if problems else {}),
            **(extra or {}),
        })
    return records


@check("manager.reinit")
def manager_reinit(ctx: CheckContext, layouts=None, keys=("tp", "cp", "dp", "pp", "dp-cp"),
                   dtypes=("float32",), shapes=None, mappings=MAPPING_NAMES, seed=0,
                   modes=("pynative",), split_sizes=None) -> list[dict]:
    """Several layouts in one process via destroy/initialize (see the module docstring)."""
    from mindscience.distributed import manager

    if not layouts:
        raise ValueError("manager.reinit needs layouts, e.g. [{'tp': 2, 'cp': 2}]")
    before = current_layout_args(manager)
    records = []
    for item in layouts:
        item = dict(item)
        manager.destroy_parallel()
        lay = manager.initialize_parallel(
            tensor_parallel_size=item.get("tp", 1),
            context_parallel_size=item.get("cp", 1),
            pipeline_parallel_size=item.get("pp", 1),
            order=item.get("order", "tp-cp-dp-pp"),
            expert_model_parallel_size=item.get("ep", 1),
            expert_tensor_parallel_size=item.get("etp"),
        )
        # "case" is one of the launcher's identity keys: it keeps layouts apart on merge.
        extra = {"layout": layout_label(lay), "case": layout_label(lay)}
        records += check_groups_against_plan(manager, ctx.rank, list(keys), extra)
        if mappings:
            records += run_mappings(groups_of(manager, None), dtypes=dtypes, shapes=shapes,
                                    mappings=mappings, seed=seed, extra=extra, modes=modes,
                                    split_sizes=split_sizes)
    restore(manager, before)
    return records


# ------------------------------------------------------------------ manager.errors
def _expect(label: str, fn, exc_type, must_contain=()) -> dict:
    try:
        fn()
    except exc_type as exc:
        msg = str(exc)
        missing = [s for s in must_contain if s not in msg]
        ok = not missing
        detail = msg if ok else f"message lacks {missing}: {msg}"
    except Exception as exc:  # noqa: BLE001
        ok, detail = False, f"expected {exc_type.__name__}, got {type(exc).__name__}: {exc}"
    else:
        ok, detail = False, f"no {exc_type.__name__} raised"
    return {"check": f"manager_error.{label}", "group": "world", "passed": ok,
            "max_error": 0.0, "message": detail}


@check("manager.errors")
def manager_errors(ctx: CheckContext) -> list[dict]:
    """Error paths of the manager (no collective runs before the final restore)."""
    from mindscience.distributed import manager
    from mindscience.distributed.group import GroupNotCreatedError, ParallelGroup

    before = current_layout_args(manager)
    world = ctx.world_size
    records = []
    manager.destroy_parallel()
    getters = {
        "get_tensor_parallel_group": manager.get_tensor_parallel_group,
        "get_layout": manager.get_layout,
        "get_group": lambda: manager.get_group("tp-cp"),
        "get_context_parallel_rank": manager.get_context_parallel_rank,
        "get_data_parallel_world_size": manager.get_data_parallel_world_size,
        "get_pipeline_parallel_group_name": manager.get_pipeline_parallel_group_name,
        "is_pipeline_last_stage": manager.is_pipeline_last_stage,
    }
    for label, fn in getters.items():
        records.append(_expect(f"before_init.{label}", fn, RuntimeError, ["initialize_parallel"]))
    records.append({"check": "manager_error.before_init.is_initialized", "group": "world",
                    "passed": manager.is_initialized() is False, "max_error": 0.0})

    bad = {
        "tp_not_dividing_world": dict(tensor_parallel_size=world + 1),
        "tp_zero": dict(tensor_parallel_size=0),
        "cp_negative": dict(context_parallel_size=-2),
        "pp_not_int": dict(pipeline_parallel_size=1.5),
        "order_unknown_axis": dict(order="tp-cp-dp-xx"),
        "order_missing_axis": dict(order="tp-cp-dp"),
        "ep_not_dividing_world": dict(expert_model_parallel_size=world + 1),
        "etp_zero": dict(expert_tensor_parallel_size=0),
    }
    for label, kwargs in bad.items():
        records.append(_expect(f"bad_sizes.{label}", lambda kw=kwargs: manager.initialize_parallel(**kw),
                               RuntimeError, ["initialize_parallel"]))
        records.append(_expect(f"bad_sizes_valueerror.{label}",
                               lambda kw=kwargs: manager.initialize_parallel(**kw), ValueError))
        records.append({"check": f"manager_error.bad_sizes_leave_uninitialized.{label}",
                        "group": "world", "passed": manager.is_initialized() is False,
                        "max_error": 0.0})

    # Not initialized communication (simulated): RuntimeError, state untouched.
    real = manager._communication_initialized
    manager._communication_initialized = lambda: False
    try:
        records.append(_expect("comm_not_initialized", manager.initialize_parallel,
                               RuntimeError, ["mindspore.communication.init()"]))
    finally:
        manager._communication_initialized = real

    # A layout with tp=1, pp=1: no group is created; size-1 group_name raises.
    manager.initialize_parallel()
    try:
        records.append(_expect("double_init", manager.initialize_parallel, RuntimeError,
                               ["already called", "destroy_parallel"]))
        records.append(_expect("size1_group_name", manager.get_tensor_parallel_group_name,
                               GroupNotCreatedError, ["size 1", "group.size > 1"]))
        records.append(_expect("size1_group_name_is_runtimeerror",
                               manager.get_pipeline_parallel_group_name, RuntimeError))
        records.append(_expect("trivial_group_name",
                               lambda: ParallelGroup.trivial("tp", ctx.rank).group_name,
                               GroupNotCreatedError))
        records.append(_expect("unknown_group_key", lambda: manager.get_group("tp-xx"), ValueError,
                               ["unknown axis"]))
        no_groups = manager.get_created_group_count()
        want = 0 if world == 1 else 1  # only dp (= dp-cp) has size > 1
        records.append({"check": "manager_error.trivial_layout_group_count", "group": "world",
                        "passed": no_groups == want, "max_error": 0.0,
                        "message": f"{no_groups} backend groups, expected {want}"})
    finally:
        restore(manager, before)
    return records
