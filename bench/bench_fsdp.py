"""``fully_shard`` units (FSDP2): peak gathered bytes and step time, reshard and prefetch on/off.

Run (by hand; a benchmark, not a test):

    python bench/bench_fsdp.py [--steps 5] [--blocks 6] [--hidden 384] [--modes pynative jit]

One 4-rank msrun launch (dp4, float32); this file is also the check module the workers
import (``bench.fsdp``). The model: ``blocks`` residual MLP blocks (Dense(h, 4h) -> tanh ->
Dense(4h, h)), each its own ``fully_shard`` unit, and a root unit (input projection and
head, Dense(h, h) each) around them; an MSE loss on 64 rows per rank. Per configuration:
the whole model (replicated, ``GradientFinalizer``), then ``fully_shard`` with
(reshard_after_forward, prefetch) in (True, True), (True, False), (False, True),
(False, False). A step is forward + backward (+ the finalizer); the median of ``--steps``
steps after one warm-up (which also records the unit order prefetch follows), the slowest
rank's. The peak of gathered bytes (``fsdp.peak_gathered_bytes()``) is counted in the
measured steps and compared with ``fsdp.rules.peak_gathered_bytes`` (the model's figure).
Compiled (``--modes jit``) runs as reshard=False, prefetch=False whatever is asked
(``fsdp_runtime("jit")``): measured once, with the default flags.
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
COMBOS = ((True, True), (True, False), (False, True), (False, False))
_KEEP = []


def _model(blocks, hidden, seed=5):
    import mindspore as ms
    import numpy as np
    from mindspore import nn, ops

    class Block(nn.Cell):
        def __init__(self):
            super().__init__()
            self.up = nn.Dense(hidden, 4 * hidden)
            self.down = nn.Dense(4 * hidden, hidden)

        def construct(self, x):
            return x + self.down(ops.tanh(self.up(x)))

    class Net(nn.Cell):
        def __init__(self):
            super().__init__()
            self.inp = nn.Dense(hidden, hidden)
            self.blocks = nn.CellList([Block() for _ in range(blocks)])
            self.head = nn.Dense(hidden, hidden)

        def construct(self, x, t):
            h = self.inp(x)
            for block in self.blocks:
                h = block(h)
            return ((self.head(h) - t) ** 2).mean()

    ms.set_seed(seed)
    np.random.seed(seed)
    return Net()


@check("bench.fsdp")
def bench_fsdp(ctx, blocks=6, hidden=384, rows=64, steps=5, modes=("pynative",)):
    import mindspore as ms
    import numpy as np

    from mindscience.distributed import GradientFinalizer, fully_shard, manager
    from mindscience.distributed.fsdp import (peak_gathered_bytes, reset_gathered_bytes, rules,
                                              units_of)

    if not manager.is_initialized():
        manager.initialize_parallel()
    dp = manager.get_data_context_parallel_group()
    rng = np.random.default_rng(dp.rank)
    x = ms.Tensor(rng.standard_normal((rows, hidden)).astype(np.float32))
    t = ms.Tensor(rng.standard_normal((rows, hidden)).astype(np.float32))
    records = []
    for mode in modes:
        configs = [("whole", None)] + [("fully_shard", c) for c in (COMBOS if mode == "pynative"
                                                                     else ((True, True),))]
        for label, flags in configs:
            net = _model(blocks, hidden)
            if flags is not None:
                for block in net.blocks:
                    fully_shard(block, reshard_after_forward=flags[0], prefetch=flags[1])
                fully_shard(net, reshard_after_forward=flags[0], prefetch=flags[1])
            params = net.trainable_params()
            fn = ms.value_and_grad(net, None, params)
            if mode == "jit":
                fn = ms.jit(fn)
            _KEEP.append((net, fn))
            finalize = GradientFinalizer(params)
            times = []
            for i in range(steps + 1):
                if i == 1:
                    reset_gathered_bytes()
                t0 = time.perf_counter()
                loss, grads = fn(x, t)
                grads = finalize(grads)
                float(loss)
                _ = [g.asnumpy() for g in grads[:1]]
                if i:
                    times.append(time.perf_counter() - t0)
            rec = {"check": "bench.fsdp", "mode": mode, "model": label,
                   "reshard": None if flags is None else flags[0],
                   "prefetch": None if flags is None else flags[1],
                   "step_s_median": round(statistics.median(times), 4),
                   "loss": float(loss), "passed": True}
            if flags is not None:
                units = units_of(net)
                leaves = [u.bytes for u in units if u.cell is not net]
                root = [u.bytes for u in units if u.cell is net][0]
                runs = rules.fsdp_runtime(mode, *flags)
                rec.update(peak_bytes=peak_gathered_bytes(), unit_bytes=leaves[0], root_bytes=root,
                           whole_bytes=root + sum(leaves),
                           figure=rules.peak_gathered_bytes(leaves, root, runs["reshard_after_forward"],
                                                            runs["prefetch"]))
            records.append(rec)
    return records


def main(argv=None):
    from bench_mappings import _loadavg, run_bench_launch

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--blocks", type=int, default=6)
    parser.add_argument("--hidden", type=int, default=384)
    parser.add_argument("--modes", nargs="+", default=["pynative"], choices=["pynative", "jit"])
    parser.add_argument("--timeout", type=float, default=900.0)
    args = parser.parse_args(argv)
    command = "python bench/bench_fsdp.py " + " ".join(shlex.quote(a) for a in (argv or sys.argv[1:]))
    spec = {"modules": ["bench_fsdp"], "checks": [{"name": "bench.fsdp", "params": {
        "blocks": args.blocks, "hidden": args.hidden, "steps": args.steps, "modes": args.modes}}]}
    load_before = _loadavg()
    launched = run_bench_launch(spec, WORLD, args.timeout, progress_every_s=60)
    if launched is None:
        return 1
    result, wall, load_after = launched
    recs = [r for st in result.ranks.values() for r in (st or {}).get("records", [])]
    print(f"command: {command}")
    print(f"{WORLD} ranks (dp4), wall {wall:.0f} s, load {load_before} -> {load_after}")
    print()
    print(f"{args.blocks} blocks of hidden {args.hidden}, float32; step = forward + backward "
          f"(+ finalizer), median of {args.steps} steps, slowest rank")
    print("| mode | model | reshard_after_forward | prefetch | step s | vs whole | "
          "peak gathered bytes | model's figure | of the whole model |")
    print("|---|---|---|---|---|---|---|---|---|")
    for mode in args.modes:
        sel = [r for r in recs if r["mode"] == mode]
        keys = []
        for r in sel:
            key = (r["model"], r["reshard"], r["prefetch"])
            if key not in keys:
                keys.append(key)
        base = None
        for key in keys:
            rs = [r for r in sel if (r["model"], r["reshard"], r["prefetch"]) == key]
            step = max(r["step_s_median"] for r in rs)
            base = step if base is None else base
            first = rs[0]
            if key[0] == "whole":
                print(f"| {mode} | whole | - | - | {step:.3f} | 1.00x | - | - | - |")
                continue
            peaks = {r["peak_bytes"] for r in rs}
            peak = max(peaks)
            same = "" if len(peaks) == 1 else " (ranks differ)"
            if mode != "pynative":  # compiled gathers are not counted (no eager state)
                print(f"| {mode} | fully_shard | {key[1]} (runs False) | {key[2]} (runs False) | "
                      f"{step:.3f} | {step / base:.2f}x | not counted | {first['figure']:,} | 100% |")
                continue
            print(f"| {mode} | fully_shard | {key[1]} | {key[2]} | {step:.3f} | {step / base:.2f}x | "
                  f"{peak:,}{same} | {first['figure']:,} | {peak / first['whole_bytes']:.0%} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
