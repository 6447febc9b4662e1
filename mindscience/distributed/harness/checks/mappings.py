"""Checks of the communication mappings and of the group manager, run inside every rank.

Used by the test suite and by ``msdist verify``. Every value is checked against a numpy
reference that each rank computes on its own: the inputs of every rank are small
integers drawn from ``(seed, global rank, ...)``, so every rank knows every other
rank's input, and sums of them are exact in float32, float16 and bfloat16 (as
nccl-tests does). The upstream gradient is ``C_r``, the cotangent of
``loss = sum(out * C_r)``, again small integers known to all ranks.

Checks (all params optional):

``mappings.all``
    Each mapping forward and backward on each group, dtype and shape. One record per
    combination::

        {"check": "mapping.scatter_to_hidden", "group": "tp", "group_size": 2,
         "dtype": "bfloat16", "shape": [4, 4], "input_shape": [4, 4],
         "output_shape": [4, 2], "direction": "forward+backward",
         "autograd": "ms.grad", "passed": True, "max_error": 0.0,
         "forward_error": 0.0, "backward_error": 0.0,
         "collectives": ["all_gather"], "composed": [], "backend": "composed",
         "backend_calls": 2}

    ``shape`` is the global (full) shape ``(S, ..., H)``; each mapping's input is the
    shard of it that the mapping expects. Params: ``groups`` (manager keys; default
    every axis of size > 1; keys whose groups hold the same ranks run once, labelled
    ``"cp=dp-cp"``), ``dtypes``, ``shapes`` (default ``[[2G, 2G], [G, 3, 2G]]`` per
    group of size G), ``mappings`` (names, default all, see :data:`MAPPING_NAMES`),
    ``seed``, ``group_api`` (``"object"``: pass the ParallelGroup; ``"name"``: pass its
    backend group name). float32 runs use ``ms.value_and_grad`` (the loss is checked
    too), float16/bfloat16 ``ms.grad``. A size-1 group must be the identity with no
    backend call.

``mappings.errors``
    Non-divisible dims (and rank < 2 for the all-to-alls) raise ``ValueError`` naming
    the mapping, the dim, its size and the group size, on every rank, with no backend
    call. Params: ``groups``.

``manager.reinit``
    For each layout of ``layouts`` (``[{"tp": 2, "cp": 2, "pp": 1, "order": ...}]``):
    ``destroy_parallel()`` + ``initialize_parallel(...)``, then every group of
    ``keys`` (default tp, cp, dp, pp, dp-cp) is compared with the plan
    (``Layout.group_of``): member ranks, group rank, the backend's own size and rank,
    and the member ranks gathered over the backend communicator. Then ``mappings.all``
    runs on that layout's axis groups of size > 1 (``dtypes``/``shapes``/``mappings``
    params; ``mappings=[]`` checks the groups only). Records carry ``"layout"`` and
    ``"case"`` (both e.g. ``"tp2-cp2-dp1-pp1:cp-tp-dp-pp"``). The layout in force
    before is restored.

``manager.errors``
    Getters before ``initialize_parallel`` raise RuntimeError, so do a second
    ``initialize_parallel``, sizes that do not fit the world, a bad order, and
    ``group_name`` of a size-1 group; ``initialize_parallel`` without
    ``communication.init()`` raises RuntimeError. The layout in force before is restored.
"""

from __future__ import annotations

import numpy as np

from ..registry import CheckContext, check
from .groups import distinct_groups

MAPPING_NAMES = (
    "copy_to_all",
    "reduce_from_all",
    "scatter_to_hidden",
    "gather_from_hidden",
    "scatter_to_sequence",
    "gather_from_sequence",
    "gather_from_sequence(tensor_parallel_output_grad=False)",
    "reduce_scatter_to_sequence",
    "all_to_all_from_hidden_to_sequence",
    "all_to_all_from_sequence_to_hidden",
)
DTYPES = ("float32", "float16", "bfloat16")
TOLERANCE = {"float32": 1e-6, "float16": 1e-3, "bfloat16": 1e-2}
AXIS_KEYS = ("tp", "cp", "dp", "pp")
LOW, HIGH = -3, 4  # inputs and cotangents are integers in [-3, 3]

# Collectives each mapping runs (forward + backward), to report which are composed.
_COLLECTIVES = {
    "copy_to_all": ("all_reduce",),
    "reduce_from_all": ("all_reduce",),
    "scatter_to_hidden": ("all_gather",),
    "gather_from_hidden": ("all_gather",),
    "scatter_to_sequence": ("all_gather",),
    "gather_from_sequence": ("all_gather", "reduce_scatter"),
    "gather_from_sequence(tensor_parallel_output_grad=False)": ("all_gather",),
    "reduce_scatter_to_sequence": ("reduce_scatter", "all_gather"),
    "all_to_all_from_hidden_to_sequence": ("all_to_all",),
    "all_to_all_from_sequence_to_hidden": ("all_to_all",),
}


# ------------------------------------------------------------------ numpy reference
def _split(a, parts, axis, index):
    return np.split(a, parts, axis=axis)[index]


def _input_shape(name: str, shape: tuple, G: int) -> tuple:
    """The local input shape a mapping expects, for the global shape ``(S, ..., H)``."""
    S, H = shape[0], shape[-1]
    if name in ("gather_from_hidden", "all_to_all_from_hidden_to_sequence"):
        return shape[:-1] + (H // G,)
    if name.startswith("gather_from_sequence") or name == "all_to_all_from_sequence_to_hidden":
        return (S // G,) + shape[1:]
    return shape


def _output_shape(name: str, in_shape: tuple, G: int) -> tuple:
    """The output shape of a mapping for the local input shape ``in_shape``."""
    first, last = in_shape[0], in_shape[-1]
    if name in ("scatter_to_hidden", "all_to_all_from_sequence_to_hidden"):
        last //= G
    if name in ("gather_from_hidden", "all_to_all_from_hidden_to_sequence"):
        last *= G
    if name in ("scatter_to_sequence", "reduce_scatter_to_sequence",
                "all_to_all_from_hidden_to_sequence"):
        first //= G
    if name.startswith("gather_from_sequence") or name == "all_to_all_from_sequence_to_hidden":
        first *= G
    return (first,) + tuple(in_shape[1:-1]) + (last,)


def reference(name: str, xs: list, cs: list, r: int):
    """Forward output and input gradient of mapping ``name`` on group rank ``r``.

    Args:
        name: One of :data:`MAPPING_NAMES`.
        xs: Every group rank's input, by group rank.
        cs: Every group rank's upstream gradient (same shape as its output).
        r: The group rank to compute for.
    """
    G = len(xs)
    if name == "copy_to_all":
        return xs[r], sum(cs)
    if name == "reduce_from_all":
        return sum(xs), cs[r]
    if name == "scatter_to_hidden":
        return _split(xs[r], G, -1, r), np.concatenate(cs, -1)
    if name == "gather_from_hidden":
        return np.concatenate(xs, -1), _split(cs[r], G, -1, r)
    if name == "scatter_to_sequence":
        return _split(xs[r], G, 0, r), np.concatenate(cs, 0)
    if name == "gather_from_sequence":
        return np.concatenate(xs, 0), _split(sum(cs), G, 0, r)
    if name == "gather_from_sequence(tensor_parallel_output_grad=False)":
        return np.concatenate(xs, 0), _split(cs[r], G, 0, r)
    if name == "reduce_scatter_to_sequence":
        return _split(sum(xs), G, 0, r), np.concatenate(cs, 0)
    if name == "all_to_all_from_hidden_to_sequence":
        return _split(np.concatenate(xs, -1), G, 0, r), _split(np.concatenate(cs, 0), G, -1, r)
    if name == "all_to_all_from_sequence_to_hidden":
        return _split(np.concatenate(xs, 0), G, -1, r), _split(np.concatenate(cs, -1), G, 0, r)
    raise ValueError(f"unknown mapping {name!r}: expected one of {', '.join(MAPPING_NAMES)}")


def _ints(shape, *key) -> np.ndarray:
    rng = np.random.default_rng([abs(int(k)) for k in key])
    return rng.integers(LOW, HIGH, size=shape).astype(np.float32)


def _mapping_fn(name: str):
    from mindscience.distributed import mappings as M

    if name == "gather_from_sequence(tensor_parallel_output_grad=False)":
        return lambda x, g: M.gather_from_sequence(x, g, tensor_parallel_output_grad=False)
    if name not in MAPPING_NAMES:
        raise ValueError(f"unknown mapping {name!r}: expected one of {', '.join(MAPPING_NAMES)}")
    return getattr(M, name)


def _ms_dtype(name: str):
    import mindspore as ms

    try:
        return {"float32": ms.float32, "float16": ms.float16, "bfloat16": ms.bfloat16}[name]
    except KeyError:
        raise ValueError(f"dtype {name!r} is not supported: expected one of {', '.join(DTYPES)}") from None


def _err(got: np.ndarray, want: np.ndarray) -> float:
    if got.shape != want.shape:
        return float("inf")
    if got.size == 0:
        return 0.0
    return float(np.max(np.abs(got.astype(np.float64) - want.astype(np.float64))))


# ------------------------------------------------------------------ manager helpers
def _ensure_manager(ctx: CheckContext):
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
            order="-".join(ctx.layout.axes),
        )
    return manager


def _current_layout_args(manager):
    if not manager.is_initialized():
        return None
    lay = manager.get_layout()
    return dict(tensor_parallel_size=lay.tp, context_parallel_size=lay.cp,
                pipeline_parallel_size=lay.pp, order="-".join(lay.axes))


def _restore(manager, args) -> None:
    manager.destroy_parallel()
    if args is not None:
        manager.initialize_parallel(**args)


def _layout_label(lay) -> str:
    return f"tp{lay.tp}-cp{lay.cp}-dp{lay.dp}-pp{lay.pp}:{'-'.join(lay.axes)}"


# ------------------------------------------------------------------ mappings.all
def _resolve_shape(shape, G: int) -> list[int]:
    """A global shape whose entries may be multiples of the group size: ``["G", 3, "2G"]``.

    Lets one spec (e.g. ``msdist verify``'s) fit groups of every size.
    """
    dims = []
    for dim in shape:
        if isinstance(dim, str) and dim.strip().upper().endswith("G"):
            factor = dim.strip()[:-1]
            dims.append((int(factor) if factor else 1) * G)
        else:
            dims.append(int(dim))
    return dims


def run_mappings(groups, dtypes=DTYPES, shapes=None, mappings=MAPPING_NAMES, seed=0,
                 group_api="object", extra=None) -> list[dict]:
    """Run every (group, mapping, dtype, shape) combination; see ``mappings.all``.

    Args:
        groups: ``{key: ParallelGroup}``, in the same order on every rank.
        extra: Fields added to every record (e.g. the layout).

    Raises:
        RuntimeError: a mapping raised; the message names the combination. The rank
            must stop then: the other ranks are out of step with it.
    """
    import mindspore as ms

    from mindscience.distributed import collectives as C

    backend = C.get_backend()
    records = []
    for gi, (key, group) in enumerate(groups.items()):
        G, r = group.size, group.rank
        arg = group
        if group_api == "name" and G > 1:
            arg = group.group_name
        elif group_api not in ("object", "name"):
            raise ValueError(f"group_api={group_api!r} is invalid: expected 'object' or 'name'")
        group_shapes = [_resolve_shape(s, G) for s in shapes] if shapes else [[2 * G, 2 * G], [G, 3, 2 * G]]
        for mi, name in enumerate(mappings):
            fn = _mapping_fn(name)
            for di, dtype in enumerate(dtypes):
                mdt = _ms_dtype(dtype)
                for si, shape in enumerate(group_shapes):
                    shape = tuple(int(s) for s in shape)
                    if shape[0] % G or shape[-1] % G or len(shape) < 2:
                        raise ValueError(
                            f"mappings.all: shape {list(shape)} does not fit group {key!r} of "
                            f"size {G}: expected rank >= 2 and first and last dims divisible "
                            f"by {G}"
                        )
                    in_shape = _input_shape(name, shape, G)
                    xs = [_ints(in_shape, seed, gr, mi, di, si, 0) for gr in group.ranks]
                    out_shape = _output_shape(name, in_shape, G)
                    cs = [_ints(out_shape, seed, gr, mi, di, si, 1) for gr in group.ranks]
                    want_out, want_grad = reference(name, xs, cs, r)
                    record = {
                        "check": f"mapping.{name}", "group": key, "group_size": G,
                        "dtype": dtype, "shape": list(shape), "input_shape": list(in_shape),
                        "output_shape": list(out_shape), "direction": "forward+backward",
                        "group_api": group_api, "backend": backend.name,
                        "collectives": list(_COLLECTIVES[name]),
                        "composed": [op for op in _COLLECTIVES[name] if backend.composed[op]],
                        **(extra or {}),
                    }
                    x = ms.Tensor(xs[r]).astype(mdt)
                    c = ms.Tensor(cs[r])

                    def loss_fn(t, fn=fn, c=c):
                        out = fn(t, arg)
                        return (out.astype(ms.float32) * c).sum(), out

                    calls0 = C.call_count()
                    try:
                        if dtype == "float32":
                            record["autograd"] = "ms.value_and_grad"
                            (loss, out), grad = ms.value_and_grad(loss_fn, grad_position=0, has_aux=True)(x)
                            want_loss = float(np.sum(want_out.astype(np.float64) * cs[r]))
                            loss_error = abs(float(loss.asnumpy()) - want_loss)
                        else:
                            record["autograd"] = "ms.grad"
                            grad, (out,) = ms.grad(loss_fn, grad_position=0, has_aux=True)(x)
                            loss_error = 0.0
                    except Exception as exc:
                        raise RuntimeError(
                            f"mapping.{name} raised on group {key!r} (size {G}, group rank {r}), "
                            f"dtype {dtype}, global shape {list(shape)}: {exc}"
                        ) from exc
                    calls = C.call_count() - calls0
                    got_out = out.astype(ms.float32).asnumpy()
                    got_grad = grad.astype(ms.float32).asnumpy()
                    fwd, bwd = _err(got_out, want_out), _err(got_grad, want_grad)
                    tol = TOLERANCE[dtype]
                    dtypes_ok = out.dtype == mdt and grad.dtype == mdt
                    identity_ok = G > 1 or calls == 0
                    record.update(
                        passed=bool(fwd <= tol and bwd <= tol and loss_error <= tol
                                    and dtypes_ok and identity_ok),
                        max_error=max(fwd, bwd, loss_error),
                        forward_error=fwd, backward_error=bwd, loss_error=loss_error,
                        backend_calls=calls,
                    )
                    if not dtypes_ok:
                        record["error"] = f"dtype changed: out {out.dtype}, grad {grad.dtype}, expected {mdt}"
                    elif not identity_ok:
                        record["error"] = f"size-1 group made {calls} backend calls, expected 0"
                    elif not record["passed"]:
                        record["error"] = (
                            f"shapes out {list(got_out.shape)} (want {list(want_out.shape)}), "
                            f"grad {list(got_grad.shape)} (want {list(want_grad.shape)})"
                        )
                    records.append(record)
    return records


def _groups_of(manager, keys) -> dict:
    """``{label: group}`` for ``keys`` (default: every axis of size > 1), see
    :func:`~mindscience.distributed.harness.checks.groups.distinct_groups`."""
    if keys is None:
        lay = manager.get_layout()
        keys = [k for k in AXIS_KEYS if lay.size(k) > 1]
    return distinct_groups(manager, keys)


@check("mappings.all")
def mappings_all(ctx: CheckContext, groups=None, dtypes=DTYPES, shapes=None,
                 mappings=MAPPING_NAMES, seed=0, group_api="object") -> list[dict]:
    """Every mapping forward and backward against numpy (see the module docstring)."""
    manager = _ensure_manager(ctx)
    return run_mappings(_groups_of(manager, groups), dtypes=dtypes, shapes=shapes,
                        mappings=mappings, seed=seed, group_api=group_api)


# ------------------------------------------------------------------ mappings.errors
def _expect_value_error(fn, must_contain) -> tuple[bool, str]:
    try:
        fn()
    except ValueError as exc:
        msg = str(exc)
        missing = [s for s in must_contain if s not in msg]
        if missing:
            return False, f"ValueError without {missing}: {msg}"
        return True, msg
    except Exception as exc:  # noqa: BLE001
        return False, f"expected ValueError, got {type(exc).__name__}: {exc}"
    return False, "no error raised"


@check("mappings.errors")
def mappings_errors(ctx: CheckContext, groups=None) -> list[dict]:
    """Non-divisible dims and too-low ranks raise ValueError before any collective."""
    import mindspore as ms

    from mindscience.distributed import collectives as C
    from mindscience.distributed import mappings as M

    manager = _ensure_manager(ctx)
    records = []
    for key, group in _groups_of(manager, groups).items():
        G = group.size
        if G == 1:
            continue
        bad = G + 1 if G > 2 else 3  # not divisible by G
        cases = [
            ("scatter_to_hidden", (2 * G, bad), "last dim", bad),
            ("scatter_to_sequence", (bad, 2 * G), "first dim", bad),
            ("reduce_scatter_to_sequence", (bad, 2, 2 * G), "first dim", bad),
            ("all_to_all_from_hidden_to_sequence", (bad, 2 * G), "first dim", bad),
            ("all_to_all_from_sequence_to_hidden", (2 * G, 3, bad), "last dim", bad),
            ("all_to_all_from_hidden_to_sequence", (2 * G,), "rank >= 2", None),
            ("all_to_all_from_sequence_to_hidden", (2 * G,), "rank >= 2", None),
        ]
        for name, shape, what, size in cases:
            x = ms.Tensor(np.zeros(shape, np.float32))
            fn = getattr(M, name)
            must = [name, what] + ([f"size {size}", f"group size {G}"] if size else [])
            calls0 = C.call_count()
            ok, msg = _expect_value_error(lambda fn=fn, x=x: fn(x, group), must)
            calls = C.call_count() - calls0
            records.append({
                "check": f"mapping_error.{name}", "group": key, "group_size": G,
                "shape": list(shape), "case": what,
                "passed": bool(ok and calls == 0), "max_error": 0.0,
                "message": msg, "backend_calls": calls,
            })
    return records


# ------------------------------------------------------------------ manager.reinit
def check_groups_against_plan(manager, rank: int, keys, extra=None) -> list[dict]:
    """Compare every runtime group of ``keys`` with ``Layout.group_of`` of a fresh plan."""
    import mindspore as ms
    from mindspore.communication import get_group_size
    from mindspore.communication import get_rank as backend_rank

    from mindscience.distributed import collectives as C
    from mindscience.distributed.topology import Layout

    lay = manager.get_layout()
    plan = Layout(world_size=lay.world_size, tp=lay.tp, cp=lay.cp, pp=lay.pp, order="-".join(lay.axes))
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
                   dtypes=("float32",), shapes=None, mappings=MAPPING_NAMES, seed=0) -> list[dict]:
    """Several layouts in one process via destroy/initialize (see the module docstring)."""
    from mindscience.distributed import manager

    if not layouts:
        raise ValueError("manager.reinit needs layouts, e.g. [{'tp': 2, 'cp': 2}]")
    before = _current_layout_args(manager)
    records = []
    for item in layouts:
        item = dict(item)
        manager.destroy_parallel()
        lay = manager.initialize_parallel(
            tensor_parallel_size=item.get("tp", 1),
            context_parallel_size=item.get("cp", 1),
            pipeline_parallel_size=item.get("pp", 1),
            order=item.get("order", "tp-cp-dp-pp"),
        )
        # "case" is one of the launcher's identity keys: it keeps layouts apart on merge.
        extra = {"layout": _layout_label(lay), "case": _layout_label(lay)}
        records += check_groups_against_plan(manager, ctx.rank, list(keys), extra)
        if mappings:
            records += run_mappings(_groups_of(manager, None), dtypes=dtypes, shapes=shapes,
                                    mappings=mappings, seed=seed, extra=extra)
    _restore(manager, before)
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

    before = _current_layout_args(manager)
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
        _restore(manager, before)
    return records
