"""Test-only MoE checks run inside the ranks of tests/_moe_job.py (the shipped ones are
``moe.layer`` and ``moe.dispatch`` in mindscience/distributed/harness/checks/moe.py).

``moe.errors``: each bad option raises ``MoEConfigError`` on every rank, before any
collective (the collective counter does not move). ``moe.train``: DistributedOptimizer
stages against the one-rank layer; ``moe.clip``: the same with ``max_grad_norm`` (the
global norm and the clipped steps). ``moe.bytes``: what the dropless alltoall dispatch
moved on each rank against the cost model's figure for that routing.
"""

from __future__ import annotations

from mindscience.distributed.harness.checks.moe import _label, with_layout
from mindscience.distributed.harness.registry import CheckContext, check

BAD = (
    ("experts_not_divisible_by_ep", dict(num_experts=6)),
    ("topk_above_experts", dict(num_experts=4, topk=5)),
    ("groups_not_dividing_experts", dict(num_experts=4, num_groups=3, group_topk=1)),
    ("group_topk_not_dividing_topk", dict(num_experts=4, topk=3, num_groups=2, group_topk=2)),
    ("capacity_zero", dict(capacity_factor=0.0)),
    ("capacity_negative", dict(capacity_factor=-1.0)),
)


@check("moe.errors")
def errors(ctx: CheckContext, layout=None) -> list:
    def body(manager):
        from mindscience.distributed import counters
        from mindscience.distributed.moe import MoEConfig, MoEConfigError, MoELayer

        records = []
        for name, opts in BAD:
            before = counters.call_count()
            kind, message = None, ""
            try:
                MoELayer(MoEConfig(**{"hidden_size": 8, "ffn_hidden_size": 6, "num_experts": 4,
                                      "topk": 2, **opts}))
            except MoEConfigError as err:
                kind, message = type(err).__name__, str(err)
            except Exception as err:  # noqa: BLE001 - recorded: the test says which type
                kind, message = type(err).__name__, str(err)
            records.append({"check": "moe.errors", "case": name, "error": kind,
                            "message": message, "collectives": counters.call_count() - before,
                            "passed": kind == "MoEConfigError"})
        return records

    return with_layout(ctx, layout, body)


@check("moe.train")
def train(ctx: CheckContext, layout=None, stages=(0, 1, 2, 3), steps: int = 5, mode: str = "pynative",
          seq: int = 8, batch: int = 2, lr: float = 0.01, seed: int = 11) -> list:
    """``steps`` AdamW steps of the MoE layer at the layout with DistributedOptimizer at each
    ZeRO stage (stage 3 after fully_shard) against the one-rank layer trained on the whole
    batch: every step's loss (mean over dp-cp of the ranks' losses) and the final expert
    weights (this rank's slice), relative error."""
    return _train(ctx, "moe.train", layout, stages, steps, mode, seq, batch, lr, seed, None)


@check("moe.clip")
def clip(ctx: CheckContext, layout=None, stages=(0, 1, 3), steps: int = 3, mode: str = "pynative",
         max_grad_norm: float = 1.0, seq: int = 8, batch: int = 2, lr: float = 0.01,
         seed: int = 11) -> list:
    """``moe.train`` with ``max_grad_norm``: the norm each step returns (the one-rank model's,
    every parameter once) and the clipped training against the one-rank optimizer's."""
    return _train(ctx, "moe.clip", layout, stages, steps, mode, seq, batch, lr, seed, max_grad_norm)


def _train(ctx, check_name, layout, stages, steps, mode, seq, batch, lr, seed, max_grad_norm) -> list:
    def body(manager):
        import mindspore as ms
        import numpy as np

        from mindscience.distributed import collectives as C
        from mindscience.distributed.fsdp import fully_shard
        from mindscience.distributed.group import ParallelGroup
        from mindscience.distributed.harness.checks.moe import (
            _rel, global_weights, layer_params, load_weights, local_view, one_rank_layer)
        from mindscience.distributed.moe import MoEConfig, MoELayer
        from mindscience.distributed.optimizer import DistributedOptimizer

        cfg = MoEConfig(hidden_size=8, num_experts=4, ffn_hidden_size=6, topk=2,
                        aux_loss_coeff=0.01, z_loss_coeff=0.001, shared_expert_ffn_hidden_size=4)
        lay = manager.get_layout()
        D = lay.dp * lay.cp
        dpr, cpr = manager.get_data_parallel_rank(), manager.get_context_parallel_rank()
        rng = np.random.default_rng(seed)
        S, B, H = seq, batch, cfg.hidden_size
        X = rng.normal(0, 1, (S, B * lay.dp, H)).astype(np.float32)
        Cw = rng.normal(0, 1, (S, B * lay.dp, H)).astype(np.float32)
        sl = S // lay.cp
        block = (slice(cpr * sl, (cpr + 1) * sl), slice(dpr * B, (dpr + 1) * B))
        weights = global_weights(cfg, seed)
        from mindspore.communication import get_rank

        me = get_rank()

        def t(key):
            return ParallelGroup.trivial(key, me)

        ref = one_rank_layer(cfg)
        load_weights(ref, weights)
        ref_opt = DistributedOptimizer(ref.trainable_params(), lr=lr, zero_stage=0, group=t("dp-cp"),
                                       tp_group=t("tp"), pipeline_group=t("pp"),
                                       embedding_group=t("embedding"), expert_dp_group=t("edp"),
                                       expert_tensor_and_model_group=t("etp-ep"),
                                       max_grad_norm=max_grad_norm)
        cref = ms.Tensor(Cw)

        def ref_loss(x):
            out, aux, _ = ref(x)
            return (out * cref).sum() / D + aux

        ref_grad = ms.value_and_grad(ref_loss, None, ref.trainable_params())
        ref_losses, ref_norms = [], []
        for _ in range(steps):
            loss, grads = ref_grad(ms.Tensor(X))
            norm = ref_opt(grads)
            ref_losses.append(float(loss.asnumpy()))
            if max_grad_norm is not None:
                ref_norms.append(float(norm.asnumpy()))
        ref_w = {n: p.asnumpy() for n, p in layer_params(ref).items()}

        dpcp = manager.get_data_context_parallel_group()
        records = []
        for stage in stages:
            layer = MoELayer(cfg)
            load_weights(layer, weights)
            if stage == 3:
                fully_shard(layer)
            params = layer.trainable_params()
            opt = DistributedOptimizer(params, lr=lr, zero_stage=stage, max_grad_norm=max_grad_norm)
            c_local = ms.Tensor(np.ascontiguousarray(Cw[block]))

            def loss_fn(x):
                out, aux, _ = layer(x)
                return (out * c_local).sum() + aux

            grad_fn = ms.value_and_grad(loss_fn, None, params)

            def step(x):
                loss, grads = grad_fn(x)
                return loss, opt(grads)

            fn = ms.jit(step) if mode == "jit" else step
            x_local = ms.Tensor(np.ascontiguousarray(X[block]))
            losses, norms = [], []
            for _ in range(steps):
                loss, norm = fn(x_local)
                losses.append(float((C.all_reduce(loss, dpcp) / dpcp.size).asnumpy()))
                if max_grad_norm is not None:
                    norms.append(float(norm.asnumpy()))
            errors = {"losses": max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses))}
            if max_grad_norm is not None:
                errors["norms"] = max(abs(a - b) / abs(b) for a, b in zip(norms, ref_norms))
            for name in ("w1", "w2"):
                errors[name] = _rel(layer_params(layer)[name].asnumpy(),
                                    local_view(layer, name, ref_w[name]))
            if stage < 3:
                errors["router"] = _rel(layer.router.weight.asnumpy(), ref_w["router"])
            worst = max(errors.values())
            records.append({"check": check_name, "stage": stage, "mode": mode, "layout": _label(manager),
                            "passed": bool(worst <= 1e-5), "max_error": worst, "errors": errors,
                            "losses": losses, "ref_losses": ref_losses, "norms": norms,
                            "ref_norms": ref_norms, "max_grad_norm": max_grad_norm,
                            "expert_state_elements": opt.expert_optimizer.state_elements()})
        return records

    return with_layout(ctx, layout, body)


def ops_depend(value, dep):
    from mindspore import ops

    return ops.depend(value, dep)


@check("moe.bytes")
def dispatch_bytes(ctx: CheckContext, layout=None, seq: int = 16, batch: int = 4, seed: int = 5) -> list:
    """A dropless alltoall layer forward + backward in PyNative with a skewed router: the
    bytes its dispatch moved on this rank (``MoELayer.last_dispatch``) against the cost
    model's ep / etp rows (``costmodel.comm.moe_rows``) at the measured imbalance, and the
    compiled (static-slot) figure against ``moe_static_slots``."""
    def body(manager):
        from dataclasses import replace

        import mindspore as ms
        import numpy as np

        from mindscience.distributed.costmodel.comm import moe_rows
        from mindscience.distributed.costmodel.spec import ModelSpec, TrainingSpec
        from mindscience.distributed.harness.checks.moe import global_weights, load_weights
        from mindscience.distributed.moe import MoEConfig, MoELayer

        cfg = MoEConfig(hidden_size=8, num_experts=8, ffn_hidden_size=6, topk=2)
        lay = manager.get_layout()
        weights = global_weights(cfg, seed)
        weights["router"][1] += 0.3  # a mild favourite: the slot is above the mean count
        layer = MoELayer(cfg)
        load_weights(layer, weights)
        rng = np.random.default_rng(seed + manager.get_data_parallel_rank())
        x = ms.Tensor(rng.normal(0, 1, (seq, batch, cfg.hidden_size)).astype(np.float32))

        def loss_fn(x):
            out, aux, _ = layer(x)
            return (out * out).sum() + aux

        ms.value_and_grad(loss_fn, None, layer.trainable_params())(x)
        rec = dict(layer.last_dispatch)
        model = ModelSpec(num_layers=1, hidden_size=cfg.hidden_size, num_attention_heads=1,
                          seq_length=seq * lay.cp, vocab_size=0, ffn_hidden_size=cfg.ffn_hidden_size,
                          num_moe_experts=cfg.num_experts, moe_router_topk=cfg.topk)
        training = TrainingSpec(micro_batch_size=batch, precision="fp32", moe_imbalance=rec["imbalance"])
        ep, etp = lay.ep, lay.etp

        def priced(tr):
            rows = {r["group"] + ":" + r["op"]: r for r in
                    moe_rows(model, tr, lay.tp, lay.cp, ep, etp, passes=1, again=0)}
            return rows

        rows = priced(training)
        static = priced(replace(training, moe_static_slots=True))
        a2a = rows.get("ep:all_to_all", {"bytes": 0})["bytes"]
        gather = rows.get("etp:all_gather", {"bytes": 0})["bytes"]
        measured_gather = 2 * rec["etp_bytes"]
        errors = {"all_to_all": abs(a2a - rec["step_all_to_all_bytes"]) / max(a2a, 1),
                  "etp_all_gather": abs(gather - measured_gather) / max(gather, 1),
                  "static": abs(static.get("ep:all_to_all", {"bytes": 0})["bytes"]
                                - 4 * rec["static_all_to_all_bytes"]) / max(a2a, 1)}
        worst = max(errors.values())
        return [{"check": "moe.bytes", "layout": _label(manager), "record": rec,
                 "priced_all_to_all_bytes": a2a, "priced_etp_all_gather_bytes": gather,
                 "priced_static_all_to_all_bytes": static.get("ep:all_to_all", {"bytes": 0})["bytes"],
                 "errors": errors, "passed": bool(worst <= 1e-9 and rec["imbalance"] >= 1.0)}]

    return with_layout(ctx, layout, body)
