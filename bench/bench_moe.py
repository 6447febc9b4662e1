"""MoE benchmarks: the dispatcher against a bare all-to-all, and a MoE layer at ep4 vs one rank.

Run (by hand; a benchmark, not a test):

    python bench/bench_moe.py [--iters 5]

One 4-rank msrun launch; this file is also the check module the workers import
(``bench.moe_dispatch``, ``bench.moe_layer``):

(a) dispatch + combine of the ``alltoall`` dispatcher at ep4 (PyNative, dropless, 8 experts,
    top-2, 2048 tokens of H 1024 per rank: 16 MiB of real (token, expert) rows, experts
    replaced by the identity; the layer's own routing, count exchange, sorting, regrouping
    and combine: ``MoELayer._route_and_run``) against two bare all-to-alls of the same real
    bytes (a (tokens * topk, H) buffer through ``moe.comm.all_to_all_experts``: on CPU the
    same composed all-to-all, an all-gather, that the dispatcher's uneven
    ``moe.comm.all_to_all_v`` runs on). The dispatcher's buffer is ``imbalance`` times the
    real bytes (1 on CPU, where the uneven all-to-all needs no padding). Median over
    ``--iters`` after one warm-up, slowest rank; the bare pair and the dispatcher alternate
    within each iteration so both see the same load. Also timed: the same dispatch + combine
    without the router (``MoELayer._sorted_alltoall`` on one routing made beforehand).
(b) a MoE layer (8 experts, H 256, F 512, top-2, 1024 tokens per rank) at ep4 against the
    same layer on one rank (ep1, each rank alone): forward + backward step time (median,
    slowest rank), bytes of Parameters each rank holds and bytes its all-to-alls move, each
    against the cost model's figure (expert shapes + router; ``moe_rows`` at the measured
    imbalance; the router and expert FLOPs over the ``cpu`` device preset plus its ep rows).

4 ranks on 2 shared cores are oversubscribed: the ratios are what docs/BENCHMARKS.md
reports ("MoE layer"), not absolute times.
"""

from __future__ import annotations

import argparse
import shlex
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BENCH = Path(__file__).resolve().parent
for _p in (str(ROOT), str(BENCH)):
    if _p not in sys.path:
        sys.path.insert(0, _p)

from mindscience.distributed.harness.registry import check  # noqa: E402  (pure)

WORLD = 4


def _init(ep: int):
    from mindscience.distributed import manager

    if manager.is_initialized():
        manager.destroy_parallel()
    manager.initialize_parallel(expert_model_parallel_size=ep)
    return manager


def routed_layer(ctx, experts: int, hidden: int, tokens: int, topk: int = 2):
    """``(manager, layer, x, rng)`` on ep4: a MoELayer whose experts are the identity (the
    dispatch and combine alone), and this rank's ``tokens x hidden`` input."""
    import numpy as np
    import mindspore as ms
    from mindspore import nn

    from mindscience.distributed.moe import MoEConfig, MoELayer

    manager = _init(4)
    layer = MoELayer(MoEConfig(hidden_size=hidden, num_experts=experts, ffn_hidden_size=8, topk=topk))

    class Identity(nn.Cell):
        def construct(self, x):
            return x

    layer.experts = Identity()
    rng = np.random.default_rng(ctx.rank)
    x = ms.Tensor(rng.normal(0, 1, (tokens, hidden)).astype(np.float32))
    return manager, layer, x, rng


def _timed(fn, iters, all_runs=False):
    """Median seconds of ``fn`` (outputs read back) over ``iters`` after one warm-up, or
    with ``all_runs`` the list of every run's seconds (the warm-up included)."""
    times = []
    for i in range(iters + 1):
        t0 = time.perf_counter()
        out = fn()
        for o in (out if isinstance(out, (tuple, list)) else (out,)):
            o.asnumpy()
        if i or all_runs:
            times.append(time.perf_counter() - t0)
    return times if all_runs else statistics.median(times)


@check("bench.moe_dispatch")
def moe_dispatch(ctx, iters: int = 5, experts: int = 8, hidden: int = 1024, tokens: int = 2048) -> dict:
    import numpy as np
    import mindspore as ms

    from mindscience.distributed.moe.comm import all_to_all_experts

    manager, layer, x, rng = routed_layer(ctx, experts, hidden, tokens)
    ep = manager.get_expert_model_parallel_group()
    topk = 2
    real = tokens * topk * hidden * 4

    def dispatch_combine():
        return layer._route_and_run(x, 1)[0]

    buf = ms.Tensor(rng.normal(0, 1, (tokens * topk, hidden)).astype(np.float32))

    def bare():
        return all_to_all_experts(all_to_all_experts(buf, ep), ep)

    # The same dispatch + combine without the router (routed once, outside the timing).
    indices, weights, _, _ = layer.router(x, 1)

    def unrouted():
        return layer._sorted_alltoall(x, indices, weights)

    t_bare, t_disp, t_unrouted = [], [], []
    for _ in range(iters + 1):
        t_bare.append(_timed(bare, 0, all_runs=True)[0])
        t_disp.append(_timed(dispatch_combine, 0, all_runs=True)[0])
        t_unrouted.append(_timed(unrouted, 0, all_runs=True)[0])
    t_bare, t_disp, t_unrouted = (statistics.median(t[1:]) for t in (t_bare, t_disp, t_unrouted))
    rec = layer.last_dispatch
    return {"check": "bench.moe_dispatch", "passed": True, "bytes": real,
            "buffer_bytes": rec["rows"] * hidden * 4, "imbalance": rec["imbalance"],
            "expert_rows": rec.get("expert_rows", rec["rows"] // layer.ep),
            "bare_s": t_bare, "dispatch_combine_s": t_disp, "unrouted_s": t_unrouted,
            "ratio": t_disp / t_bare}


@check("bench.moe_layer")
def moe_layer(ctx, iters: int = 5, experts: int = 8, hidden: int = 256, ffn: int = 512,
              tokens: int = 1024) -> list:
    import numpy as np
    import mindspore as ms

    from mindscience.distributed.group import ParallelGroup
    from mindscience.distributed.moe import MoEConfig, MoELayer

    cfg = MoEConfig(hidden_size=hidden, num_experts=experts, ffn_hidden_size=ffn, topk=2,
                    aux_loss_coeff=0.01)
    rng = np.random.default_rng(0)
    x = ms.Tensor(rng.normal(0, 1, (tokens, 1, hidden)).astype(np.float32))
    records = []
    for ep in (1, 4):
        manager = _init(ep)
        if ep == 1:
            from mindspore.communication import get_rank

            t = lambda k: ParallelGroup.trivial(k, get_rank())  # noqa: E731
            layer = MoELayer(cfg, ep_group=t("ep"), etp_group=t("etp"), tp_group=t("tp"),
                             dp_cp_group=t("dp-cp"), cp_group=t("cp"))
        else:
            layer = MoELayer(cfg)
        params = layer.trainable_params()
        grad = ms.value_and_grad(lambda v: (lambda o: (o[0] * o[0]).sum() + o[1])(layer(v)),
                                 None, params)
        step = _timed(lambda: grad(x)[1], iters)
        held = sum(int(np.prod(p.shape)) * 4 for p in layer.get_parameters())
        expert_bytes = sum(int(np.prod(p.shape)) * 4 for p in params if getattr(p, "expert_parallel", False))
        rec = dict(layer.last_dispatch)
        # The experts' rows (each local expert padded to the busiest) over the mean.
        expert_imbalance = rec.get("expert_rows", rec["rows"] // ep) / (tokens * cfg.topk)
        rec["expert_imbalance"] = expert_imbalance
        records.append({"check": "bench.moe_layer", "passed": True, "ep": ep, "step_s": step,
                        "bytes_held": held, "expert_bytes": expert_bytes, "dispatch": rec,
                        **_priced(cfg, tokens, ep, rec["imbalance"], expert_imbalance)})
        manager.destroy_parallel()
    return records


def _priced(cfg, tokens: int, ep: int, imbalance: float, expert_imbalance: float) -> dict:
    """The cost model's figures for one MoE layer (no attention) at ``ep`` on the ``cpu`` preset:
    Parameter bytes per rank (its expert shapes + the router), bytes the four ep all-to-alls
    send per step (``moe_rows`` at the dispatch's ``imbalance``) and the step: 3x the forward
    FLOPs of the router and the experts (at ``expert_imbalance``, the busiest expert's rows)
    over the preset's FLOP/s, plus the ep rows' alpha-beta time."""

    from math import prod

    from mindscience.distributed.costmodel.comm import moe_rows
    from mindscience.distributed.costmodel.params import expert_shapes, mlp_fc1_width
    from mindscience.distributed.costmodel.spec import ClusterSpec, ModelSpec, TrainingSpec
    from mindscience.distributed.costmodel.steptime import (collective_seconds, layer_forward_flops,
                                                            moe_layer_forward_flops)

    model = ModelSpec(num_layers=1, hidden_size=cfg.hidden_size, num_attention_heads=1, seq_length=tokens,
                      vocab_size=0, ffn_hidden_size=cfg.ffn_hidden_size, num_moe_experts=cfg.num_experts,
                      moe_router_topk=cfg.topk)
    training = TrainingSpec(micro_batch_size=1, precision="fp32", moe_imbalance=max(imbalance, 1.0))
    cluster = ClusterSpec(device="cpu")
    held = 4 * (sum(prod(shape) for shape, _ in expert_shapes(model, 1, ep)) + cfg.num_experts * cfg.hidden_size)
    rows = moe_rows(model, training, 1, 1, ep, 1, passes=1, again=0)
    # The MoE FFN alone: the MoE layer's linear FLOPs minus the dense layer's, plus its MLP.
    h = cfg.hidden_size
    busy = max(expert_imbalance, 1.0)
    ffn = (moe_layer_forward_flops(model, tokens, tokens, busy)["linear"]
           - layer_forward_flops(model, tokens, tokens)["linear"]
           + 2 * tokens * h * (mlp_fc1_width(model) + model.ffn_hidden_size))
    compute = 3 * ffn / cluster.effective_flops
    comm = collective_seconds(rows, "ep", cluster, False)
    return {"priced_bytes_held": held, "priced_moved": sum(r["bytes"] for r in rows if r["group"] == "ep"),
            "priced_compute_s": compute, "priced_ep_s": comm, "priced_step_s": compute + comm}


def _slowest(records, key):
    return max(r[key] for r in records)


def main(argv=None) -> int:
    from bench_mappings import _loadavg, run_bench_launch

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--timeout", type=float, default=900.0)
    args = parser.parse_args(argv)
    command = "python bench/bench_moe.py " + " ".join(shlex.quote(a) for a in (argv or sys.argv[1:]))
    spec = {"checks": [{"name": "bench.moe_dispatch", "params": {"iters": args.iters}},
                       {"name": "bench.moe_layer", "params": {"iters": args.iters}}],
            "modules": ["bench_moe"]}
    load_before = _loadavg()
    launched = run_bench_launch(spec, WORLD, args.timeout, progress_every_s=60)
    if launched is None:
        return 1
    result, wall, load_after = launched
    recs = [r for st in result.ranks.values() for r in (st or {}).get("records", [])]
    print(f"command: {command}")
    print(f"{WORLD} ranks, wall {wall:.0f} s, load {load_before} -> {load_after}")
    d = [r for r in recs if r["check"] == "bench.moe_dispatch"]
    print()
    print(f"(a) ep4, {d[0]['bytes'] / 2**20:.0f} MiB of real rows per rank (slowest rank, median of {args.iters})")
    print("| dispatch + combine s | 2 bare all-to-alls of the real bytes s | ratio | without the router s | ratio "
          "| dispatch buffer MiB (max rank) | imbalance (max rank) | expert rows (max rank) |")
    print("|---|---|---|---|---|---|---|---|")
    disp, bare, unrouted = (_slowest(d, k) for k in ("dispatch_combine_s", "bare_s", "unrouted_s"))
    print(f"| {disp:.3f} | {bare:.3f} | {disp / bare:.2f}x | {unrouted:.3f} | {unrouted / bare:.2f}x "
          f"| {_slowest(d, 'buffer_bytes') / 2**20:.2f} | {_slowest(d, 'imbalance'):.3f} | {_slowest(d, 'expert_rows')} |")
    lay = [r for r in recs if r["check"] == "bench.moe_layer"]
    print()
    print("(b) MoE layer (8 experts, H 256, F 512, top-2, 1024 tokens/rank), forward+backward, cost model "
          "with the cpu preset at the measured imbalance (max over ranks)")
    print("| ep | step s (slowest rank) | predicted s | measured / predicted | Parameter bytes per rank | "
          "priced | all-to-all bytes per rank and step | priced | dispatch imbalance | expert imbalance |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for ep in (1, 4):
        sel = [r for r in lay if r["ep"] == ep]
        busy = max(sel, key=lambda r: (r["dispatch"]["expert_imbalance"], r["dispatch"]["imbalance"]))
        step = _slowest(sel, "step_s")
        moved = max(r["dispatch"]["step_all_to_all_bytes"] for r in sel)
        priced_moved = max(r["priced_moved"] for r in sel)
        print(f"| {ep} | {step:.3f} | {busy['priced_step_s']:.3f} | {step / busy['priced_step_s']:.2f} | "
              f"{max(r['bytes_held'] for r in sel):,} | {busy['priced_bytes_held']:,} | {moved:,} | "
              f"{priced_moved:,} | {max(r['dispatch']['imbalance'] for r in sel):.3f} | "
              f"{busy['dispatch']['expert_imbalance']:.3f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
