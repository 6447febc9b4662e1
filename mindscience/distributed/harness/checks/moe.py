"""The ``moe`` family of checks: the MoE layer at the layout against the one-rank layer.

``moe.dispatch``: uneven all-to-all (``all_to_all_v``) against numpy, forward and its
gradient, and the layer's padded dispatch buffer through the ep all-to-all and back
(round trip exact), in each mode.

``moe.layer``: for each case, the layer built at the layout (ep/etp/tp/cp/dp from the
manager) and the one-rank layer (every group of size 1) from the same global weights
(numpy), on the same global batch: each rank's output, the aux loss and every gradient
after :class:`~mindscience.distributed.finalize.GradientFinalizer` (expert weights summed
over edp, dense ones averaged over dp-cp, the router summed over tp) against the
one-rank layer's gradient of ``sum(out * C) / (dp*cp) + aux`` (the mean over the dp-cp
ranks of their losses). Dropless: one reference call on the whole batch. With a capacity
factor the drops are decided per source rank (as Megatron), so the reference runs the
one-rank layer on each rank's token shard. One record per case, mode and rank:
``max_error`` = the largest relative error (max |a - b| / max |b|) over everything
compared; ``passed`` when below ``tol``.
"""

from __future__ import annotations

import time

import numpy as np

from ..registry import CheckContext, check

DEFAULT_CASES = ({"name": "dropless"}, {"name": "capacity", "capacity_factor": 1.0})
SMALL = {"hidden_size": 8, "num_experts": 4, "ffn_hidden_size": 6, "topk": 2}


# ------------------------------------------------------------------ layout
def with_layout(ctx, layout, body):
    """``body(manager)`` with the manager initialised at ``layout`` (dict: tp, cp, pp, ep,
    etp, order), the layout in force restored afterwards. None: the layout in force, or
    the job's (``ctx.layout``, with its ep and etp)."""
    from mindscience.distributed import manager

    def args_of(lay):
        return dict(tensor_parallel_size=lay.tp, context_parallel_size=lay.cp,
                    pipeline_parallel_size=lay.pp, order=getattr(lay, "order", "-".join(lay.axes)),
                    expert_model_parallel_size=getattr(lay, "ep", 1),
                    expert_tensor_parallel_size=getattr(lay, "etp", None))

    if not layout:
        if not manager.is_initialized():
            if ctx.layout is None:
                raise RuntimeError("the moe checks need parallel groups: give the job a layout "
                                   "or pass layout={...} to the check")
            manager.initialize_parallel(**args_of(ctx.layout))
        return body(manager)
    previous = args_of(manager.get_layout()) if manager.is_initialized() else None
    manager.destroy_parallel()
    kwargs = dict(tensor_parallel_size=layout.get("tp", 1),
                  context_parallel_size=layout.get("cp", 1),
                  pipeline_parallel_size=layout.get("pp", 1),
                  expert_model_parallel_size=layout.get("ep", 1),
                  expert_tensor_parallel_size=layout.get("etp"))
    if layout.get("order"):
        kwargs["order"] = layout["order"]
    manager.initialize_parallel(**kwargs)
    try:
        return body(manager)
    finally:
        manager.destroy_parallel()
        if previous is not None:
            manager.initialize_parallel(**previous)


def _label(manager) -> str:
    lay = manager.get_layout()
    return (f"tp{lay.tp}-cp{lay.cp}-dp{lay.dp}-ep{getattr(lay, 'ep', 1)}-"
            f"etp{getattr(lay, 'etp', lay.tp)}")


# ------------------------------------------------------------------ weights
def global_weights(cfg, seed: int) -> dict:
    """Global weights of a layer (numpy float32), the same on every rank."""
    rng = np.random.default_rng(seed)
    E, H, F = cfg.num_experts, cfg.hidden_size, cfg.ffn_hidden_size
    out = {
        "router": rng.normal(0, 0.5, (E, H)).astype(np.float32),
        "w1": rng.normal(0, 0.3, (E, H, cfg.fused_ffn)).astype(np.float32),
        "w2": rng.normal(0, 0.3, (E, F, H)).astype(np.float32),
    }
    if cfg.shared_expert_ffn_hidden_size:
        fs = cfg.shared_expert_ffn_hidden_size
        out["fc1"] = rng.normal(0, 0.3, ((2 if cfg.activation == "swiglu" else 1) * fs, H)).astype(np.float32)
        out["fc2"] = rng.normal(0, 0.3, (H, fs)).astype(np.float32)
    return out


def local_view(layer, name: str, full: np.ndarray) -> np.ndarray:
    """This rank's part of a global weight (or gradient) ``name`` of ``layer``."""
    from mindscience.distributed.sharding import local_slices

    cfg = layer.config
    swiglu = cfg.activation == "swiglu"
    if name == "router":
        return full
    if name in ("w1", "w2"):
        e0, L = layer.first_expert, layer.local_experts
        part = full[e0:e0 + L]
        etp = layer.groups["etp"]
        dim = 2 if name == "w1" else 1
        stride = 2 if (swiglu and name == "w1") else 1
        idx = np.concatenate([np.arange(a, b) for a, b in
                              local_slices(part.shape[dim], etp.size, etp.rank, stride)])
        return np.take(part, idx, axis=dim)
    tp = layer.groups["tp"]
    dim = 0 if name == "fc1" else 1
    stride = 2 if (swiglu and name == "fc1") else 1
    idx = np.concatenate([np.arange(a, b) for a, b in
                          local_slices(full.shape[dim], tp.size, tp.rank, stride)])
    return np.take(full, idx, axis=dim)


def layer_params(layer) -> dict:
    """name -> Parameter of the trainable weights (the names of :func:`global_weights`)."""
    out = {"router": layer.router.weight, "w1": layer.experts.w1, "w2": layer.experts.w2}
    if layer.shared_experts is not None:
        out["fc1"] = layer.shared_experts.fc1.weight
        out["fc2"] = layer.shared_experts.fc2.weight
    return out


def load_weights(layer, weights: dict, bias=None) -> None:
    import mindspore as ms

    for name, p in layer_params(layer).items():
        p.set_data(ms.Tensor(np.ascontiguousarray(local_view(layer, name, weights[name]))))
    if bias is not None:
        layer.router.expert_bias.set_data(ms.Tensor(np.asarray(bias, np.float32)))


def one_rank_layer(cfg):
    """The layer with every group of size 1 (the dense computation)."""
    from mindscience.distributed.group import ParallelGroup
    from mindscience.distributed.moe import MoELayer

    t = ParallelGroup.trivial
    return MoELayer(cfg, ep_group=t("ep"), etp_group=t("etp"), tp_group=t("tp"),
                    dp_cp_group=t("dp-cp"), cp_group=t("cp"))


def _rel(a, b) -> float:
    a = np.asarray(a, np.float64)
    b = np.asarray(b, np.float64)
    scale = max(float(np.abs(b).max()) if b.size else 0.0, 1e-30)
    return float(np.abs(a - b).max()) / scale if b.size else 0.0


# ------------------------------------------------------------------ moe.layer
def _config(case: dict, ep: int = 1, etp: int = 1):
    """The case's config on top of :data:`SMALL`, grown to fit ep and etp (any layout)."""
    from mindscience.distributed.moe import MoEConfig

    opts = {k: v for k, v in case.items() if k not in ("name", "mode", "modes", "no_tokens", "seq", "batch")}
    base = dict(SMALL)
    if base["num_experts"] % ep:
        base["num_experts"] = 2 * ep
    if base["ffn_hidden_size"] % etp:
        base["ffn_hidden_size"] = 2 * etp
    return MoEConfig(**{**base, **opts})


def _layer_case(manager, case, modes, seq, batch, tol, seed):
    import mindspore as ms

    from mindscience.distributed.finalize import GradientFinalizer
    from mindscience.distributed.mappings import even_split_sizes, split_offsets
    from mindscience.distributed.moe import MoELayer

    lay = manager.get_layout()
    cfg = _config(case, getattr(lay, "ep", 1), getattr(lay, "etp", 1))
    dp, cp, tp = lay.dp, lay.cp, lay.tp
    D = dp * cp
    dp_rank = manager.get_data_parallel_rank()
    cp_rank = manager.get_context_parallel_rank()
    rng = np.random.default_rng(seed + 1)
    S, B, H = seq, batch, cfg.hidden_size
    X = rng.normal(0, 1, (S, B * dp, H)).astype(np.float32)
    Cw = rng.normal(0, 1, (S, B * dp, H)).astype(np.float32)
    weights = global_weights(cfg, seed)
    bias = None
    if case.get("no_tokens"):
        # Every token picks experts 0..k-1 (on ep rank 0): the other ep ranks receive none.
        bias = np.zeros(cfg.num_experts, np.float32)
        bias[: cfg.topk] = 100.0
    sl = S // cp
    block = (slice(cp_rank * sl, (cp_rank + 1) * sl), slice(dp_rank * B, (dp_rank + 1) * B))

    # ---- the one-rank reference
    ref = one_rank_layer(cfg)
    load_weights(ref, weights, bias)
    ref_names = list(layer_params(ref))
    ref_params = [layer_params(ref)[n] for n in ref_names]

    if cfg.capacity_factor is None:
        def ref_loss(x):
            out, aux, _ = ref(x)
            return (out * ms.Tensor(Cw)).sum() / D + aux, (out, aux)

        (_, (rout, raux)), (rdx, rgrads) = ms.value_and_grad(ref_loss, 0, ref_params,
                                                              has_aux=True)(ms.Tensor(X))
        ref_out = rout.asnumpy()[block]
        ref_aux = float(raux.asnumpy())
        ref_dx = rdx.asnumpy()[block] * D
    else:
        # Drops are per source rank: the reference runs each rank's token shard alone.
        shards = []
        for c in range(cp):
            for d in range(dp):
                sizes = even_split_sizes(sl, tp)
                for t, (off, n) in enumerate(zip(split_offsets(sizes), sizes)):
                    shards.append((c * sl + off, n, d))
        xs = [ms.Tensor(np.ascontiguousarray(X[a:a + n, d * B:(d + 1) * B])) for a, n, d in shards]

        def ref_loss(*xs_):
            total = 0.0
            outs = []
            for (a, n, d), x in zip(shards, xs_):
                out, aux, _ = ref(x)
                total = total + (out * ms.Tensor(np.ascontiguousarray(
                    Cw[a:a + n, d * B:(d + 1) * B]))).sum() / D + aux
                outs.append(out)
            return total, tuple(outs)

        positions = tuple(range(len(xs)))
        (_, outs), (dxs, rgrads) = ms.value_and_grad(ref_loss, positions, ref_params,
                                                      has_aux=True)(*xs)
        full_out = np.zeros_like(X)
        full_dx = np.zeros_like(X)
        for (a, n, d), o, g in zip(shards, outs, dxs):
            full_out[a:a + n, d * B:(d + 1) * B] = o.asnumpy()
            full_dx[a:a + n, d * B:(d + 1) * B] = g.asnumpy()
        ref_out = full_out[block]
        ref_dx = full_dx[block] * D
        ref_aux = None
    ref_grads = {n: g.asnumpy() for n, g in zip(ref_names, rgrads)}

    # ---- the layer at the layout
    layer = MoELayer(cfg)
    load_weights(layer, weights, bias)
    names = list(layer_params(layer))
    params = [layer_params(layer)[n] for n in names]
    fin = GradientFinalizer(params)
    c_local = ms.Tensor(np.ascontiguousarray(Cw[block]))

    def loss_fn(x):
        out, aux, stats = layer(x)
        return (out * c_local).sum() + aux, (out, aux, stats)

    grad_fn = ms.value_and_grad(loss_fn, 0, params, has_aux=True)

    def step(x):
        (loss, (out, aux, stats)), (dx, grads) = grad_fn(x)
        return loss, out, aux, stats, dx, fin(grads)

    from mindscience.distributed import collectives as C

    dpcp = manager.get_data_context_parallel_group()
    records = []
    x_local = ms.Tensor(np.ascontiguousarray(X[block]))
    for mode in modes:
        fn = ms.jit(step) if mode == "jit" else step
        t0 = time.perf_counter()
        _, out, aux, stats, dx, grads = fn(x_local)
        elapsed = time.perf_counter() - t0
        errors = {"output": _rel(out.asnumpy(), ref_out), "dx": _rel(dx.asnumpy(), ref_dx)}
        # Each rank's aux is its replica's (seq_aux_loss: the mean over ITS sequences); the
        # global loss takes the mean over the dp-cp ranks, which is the one-rank value.
        aux_mean = float((C.all_reduce(aux, dpcp) / dpcp.size).asnumpy())
        if ref_aux is not None and (cfg.aux_loss_coeff or cfg.z_loss_coeff):
            errors["aux"] = abs(aux_mean - ref_aux) / max(abs(ref_aux), 1e-30)
        for n, g in zip(names, grads):
            errors["grad." + n] = _rel(g.asnumpy(), local_view(layer, n, ref_grads[n]))
        worst = max(errors.values())
        st = stats.asnumpy()
        received = None
        if case.get("no_tokens"):
            received = float(st[layer.first_expert:layer.first_expert + layer.local_experts].sum())
        records.append({
            "check": "moe.layer", "group": "etp-ep", "case": case.get("name", "case"), "mode": mode,
            "passed": bool(worst <= tol and np.isfinite(worst)), "max_error": worst,
            "errors": errors, "aux": float(aux.asnumpy()), "aux_dp_mean": aux_mean,
            "ref_aux": ref_aux,
            "stats": [float(v) for v in st], "tokens_to_my_experts": received,
            "seconds": elapsed, "layout": _label(manager),
        })
    return records


@check("moe.layer")
def layer_check(ctx: CheckContext, cases=DEFAULT_CASES, modes=("pynative",), layout=None,
                seq: int = 8, batch: int = 2, tol: float = 1e-5, seed: int = 5) -> list:
    """The MoE layer at the layout vs the one-rank layer (see the module docstring)."""
    def body(manager):
        records = []
        for case in cases:
            records.extend(_layer_case(manager, dict(case), list(case.get("modes", modes)),
                                       seq, batch, tol, seed))
        return records

    return with_layout(ctx, layout, body)


# ------------------------------------------------------------------ moe.dispatch
@check("moe.dispatch")
def dispatch_check(ctx: CheckContext, modes=("pynative",), layout=None, hidden: int = 4,
                   tol: float = 0.0, seed: int = 3) -> list:
    """Uneven all-to-all over ep (values and gradient vs numpy) and the padded dispatch
    buffer's round trip, per mode."""
    def body(manager):
        import mindspore as ms

        from mindscience.distributed.moe.comm import all_to_all_experts, all_to_all_v

        ep = manager.get_group("ep")
        G, r = ep.size, ep.rank
        rng = np.random.default_rng(seed)
        # Uneven counts with zeros: rank i sends M[i][j] rows to rank j.
        M = rng.integers(0, 4, (G, G))
        M[0, G - 1] = 0
        M[G - 1, :] = 0 if G > 1 else M[G - 1, :]  # the last rank sends nothing at all
        M = [[int(v) for v in row] for row in M]
        data = [rng.normal(0, 1, (sum(M[i]), hidden)).astype(np.float32) for i in range(G)]
        coef = [rng.normal(0, 1, (sum(M[i][j] for i in range(G)), hidden)).astype(np.float32)
                for j in range(G)]
        offs = [np.concatenate([[0], np.cumsum(M[i])]) for i in range(G)]
        expect = np.concatenate([data[i][offs[i][r]:offs[i][r] + M[i][r]] for i in range(G)], 0)
        # d/dx of sum(out_j * coef_j) over all ranks: each row sent i->j gets coef_j's row.
        grad = np.zeros_like(data[r])
        for j in range(G):
            start = sum(M[i][j] for i in range(r))
            grad[offs[r][j]:offs[r][j] + M[r][j]] = coef[j][start:start + M[r][j]]
        slots = 3
        buf = rng.normal(0, 1, (G * 2, slots, hidden)).astype(np.float32)

        def f(x):
            y = all_to_all_v(x, ep, M)
            return (y * ms.Tensor(coef[r])).sum(), y

        def roundtrip(b):
            return all_to_all_experts(all_to_all_experts(b, ep), ep)

        records = []
        for mode in modes:
            gf = ms.value_and_grad(f, 0, None, has_aux=True)
            rt = roundtrip
            if mode == "jit":
                gf, rt = ms.jit(gf), ms.jit(roundtrip)
            (_, y), g = gf(ms.Tensor(data[r]))
            back = rt(ms.Tensor(buf)).asnumpy()
            err = max(_rel(y.asnumpy(), expect) if expect.size else 0.0,
                      _rel(g.asnumpy(), grad) if grad.size else 0.0,
                      _rel(back, buf))
            records.append({"check": "moe.dispatch", "group": "ep", "mode": mode,
                            "passed": bool(err <= tol), "max_error": err,
                            "sizes": M, "layout": _label(manager)})
        return records

    return with_layout(ctx, layout, body)
