"""The step-time model on this machine: predicted (calibrated by ``msdist verify``) vs measured.

1. ``msdist verify`` on 8 CPU ranks (tp2 x cp2 x dp2, bandwidth checks: the compute probe
   and the collective sweep) writes a report;
2. one msrun launch of 8 ranks trains ``examples/inside_train_transformer.py``'s block (jit
   train step: value_and_grad + GradientFinalizer + AdamW) on every tp x cp x dp layout of 8
   ranks and records the slowest rank's median step time (steps after the first);
3. the cost model, with ``--calibrate`` from that report (the ``cpu`` preset's cores and
   operator launches kept: docs/COST_MODEL.md, "Ranks sharing cores"), predicts each layout's
   compiled step:
   the same block (1 layer, d_model, heads, ffn, the sequence, the example's vocabulary-parallel
   embedding and LM head) as a ``model:``, fp32,
   sequence parallelism, one micro-batch of ``batch / dp`` samples per dp rank, and no
   overlap of the gradient reduction (GradientFinalizer runs after the backward).

Prints predicted, measured, the error and Spearman's rank correlation.

Run:  python bench/validate_cpu.py [--steps 6] [--seq-len 64] [--d-model 64]
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BENCH = Path(__file__).resolve().parent
for p in (str(ROOT), str(BENCH)):
    if p not in sys.path:
        sys.path.insert(0, p)

from bench_mappings import _loadavg, run_bench_launch  # noqa: E402
from bench_plan import msdist  # noqa: E402

from mindscience.distributed.costmodel import estimate  # noqa: E402
from mindscience.distributed.costmodel.calibrate import calibrate, read_report  # noqa: E402
from mindscience.distributed.costmodel.spec import ClusterSpec, ModelSpec, TrainingSpec, Workload  # noqa: E402
from mindscience.distributed.topology import Layout  # noqa: E402

WORLD = 8


def layouts(heads: int, seq: int, batch: int):
    """Every (tp, cp, dp) of 8 ranks the block allows: heads and sequence over tp*cp, batch over dp."""
    for tp in (1, 2, 4, 8):
        for cp in (1, 2, 4, 8):
            if WORLD % (tp * cp):
                continue
            dp = WORLD // (tp * cp)
            if heads % (tp * cp) == 0 and seq % (tp * cp) == 0 and batch % dp == 0:
                yield tp, cp, dp


def example_vocab() -> int:
    """The example's vocabulary (``VOCAB``), read from its source: importing it would load MindSpore here."""
    import re

    text = (ROOT / "examples" / "inside_train_transformer.py").read_text()
    return int(re.search(r"^VOCAB = (\d+)", text, re.M).group(1))


def spearman(a: list, b: list) -> float:
    def ranks(x):
        order = sorted(range(len(x)), key=lambda i: x[i])
        r = [0.0] * len(x)
        for rank, i in enumerate(order):
            r[i] = float(rank)
        return r

    ra, rb = ranks(a), ranks(b)
    n = len(a)
    return 1 - 6 * sum((x - y) ** 2 for x, y in zip(ra, rb)) / (n * (n * n - 1))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--d-model", type=int, default=64)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--ffn", type=int, default=256)
    parser.add_argument("--timeout", type=float, default=1500.0)
    parser.add_argument("--report", help="reuse a verify report instead of running msdist verify")
    args = parser.parse_args(argv)
    command = "python bench/validate_cpu.py " + " ".join(shlex.quote(a) for a in (argv or sys.argv[1:]))
    work = Path(tempfile.mkdtemp(prefix="msdist-validate-"))
    report_path = Path(args.report) if args.report else work / "report.json"
    if not args.report:
        layout_file = work / "cpu-8.yaml"
        layout_file.write_text(f"world_size: {WORLD}\ntp: 2\ncp: 2\nbackend: cpu\n")
        proc = subprocess.run(msdist() + ["verify", str(layout_file), "--checks", "bandwidth", "--format", "json",
                                          "-o", str(report_path), "--log-dir", str(work / "verify")],
                              capture_output=True, text=True, timeout=args.timeout)
        if proc.returncode != 0:
            print(proc.stderr, file=sys.stderr)
            return 1
    cases = list(layouts(args.heads, args.seq_len, args.batch))
    params = dict(steps=args.steps, seq_len=args.seq_len, batch=args.batch, d_model=args.d_model,
                  num_heads=args.heads, ffn=args.ffn, modes=["jit"])
    spec = {"layout": {"world_size": WORLD, "tp": 1, "cp": 1},
            "checks": [{"name": "examples.inside_train_transformer", "params": {"tp": tp, "cp": cp, **params}}
                       for tp, cp, _ in cases],
            "modules": ["_examples_checks"]}
    load_before = _loadavg()
    launched = run_bench_launch(spec, WORLD, args.timeout, progress_every_s=60)
    if launched is None:
        return 1
    result, wall, load_after = launched
    measured = {}
    for state in result.ranks.values():
        for r in (state or {}).get("records", []):
            key = (r["layout"]["tp"], r["layout"]["cp"], r["layout"]["dp"])
            measured[key] = max(measured.get(key, 0.0), r["jit_step_s"])
    report = read_report(report_path)
    model = ModelSpec(num_layers=1, hidden_size=args.d_model, num_attention_heads=args.heads,
                      seq_length=args.seq_len, vocab_size=example_vocab(), ffn_hidden_size=args.ffn, name="train_transformer")
    cluster, sources = calibrate(ClusterSpec(device="cpu"), report, report_path.name)
    rows = []
    for tp, cp, dp in cases:
        training = TrainingSpec(micro_batch_size=args.batch // dp, global_batch_size=args.batch, precision="fp32",
                                sequence_parallel=True, overlap_grad_reduce=False)
        layout = Layout(world_size=WORLD, tp=tp, cp=cp)
        time = estimate(layout, Workload(model=model, training=training, cluster=cluster), mode="jit")["time"]
        rows.append((tp, cp, dp, time["step_time_s"], measured[(tp, cp, dp)], time["breakdown"]))
    print(f"command: {command}")
    print(f"{WORLD} ranks, launch wall {wall:.0f} s, load {load_before} -> {load_after}; verify report {report_path}")
    print(f"calibrated: {cluster.peak_tflops * cluster.compute_efficiency:.4g} TFLOP/s, intra-node "
          f"{cluster.intra_node_gbps:.4g} GB/s, {cluster.intra_node_latency_us:.4g} us per call")
    print(f"sources: {json.dumps(sources)}\n")
    print("| tp | cp | dp | predicted ms | measured ms | error | largest predicted terms |")
    print("|---|---|---|---|---|---|---|")
    for tp, cp, dp, predicted, got, parts in sorted(rows, key=lambda r: r[4]):
        top = ", ".join(f"{k[:-2]} {v * 1e3:.1f}" for k, v in sorted(parts.items(), key=lambda kv: -kv[1])[:3])
        print(f"| {tp} | {cp} | {dp} | {predicted * 1e3:.1f} | {got * 1e3:.1f} | {predicted / got - 1:+.0%} | {top} |")
    errors = [abs(r[3] / r[4] - 1) for r in rows]
    print(f"\nmedian |error| {statistics.median(errors):.0%}, Spearman rank correlation "
          f"{spearman([r[3] for r in rows], [r[4] for r in rows]):.2f} over {len(rows)} layouts")
    return 0


if __name__ == "__main__":
    sys.exit(main())
