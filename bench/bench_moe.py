"""MoE benchmarks: the dispatcher against a bare all-to-all, and a MoE layer at ep4 vs one rank.

Run (by hand; a benchmark, not a test):

    python bench/bench_moe.py [--iters 5]

One 4-rank msrun launch; this file is also the check module the workers import
(``bench.moe_dispatch``, ``bench.moe_layer``):

(a) dispatch + combine of the ``alltoall`` dispatcher at ep4 (dropless, 8 experts, top-2,
    a 16 MiB float32 (E, C, H) dispatch buffer per rank, experts replaced by the identity)
    against two bare all-to-alls of the same buffer (the dispatch and the combine
    exchanges alone). Median over ``--iters`` after one warm-up, slowest rank.
(b) a MoE layer (8 experts, H 256, F 512, top-2, 1024 tokens per rank) at ep4 against the
    same layer on one rank (ep1, each rank alone): forward + backward step time (median,
    slowest rank) and bytes of Parameters each rank holds.

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


def _timed(fn, iters):
    times = []
    for i in range(iters + 1):
        t0 = time.perf_counter()
        out = fn()
        for o in (out if isinstance(out, (tuple, list)) else (out,)):
            o.asnumpy()
        if i:
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


@check("bench.moe_dispatch")
def moe_dispatch(ctx, iters: int = 5, experts: int = 8, hidden: int = 1024, tokens: int = 512) -> dict:
    import numpy as np
    import mindspore as ms
    from mindspore import nn, ops

    from mindscience.distributed.moe import MoEConfig, MoELayer
    from mindscience.distributed.moe.comm import all_to_all_experts

    manager = _init(4)
    ep = manager.get_expert_model_parallel_group()
    layer = MoELayer(MoEConfig(hidden_size=hidden, num_experts=experts, ffn_hidden_size=8, topk=2))

    class Identity(nn.Cell):
        def construct(self, x):
            return x

    layer.experts = Identity()
    rng = np.random.default_rng(ctx.rank)
    x = ms.Tensor(rng.normal(0, 1, (tokens, hidden)).astype(np.float32))
    nbytes = experts * tokens * hidden * 4

    def dispatch_combine():
        idx, weights, routed, _ = layer.router(x)
        onehot = ops.one_hot(idx, experts, ops.ones((), ms.float32), ops.zeros((), ms.float32))
        wmap = (onehot * weights.reshape(weights.shape + (1,))).sum(1)
        buf = x.reshape((1, tokens, hidden)) * routed.T.reshape((experts, tokens, 1))
        y = layer._experts_alltoall(buf)
        return (y * wmap.T.reshape((experts, tokens, 1))).sum(0)

    buf = ms.Tensor(rng.normal(0, 1, (experts, tokens, hidden)).astype(np.float32))

    def bare():
        return all_to_all_experts(all_to_all_experts(buf, ep), ep)

    t_bare = _timed(bare, iters)
    t_disp = _timed(dispatch_combine, iters)
    return {"check": "bench.moe_dispatch", "passed": True, "bytes": nbytes,
            "bare_s": t_bare, "dispatch_combine_s": t_disp, "ratio": t_disp / t_bare}


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
        records.append({"check": "bench.moe_layer", "passed": True, "ep": ep, "step_s": step,
                        "bytes_held": held, "expert_bytes": expert_bytes})
        manager.destroy_parallel()
    return records


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
    print(f"(a) ep4, {d[0]['bytes'] / 2**20:.0f} MiB dispatch buffer per rank (slowest rank, median of {args.iters})")
    print("| dispatch + combine s | 2 bare all-to-alls s | ratio |")
    print("|---|---|---|")
    disp, bare = _slowest(d, "dispatch_combine_s"), _slowest(d, "bare_s")
    print(f"| {disp:.3f} | {bare:.3f} | {disp / bare:.2f}x |")
    lay = [r for r in recs if r["check"] == "bench.moe_layer"]
    print()
    print("(b) MoE layer (8 experts, H 256, F 512, top-2, 1024 tokens/rank), forward+backward")
    print("| ep | step s (slowest rank) | Parameter bytes per rank | expert bytes | expert bytes x ep |")
    print("|---|---|---|---|---|")
    for ep in (1, 4):
        sel = [r for r in lay if r["ep"] == ep]
        print(f"| {ep} | {_slowest(sel, 'step_s'):.3f} | {max(r['bytes_held'] for r in sel):,} | "
              f"{max(r['expert_bytes'] for r in sel):,} | {max(r['expert_bytes'] for r in sel) * ep:,} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
