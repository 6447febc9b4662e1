"""Benchmark ColumnParallelLinear / RowParallelLinear: overhead at tp=1, time and memory at tp>1.

    python bench/bench_layers.py                       # everything (several minutes on 2 cores)
    python bench/bench_layers.py --skip-msrun          # only the tp=1 overhead table
    python bench/bench_layers.py --tp 1 2 4 --hidden 4096 --tokens 256 --iters 5

Part 1 (this process, no communication): forward+backward (gradients of the input and
of every parameter of ``sum(layer(x))``) of the parallel layers at tp=1 against
``mindspore.mint.nn.Linear`` of the same shape, float32 compute, alternating the three
layers (in a rotating order) each iteration; the median and the minimum time of each and
their ratios to mint.nn.Linear. On a shared 2-core machine identical layers differ by
up to ~10% from run to run, so read ratios within 0.9-1.1 as "the same".

Part 2 (one ``msrun`` per tp size, tp = all ranks): per rank, the time of the same
forward+backward for ``ColumnParallelLinear(H, H, gather_output=False)`` and
``RowParallelLinear(H, H, input_is_parallel=True)`` (the MLP pairing: Column has its
all-reduce in the backward, Row in the forward), the peak memory of building each layer
(``initialize_affine_weight`` materializes the full master weight on every rank) and
the peak resident memory of the process during the timed loop. "init peak" is the
growth of the peak RSS while one layer is built (master + shard), "params" the bytes of
the layer's parameters afterwards. Memory comes from
``/proc/self/status`` (VmRSS / VmHWM, reset via ``/proc/self/clear_refs``). msrun gives
every rank ``OMP_NUM_THREADS=1``; on a 2-core machine 4 ranks are oversubscribed, and
CPU collectives are compositions (all-reduce via ``mint.distributed``), so these figures
describe the machine, not the method.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import uuid

import numpy as np

MiB = 1024 * 1024


# ----------------------------------------------------------------------------- memory
def _status(field: str) -> float:
    with open("/proc/self/status", encoding="ascii") as fh:
        for line in fh:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024 / MiB
    return float("nan")


def rss_mib() -> float:
    return _status("VmRSS")


def peak_mib() -> float:
    return _status("VmHWM")


def reset_peak() -> None:
    """Reset VmHWM to the current RSS (Linux: write 5 to clear_refs)."""
    with open("/proc/self/clear_refs", "w", encoding="ascii") as fh:
        fh.write("5")


# ----------------------------------------------------------------------------- timing
def make_step(layer, x):
    """One forward+backward: gradients of the input and of every parameter, synchronized."""
    import mindspore as ms

    params = layer.trainable_params()

    def loss(inp):
        out = layer(inp)
        return (out[0] if isinstance(out, tuple) else out).sum()

    grad_fn = ms.grad(loss, grad_position=0, weights=params)

    def step():
        dx, grads = grad_fn(x)
        dx.asnumpy()  # block until the work is done
        for g in grads:
            g.asnumpy()

    return step


def time_steps(steps: dict, iters: int, warmup: int = 1) -> dict:
    """Seconds per step of each callable: ``{name: (median, min)}``.

    The callables alternate, and the order rotates every iteration, so none is always
    the first (cold caches, allocator) or the last.
    """
    for fn in steps.values():
        for _ in range(warmup):
            fn()
    names = list(steps)
    times = {name: [] for name in names}
    for i in range(iters):
        for name in names[i % len(names):] + names[:i % len(names)]:
            t0 = time.perf_counter()
            steps[name]()
            times[name].append(time.perf_counter() - t0)
    return {name: (statistics.median(ts), min(ts)) for name, ts in times.items()}


# ----------------------------------------------------------------------------- part 1
def overhead_tp1(shapes, iters: int) -> list:
    import mindspore as ms
    from mindspore import mint

    from mindscience.distributed.modules import ColumnParallelLinear, RowParallelLinear

    ms.set_context(mode=ms.PYNATIVE_MODE)
    rows = []
    for hidden, tokens in shapes:
        x = ms.Tensor(np.random.default_rng(0).standard_normal((tokens, hidden)), ms.float32)
        layers = {
            "mint.nn.Linear": mint.nn.Linear(hidden, hidden),
            "ColumnParallelLinear": ColumnParallelLinear(hidden, hidden, compute_dtype=ms.float32),
            "RowParallelLinear": RowParallelLinear(hidden, hidden, compute_dtype=ms.float32),
        }
        timed = time_steps({k: make_step(v, x) for k, v in layers.items()}, iters)
        base_med, base_min = timed["mint.nn.Linear"]
        for name, (med, low) in timed.items():
            rows.append({"shape": f"{hidden}x{hidden}, x ({tokens}, {hidden})", "layer": name,
                         "median ms": round(med * 1e3, 2), "min ms": round(low * 1e3, 2),
                         "ratio (median)": round(med / base_med, 3),
                         "ratio (min)": round(low / base_min, 3)})
    return rows


# ----------------------------------------------------------------------------- part 2 (rank side)
def worker(args) -> int:
    from mindspore.communication import get_group_size, get_rank, init

    import mindspore as ms

    if os.environ.get("MS_ROLE") == "MS_SCHED":
        init()
        return 0
    ms.set_context(mode=ms.PYNATIVE_MODE)
    init()
    from mindscience.distributed import manager
    from mindscience.distributed.modules import ColumnParallelLinear, RowParallelLinear

    rank, world = get_rank(), get_group_size()
    manager.initialize_parallel(tensor_parallel_size=world)
    tp = manager.get_tensor_parallel_group()
    h, t = args.hidden, args.tokens
    result = {"rank": rank, "tp": world, "hidden": h, "tokens": t,
              "omp_threads": os.environ.get("OMP_NUM_THREADS")}

    def build(name, make):
        base = rss_mib()
        reset_peak()
        ms.set_seed(0)
        layer = make()
        result[f"{name}_init_peak_mib"] = round(peak_mib() - base, 1)
        result[f"{name}_init_kept_mib"] = round(rss_mib() - base, 1)
        result[f"{name}_param_mib"] = round(sum(p.nbytes for p in layer.get_parameters()) / MiB, 1)
        return layer

    col = build("column", lambda: ColumnParallelLinear(h, h, gather_output=False, compute_dtype=ms.float32))
    row = build("row", lambda: RowParallelLinear(h, h, input_is_parallel=True, compute_dtype=ms.float32))
    rng = np.random.default_rng(0)
    x_full = ms.Tensor(rng.standard_normal((t, h)), ms.float32)
    x_part = ms.Tensor(rng.standard_normal((t, h // tp.size)), ms.float32)
    steps = {"column": make_step(col, x_full), "row": make_step(row, x_part)}
    for fn in steps.values():
        fn()  # warm-up (first collective, kernel selection)
    base = rss_mib()
    reset_peak()
    timed = time_steps(steps, args.iters, warmup=0)
    result["loop_peak_mib"] = round(peak_mib(), 1)
    result["loop_peak_delta_mib"] = round(peak_mib() - base, 1)
    for name, (med, low) in timed.items():
        result[f"{name}_ms"] = round(med * 1e3, 1)
        result[f"{name}_min_ms"] = round(low * 1e3, 1)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, f"rank_{rank}.json"), "w", encoding="utf-8") as fh:
        json.dump(result, fh)
    return 0


# ----------------------------------------------------------------------------- part 2 (parent side)
def launch(tp: int, args) -> tuple:
    from mindscience.distributed.harness import find_free_port, find_msrun, stop_job

    out = tempfile.mkdtemp(prefix=f"bench-layers-tp{tp}-")
    cmd = [find_msrun(), f"--worker_num={tp}", f"--local_worker_num={tp}",
           f"--master_port={find_free_port()}", f"--log_dir={out}/logs", "--join=True",
           os.path.abspath(__file__), "--as-msrun-rank", "--out", out,
           "--hidden", str(args.hidden), "--tokens", str(args.tokens), "--iters", str(args.iters)]
    job = uuid.uuid4().hex
    env = dict(os.environ, MSDIST_HARNESS_JOB=job,
               PATH=os.pathsep.join([os.path.dirname(sys.executable), os.environ.get("PATH", "")]))
    proc = subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    try:
        code = proc.wait(timeout=args.timeout)
    except subprocess.TimeoutExpired:
        code = None
    finally:
        stop_job(job, [proc])  # msrun's workers run in their own sessions
    ranks = []
    for r in range(tp):
        path = os.path.join(out, f"rank_{r}.json")
        if os.path.exists(path):
            with open(path, encoding="utf-8") as fh:
                ranks.append(json.load(fh))
    if code != 0 or len(ranks) != tp:
        raise RuntimeError(
            f"tp={tp}: msrun exited with {code}, {len(ranks)}/{tp} results; logs in {out}/logs"
        )
    return cmd, ranks


def table(rows: list, columns: list) -> str:
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(str(r[c]) for c in columns) + " |" for r in rows]
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=4096, help="layer size H (an H x H layer)")
    parser.add_argument("--tokens", type=int, default=256, help="rows of the input")
    parser.add_argument("--iters", type=int, default=5, help="timed iterations (median)")
    parser.add_argument("--tp", type=int, nargs="*", default=[1, 2, 4], help="tp sizes to run under msrun")
    parser.add_argument("--skip-msrun", action="store_true", help="only part 1 (tp=1 overhead)")
    parser.add_argument("--timeout", type=float, default=600)
    parser.add_argument("--json", help="also write all results to this file")
    parser.add_argument("--as-msrun-rank", dest="worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        return worker(args)

    command = "python bench/bench_layers.py " + " ".join(argv if argv is not None else sys.argv[1:])
    load = " / ".join(f"{v:.1f}" for v in os.getloadavg())
    print(f"command: {command.strip()}\n(nproc={os.cpu_count()}, load average 1/5/15 min at start: {load})\n")
    results = {"command": command.strip(), "nproc": os.cpu_count(), "load_at_start": os.getloadavg()}
    shapes = [(1024, 128), (args.hidden, args.tokens)]
    rows = overhead_tp1(shapes, max(args.iters, 15))
    results["tp1_overhead"] = rows
    print("### tp=1: forward+backward vs mint.nn.Linear (float32, in-process)\n")
    print(table(rows, ["shape", "layer", "median ms", "min ms", "ratio (median)", "ratio (min)"]))
    if not args.skip_msrun:
        per_tp = []
        for tp in args.tp:
            cmd, ranks = launch(tp, args)
            per_tp.append({
                "tp": tp,
                "column fwd+bwd ms (median, max over ranks)": max(r["column_ms"] for r in ranks),
                "row fwd+bwd ms (median, max over ranks)": max(r["row_ms"] for r in ranks),
                "column init peak MiB": max(r["column_init_peak_mib"] for r in ranks),
                "column params MiB": max(r["column_param_mib"] for r in ranks),
                "row init peak MiB": max(r["row_init_peak_mib"] for r in ranks),
                "row params MiB": max(r["row_param_mib"] for r in ranks),
                "loop peak RSS MiB (max rank)": max(r["loop_peak_mib"] for r in ranks),
                "loop peak delta MiB": max(r["loop_peak_delta_mib"] for r in ranks),
                "msrun": " ".join(os.path.basename(c) if i == 0 else c for i, c in enumerate(cmd)),
                "ranks": ranks,
            })
        results["msrun"] = per_tp
        cols = [c for c in per_tp[0] if c not in ("ranks", "msrun")]
        print(f"\n### {args.hidden}x{args.hidden} layer, x ({args.tokens}, {args.hidden}), "
              "one msrun per tp (OMP_NUM_THREADS=1 per rank)\n")
        print(table(per_tp, cols))
        print("\nmsrun commands:")
        for row in per_tp:
            print("  " + row["msrun"])
    results["load_at_end"] = os.getloadavg()
    print("\nload average 1/5/15 min at end: " + " / ".join(f"{v:.1f}" for v in os.getloadavg()))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump(results, fh, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
