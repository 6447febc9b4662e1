"""Checks of ``context_parallel_attention`` (ring, Ulysses, all-gather KV) against dense attention.

Every rank computes the dense attention of the whole sequence in numpy (float64, forward
and the gradients of ``sum(out * C)`` for a fixed random ``C``), runs the parallel
attention on its rows (even, uneven ``split_sizes`` or zigzag) and compares its rows of the
output and of the q, k, v gradients. Nothing is gathered for the comparison.

* ``attention.methods``: a list of cases (``method``, ``causal``, ``gqa``, ``split``:
  "even" / "uneven" / "zigzag", ``dtype``), each in the given ``modes``; the compiled modes
  differentiate all cases of one dtype as ONE graph (:func:`.modes.differentiate_batch`).
* ``attention.errors``: indivisible heads, bad split sizes and the like raise ValueError
  before any collective.
* ``attention.layer``: ``ContextParallelAttention`` (tp x cp) against the same projections
  and dense attention in numpy.
"""

from __future__ import annotations

import itertools

import numpy as np

from ..registry import CheckContext, check
from .layers import _ensure_parallel, _err, error_outcome

TOL = {"float32": 1e-5, "bfloat16": 2e-2}


# ----------------------------------------------------------------------------- numpy reference
def dense_attention(q, k, v, cot, causal, scale=None):
    """``(out, dq, dk, dv)`` of softmax attention, float64; q (S, B, N, D), k/v (S, B, Nkv, D)."""
    q, k, v, cot = (a.astype(np.float64) for a in (q, k, v, cot))
    S, B, N, D = q.shape
    g = N // k.shape[2]
    scale = 1.0 / np.sqrt(D) if scale is None else scale
    ke, ve = np.repeat(k, g, axis=2), np.repeat(v, g, axis=2)
    s = np.einsum("ibhd,jbhd->bhij", q, ke) * scale
    if causal:
        s = np.where(np.triu(np.ones((S, S), bool), 1), -np.inf, s)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    out = np.einsum("bhij,jbhd->ibhd", p, ve)
    dv_e = np.einsum("bhij,ibhd->jbhd", p, cot)
    dp = np.einsum("ibhd,jbhd->bhij", cot, ve)
    delta = np.einsum("ibhd,ibhd->bhi", cot, out)[..., None]
    ds = p * (dp - delta)
    dq = np.einsum("bhij,jbhd->ibhd", ds, ke) * scale
    dk_e = np.einsum("bhij,ibhd->jbhd", ds, q) * scale
    Nkv = k.shape[2]
    dk = dk_e.reshape(S, B, Nkv, g, D).sum(3)
    dv = dv_e.reshape(S, B, Nkv, g, D).sum(3)
    return out, dq, dk, dv


def local_rows(group, split, S):
    """Indices of this rank's rows of the full sequence and the split_sizes to pass."""
    n, r = group.size, group.rank
    if split == "zigzag":
        c = S // (2 * n)
        return np.r_[r * c:(r + 1) * c, (2 * n - 1 - r) * c:(2 * n - r) * c], None
    if split == "uneven":
        from mindscience.distributed.mappings import even_split_sizes

        sizes = even_split_sizes(S, n)
        start = sum(sizes[:r])
        return np.arange(start, start + sizes[r]), sizes
    c = S // n
    return np.arange(r * c, (r + 1) * c), None


class _AttnCase:
    def __init__(self, group, method="ring", causal=False, gqa=False, split="even", dtype="float32",
                 softmax_scale=None, seq_len=None, batch=2, heads=4, head_dim=8, seed=0):
        import mindspore as ms

        n = group.size
        self.group, self.method, self.causal, self.gqa = group, method, causal, gqa
        self.split, self.dtype, self.scale = split, dtype, softmax_scale
        S = seq_len or (4 * n if split != "uneven" else 4 * n + 3)
        nkv = heads // 2 if gqa else heads
        if method == "ulysses":  # whole heads per rank: N and N_kv multiples of cp
            heads, nkv = (2 * n, n) if gqa else (n, n)
        rng = np.random.default_rng(seed + 7)
        self.full = [rng.standard_normal(shape).astype(np.float32)
                     for shape in ((S, batch, heads, head_dim), (S, batch, nkv, head_dim),
                                   (S, batch, nkv, head_dim), (S, batch, heads, head_dim))]
        if dtype != "float32":  # the reference sees the rounded inputs
            self.full[:3] = [ms.Tensor(a).astype(ms.bfloat16).float().asnumpy() for a in self.full[:3]]
        self.rows, self.sizes = local_rows(group, split, S)
        self.ref = [a[self.rows] for a in dense_attention(*self.full, causal, softmax_scale)]
        q, k, v, cot = (a[self.rows] for a in self.full)
        self.shapes = (q.shape, k.shape, v.shape)
        self.x = ms.Tensor(np.concatenate([q.ravel(), k.ravel(), v.ravel()]))
        self.cot = ms.Tensor(cot)
        self.desc = (f"cp={n} {method} causal={causal} gqa={gqa} split={split} "
                     f"N={heads}/{nkv} S={S} {dtype}"
                     + (f" scale={softmax_scale}" if softmax_scale is not None else ""))

    def loss(self):
        import mindspore as ms
        from mindspore import ops

        from mindscience.distributed.modules import context_parallel_attention

        group, method, causal, cot, scale = self.group, self.method, self.causal, self.cot, self.scale
        sizes, lb = self.sizes, self.split == "zigzag"
        (qs, ks, vs), dt = self.shapes, getattr(ms, self.dtype)
        nq, nk = int(np.prod(qs)), int(np.prod(ks))
        slicer = ops.StridedSlice()

        def part(x, start, length, shape):
            return slicer(x, (start,), (start + length,), (1,)).reshape(shape).astype(dt)

        def loss_fn(x):
            q = part(x, 0, nq, qs)
            k = part(x, nq, nk, ks)
            v = part(x, nq + nk, nk, vs)
            out = context_parallel_attention(q, k, v, group, method=method, causal=causal,
                                             softmax_scale=scale, split_sizes=sizes, load_balance=lb)
            out = out.astype(ms.float32)
            return (out * cot).sum(), out

        return loss_fn

    def record(self, out, dx, mode):
        dx = dx.asnumpy() if hasattr(dx, "asnumpy") else dx
        nq, nk = int(np.prod(self.shapes[0])), int(np.prod(self.shapes[1]))
        got = [out, dx[:nq].reshape(self.shapes[0]), dx[nq:nq + nk].reshape(self.shapes[1]),
               dx[nq + nk:].reshape(self.shapes[2])]
        scaled = self.dtype != "float32"
        errors = {name: _err(g, w, scaled) for name, g, w in
                  zip(("output", "grad q", "grad k", "grad v"), got, self.ref)}
        max_error = max(errors.values())
        tol = TOL.get(self.dtype, 2e-2)
        return {"check": "attention.methods", "group": "cp", "case": self.desc, "mode": mode,
                "method": self.method, "causal": self.causal, "gqa": self.gqa,
                "split": self.split, "dtype": self.dtype, "softmax_scale": self.scale, "passed": bool(max_error <= tol),
                "max_error": max_error, "atol": tol, "errors": errors,
                "error": "scaled by max(1, max |dense|)" if scaled else "absolute"}


def default_cases(methods=("ring", "ulysses", "allgather_kv"), dtypes=("float32",)) -> list:
    """Every method x causal x (MHA, GQA) x (even, uneven), plus the zigzag ring."""
    cases = []
    for method, causal, gqa, split, dtype in itertools.product(
            methods, (False, True), (False, True), ("even", "uneven"), dtypes):
        cases.append(dict(method=method, causal=causal, gqa=gqa, split=split, dtype=dtype))
    if "ring" in methods:
        for gqa, dtype in itertools.product((False, True), dtypes):
            cases.append(dict(method="ring", causal=True, gqa=gqa, split="zigzag", dtype=dtype))
    return cases


METHODS = ("ring", "ulysses", "allgather_kv")
# A softmax_scale other than 1/sqrt(D) = 0.354 (head_dim 8), on one case per method.
CUSTOM_SCALE = 0.3


def suite_cases() -> list:
    """The test suite's PyNative set: the whole matrix (every method x causal x GQA x even /
    uneven, plus the zigzag ring with and without GQA) in float32, one case per method with
    a custom ``softmax_scale`` (non-causal MHA uneven), and each method causal GQA uneven in
    bfloat16."""
    cases = default_cases(METHODS)
    for case in cases:
        if not case["causal"] and not case["gqa"] and case["split"] == "uneven":
            case["softmax_scale"] = CUSTOM_SCALE
    cases += [dict(method=m, causal=True, gqa=True, split="uneven", dtype="bfloat16") for m in METHODS]
    return cases


# The compiled sets: one case per method in each compiled mode, complementary between the
# two modes, so that across ms.jit and GRAPH_MODE every method meets causal and not, MHA and
# GQA, even and uneven, float32 and bfloat16 (a case costs ~6 s of compile per rank on 4
# ranks of 2 cores; the eager set runs the whole matrix).
_JIT_DTYPE = {"ring": "float32", "ulysses": "bfloat16", "allgather_kv": "float32"}
_OTHER = {"float32": "bfloat16", "bfloat16": "float32"}


def jit_cases() -> list:
    """The suite's ``ms.jit`` set (one graph): each method non-causal MHA even (ring and
    all-gather KV in float32, Ulysses in bfloat16), and the zigzag ring (GQA)."""
    return ([dict(method=m, causal=False, gqa=False, split="even", dtype=_JIT_DTYPE[m]) for m in METHODS]
            + [dict(method="ring", causal=True, gqa=True, split="zigzag")])


def graph_cases() -> list:
    """The suite's GRAPH_MODE set (one graph): each method causal GQA uneven, in the dtype
    its :func:`jit_cases` case does not use."""
    return [dict(method=m, causal=True, gqa=True, split="uneven", dtype=_OTHER[_JIT_DTYPE[m]])
            for m in METHODS]


def verify_cases(dtype: str = "float32") -> list:
    """What ``msdist verify`` runs in each of its modes: each method causal, GQA, uneven in
    the run's dtype; eagerly also the zigzag ring."""
    return [dict(method=m, causal=True, gqa=True, split="uneven", dtype=dtype) for m in METHODS]


def verify_eager_cases(dtype: str = "float32") -> list:
    """:func:`verify_cases` plus the zigzag ring (PyNative)."""
    return verify_cases(dtype) + [dict(method="ring", causal=True, gqa=True, split="zigzag", dtype=dtype)]


# Named case sets: fixed ones, and the verify ones that run in the run's dtype.
CASE_SETS = {"suite": suite_cases, "jit": jit_cases, "graph": graph_cases}
DTYPE_CASE_SETS = {"verify": verify_eager_cases, "verify_compiled": verify_cases}


@check("attention.methods")
def methods(ctx: CheckContext, tp=None, cp=None, modes=("pynative",), cases=None,
            methods=("ring", "ulysses", "allgather_kv"), dtypes=("float32",), **sizes) -> list:
    """Each case in each mode against dense attention (see the module docstring).

    ``cases``: a list of case dicts, or the name of a set: ``"all"`` (default: every method
    x causal x GQA x split in each of ``dtypes``, :func:`default_cases`), one of
    :data:`CASE_SETS` (``"suite"``, ``"jit"``, ``"graph"``) or of :data:`DTYPE_CASE_SETS`
    (``"verify"``, ``"verify_compiled"``, in ``dtypes[0]``)."""
    from mindscience.distributed import manager

    from .modes import _COMPILED_KEEP_ALIVE, differentiate_batch, value_and_grad

    _ensure_parallel(ctx, tp, cp)
    group = manager.get_context_parallel_group()
    if cases is None or cases == "all":
        specs = default_cases(tuple(methods), tuple(dtypes))
    elif isinstance(cases, str) and cases in DTYPE_CASE_SETS:
        specs = DTYPE_CASE_SETS[cases](dtypes[0])
    elif isinstance(cases, str):
        if cases not in CASE_SETS:
            raise ValueError(f"cases={cases!r} is invalid: expected a list of cases or one of "
                             f"{sorted(['all', *CASE_SETS, *DTYPE_CASE_SETS])}")
        specs = CASE_SETS[cases]()
    else:
        specs = cases
    records = []
    for mode in modes:
        built = [_AttnCase(group, **spec, **sizes) for spec in specs]
        losses = [c.loss() for c in built]
        _COMPILED_KEEP_ALIVE.extend(losses)
        if mode == "pynative":
            results = []
            for c, loss in zip(built, losses):
                (_, out), dx = value_and_grad("pynative", loss, c.x)
                results.append((out.asnumpy(), dx))
        else:
            _, outs, dxs, _ = differentiate_batch(mode, losses, [c.x for c in built])
            dxs = dxs if isinstance(dxs, tuple) else (dxs,)  # one case: a tensor, not a 1-tuple
            results = [(o.asnumpy(), d) for o, d in zip(outs, dxs)]
        for c, (out, dx) in zip(built, results):
            rec = c.record(out, dx, mode)
            rec["compiled_with"] = len(built) if mode != "pynative" else 1
            records.append(rec)
    return records


@check("attention.errors")
def errors(ctx: CheckContext, tp=None, cp=None) -> list:
    """Bad arguments raise ValueError before any collective call."""
    import mindspore as ms

    from mindscience.distributed import manager
    from mindscience.distributed.modules import ContextParallelAttention, context_parallel_attention

    _ensure_parallel(ctx, tp, cp)
    g = manager.get_context_parallel_group()
    n = g.size

    def t(*shape):
        return ms.Tensor(np.ones(shape, np.float32))

    q4, kv4 = t(4, 1, 4, 8), t(4, 1, 4, 8)
    cases = {
        "ulysses heads not divisible": lambda: context_parallel_attention(
            t(4, 1, n + 1, 8), t(4, 1, n + 1, 8), t(4, 1, n + 1, 8), g, method="ulysses"),
        "gqa N not a multiple of N_kv": lambda: context_parallel_attention(
            t(4, 1, 3, 8), t(4, 1, 2, 8), t(4, 1, 2, 8), g),
        "split_sizes wrong count": lambda: context_parallel_attention(
            q4, kv4, kv4, g, split_sizes=[4] * (n + 1)),
        "split_sizes not this rank's rows": lambda: context_parallel_attention(
            q4, kv4, kv4, g, split_sizes=[5] * n),
        "split_sizes negative": lambda: context_parallel_attention(
            q4, kv4, kv4, g, split_sizes=[4] * (n - 1) + [-1]),
        "unknown method": lambda: context_parallel_attention(q4, kv4, kv4, g, method="flash"),
        "load_balance without causal": lambda: context_parallel_attention(
            q4, kv4, kv4, g, load_balance=True),
        "k/v shapes differ": lambda: context_parallel_attention(q4, kv4, t(4, 1, 4, 4), g),
        "layer hidden not divisible by heads": lambda: ContextParallelAttention(10, 4),
    }
    records = []
    for name, fn in cases.items():
        outcome, message, calls = error_outcome(fn)
        records.append({"check": "attention.errors", "group": "cp", "case": f"cp={n} {name}",
                        "passed": outcome == "ValueError" and calls == 0, "max_error": 0.0,
                        "raised": outcome, "collective_calls": calls, "message": message})
    return records


@check("attention.layer")
def layer(ctx: CheckContext, tp=None, cp=None, methods=("ring", "ulysses", "allgather_kv"),
          causal=True, hidden=32, heads=8, groups=4, seq_len=8, batch=2, seed=0) -> list:
    """``ContextParallelAttention`` on tp x cp against the same layer on size-1 groups (the
    dense model, same seed): output, input gradient, weight gradients (summed over cp)."""
    import mindspore as ms

    from mindscience.distributed import collectives, manager
    from mindscience.distributed.group import ParallelGroup
    from mindscience.distributed.modules import ContextParallelAttention

    tp_g = _ensure_parallel(ctx, tp, cp)
    cp_g = manager.get_context_parallel_group()
    rng = np.random.default_rng(seed + 5)
    x_full = rng.standard_normal((seq_len, batch, hidden)).astype(np.float32)
    cot_full = rng.standard_normal((seq_len, batch, hidden)).astype(np.float32)
    rows = np.arange(cp_g.rank * seq_len // cp_g.size, (cp_g.rank + 1) * seq_len // cp_g.size)
    records = []
    for method in methods:
        opts = dict(num_query_groups=groups, method=method, causal=causal,
                    compute_dtype=ms.float32)
        results = []
        for net_groups, x, cot in (
                ((ParallelGroup.trivial("tp"), ParallelGroup.trivial("cp")), x_full, cot_full),
                ((tp_g, cp_g), x_full[rows], cot_full[rows])):
            ms.set_seed(seed)
            net = ContextParallelAttention(hidden, heads, tp_group=net_groups[0],
                                           cp_group=net_groups[1], **opts)
            params = net.trainable_params()
            cot_t = ms.Tensor(cot)

            def loss_fn(inp, net=net, cot_t=cot_t):
                out = net(inp)
                return (out * cot_t).sum(), out

            (_, out), (dx, grads) = ms.value_and_grad(loss_fn, 0, params, has_aux=True)(ms.Tensor(x))
            results.append((out.asnumpy(), dx.asnumpy(),
                            {p.name: g for p, g in zip(params, grads)}))
        (d_out, d_dx, d_g), (p_out, p_dx, p_g) = results
        errors = {"output": _err(p_out, d_out[rows]), "grad input": _err(p_dx, d_dx[rows])}
        for name, dim in (("qkv.weight", 0), ("qkv.bias", 0), ("out.weight", 1)):
            total = collectives.all_reduce(p_g[name], cp_g)
            want = np.split(d_g[name].asnumpy(), tp_g.size, axis=dim)[tp_g.rank]
            errors[f"grad {name} (sum over cp)"] = _err(total, want)
        max_error = max(errors.values())
        records.append({"check": "attention.layer", "group": "tp-cp",
                        "case": f"tp={tp_g.size} cp={cp_g.size} {method} causal={causal} "
                                f"N={heads}/{groups}", "mode": "pynative",
                        "passed": bool(max_error <= 1e-4), "max_error": max_error,
                        "errors": errors, "atol": 1e-4})
    return records
