"""Checks of the parallel layers against a dense ``mint.nn.Linear``.

Every rank builds the dense layer and the parallel layer after the same
``mindspore.set_seed``, feeds both the same data (the parallel one its share of it) and
compares, on its own shard: the initial parameters (must be bit-identical), the output,
the input gradient and the weight and bias gradients of ``sum(output * C)`` for a fixed
random ``C``. Nothing is gathered for the comparison, so a wrong shard on any rank fails
that rank's record.

Checks (all take ``tp`` / ``cp``: the parallel sizes to run under; default: the spec's
layout, else the sizes already initialized, else ``tp`` = all ranks):

* ``layers.init_exact``: shards of ``initialize_affine_weight`` and of both layers equal
  the slices of the dense tensors, exactly.
* ``layers.column`` / ``layers.row``: one configuration (``bias``, ``gather_output`` or
  ``input_is_parallel``, ``sequence_parallel``, ``skip_bias_add``).
* ``layers.matrix``: every configuration of both layers, one record each.
* ``layers.errors``: bad sizes raise ``ValueError`` before any communication.
* ``layers.modes``: representative configurations compiled (``ms.jit`` of the grad
  function, ``construct = ms.jit(construct)``, GRAPH_MODE): equal to the dense layer
  and to the same layer in PyNative (``pynative_diff``).
* ``layers.dense_equivalence``: the three above in one step (what ``msdist verify`` runs).

``layers.column`` / ``layers.row`` also take ``split_sizes`` (with ``sequence_parallel``):
an uneven sequence such as ``[3, 0, 2, 1]`` on tp = 4, or ``"auto"`` (S = tp + 1).

The ``examples.*`` checks (the scripts in ``examples/``) live in :mod:`.examples`.

Example spec (4 ranks; ``tp=2`` makes two tp groups of 2)::

    {"checks": [{"name": "layers.matrix", "params": {"tp": 2}}]}
"""

from __future__ import annotations

import itertools

import numpy as np

from ..registry import CheckContext, check

DEFAULT_ATOL = 1e-4
# Tolerances for low-precision compute, on errors scaled by max(1, max |dense value|):
# a few units of the dtype's rounding error (bfloat16 2**-8, float16 2**-11).
LOW_PRECISION_TOL = {"float16": 3e-3, "bfloat16": 2e-2}


# ----------------------------------------------------------------------------- setup
def _ensure_parallel(ctx: CheckContext, tp=None, cp=None):
    """Initialize the manager for (tp, cp), reusing the groups in force when they fit.

    Returns the tensor-parallel group. Every rank runs the same checks in the same
    order, so the (collective) group creation happens in step on all ranks.
    """
    from mindscience.distributed import manager

    layout = ctx.layout
    current = manager.get_layout() if manager.is_initialized() else None
    if tp is None and cp is None:
        if layout is not None:
            want = dict(tp=layout.tp, cp=layout.cp, pp=layout.pp, order="-".join(layout.axes))
        elif current is not None:
            return manager.get_tensor_parallel_group()
        else:
            want = dict(tp=ctx.world_size, cp=1, pp=1, order=None)
    else:
        want = dict(tp=tp or 1, cp=cp or 1, pp=1, order=None)
    if current is not None and (current.tp, current.cp, current.pp) == (want["tp"], want["cp"], want["pp"]) \
            and (want["order"] is None or "-".join(current.axes) == want["order"]):
        return manager.get_tensor_parallel_group()
    manager.destroy_parallel()
    kwargs = dict(tensor_parallel_size=want["tp"], context_parallel_size=want["cp"],
                  pipeline_parallel_size=want["pp"])
    if want["order"]:
        kwargs["order"] = want["order"]
    manager.initialize_parallel(**kwargs)
    return manager.get_tensor_parallel_group()


def _dtype(name):
    import mindspore as ms

    return getattr(ms, name) if isinstance(name, str) else name


# ----------------------------------------------------------------------------- helpers
def _np(t):
    return t.asnumpy() if hasattr(t, "asnumpy") else np.asarray(t)


def _err(a, b, scaled: bool = False) -> float:
    """Max abs difference; ``scaled`` divides it by ``max(1, max |b|)``. inf on a shape mismatch."""
    a, b = _np(a).astype(np.float64), _np(b).astype(np.float64)
    if a.shape != b.shape:
        return float("inf")
    if not a.size:
        return 0.0
    err = float(np.max(np.abs(a - b)))
    return err / max(1.0, float(np.max(np.abs(b)))) if scaled else err


def _chunk(a, group, dim):
    """Group-rank ``group.rank``'s chunk of ``a`` along ``dim`` (numpy or Tensor)."""
    n = a.shape[dim] // group.size
    index = [slice(None)] * len(a.shape)
    index[dim] = slice(group.rank * n, (group.rank + 1) * n)
    return a[tuple(index)]


def _seq_chunk(a, group, sizes):
    """This rank's rows of ``a`` (dim 0): the even chunk, or ``sizes[rank]`` rows at the
    shard's offset when ``sizes`` (an uneven split) is given."""
    if sizes is None:
        return _chunk(a, group, 0)
    start = sum(sizes[:group.rank])
    return a[start:start + sizes[group.rank]]


def _resolve_split_sizes(split_sizes, group_size, seq_len, sequence_parallel):
    """``(sizes or None, seq_len)`` for ``compare_with_dense``'s ``split_sizes``.

    ``None``: the even split of ``seq_len``. ``"auto"``: a ragged split of S = G + 1 rows
    (``[2, 1, ..., 1]``). A list: one size per tp rank (zeros allowed); S is their sum.
    """
    if split_sizes is None:
        return None, seq_len
    if not sequence_parallel:
        raise ValueError(
            f"split_sizes={split_sizes!r} needs sequence_parallel=True: only sequence-"
            "parallel layers shard the sequence"
        )
    if split_sizes == "auto":
        from mindscience.distributed.mappings import even_split_sizes

        return even_split_sizes(group_size + 1, group_size), group_size + 1
    if not isinstance(split_sizes, (list, tuple)) or len(split_sizes) != group_size or any(
            isinstance(s, bool) or not isinstance(s, (int, np.integer)) or s < 0 for s in split_sizes):
        raise ValueError(
            f"split_sizes={split_sizes!r} is invalid: expected 'auto' or a list of "
            f"{group_size} integers >= 0 (one per tp rank)"
        )
    return [int(s) for s in split_sizes], int(sum(split_sizes))


LAYER_MODES = ("pynative", "jit", "jit-construct", "graph")


def _make_layer_loss(net, cot, skip_bias_add, split_sizes=None):
    def loss_fn(inp):
        out = net(inp) if split_sizes is None else net(inp, split_sizes=split_sizes)
        if skip_bias_add:  # the caller adds the returned bias, as a fused kernel would
            out, bias = out
            if bias is not None:
                out = out + bias
        return (out * cot).sum(), out

    return loss_fn


def _forward_backward(net, x, cot, skip_bias_add, mode="pynative", split_sizes=None):
    """Output, input gradient and {param name: gradient} of ``sum(out * cot)``.

    ``split_sizes`` (an uneven sequence split) is passed to the call: ``net(x, split_sizes=...)``.

    ``mode``: ``pynative``; ``jit`` (the value_and_grad function compiled with
    ``ms.jit``); ``jit-construct`` (``net.construct = ms.jit(net.construct)``, eager
    autograd around it); ``graph`` (GRAPH_MODE, the loss as a Cell).
    """
    import mindspore as ms

    from .modes import _COMPILED_KEEP_ALIVE, _LossCell

    if mode not in LAYER_MODES:
        raise ValueError(f"mode {mode!r} is invalid: expected one of {', '.join(LAYER_MODES)}")
    params = net.trainable_params()
    if mode != "pynative":
        _COMPILED_KEEP_ALIVE.append(net)  # see modes._COMPILED_KEEP_ALIVE
    if mode == "jit-construct":
        net.construct = ms.jit(net.construct)
    loss_fn = _make_layer_loss(net, cot, skip_bias_add, split_sizes)
    if mode == "graph":
        ms.set_context(mode=ms.GRAPH_MODE)
        try:
            cell = _LossCell(loss_fn)
            grad_fn = ms.value_and_grad(cell, grad_position=0, weights=params, has_aux=True)
            (_, out), (dx, grads) = grad_fn(x)
        finally:
            ms.set_context(mode=ms.PYNATIVE_MODE)
    else:
        grad_fn = ms.value_and_grad(loss_fn, grad_position=0, weights=params, has_aux=True)
        if mode == "jit":
            grad_fn = ms.jit(grad_fn)
        (_, out), (dx, grads) = grad_fn(x)
    return out, dx, {p.name.split(".")[-1]: g for p, g in zip(params, grads)}


def _forward_backward_many(cases, mode):
    """``[(out, dx, {param name: grad})]`` of several :class:`_LayerCase` layers, as ONE graph.

    ``mode`` "jit" or "graph". The loss is the sum of the cases' losses, chained in order
    as the mapping battery's are (:func:`.modes.differentiate_batch`), so each layer's
    gradients are exactly its own; one compile instead of one per configuration (each
    costs ~1.5 s on 4 CPU ranks).
    """
    from .modes import _COMPILED_KEEP_ALIVE, differentiate_batch

    losses = [_make_layer_loss(c.layer, c.cot, c.skip_bias_add, c.sizes) for c in cases]
    per_case = [c.layer.trainable_params() for c in cases]
    for i, ps in enumerate(per_case):
        for p in ps:
            # One graph rejects two parameters of one name; every layer has a "weight".
            p.name = f"case{i}.{p.name}"
    _COMPILED_KEEP_ALIVE.extend(c.layer for c in cases)
    _, outs, dxs, grads = differentiate_batch(mode, losses, [c.x for c in cases],
                                              weights=[p for ps in per_case for p in ps])
    results, start = [], 0
    for out, dx, ps in zip(outs, dxs, per_case):
        gs = grads[start:start + len(ps)]
        start += len(ps)
        results.append((out, dx, {p.name.split(".")[-1]: g for p, g in zip(ps, gs)}))
    return results


def _case(**flags) -> str:
    return " ".join(f"{k}={v}" for k, v in flags.items())


# ----------------------------------------------------------------------------- layer vs dense
def compare_with_dense(kind: str, group, *, mode="pynative", keep_values=False, **options) -> dict:
    """One configuration of ``kind`` ("column" or "row") against ``mint.nn.Linear``.

    Options (keyword): ``bias=True, gather_output=True, input_is_parallel=False,
    sequence_parallel=False, skip_bias_add=False, seq_len=8, batch=2, in_features=32,
    out_features=48, seed=0, compute_dtype="float32", atol=None, split_sizes=None``.

    Returns a record whose ``errors`` hold, per quantity, the max abs difference
    between this rank's parallel value and the matching slice of the dense one (the
    dense layer always computes in float32). With ``compute_dtype`` float16/bfloat16 the
    errors are scaled by ``max(1, max |dense value|)`` and ``atol`` defaults to
    :data:`LOW_PRECISION_TOL`; with float32 they are absolute and ``atol`` defaults to
    1e-4. Initial parameters must match exactly in every case. ``mode`` runs the
    parallel layer's forward and backward in an execution mode (see
    :func:`_forward_backward`); ``keep_values`` adds its numpy results under
    ``"_values"`` (for comparisons between modes; not JSON).

    ``split_sizes`` (with ``sequence_parallel``): an uneven sequence, passed to the layer
    as ``layer(x, split_sizes=...)``. A list of one size per tp rank (a rank may hold 0
    rows; S is their sum, ``seq_len`` is ignored) or ``"auto"`` (S = tp + 1, i.e.
    ``[2, 1, ..., 1]``). Each rank's input (Column) or output (Row) is then its uneven
    shard of the dense one; the record carries ``split_sizes`` and ``split: "uneven"``.
    """
    case = _LayerCase(kind, group, **options)
    return case.record(case.run(mode), mode, keep_values)


class _LayerCase:
    """One layer configuration: the dense and the parallel layer built from one seed, the
    inputs, the dense results; :meth:`run` differentiates the parallel layer alone,
    :func:`_forward_backward_many` several at once; :meth:`record` compares."""

    def __init__(self, kind: str, group, *, bias=True, gather_output=True, input_is_parallel=False,
                 sequence_parallel=False, skip_bias_add=False, seq_len=8, batch=2,
                 in_features=32, out_features=48, seed=0, compute_dtype="float32",
                 atol=None, split_sizes=None):
        import mindspore as ms
        from mindspore import mint

        from mindscience.distributed.modules import ColumnParallelLinear, RowParallelLinear

        self.kind, self.group, self.bias = kind, group, bias
        self.sequence_parallel, self.skip_bias_add = sequence_parallel, skip_bias_add
        self.compute_dtype, self.out_features = compute_dtype, out_features
        self.scaled = str(compute_dtype) != "float32"
        if atol is None:
            atol = LOW_PRECISION_TOL.get(str(compute_dtype), DEFAULT_ATOL) if self.scaled else DEFAULT_ATOL
        self.atol = atol
        sizes, seq_len = _resolve_split_sizes(split_sizes, group.size, seq_len, sequence_parallel)
        self.sizes = sizes
        rng = np.random.default_rng(seed + 1)
        x_full = rng.standard_normal((seq_len, batch, in_features)).astype(np.float32)
        self.cot_full = rng.standard_normal((seq_len, batch, out_features)).astype(np.float32)

        ms.set_seed(seed)
        self.dense = mint.nn.Linear(in_features, out_features, bias=bias)
        ms.set_seed(seed)
        common = dict(bias=bias, use_sequence_parallel=sequence_parallel, skip_bias_add=skip_bias_add,
                      compute_dtype=_dtype(compute_dtype), group=group)
        if kind == "column":
            self.layer = ColumnParallelLinear(in_features, out_features, gather_output=gather_output,
                                              **common)
            x = _seq_chunk(x_full, group, sizes) if sequence_parallel else x_full
            cot = self.cot_full if gather_output else _chunk(self.cot_full, group, -1)
            flags = dict(bias=bias, gather_output=gather_output, sequence_parallel=sequence_parallel)
            self.gather_output = gather_output
        elif kind == "row":
            self.layer = RowParallelLinear(in_features, out_features, input_is_parallel=input_is_parallel,
                                           **common)
            x = _chunk(x_full, group, -1) if input_is_parallel else x_full
            cot = _seq_chunk(self.cot_full, group, sizes) if sequence_parallel else self.cot_full
            flags = dict(bias=bias, input_is_parallel=input_is_parallel,
                         sequence_parallel=sequence_parallel)
            self.input_is_parallel = input_is_parallel
        else:
            raise ValueError(f"kind={kind!r}: expected 'column' or 'row'")
        if skip_bias_add:
            flags["skip_bias_add"] = True
        if sizes is not None:
            flags["split_sizes"] = "[" + ",".join(map(str, sizes)) + "]"
        self.flags = flags
        self.x, self.cot = ms.Tensor(x), ms.Tensor(cot)
        self.dense_results = _forward_backward(self.dense, ms.Tensor(x_full), ms.Tensor(self.cot_full),
                                               False)

    def run(self, mode):
        """``(out, dx, {param: grad})`` of the parallel layer, differentiated alone in ``mode``."""
        return _forward_backward(self.layer, self.x, self.cot, self.skip_bias_add, mode,
                                 split_sizes=self.sizes)

    def record(self, results, mode, keep_values=False) -> dict:
        from mindscience.distributed import collectives

        kind, group, sizes, scaled = self.kind, self.group, self.sizes, self.scaled
        d_out, d_dx, d_g = self.dense_results
        p_out, p_dx, p_g = results
        layer, dense = self.layer, self.dense
        weight_dim = 0 if kind == "column" else 1
        errors = {"init weight": _err(layer.weight, _chunk(_np(dense.weight), group, weight_dim))}
        if self.bias:
            dense_bias = _np(dense.bias)
            want_bias = _chunk(dense_bias, group, 0) if kind == "column" else dense_bias
            errors["init bias"] = _err(layer.bias, want_bias)

        if kind == "column":
            want_out = _np(d_out) if self.gather_output else _chunk(_np(d_out), group, -1)
            want_dx = _seq_chunk(_np(d_dx), group, sizes) if self.sequence_parallel else _np(d_dx)
        else:
            want_out = _seq_chunk(_np(d_out), group, sizes) if self.sequence_parallel else _np(d_out)
            want_dx = _chunk(_np(d_dx), group, -1) if self.input_is_parallel else _np(d_dx)
        errors["output"] = _err(p_out, want_out, scaled)
        errors["grad input"] = _err(p_dx, want_dx, scaled)
        errors["grad weight"] = _err(p_g["weight"], _chunk(_np(d_g["weight"]), group, weight_dim), scaled)
        if self.bias:
            if kind == "column":
                errors["grad bias"] = _err(p_g["bias"], _chunk(_np(d_g["bias"]), group, 0), scaled)
            elif self.sequence_parallel:
                # Documented behaviour: each rank holds its sequence chunk's share of the
                # bias gradient; the shares sum (over tp) to the dense gradient.
                share = _seq_chunk(self.cot_full, group, sizes).reshape(-1, self.out_features).sum(axis=0)
                errors["grad bias (this rank's share)"] = _err(p_g["bias"], share, scaled)
                total = collectives.all_reduce(p_g["bias"], group)
                errors["grad bias (sum over tp)"] = _err(total, d_g["bias"], scaled)
            else:
                errors["grad bias"] = _err(p_g["bias"], d_g["bias"], scaled)

        max_error = max(errors.values())
        init_exact = errors["init weight"] == 0.0 and errors.get("init bias", 0.0) == 0.0
        extra = {}
        if keep_values:
            extra["_values"] = {"output": _np(p_out), "grad input": _np(p_dx),
                                **{f"grad {k}": _np(v) for k, v in p_g.items()}}
        return {
            **extra,
            "check": f"layers.{kind}",
            "group": "tp",
            "case": _case(tp=group.size, **self.flags),
            "mode": mode,
            "tp": group.size,
            "compute_dtype": str(self.compute_dtype),
            "split": "uneven" if sizes is not None else "even",
            "split_sizes": sizes,
            "passed": bool(init_exact and max_error <= self.atol),
            "max_error": max_error,
            "init_exact": bool(init_exact),
            "errors": errors,
            "atol": self.atol,
            "error": "scaled by max(1, max |dense|)" if scaled else "absolute",
        }


@check("layers.column")
def column(ctx: CheckContext, tp=None, cp=None, bias=True, gather_output=True,
           sequence_parallel=False, skip_bias_add=False, compute_dtype="float32",
           atol=None, split_sizes=None, **sizes) -> dict:
    """ColumnParallelLinear in one configuration against mint.nn.Linear.

    ``split_sizes`` (with ``sequence_parallel``): an uneven sequence, a list of one size
    per tp rank (zeros allowed) or ``"auto"`` (S = tp + 1); see :func:`compare_with_dense`."""
    group = _ensure_parallel(ctx, tp, cp)
    return compare_with_dense("column", group, bias=bias, gather_output=gather_output,
                              sequence_parallel=sequence_parallel, skip_bias_add=skip_bias_add,
                              compute_dtype=compute_dtype, atol=atol, split_sizes=split_sizes,
                              **sizes)


@check("layers.row")
def row(ctx: CheckContext, tp=None, cp=None, bias=True, input_is_parallel=False,
        sequence_parallel=False, skip_bias_add=False, compute_dtype="float32",
        atol=None, split_sizes=None, **sizes) -> dict:
    """RowParallelLinear in one configuration against mint.nn.Linear.

    ``split_sizes`` (with ``sequence_parallel``): an uneven sequence, a list of one size
    per tp rank (zeros allowed) or ``"auto"`` (S = tp + 1); see :func:`compare_with_dense`."""
    group = _ensure_parallel(ctx, tp, cp)
    return compare_with_dense("row", group, bias=bias, input_is_parallel=input_is_parallel,
                              sequence_parallel=sequence_parallel, skip_bias_add=skip_bias_add,
                              compute_dtype=compute_dtype, atol=atol, split_sizes=split_sizes,
                              **sizes)


@check("layers.matrix")
def matrix(ctx: CheckContext, tp=None, cp=None, compute_dtype="float32", atol=None,
           skip_bias_add=True, **sizes) -> list:
    """Both layers in every combination of bias x gather_output / input_is_parallel x
    sequence_parallel (16 records), plus skip_bias_add with bias (4 more by default)."""
    group = _ensure_parallel(ctx, tp, cp)
    return [compare_with_dense(kind, group, compute_dtype=compute_dtype, atol=atol, **flags, **sizes)
            for kind, flags in matrix_configs(skip_bias_add)]


def matrix_configs(skip_bias_add=True) -> list:
    """``(kind, flags)`` of every configuration: bias x gather_output / input_is_parallel x
    sequence_parallel for both layers, plus skip_bias_add with bias (4 more)."""
    configs = []
    for kind, (b, split, sp) in itertools.product(("column", "row"),
                                                 itertools.product((True, False), repeat=3)):
        flag = {"gather_output": split} if kind == "column" else {"input_is_parallel": split}
        configs.append((kind, dict(bias=b, sequence_parallel=sp, **flag)))
    if skip_bias_add:
        for kind, split in itertools.product(("column", "row"), (True, False)):
            flag = {"gather_output": split} if kind == "column" else {"input_is_parallel": split}
            configs.append((kind, dict(bias=True, skip_bias_add=True, sequence_parallel=False, **flag)))
    return configs


# Representative configurations for the execution-mode check: every mapping the
# layers use (copy/all-reduce, gathers and scatters of both dims, sequence parallelism).
MODE_CONFIGS = (
    ("column", dict(gather_output=True)),
    ("column", dict(gather_output=False, sequence_parallel=True)),
    ("column", dict(gather_output=True, skip_bias_add=True)),
    ("row", dict(input_is_parallel=False)),
    ("row", dict(input_is_parallel=True, sequence_parallel=True)),
)


@check("layers.modes")
def modes(ctx: CheckContext, tp=None, cp=None, modes=("jit", "jit-construct", "graph"),
          configs="representative", compute_dtype="float32", atol=None, **sizes) -> list:
    """The layers compiled (see :data:`LAYER_MODES`) against the dense layer AND against
    the same layer in PyNative: ``pynative_diff`` is the largest difference between the
    compiled and the PyNative output and gradients (float32: must be <= 1e-6).

    ``configs``: ``"representative"`` (:data:`MODE_CONFIGS`, 5) or ``"all"`` (the 20 of
    ``layers.matrix``). ``jit`` and ``graph`` differentiate every configuration in ONE
    compiled graph (:func:`_forward_backward_many`); ``jit-construct`` compiles each
    layer's construct on its own, as a user who decorates one layer does."""
    group = _ensure_parallel(ctx, tp, cp)
    if configs not in ("representative", "all"):
        raise ValueError(f"configs={configs!r} is invalid: expected 'representative' or 'all'")
    chosen = MODE_CONFIGS if configs == "representative" else matrix_configs()
    records, wants = [], []
    for kind, flags in chosen:
        eager = compare_with_dense(kind, group, compute_dtype=compute_dtype, atol=atol,
                                   keep_values=True, **flags, **sizes)
        wants.append(eager.pop("_values"))
        eager["check"] = f"layers.modes.{kind}"
        records.append(eager)
    for mode in modes:
        cases = [_LayerCase(kind, group, compute_dtype=compute_dtype, atol=atol, **flags, **sizes)
                 for kind, flags in chosen]
        if mode in ("jit", "graph"):
            results = _forward_backward_many(cases, mode)
        else:
            results = [case.run(mode) for case in cases]
        for case, result, want in zip(cases, results, wants):
            rec = case.record(result, mode, keep_values=True)
            got = rec.pop("_values")
            rec["check"] = f"layers.modes.{case.kind}"
            rec["pynative_diff"] = max(_err(got[k], want[k]) for k in want)
            rec["compiled_with"] = len(cases) if mode in ("jit", "graph") else 1
            rec["passed"] = bool(rec["passed"] and rec["pynative_diff"] <= 1e-6)
            records.append(rec)
    return records


@check("layers.init_exact")
def init_exact(ctx: CheckContext, tp=None, cp=None, seed=0) -> list:
    """Shards equal the dense tensors' slices bit for bit (max_error must be 0)."""
    import mindspore as ms
    from mindspore import Parameter, mint
    from mindspore.common.initializer import initializer

    from mindscience.distributed.modules import (
        ColumnParallelLinear, RowParallelLinear, initialize_affine_weight,
    )

    group = _ensure_parallel(ctx, tp, cp)
    records = []

    def record(case, errors):
        max_error = max(errors.values())
        records.append({"check": "layers.init_exact", "group": "tp", "case": f"tp={group.size} {case}",
                        "passed": max_error == 0.0, "max_error": max_error, "errors": errors})

    n = group.size
    for (fan_in, fan_out), dtype in itertools.product(((4 * n, 6 * n), (24 * n, 8 * n)),
                                                      ("float32", "float16", "bfloat16")):
        for kind in ("column", "row"):
            ms.set_seed(seed)
            dense = mint.nn.Linear(fan_in, fan_out, dtype=_dtype(dtype))
            ms.set_seed(seed)
            cls = ColumnParallelLinear if kind == "column" else RowParallelLinear
            layer = cls(fan_in, fan_out, param_init_dtype=_dtype(dtype), group=group)
            wdim = 0 if kind == "column" else 1
            b = _np(dense.bias.float())
            record(f"{kind} in={fan_in} out={fan_out} {dtype}", {
                "weight": _err(layer.weight.float(), _chunk(_np(dense.weight.float()), group, wdim)),
                "bias": _err(layer.bias.float(), _chunk(b, group, 0) if kind == "column" else b),
            })
    for init, dim in itertools.product(("XavierUniform", "normal", "TruncatedNormal"), (0, 1)):
        shape = (8 * n, 4 * n)
        ms.set_seed(seed)
        full = Parameter(initializer(init, shape, ms.float32))
        ms.set_seed(seed)
        shard = initialize_affine_weight(shape, n, dim, init, tp_rank=group.rank)
        record(f"initialize_affine_weight {init} partition_dim={dim}",
               {"weight": _err(shard, _chunk(_np(full), group, dim))})
    return records


def error_outcome(fn) -> tuple[str, str, int]:
    """Call ``fn``, expecting a ValueError: ``(exception type or "no error", its message,
    collectives called meanwhile)``. Another exception is reported, not raised, so the rank goes on."""
    from mindscience.distributed import collectives

    before = collectives.call_count()
    try:
        fn()
        outcome, message = "no error", ""
    except ValueError as exc:
        outcome, message = "ValueError", str(exc)
    except Exception as exc:  # noqa: BLE001 - report the wrong type, do not crash the rank
        outcome, message = type(exc).__name__, str(exc)
    return outcome, message, collectives.call_count() - before


@check("layers.errors")
def errors(ctx: CheckContext, tp=None, cp=None) -> list:
    """Sizes the layers cannot split raise ValueError, before any collective call."""
    import mindspore as ms

    from mindscience.distributed.modules import ColumnParallelLinear, RowParallelLinear

    group = _ensure_parallel(ctx, tp, cp)
    n = group.size
    f32 = dict(compute_dtype=ms.float32, group=group)

    def x(*shape):
        return ms.Tensor(np.ones(shape, np.float32))

    cases = {
        "column out_features not divisible": lambda: ColumnParallelLinear(8, 4 * n + 1, **f32),
        "row in_features not divisible": lambda: RowParallelLinear(4 * n + 1, 8, **f32),
        "column wrong last dim": lambda: ColumnParallelLinear(8, 4 * n, **f32)(x(4 * n, 7)),
        "row wrong last dim": lambda: RowParallelLinear(4 * n, 8, **f32)(x(4 * n, 4 * n + 1)),
        "row input_is_parallel given the full input": lambda: RowParallelLinear(
            4 * n, 8, input_is_parallel=True, **f32)(x(4, 4 * n)),
        "row sequence dim not divisible": lambda: RowParallelLinear(
            4 * n, 8, use_sequence_parallel=True, **f32)(x(4 * n + 1, 4 * n)),
        "column sequence parallel without a sequence dim": lambda: ColumnParallelLinear(
            8, 4 * n, use_sequence_parallel=True, **f32)(x(8)),
    }
    records = []
    for name, fn in cases.items():
        if n == 1 and "not divisible" in name:
            continue  # everything divides by 1
        outcome, message, calls = error_outcome(fn)
        records.append({"check": "layers.errors", "group": "tp", "case": f"tp={n} {name}",
                        "passed": outcome == "ValueError" and calls == 0
                        and ("expected" in message or "divisible" in message),
                        "max_error": 0.0, "raised": outcome, "collective_calls": calls,
                        "message": message})
    return records


@check("layers.dense_equivalence")
def dense_equivalence(ctx: CheckContext, tp=None, cp=None, compute_dtype="float32", atol=None,
                      **sizes) -> list:
    """What ``msdist verify`` runs: ``layers.init_exact``, ``layers.matrix`` (both layers,
    every configuration) and ``layers.errors``, under the job's layout."""
    return (init_exact(ctx, tp, cp)
            + matrix(ctx, tp, cp, compute_dtype=compute_dtype, atol=atol, **sizes)
            + errors(ctx, tp, cp))
