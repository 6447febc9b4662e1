"""``msdist train``'s step on every layout of 8 CPU ranks: measured vs the calibrated cost model.

1. ``msdist verify`` on 8 CPU ranks (tp2 x cp2 x dp2, bandwidth checks: the compute probe
   and the collective sweep) writes a report (or ``--report`` reuses one);
2. ONE msrun launch of 8 ranks runs, for every tp x cp x pp x dp layout of 8 ranks that
   the cost model's constraints and the batch allow, ``bench.train_layout``
   (bench/validate_train_checks.py): the groups are re-created with
   ``manager.initialize_parallel`` and the ``Trainer`` of ``msdist train`` (GPTModel +
   DistributedOptimizer, AdamW) trains the preset for ``--steps`` steps; the measured
   step is ``msdist train``'s: per step the slowest rank, then the median of the steps
   after the first;
3. the predicted step is ``msdist train``'s "predicted" column: the same
   ``build_options`` / ``training_spec`` / ``run_cluster`` (the ``cpu`` preset,
   ``--calibrate`` from the verify report; with ``--uncalibrated`` the preset alone, as
   ``msdist train`` without ``--calibrate``: no verify run) and ``costmodel.estimate`` in
   the run's mode.

Prints (and with ``--output`` writes as JSON) the table with each layout's predicted
terms, the median |error|, Spearman's rank correlation, and a non-negative least-squares
fit ``measured ~ sum_k c_k * term_k`` over the layouts: ``c_k`` far from 1 names the term
of the model that is furthest from the measurement.

Run:  python bench/validate_train.py [--model tiny-gpt] [--steps 3] [--mode jit]
                                     [--report verify.json | --uncalibrated] [--output result.json]
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, replace
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BENCH = Path(__file__).resolve().parent
for p in (str(ROOT), str(BENCH)):
    if p not in sys.path:
        sys.path.insert(0, p)

from bench_mappings import _loadavg  # noqa: E402
from bench_plan import msdist  # noqa: E402
from validate_cpu import spearman  # noqa: E402

from mindscience.distributed.costmodel import estimate, load_workload, rank_layers, violations, what_runs  # noqa: E402
from mindscience.distributed.costmodel.steptime import TERMS  # noqa: E402
from mindscience.distributed.topology import Layout  # noqa: E402
from mscli.commands.train import build_options, run_cluster  # noqa: E402
from mscli.layouts import resolve_model  # noqa: E402

WORLD = 8
SIZES = (1, 2, 4, 8)


def layouts(workload, flags: dict):
    """``[(Layout, run workload, TrainOptions)]`` of every tp x cp x pp x dp of 8 ranks that runs.

    A layout is kept when the cost model's constraints hold for the run's training (the
    preset's, with ``flags`` over it as ``msdist train`` applies them) and the batch splits
    into ``b x dp`` (``build_options``); the rest are returned as ``(sizes, reason)``.
    """
    from mindscience.distributed.training.loop import training_spec
    from mindscience.distributed.training.options import TrainOptionError

    kept, skipped = [], []
    for tp in SIZES:
        for cp in SIZES:
            for pp in SIZES:
                if WORLD % (tp * cp * pp):
                    continue
                dp = WORLD // (tp * cp * pp)
                layout = Layout(world_size=WORLD, tp=tp, cp=cp, pp=pp, backend="cpu")
                try:
                    opts = build_options(workload, layout, **flags)
                except TrainOptionError as err:
                    skipped.append(((tp, cp, pp, dp), str(err)))
                    continue
                run = replace(workload, training=training_spec(workload.training, opts))
                broken = violations(run.model, run.training, tp, cp, pp, dp)
                if broken:
                    skipped.append(((tp, cp, pp, dp), broken[0][0]))
                    continue
                kept.append((layout, run, opts))
    return kept, skipped


def run_verify(work: Path, timeout: float) -> Path | None:
    """``msdist verify`` (bandwidth checks) on 8 CPU ranks at tp2 x cp2 x dp2; the report's path."""
    report = work / "report.json"
    layout_file = work / "cpu-8.yaml"
    layout_file.write_text(f"world_size: {WORLD}\ntp: 2\ncp: 2\nbackend: cpu\n")
    proc = subprocess.run(msdist() + ["verify", str(layout_file), "--checks", "bandwidth", "--format", "json",
                                      "-o", str(report), "--log-dir", str(work / "verify")],
                          capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        print(proc.stderr, file=sys.stderr)
        return None
    return report


class LoadSampler:
    """The 1-minute load average every ``every_s`` seconds while a launch runs (a thread)."""

    def __init__(self, every_s: float = 15.0):
        self.samples: list = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(every_s,), daemon=True)

    def _run(self, every_s: float) -> None:
        while not self._stop.is_set():
            self.samples.append(float(_loadavg().split()[0]))
            self._stop.wait(every_s)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()


def launch_partial(spec: dict, timeout: float):
    """One msrun launch of ``spec`` (bench/ on the workers' path); ``(result, wall_s)``.

    A launch that fails or times out still gives the layouts every rank finished (the
    ranks write their records as they go): they are kept, the failure is printed, and
    the layouts not reached are named by the caller.
    """
    import os

    from mindscience.distributed.harness import launch

    env = {"PYTHONPATH": os.pathsep.join(p for p in (str(BENCH), os.environ.get("PYTHONPATH", "")) if p)}
    last = [0.0]

    def progress(snap):
        now = time.time()
        if now - last[0] >= 60 or snap.get("finished"):
            last[0] = now
            done = {r: (s or {}).get("done") for r, s in (snap.get("ranks") or {}).items()}
            print(f"[{snap.get('elapsed_s', 0):6.0f} s] load {_loadavg()} layouts done per rank {done}",
                  file=sys.stderr, flush=True)

    started = time.perf_counter()
    result = launch(spec, WORLD, timeout=timeout, env=env, on_progress=progress)
    if not result.ok:
        print(f"launch did not complete (log dir {result.log_dir}); keeping the layouts every rank finished:",
              file=sys.stderr)
        for f in result.failures:
            print(f"  rank {f['rank']} {f['kind']}: {f['reason']}", file=sys.stderr)
    return result, time.perf_counter() - started


def measured_steps(result) -> dict:
    """``({(tp, cp, pp, dp): {"step_s", "per_step_s", "losses", "build_s"}}, {sizes: error})``:
    per step the slowest rank, then the median of the steps after the first (``msdist train``'s
    figure); the second mapping names the layouts a rank could not run, with its error."""
    from mindscience.distributed.training.report import steady_step_time

    per_layout: dict = {}
    failed: dict = {}
    for state in result.ranks.values():
        for r in (state or {}).get("records", []):
            if r.get("check") != "bench.train_layout":
                continue
            lay = r["layout"]
            key = (lay["tp"], lay["cp"], lay["pp"], lay["dp"])
            if "error" in r:
                failed.setdefault(key, r["error"])
                continue
            entry = per_layout.setdefault(key, {"per_step_s": [0.0] * len(r["times_s"]), "losses": r["losses"],
                                                "build_s": 0.0})
            entry["per_step_s"] = [max(a, b) for a, b in zip(entry["per_step_s"], r["times_s"])]
            entry["build_s"] = max(entry["build_s"], r["build_s"])
            entry["ranks"] = entry.get("ranks", 0) + 1
    for key in failed:
        per_layout.pop(key, None)  # a layout some rank could not run is not measured
    for key in [k for k, e in per_layout.items() if e["ranks"] < WORLD]:
        per_layout.pop(key)  # cut off by a timeout on some rank: its slowest rank is unknown
    for entry in per_layout.values():
        entry["step_s"] = steady_step_time(entry["per_step_s"])
    return per_layout, failed


def layer_passes(workload, lay) -> float:
    """Layer forward passes the busiest rank runs per step: its layers x micro-batches x (1 forward
    + 2 for the backward + the pipeline's re-run forward), the count a per-pass framework cost scales with."""
    from mindscience.distributed.costmodel.comm import recompute_passes
    from mindscience.distributed.costmodel.memory import num_microbatches

    training, runtime, _ = what_runs(workload.training, lay.tp, lay.cp, lay.pp, lay.dp)
    m = num_microbatches(training, lay.dp, lay.world_size)
    layers = rank_layers(workload.model, training, lay.pp)
    return max(layers[i] * m * (3 + recompute_passes(workload.model, training, lay.pp, i, runtime))
               for i in range(lay.pp))


def term_fit(rows: list, extra: str | None = None) -> dict:
    """Non-negative least squares ``measured ~ sum_k c_k * term_k`` over the layouts.

    Only terms that are non-zero somewhere take part. ``c_k`` is how much the measurement
    says term k costs per second the model predicts for it: 1 = priced right. ``extra``
    adds a row key as one more column (its coefficient: seconds per unit), e.g. the
    busiest rank's ``layer_passes``, a cost the model does not have.
    """
    import numpy as np
    from scipy.optimize import nnls

    names = [k for k in TERMS if any(r["breakdown"][k] > 0 for r in rows)]
    a = np.array([[r["breakdown"][k] for k in names] + ([r[extra]] if extra else []) for r in rows])
    y = np.array([r["measured_s"] for r in rows])
    # Relative errors matter (times span an order of magnitude): weight each row by 1/measured.
    coef, _ = nnls(a / y[:, None], np.ones_like(y))
    fitted = a @ coef
    return {"coefficients": dict(zip(names + ([extra] if extra else []), coef.tolist())),
            "median_abs_error": float(np.median(np.abs(fitted / y - 1))),
            "spearman": spearman(fitted.tolist(), y.tolist())}


def table(rows: list) -> list:
    lines = ["| tp | cp | pp | dp | m | predicted ms | measured ms | error | compute | bubble | tp | cp | pp | dp |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in sorted(rows, key=lambda r: r["measured_s"]):
        tp, cp, pp, dp = r["layout"]
        terms = " | ".join(f"{r['breakdown'][k] * 1e3:.1f}" for k in TERMS)
        lines.append(f"| {tp} | {cp} | {pp} | {dp} | {r['microbatches']} | {r['predicted_s'] * 1e3:.1f} | "
                     f"{r['measured_s'] * 1e3:.1f} | {r['predicted_s'] / r['measured_s'] - 1:+.0%} | {terms} |")
    return lines


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny-gpt", help="a preset or model file (msdist train --model)")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--mode", default="jit", choices=("jit", "pynative"))
    parser.add_argument("--micro-batch-size", type=int, default=None)
    parser.add_argument("--global-batch-size", type=int, default=None)
    parser.add_argument("--seq-length", type=int, default=None, help="override the model's seq_length")
    parser.add_argument("--only", default=None, help="dev runs: 'tp,cp,pp;...' layouts to keep")
    parser.add_argument("--timeout", type=float, default=1500.0)
    parser.add_argument("--deadline", help="HH:MM UTC the training launch must end by (shortens --timeout; "
                                           "the layouts finished by then are kept)")
    parser.add_argument("--report", help="reuse a verify report instead of running msdist verify")
    parser.add_argument("--output", help="write the rows, fit and calibration as JSON here")
    parser.add_argument("--reprice", help="a previous --output: price its measured layouts again (no launch)")
    parser.add_argument("--uncalibrated", action="store_true",
                        help="price with the cpu preset (msdist train without --calibrate): no verify run")
    args = parser.parse_args(argv)
    command = "python bench/validate_train.py " + " ".join(shlex.quote(a) for a in (argv or sys.argv[1:]))
    workload = load_workload(resolve_model(args.model))
    if args.seq_length:
        workload = replace(workload, model=replace(workload.model, seq_length=args.seq_length))
    flags = dict(steps=args.steps, mode=args.mode, micro_batch_size=args.micro_batch_size,
                 global_batch_size=args.global_batch_size)
    cases, skipped = layouts(workload, flags)
    # Cheap layouts first: context parallelism (the ring) costs most here, so a launch cut
    # off by --deadline keeps as many layouts as it can.
    cases.sort(key=lambda c: (c[0].cp, c[0].tp, c[0].pp))
    if args.only:
        wanted = {tuple(int(x) for x in part.split(",")) for part in args.only.split(";")}
        cases = [c for c in cases if (c[0].tp, c[0].cp, c[0].pp) in wanted]
    if args.reprice:
        old = json.loads(Path(args.reprice).read_text())
        measured = {tuple(r["layout"]): {"step_s": r["measured_s"], **{k: r[k] for k in
                    ("per_step_s", "losses", "build_s")}} for r in old["rows"]}
        cases = [c for c in cases if (c[0].tp, c[0].cp, c[0].pp, c[0].dp) in measured]
        report = None if args.uncalibrated else Path(args.report or old["report"])
        return summarize(args, command, cases, skipped, measured, report,
                         {k: old[k] for k in ("started", "wall_s", "load_before", "load_after", "load_samples")})
    work = Path(tempfile.mkdtemp(prefix="msdist-validate-train-"))
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    report_path = None
    if not args.uncalibrated:
        report_path = Path(args.report) if args.report else run_verify(work, args.timeout)
        if report_path is None:
            return 1
    model_map = asdict(workload.model)
    checks = [{"name": "bench.train_layout",
               "params": {"tp": lay.tp, "cp": lay.cp, "pp": lay.pp, "model": model_map,
                          "training": asdict(run.training), "options": opts.to_dict()}}
              for lay, run, opts in cases]
    spec = {"layout": {"world_size": WORLD, "tp": 1, "cp": 1}, "checks": checks,
            "modules": ["validate_train_checks"]}
    timeout = args.timeout
    if args.deadline:
        hour, minute = (int(x) for x in args.deadline.split(":"))
        now = time.gmtime()
        timeout = min(timeout, (hour - now.tm_hour) * 3600 + (minute - now.tm_min) * 60 - now.tm_sec)
        if timeout < 60:
            print(f"--deadline {args.deadline}: {timeout:.0f} s left, too little for a launch.", file=sys.stderr)
            return 1
    load_before = _loadavg()
    with LoadSampler() as sampler:
        result, wall = launch_partial(spec, timeout)
    load_after = _loadavg()
    run = {"started": started, "wall_s": wall, "load_before": load_before, "load_after": load_after,
           "load_samples": sampler.samples}
    measured, failed = measured_steps(result)
    skipped += [(key, f"{args.mode} failed: {error}") for key, error in sorted(failed.items())]
    skipped += [((c[0].tp, c[0].cp, c[0].pp, c[0].dp), "not reached before the launch ended") for c in cases
                if (c[0].tp, c[0].cp, c[0].pp, c[0].dp) not in measured
                and (c[0].tp, c[0].cp, c[0].pp, c[0].dp) not in failed]
    return summarize(args, command, cases, skipped, measured, report_path, run)


def summarize(args, command: str, cases: list, skipped: list, measured: dict, report_path: Path | None,
              run: dict) -> int:
    """Price every measured layout, print the table and the figures, write ``--output``."""
    rows, cluster, sources = [], None, None
    cases = [c for c in cases if (c[0].tp, c[0].cp, c[0].pp, c[0].dp) in measured]
    for lay, workload, _ in cases:
        priced = run_cluster(workload, lay, True, str(report_path) if report_path else None)
        est = estimate(lay, priced, mode=args.mode)
        cluster = priced.cluster
        key = (lay.tp, lay.cp, lay.pp, lay.dp)
        got = measured[key]
        rows.append({"layout": key, "microbatches": est["model"]["num_microbatches"],
                     "predicted_s": est["time"]["step_time_s"], "measured_s": got["step_s"],
                     "breakdown": est["time"]["breakdown"], "per_step_s": got["per_step_s"],
                     "oversubscription": est["time"]["oversubscription"],
                     "losses": got["losses"], "build_s": got["build_s"], "layer_passes": layer_passes(workload, lay),
                     "calls": {g: sum(r["count"] for r in est["communication"]["per_step"] if r["group"] == g)
                               for g in ("tp", "cp", "pp", "dp-cp")}})
    from mindscience.distributed.costmodel.calibrate import calibrate, read_report
    from mindscience.distributed.costmodel.spec import ClusterSpec

    if report_path is not None:
        _, sources = calibrate(ClusterSpec(device="cpu"), read_report(report_path), report_path.name)
    else:
        sources = "the cpu preset (no --calibrate)"
    errors = [abs(r["predicted_s"] / r["measured_s"] - 1) for r in rows]
    rho = spearman([r["predicted_s"] for r in rows], [r["measured_s"] for r in rows]) if len(rows) > 1 else float("nan")
    fit = term_fit(rows) if len(rows) > 2 else None
    fit_passes = term_fit(rows, "layer_passes") if len(rows) > 3 else None
    loads = run["load_samples"]
    print(f"command: {command}")
    print(f"started {run['started']}; {WORLD} ranks, {len(rows)} layouts, launch wall {run['wall_s']:.0f} s; load "
          f"before {run['load_before']}, after {run['load_after']}, 1-min load during the launch "
          f"{min(loads):.2f}-{max(loads):.2f} (median {statistics.median(loads):.2f}); verify report {report_path}")
    print(f"{'calibrated' if report_path else 'cpu preset'}: {cluster.effective_flops / 1e12:.4g} TFLOP/s, "
          f"intra-node {cluster.intra_node_gbps:.4g} GB/s, {cluster.intra_node_latency_us:.4g} us per call, "
          f"{cluster.op_overhead_us:.4g} us per operator, {cluster.cores_per_node} cores "
          f"(oversubscription x{rows[0]['oversubscription'] if rows else 1:g})")
    if skipped:
        print("not measured: " + "; ".join(f"{s}: {why}" for s, why in skipped))
    print()
    print("\n".join(table(rows)))
    print(f"\nmedian |error| {statistics.median(errors):.0%}, Spearman rank correlation {rho:.2f} over "
          f"{len(rows)} layouts")
    if fit:
        coefs = ", ".join(f"{k[:-2]} x{v:.2f}" for k, v in fit["coefficients"].items())
        print(f"NNLS fit measured ~ sum c_k term_k: {coefs} (median |error| of the fit "
              f"{fit['median_abs_error']:.0%}, Spearman {fit['spearman']:.2f})")
    if fit_passes:
        coefs = ", ".join(f"{k} x{v:.3g}" for k, v in fit_passes["coefficients"].items())
        print(f"  with the busiest rank's layer passes as a column: {coefs} (median |error| "
              f"{fit_passes['median_abs_error']:.0%}, Spearman {fit_passes['spearman']:.2f})")
    if args.output:
        Path(args.output).write_text(json.dumps({
            "command": command, **run, "report": str(report_path) if report_path else None,
            "cluster": asdict(cluster), "sources": sources, "rows": rows, "skipped": skipped,
            "median_abs_error": statistics.median(errors), "spearman": rho, "fit": fit,
            "fit_with_layer_passes": fit_passes}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
