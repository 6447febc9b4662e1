"""Context-parallel attention: time and peak memory per rank of each method vs dense attention.

    python bench/bench_attention.py                   # S = 4K, 8K (N=4, D=16) and 16K (N=1, D=64)
    python bench/bench_attention.py --seq-lens 4096 --methods ring allgather_kv

One ``msrun`` launch of 4 ranks (cp = 4) per (method, S), each running
``examples/long_sequence.py --methods <method>`` (causal, forward + backward, float32,
B = 1; one warm-up, then one timed run with the peak resident memory reset just before,
so each launch's peak is that method's own: MindSpore's CPU memory pool keeps what a run
allocated). "dense" is the same script in one plain process (cp = 1): the whole
attention on one rank. Ulysses needs N divisible by cp, so it runs with N = 4 heads;
at S = 16K the shape is the few-heads case (N = 1, D = 64) of examples/long_sequence.py,
where Ulysses cannot split heads and dense attention (four 1 GiB score matrices) is not
run on this 23 GiB machine shared by five jobs. Times on 4 ranks of a 2-core machine
are oversubscribed and noisy: read them as orders of magnitude.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import subprocess
import sys
import tempfile
import uuid

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLE = os.path.join(ROOT, "examples", "long_sequence.py")


def shape_for(seq_len: int, shape=None) -> tuple:
    if shape:
        return tuple(shape)
    return (1, 64) if seq_len > 8192 else (4, 16)


def run_one(method: str, seq_len: int, ranks: int, timeout: float, shape=None) -> list:
    heads, head_dim = shape_for(seq_len, shape)
    out = os.path.join(tempfile.mkdtemp(prefix="bench_attn_"), "rec")
    args = ["--seq-len", str(seq_len), "--heads", str(heads), "--head-dim", str(head_dim),
            "--methods", "allgather_kv" if method == "dense" else method, "--json", out]
    if method == "dense":
        cmd = [sys.executable, EXAMPLE] + args
    else:
        port = 20000 + uuid.uuid4().int % 20000
        cmd = ["msrun", f"--worker_num={ranks}", f"--local_worker_num={ranks}", f"--master_port={port}",
               f"--log_dir={out}_logs", "--join=True", EXAMPLE] + args
    proc = subprocess.run(cmd, cwd=os.path.join(ROOT, "examples"), capture_output=True, text=True,
                          timeout=timeout)
    records = [json.load(open(p, encoding="utf-8")) for p in sorted(glob.glob(out + ".rank*"))]
    if proc.returncode != 0 or not records:
        print(f"{method} S={seq_len}: failed (rc {proc.returncode}), logs {out}_logs\n{proc.stderr[-2000:]}",
              file=sys.stderr)
        return []
    key = "allgather_kv" if method == "dense" else method
    return [(r["peak_mib"][key], r["step_s"][key], r["baseline_mib"]) for r in records]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq-lens", type=int, nargs="+", default=[4096, 8192, 16384])
    parser.add_argument("--methods", nargs="+", default=["dense", "ring", "ulysses", "allgather_kv"])
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--timeout", type=float, default=900)
    parser.add_argument("--shape", type=int, nargs=2, metavar=("N", "D"),
                        help="heads and head size for every S (default: 4 x 16 up to 8K, 1 x 64 above), "
                             "and run every given method at every S (nothing skipped)")
    args = parser.parse_args(argv)
    print("| S | N x D | method | ranks | peak MiB per rank (max) | above baseline | fwd+bwd s (max) |")
    print("|---|---|---|---|---|---|---|")
    for seq_len in args.seq_lens:
        heads, head_dim = shape_for(seq_len, args.shape)
        for method in args.methods:
            if seq_len > 8192 and method in ("dense", "ulysses") and not args.shape:
                continue  # see the module docstring
            rows = run_one(method, seq_len, args.ranks, args.timeout, args.shape)
            if not rows:
                continue
            peak = max(r[0] for r in rows)
            base = max(r[2] for r in rows)
            step = max(r[1] for r in rows)
            n = 1 if method == "dense" else args.ranks
            print(f"| {seq_len:,} | {heads} x {head_dim} | {method} | {n} | {peak:.0f} | {peak - base:.0f} "
                  f"| {step:.2f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
