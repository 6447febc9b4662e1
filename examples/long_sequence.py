"""Ring attention on a long sequence, and its peak memory next to all-gather KV's.

    msrun --worker_num=4 --local_worker_num=4 --master_port=8118 --log_dir=logs/long_seq \
          --join=True examples/long_sequence.py                    # S = 16,384 over cp = 4

    ... examples/long_sequence.py --seq-len 4096 --heads 2         # smaller / other shapes

Each rank holds S/cp rows of q, k, v (one head of 64 by default, the few-heads case of
meshes and graphs, where Ulysses cannot split heads). Causal attention runs forward and
backward twice, first with ``method="ring"`` (K/V blocks of S/cp rows travel around the
ring: O(S/cp) per rank), then with ``method="allgather_kv"`` (every rank gathers the whole
K/V and scores its queries against all S keys: O(S)). Before each run the process's peak
resident memory is reset (Linux ``/proc/self/clear_refs``); MindSpore's memory pool keeps
what the ring allocated, so all-gather KV's figure is its peak or the ring's, whichever is
larger. The two outputs and input gradients must agree.

Printed per rank: peak memory (MiB) of each method and the time of one forward+backward.
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np

import mindspore as ms
from mindspore import ops

import _common as C
from mindscience.distributed.modules import context_parallel_attention

# Ring first: MindSpore's CPU memory pool keeps what a run allocated as resident memory,
# so the second method's peak is at least the first's (measured: with all-gather KV first,
# the ring's "peak" was all-gather KV's retained memory).
METHODS = ("ring", "allgather_kv")


def _reset_peak() -> bool:
    try:
        with open("/proc/self/clear_refs", "w", encoding="ascii") as fh:
            fh.write("5")  # resets VmHWM, the peak resident set size
        return True
    except OSError:
        return False


def peak_mib() -> float:
    """This process's peak resident memory since the last reset (VmHWM), in MiB."""
    with open("/proc/self/status", encoding="ascii") as fh:
        for line in fh:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024.0
    return float("nan")


def current_mib() -> float:
    with open("/proc/self/status", encoding="ascii") as fh:
        for line in fh:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024.0
    return float("nan")


def run(seq_len: int = 16384, batch: int = 1, heads: int = 1, head_dim: int = 64,
        causal: bool = True, seed: int = 0, atol: float = 1e-4, methods=METHODS) -> dict:
    """Both methods forward + backward on this rank's rows; the cp group must exist."""
    cp = C.cp_group()
    if seq_len % cp.size:
        raise ValueError(f"seq_len={seq_len} must be divisible by cp={cp.size}")
    rows = seq_len // cp.size
    rng = np.random.default_rng(seed + cp.rank)  # each rank's own rows of q, k, v
    q, k, v, cot = (ms.Tensor(rng.standard_normal((rows, batch, heads, head_dim)).astype(np.float32))
                    for _ in range(4))
    record = {"check": "examples.long_sequence", "seq_len": seq_len, "cp": cp.size,
              "rows_per_rank": rows, "heads": heads, "head_dim": head_dim, "causal": causal,
              "baseline_mib": current_mib(), "peak_mib": {}, "step_s": {}}
    results = {}
    for method in methods:
        def loss(a, b, c, method=method):
            out = context_parallel_attention(a, b, c, cp, method=method, causal=causal)
            return (out * cot).sum(), out

        grad_fn = ms.value_and_grad(loss, (0, 1, 2), has_aux=True)
        grad_fn(q, k, v)  # warm-up: kernels, communicators, caches
        record["peak_reset"] = _reset_peak()
        start = time.perf_counter()
        (_, out), grads = grad_fn(q, k, v)
        values = [out.asnumpy()] + [g.asnumpy() for g in grads]
        record["step_s"][method] = time.perf_counter() - start
        record["peak_mib"][method] = peak_mib()
        results[method] = values
        del out, grads
    errors = {}
    if len(results) == 2:
        a, b = (results[m] for m in methods)
        for name, x, y in zip(("output", "grad q", "grad k", "grad v"), a, b):
            errors[f"{name}: ring vs allgather_kv"] = float(np.max(np.abs(x - y)))
    return C.result("examples.long_sequence", errors, atol, **record)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq-len", type=int, default=16384)
    parser.add_argument("--heads", type=int, default=1)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--methods", default=",".join(METHODS),
                        help="comma-separated, run in this order (bench/bench_attention.py runs one "
                             "per launch so that each peak is its own)")
    parser.add_argument("--json", default=None, help="each rank writes its record to JSON.rank<r>")
    args = parser.parse_args(argv)
    from mindspore.communication import get_group_size

    methods = tuple(m.strip() for m in args.methods.split(",") if m.strip())
    C.setup(context_parallel_size=get_group_size() if C.launched_by_msrun() else 1)
    record = run(seq_len=args.seq_len, batch=args.batch, heads=args.heads, head_dim=args.head_dim,
                 methods=methods)
    cp = C.cp_group()
    if args.json:
        import json

        with open(f"{args.json}.rank{cp.rank}", "w", encoding="utf-8") as fh:
            json.dump(record, fh)
    if methods != METHODS:
        return 0
    # One row per rank: [peak ring, peak allgather_kv, time ring, time allgather_kv].
    mine = np.zeros((cp.size, 4), np.float32)
    mine[cp.rank] = [record["peak_mib"][m] for m in METHODS] + [record["step_s"][m] for m in METHODS]
    table = mine if cp.size == 1 else ops.AllReduce()(ms.Tensor(mine)).asnumpy()
    if cp.rank == 0:
        print(f"causal attention, S = {record['seq_len']:,} over cp = {cp.size} "
              f"({record['rows_per_rank']:,} rows per rank), {args.heads} head(s) of {args.head_dim}, "
              "forward + backward, float32")
        print(f"{'rank':>4}  {'peak MiB ring':>14}  {'peak MiB allgather_kv':>22}  "
              f"{'s ring':>8}  {'s allgather_kv':>15}")
        for r, row in enumerate(table):
            print(f"{r:>4}  {row[0]:>14.0f}  {row[1]:>22.0f}  {row[2]:>8.2f}  {row[3]:>15.2f}")
        print(f"baseline (before attention) {record['baseline_mib']:.0f} MiB on rank 0; "
              f"ring vs allgather_kv max difference {record['max_error']:.2e}")
    return C.report(record) if C.launched_by_msrun() else (0 if record["passed"] else 1)


if __name__ == "__main__":
    sys.exit(main())
