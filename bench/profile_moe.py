"""Where the ``alltoall`` dispatcher's time goes: per operation, slowest rank, one launch.

Run (by hand, a profile, not a test):

    flock /tmp/msdist-mp.lock python bench/profile_moe.py [--iters 5]

The setup of ``bench/bench_moe.py`` (a): ep4, PyNative, dropless, 8 experts, top-2, 2048
tokens of H 1024 per rank (16 MiB of real rows), identity experts. Each iteration runs,
one after the other so they see the same load: two bare all-to-alls of the real bytes, the
slot layout (``MoELayer._sized_alltoall``, the dispatcher before the sorted chunks) and the
sorted-chunk layout (``MoELayer._sorted_alltoall`` with ``moe.comm.all_to_all_v``), each operation timed between two
synchronisations (a one-element read back). Each figure is the median over ``--iters``
after one warm-up, then the max over ranks. The synchronisations add a little to every
operation; the totals are therefore a bit above bench_moe.py's.
"""

from __future__ import annotations

import argparse
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


class _Clock:
    def __init__(self):
        self.t = {}
        self.order = []

    def start(self):
        self.t0 = time.perf_counter()

    def lap(self, name, value=None):
        if value is not None:
            value.reshape((-1,))[:1].asnumpy()
        now = time.perf_counter()
        if name not in self.t:
            self.t[name] = []
            self.order.append(name)
        self.t[name].append(now - self.t0)
        self.t0 = now
        return value


@check("profile.moe_dispatch")
def profile_dispatch(ctx, iters: int = 5, experts: int = 8, hidden: int = 1024, tokens: int = 2048) -> dict:
    import numpy as np
    import mindspore as ms
    from mindspore import ops
    from mindspore import dtype as mstype

    from mindscience.distributed import collectives as C
    from mindscience.distributed.moe.comm import all_to_all_experts, all_to_all_v, all_to_all_v_rows

    from bench_moe import routed_layer

    topk = 2
    manager, layer, x, rng = routed_layer(ctx, experts, hidden, tokens, topk)
    ep = manager.get_expert_model_parallel_group()
    real = ms.Tensor(rng.normal(0, 1, (tokens * topk, hidden)).astype(np.float32))
    E, L, H, n = experts, layer.local_experts, hidden, tokens
    clocks = {"bare": _Clock(), "slots": _Clock(), "sorted": _Clock()}

    def bare(c):
        c.start()
        y = c.lap("all-to-all 1", all_to_all_experts(real, ep))
        c.lap("all-to-all 2", all_to_all_experts(y, ep))

    def route(c):
        c.start()
        indices, weights, routed, sums = layer.router(x, 1)
        c.lap("router", weights)
        return indices, weights, routed

    def slots(c):
        indices, weights, routed = route(c)
        onehot = ops.one_hot(indices, E, ops.ones((), mstype.float32), ops.zeros((), mstype.float32))
        wmap = c.lap("weight map (N, E)", (onehot * weights.reshape(weights.shape + (1,))).sum(1))
        cap = layer._dropless_slot(routed)
        c.lap("count all-gather + host sync")
        idx, valid = layer._select(routed, wmap, n, cap)
        c.lap("slot select (top-k over E x N)", idx)
        flat = idx.reshape((-1,))
        buf = c.lap("slot gather", ops.gather(x, flat, 0)).reshape((E, cap, H))
        buf = c.lap("validity mask", buf * valid.reshape((E, cap, 1)))
        cw = c.lap("slot weights", ops.gather_elements(wmap.T, 1, idx) * valid)
        y = c.lap("all-to-all 1", all_to_all_experts(buf, ep))
        src = y.shape[0] // L
        y = y.reshape((src, L, cap, H)).transpose(1, 0, 2, 3).reshape((L, src * cap, H))
        y = c.lap("transpose to experts", y)
        y = layer.experts(y)
        y = c.lap("transpose back", y.reshape((L, src, cap, H)).transpose(1, 0, 2, 3).reshape((src * L, cap, H)))
        y = c.lap("all-to-all 2", all_to_all_experts(y, ep))
        y = c.lap("combine multiply", (y * cw.reshape((E, cap, 1))).reshape((E * cap, H)))
        c.lap("combine scatter-add", ops.unsorted_segment_sum(y, flat, n))
        return E * cap

    def chunks(c):
        indices, weights, routed = route(c)
        k = topk
        flat = indices.asnumpy().reshape(-1)
        counts = np.bincount(flat, minlength=E).astype(np.float32).reshape((1, E))
        c.lap("indices to host")
        counts = np.rint(C.all_gather(ms.Tensor(counts), layer.dispatch_group, 0).asnumpy()).astype(np.int64)
        c.lap("count all-gather + host sync")
        send, pos, matrix, sizes, recv, back, R = layer._chunk_plan(flat, counts)
        i32 = lambda a: ms.Tensor(a.astype(np.int32))  # noqa: E731
        send, pos, recv, back = i32(send), i32(pos), i32(recv), i32(back)
        c.lap("host index plan")
        y = c.lap("send gather (sorted by expert)", ops.gather(x, send, 0))
        y = c.lap("all-to-all-v 1", all_to_all_v(y, ep, matrix))
        y = c.lap("recv gather (per expert)", ops.gather(y, recv, 0)).reshape((L, R, H))
        y = layer.experts(y).reshape((L * R, H))
        y = c.lap("back gather", ops.gather(y, back, 0))
        y = c.lap("all-to-all-v 2", all_to_all_v(y, ep, tuple(zip(*matrix))))
        y = c.lap("unsort gather (N, k)", ops.gather(y, pos, 0)).reshape((n, k, H))
        c.lap("combine bmm", ops.bmm(weights.reshape((n, 1, k)), y))
        return all_to_all_v_rows(ep, matrix)

    rows = {}
    for it in range(iters + 1):
        bare(clocks["bare"])
        rows["slots"] = slots(clocks["slots"])
        rows["sorted"] = chunks(clocks["sorted"])
        if it == 0:
            for c in clocks.values():
                c.t = {k: [] for k in c.t}
    out = {}
    for name, c in clocks.items():
        out[name] = [[k, statistics.median(c.t[k])] for k in c.order]
    manager.destroy_parallel()
    return {"check": "profile.moe_dispatch", "passed": True, "ops": out,
            "rows": {k: int(v) for k, v in rows.items()}, "real_rows": tokens * topk}


def main(argv=None) -> int:
    from bench_mappings import _loadavg, run_bench_launch

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--timeout", type=float, default=900.0)
    args = parser.parse_args(argv)
    spec = {"checks": [{"name": "profile.moe_dispatch", "params": {"iters": args.iters}}],
            "modules": ["profile_moe"]}
    load_before = _loadavg()
    launched = run_bench_launch(spec, 4, args.timeout, progress_every_s=60)
    if launched is None:
        return 1
    result, wall, load_after = launched
    recs = [r for st in result.ranks.values() for r in (st or {}).get("records", [])]
    print(f"4 ranks, wall {wall:.0f} s, load {load_before} -> {load_after}")
    for name in ("bare", "slots", "sorted"):
        names = [k for k, _ in recs[0]["ops"][name]]
        per = {k: max(dict(r["ops"][name])[k] for r in recs) for k in names}
        total = max(sum(v for _, v in r["ops"][name]) for r in recs)
        rows = max(r["rows"].get(name, r["real_rows"]) for r in recs)
        print(f"\n{name}: total {total * 1e3:.0f} ms (slowest rank), rows sent per rank {rows} "
              f"(real {recs[0]['real_rows']})")
        for k in names:
            print(f"  {k:34s} {per[k] * 1e3:8.1f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
