"""Test-only MoE checks run inside the ranks of tests/_moe_job.py (the shipped ones are
``moe.layer`` and ``moe.dispatch`` in mindscience/distributed/harness/checks/moe.py).

``moe.errors``: each bad option raises ``MoEConfigError`` on every rank, before any
collective (the collective counter does not move).
"""

from __future__ import annotations

from mindscience.distributed.harness.checks.moe import with_layout
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
                                       embedding_group=t("embedding"), expert_dp_group=t("edp"))
        cref = ms.Tensor(Cw)

        def ref_loss(x):
            out, aux, _ = ref(x)
            return (out * cref).sum() / D + aux

        ref_grad = ms.value_and_grad(ref_loss, None, ref.trainable_params())
        ref_losses = []
        for _ in range(steps):
            loss, grads = ref_grad(ms.Tensor(X))
            ref_opt(grads)
            ref_losses.append(float(loss.asnumpy()))
        ref_w = {n: p.asnumpy() for n, p in layer_params(ref).items()}

        dpcp = manager.get_data_context_parallel_group()
        records = []
        for stage in stages:
            layer = MoELayer(cfg)
            load_weights(layer, weights)
            if stage == 3:
                fully_shard(layer)
            params = layer.trainable_params()
            opt = DistributedOptimizer(params, lr=lr, zero_stage=stage)
            c_local = ms.Tensor(np.ascontiguousarray(Cw[block]))

            def loss_fn(x):
                out, aux, _ = layer(x)
                return (out * c_local).sum() + aux

            grad_fn = ms.value_and_grad(loss_fn, None, params)

            def step(x):
                loss, grads = grad_fn(x)
                return ops_depend(loss, opt(grads))

            fn = ms.jit(step) if mode == "jit" else step
            x_local = ms.Tensor(np.ascontiguousarray(X[block]))
            losses = []
            for _ in range(steps):
                loss = fn(x_local)
                losses.append(float((C.all_reduce(loss, dpcp) / dpcp.size).asnumpy()))
            errors = {"losses": max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses))}
            for name in ("w1", "w2"):
                errors[name] = _rel(layer_params(layer)[name].asnumpy(),
                                    local_view(layer, name, ref_w[name]))
            if stage < 3:
                errors["router"] = _rel(layer.router.weight.asnumpy(), ref_w["router"])
            worst = max(errors.values())
            records.append({"check": "moe.train", "stage": stage, "mode": mode,
                            "passed": bool(worst <= 1e-5), "max_error": worst, "errors": errors,
                            "losses": losses, "ref_losses": ref_losses,
                            "expert_state_elements": opt.expert_optimizer.state_elements()})
        return records

    return with_layout(ctx, layout, body)


def ops_depend(value, dep):
    from mindspore import ops

    return ops.depend(value, dep)
