"""Checks of the communication mappings, run inside every rank.

Used by the test suite and by ``msdist verify``. Every value is checked against a numpy
reference (:mod:`.mapping_reference`) that each rank computes on its own: the inputs of
every rank are small integers drawn from ``(seed, global rank, ...)``, so every rank
knows every other rank's input, and sums of them are exact in float32, float16 and
bfloat16 (as nccl-tests does). The upstream gradient is ``C_r``, the cotangent of
``loss = sum(out * C_r)``, again small integers known to all ranks.

Checks (all params optional):

``mappings.all``
    Each mapping forward and backward on each group, dtype, shape and execution mode.
    One record per combination::

        {"check": "mapping.scatter_to_hidden", "group": "tp", "group_size": 2,
         "mode": "jit", "dtype": "bfloat16", "shape": [4, 4], "input_shape": [4, 4],
         "output_shape": [4, 2], "split_sizes": None, "direction": "forward+backward",
         "autograd": "ms.grad", "passed": True, "max_error": 0.0,
         "forward_error": 0.0, "backward_error": 0.0,
         "collectives": ["all_gather"], "composed": [], "backend": "composed",
         "backend_calls": 2}

    ``shape`` is the global (full) shape ``(S, ..., H)``; each mapping's input is the
    shard of it that the mapping expects. Params: ``groups`` (manager keys; default
    every axis of size > 1; keys whose groups hold the same ranks run once, labelled
    ``"cp=dp-cp"``), ``dtypes``, ``shapes`` (default ``[[2G, 2G], [G, 3, 2G]]`` per
    group of size G), ``mappings`` (names, default all, see :data:`MAPPING_NAMES`),
    ``modes`` (``pynative``, ``jit``, ``graph``; default pynative, see :mod:`.modes`),
    ``split_sizes`` (a list of ragged splits, e.g. ``[[2, 1, 1, 1], [1, 1, 1, 0]]``:
    each split whose length is the group size runs the sequence mappings with
    ``split_sizes=`` on the global shape ``(sum(split),) + shape[1:]``; ``"auto"``: one
    split per group, ``[3, 2, ..., 2]``, i.e. S = 2G + 1), ``seed``,
    ``group_api`` (``"object"``: pass the ParallelGroup; ``"name"``: pass its backend
    group name). float32 runs use ``ms.value_and_grad`` (the loss is checked too),
    float16/bfloat16 ``ms.grad``. A size-1 group must be the identity with no backend
    call.

``mappings.errors``
    Non-divisible dims (and rank < 2 for the all-to-alls), and bad ``split_sizes``
    (wrong count, negative, not summing to the dim, not this rank's rows), raise
    ``ValueError`` naming the mapping, the sizes and the dim, on every rank, with no
    backend call. In compiled code (``modes`` with jit/graph) a non-divisible dim
    raises the same ``ValueError`` at trace time, and a backend group name that was
    never resolved raises a ``RuntimeError`` naming ms.jit and the alternative.
    Params: ``groups``, ``modes``.
"""

from __future__ import annotations

import mindspore as ms
import numpy as np
from mindspore import ops

from mindscience.distributed import mappings as M

from ..registry import CheckContext, check
from .groups import ensure_manager, groups_of
from .mapping_reference import (
    COLLECTIVES,
    DTYPES,
    MAPPING_NAMES,
    SEQUENCE_MAPPINGS,
    TOLERANCE,
    input_shape,
    ints,
    max_error,
    output_shape,
    reference,
)
from .modes import check_mode, value_and_grad, value_and_grad_many

__all__ = ["MAPPING_NAMES", "SEQUENCE_MAPPINGS", "DTYPES", "reference", "run_mappings"]

_groups_of = groups_of  # the name the tests know


def _gather_no_reduce(x, group, split_sizes=None):
    # A module-level function, not a lambda or a closure: compiled code parses what it
    # calls, and rejects lambdas and functions whose scope imports.
    return M.gather_from_sequence(x, group, False, split_sizes)


def _mapping_fn(name: str):
    if name == "gather_from_sequence(tensor_parallel_output_grad=False)":
        return _gather_no_reduce
    if name not in MAPPING_NAMES:
        raise ValueError(f"unknown mapping {name!r}: expected one of {', '.join(MAPPING_NAMES)}")
    return getattr(M, name)


def _ms_dtype(name: str):
    import mindspore as ms

    try:
        return {"float32": ms.float32, "float16": ms.float16, "bfloat16": ms.bfloat16}[name]
    except KeyError:
        raise ValueError(f"dtype {name!r} is not supported: expected one of {', '.join(DTYPES)}") from None


def _make_loss(fn, arg, c, sizes):
    """``loss(t) = (sum(fn(t) * c), fn(t))`` as a closure (compiled code takes no defaults)."""
    # The products are flattened and given one extra zero before the sum: MindSpore's
    # CPU sum of an EMPTY tensor (a zero-row shard) is not 0 (measured).
    zero = ops.zeros((1,), ms.float32)
    if sizes is None:
        def loss(t):
            out = fn(t, arg)
            return ops.cat(((out.astype(ms.float32) * c).reshape((-1,)), zero)).sum(), out
    else:
        def loss(t):
            out = fn(t, arg, split_sizes=sizes)
            return ops.cat(((out.astype(ms.float32) * c).reshape((-1,)), zero)).sum(), out
    return loss


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


def _cases(G, shapes, mappings, split_sizes):
    """``(mapping, global shape, sizes)`` to run on a group of size G."""
    group_shapes = [_resolve_shape(s, G) for s in shapes] if shapes else [[2 * G, 2 * G], [G, 3, 2 * G]]
    cases = []
    if split_sizes is None:
        for name in mappings:
            for shape in group_shapes:
                cases.append((name, tuple(int(s) for s in shape), None))
        return cases
    if split_sizes == "auto":
        # One ragged split per group size: S = 2G + 1, the first rank holding 3 rows.
        split_sizes = [[3] + [2] * (G - 1)]
    for sizes in split_sizes:
        if len(sizes) != G:
            continue
        for name in mappings:
            if name not in SEQUENCE_MAPPINGS:
                continue
            for shape in group_shapes:
                cases.append((name, (int(sum(sizes)),) + tuple(int(s) for s in shape[1:]),
                              tuple(int(s) for s in sizes)))
    return cases


def run_mappings(groups, dtypes=DTYPES, shapes=None, mappings=MAPPING_NAMES, seed=0,
                 group_api="object", extra=None, modes=("pynative",), split_sizes=None) -> list[dict]:
    """Run every (group, mapping, dtype, shape, mode) combination; see ``mappings.all``.

    Args:
        groups: ``{key: ParallelGroup}``, in the same order on every rank.
        extra: Fields added to every record (e.g. the layout).
        split_sizes: Ragged splits to run the sequence mappings with (None: even).

    Raises:
        RuntimeError: a mapping raised; the message names the combination. The rank
            must stop then: the other ranks are out of step with it.
    """
    import mindspore as ms

    from mindscience.distributed import collectives as C

    for mode in modes:
        check_mode(mode)
    if group_api not in ("object", "name"):
        raise ValueError(f"group_api={group_api!r} is invalid: expected 'object' or 'name'")
    backend = C.get_backend()
    records = []
    pending: dict = {}
    for key, group in groups.items():
        G, r = group.size, group.rank
        arg = group
        if group_api == "name" and G > 1:
            arg = group.group_name
            C.resolve_group(arg)  # compiled code only sees names resolved eagerly before
        for ci, (name, shape, sizes) in enumerate(_cases(G, shapes, mappings, split_sizes)):
            mi = MAPPING_NAMES.index(name)
            if len(shape) < 2 or (sizes is None and (shape[0] % G or shape[-1] % G)) or shape[-1] % G:
                raise ValueError(
                    f"mappings.all: shape {list(shape)} does not fit group {key!r} of size "
                    f"{G}: expected rank >= 2 and the last dim (and the first, for even "
                    f"splits) divisible by {G}"
                )
            fn = _mapping_fn(name)
            for di, dtype in enumerate(dtypes):
                mdt = _ms_dtype(dtype)
                xs = [ints(input_shape(name, shape, G, gr, sizes), seed, rank, mi, di, ci, 0)
                      for gr, rank in enumerate(group.ranks)]
                cs = [ints(output_shape(name, shape, G, gr, sizes), seed, rank, mi, di, ci, 1)
                      for gr, rank in enumerate(group.ranks)]
                want_out, want_grad = reference(name, xs, cs, r, sizes)
                for mode in modes:
                    case = _Case(name, fn, arg, key, G, r, dtype, mdt, shape, sizes, mode,
                                 xs[r], cs[r], want_out, want_grad)
                    if mode == "pynative":  # nothing to compile: one at a time
                        records += _run_cases(C, ms, [case], group_api, backend, extra)
                    else:
                        pending.setdefault((mode, dtype), []).append(case)
        # One compiled graph per (mode, dtype) and group, even and uneven splits alike:
        # see modes.value_and_grad_many.
        for cases in pending.values():
            records += _run_cases(C, ms, cases, group_api, backend, extra)
        pending.clear()
    return records


class _Case:
    """One (mapping, group, dtype, shape, split, mode) combination and its reference."""

    def __init__(self, name, fn, arg, key, G, r, dtype, mdt, shape, sizes, mode,
                 x_np, c_np, want_out, want_grad):
        self.name, self.fn, self.arg, self.key, self.G, self.r = name, fn, arg, key, G, r
        self.dtype, self.mdt, self.shape, self.sizes, self.mode = dtype, mdt, shape, sizes, mode
        self.x_np, self.c_np, self.want_out, self.want_grad = x_np, c_np, want_out, want_grad

    def describe(self) -> str:
        return (f"mapping.{self.name} on group {self.key!r} (size {self.G}, group rank "
                f"{self.r}), mode {self.mode}, dtype {self.dtype}, global shape "
                f"{list(self.shape)}, split_sizes {self.sizes}")


def _run_cases(C, ms, cases, group_api, backend, extra) -> list[dict]:
    """Run cases of one mode and dtype (compiled: as one graph) and check each."""
    mode, dtype = cases[0].mode, cases[0].dtype
    with_value = dtype == "float32"
    xs = [ms.Tensor(case.x_np).astype(case.mdt) for case in cases]
    losses = [_make_loss(case.fn, case.arg, ms.Tensor(case.c_np), case.sizes) for case in cases]
    calls0 = C.call_count()
    try:
        results = value_and_grad_many(mode, losses, xs, with_value)
    except Exception as exc:
        what = cases[0].describe() if len(cases) == 1 else (
            f"one of {len(cases)} cases compiled together: "
            + "; ".join(case.describe() for case in cases))
        raise RuntimeError(f"{what} raised: {exc}") from exc
    # Per case; compiled code calls the backend while it traces, once per graph.
    calls = (C.call_count() - calls0) // len(cases)
    return [_check_case(case, loss, out, grad, calls, with_value, group_api, backend, extra,
                        batch=len(cases))
            for case, ((loss, out), grad) in zip(cases, results)]


def _check_case(case, loss, out, grad, calls, with_value, group_api, backend, extra,
                batch) -> dict:
    name, G, sizes, dtype, mdt = case.name, case.G, case.sizes, case.dtype, case.mdt
    record = {
        "check": f"mapping.{name}", "group": case.key, "group_size": G, "mode": case.mode,
        "dtype": dtype, "shape": list(case.shape), "input_shape": list(case.x_np.shape),
        "output_shape": list(case.c_np.shape), "split_sizes": list(sizes) if sizes else None,
        "split": "uneven" if sizes else "even",
        "direction": "forward+backward", "group_api": group_api, "backend": backend.name,
        "collectives": list(COLLECTIVES[name]),
        "composed": [op for op in COLLECTIVES[name] if backend.composed[op]],
        "autograd": "ms.value_and_grad" if with_value else "ms.grad",
        # How many cases were differentiated in the same compiled graph (1: alone).
        "compiled_with": batch,
        **(extra or {}),
    }
    loss_error = 0.0
    if with_value:
        want_loss = float(np.sum(case.want_out.astype(np.float64) * case.c_np))
        loss_error = abs(float(loss.asnumpy()) - want_loss)
    got_out = out.astype(ms.float32).asnumpy()
    got_grad = grad.astype(ms.float32).asnumpy()
    fwd, bwd = max_error(got_out, case.want_out), max_error(got_grad, case.want_grad)
    tol = TOLERANCE[dtype]
    dtypes_ok = out.dtype == mdt and grad.dtype == mdt
    identity_ok = G > 1 or calls == 0
    record.update(
        passed=bool(fwd <= tol and bwd <= tol and loss_error <= tol and dtypes_ok and identity_ok),
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
            f"shapes out {list(got_out.shape)} (want {list(case.want_out.shape)}), "
            f"grad {list(got_grad.shape)} (want {list(case.want_grad.shape)})"
        )
    return record


@check("mappings.all")
def mappings_all(ctx: CheckContext, groups=None, dtypes=DTYPES, shapes=None,
                 mappings=MAPPING_NAMES, seed=0, group_api="object", modes=("pynative",),
                 split_sizes=None) -> list[dict]:
    """Every mapping forward and backward against numpy (see the module docstring)."""
    manager = ensure_manager(ctx)
    return run_mappings(groups_of(manager, groups), dtypes=dtypes, shapes=shapes,
                        mappings=mappings, seed=seed, group_api=group_api, modes=modes,
                        split_sizes=split_sizes)


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


def _split_size_cases(G: int, r: int):
    """``(label, mapping, input shape, split_sizes, words the message must hold)``."""
    even = [2] * G
    mine = [1] * G
    mine[r] = 2  # a split that gives this rank 2 rows when its input has 1
    return [
        ("wrong_count", "scatter_to_sequence", (2 * G, 2), [2] * (G + 1), ["must be a list of", str(G)]),
        ("negative", "reduce_scatter_to_sequence", (2 * G, 2), [-1] + [2] * (G - 2) + [2 * 1 + 1],
         ["integers >= 0", "-1"]),
        ("not_summing", "scatter_to_sequence", (2 * G + 1, 2), even, ["sum to", "first dim is"]),
        ("not_summing_a2a", "all_to_all_from_hidden_to_sequence", (2 * G + 1, 2 * G), even,
         ["sum to", f"{2 * G + 1}"]),
        ("not_my_rows", "gather_from_sequence", (1, 2), mine, ["group rank", "rows"]),
        ("not_my_rows_a2a", "all_to_all_from_sequence_to_hidden", (1, 2 * G), mine,
         ["group rank", "rows"]),
    ]


def _compiled_errors(ms, M, C, key, group, mode) -> list[dict]:
    """In compiled code: a non-divisible dim, and a never-resolved backend name."""
    G = group.size
    x = ms.Tensor(np.zeros((G + 1, 2 * G), np.float32))
    gather_name = "never-resolved-group-name"

    def bad_dim(t):
        out = M.scatter_to_sequence(t, group)
        return out.sum(), out

    def bad_name(t):
        out = M.gather_from_hidden(t, gather_name)
        return out.sum(), out

    records = []
    for label, loss, exc_type, must in (
        ("compiled_non_divisible", bad_dim, ValueError,
         ["scatter_to_sequence", "first dim", f"size {G + 1}", "even_split_sizes"]),
        ("compiled_unknown_group_name", bad_name, RuntimeError,
         ["ms.jit", "ParallelGroup", gather_name]),
    ):
        calls0 = C.call_count()
        try:
            value_and_grad(mode, loss, x)
            ok, msg = False, "no error raised"
        except exc_type as exc:
            msg = str(exc)
            missing = [s for s in must if s not in msg]
            ok = not missing
            if missing:
                msg = f"message lacks {missing}: {msg}"
        except Exception as exc:  # noqa: BLE001
            ok, msg = False, f"expected {exc_type.__name__}, got {type(exc).__name__}: {exc}"
        records.append({
            "check": f"mapping_error.{label}", "group": key, "group_size": G, "mode": mode,
            "case": f"{label}:{mode}", "passed": bool(ok and C.call_count() == calls0),
            "max_error": 0.0, "message": msg[:2000],
        })
    return records


@check("mappings.errors")
def mappings_errors(ctx: CheckContext, groups=None, modes=()) -> list[dict]:
    """Bad dims, ranks and split sizes raise before any collective (also when compiled)."""
    import mindspore as ms

    from mindscience.distributed import collectives as C

    manager = ensure_manager(ctx)
    records = []
    for key, group in groups_of(manager, groups).items():
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
        for label, name, shape, sizes, words in _split_size_cases(G, group.rank):
            x = ms.Tensor(np.zeros(shape, np.float32))
            fn = getattr(M, name)
            calls0 = C.call_count()
            ok, msg = _expect_value_error(
                lambda fn=fn, x=x, sizes=sizes: fn(x, group, split_sizes=sizes),
                [name, "split_sizes"] + words)
            calls = C.call_count() - calls0
            records.append({
                "check": f"mapping_error.split_sizes.{label}", "group": key, "group_size": G,
                "shape": list(shape), "case": label, "split_sizes": list(sizes),
                "passed": bool(ok and calls == 0), "max_error": 0.0,
                "message": msg, "backend_calls": calls,
            })
        for mode in modes:
            if check_mode(mode) != "pynative":
                records += _compiled_errors(ms, M, C, key, group, mode)
    return records


