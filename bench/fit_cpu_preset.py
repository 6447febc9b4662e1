"""Fit the ``cpu`` preset's per-call constants to ``msdist train`` steps measured on this machine.

The preset's step model (docs/COST_MODEL.md, "Ranks sharing cores"): every term of a
rank is ``ranks / cores`` times longer when the ranks of a node outnumber its cores, each
operator launch costs ``op_overhead_us`` and each collective call ``intra_node_latency_us``
on a core of its own. This script searches those two constants (a log grid, then a finer
one around the best) for the smallest median |error| over every measured step it is given:

* ``--train FILE``: ``msdist train ... -o FILE`` reports (layout, model, training, mode and the
  measured step are in the report);
* ``--table FILE``: ``python bench/validate_train.py --output FILE`` results (tiny-gpt on
  every layout of 8 ranks).

The other preset values stay (peak, bandwidths); ``--cores`` is the machine's (2 here).
Prints the best pair, the median |error|, Spearman's rank correlation and each step.

Run:  python bench/fit_cpu_preset.py --train dp4.json --train tp2pp2.json --table vt.json [--cores 2]
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from dataclasses import fields, replace
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BENCH = Path(__file__).resolve().parent
for p in (str(ROOT), str(BENCH)):
    if p not in sys.path:
        sys.path.insert(0, p)

from mindscience.distributed.costmodel import estimate  # noqa: E402
from mindscience.distributed.costmodel.spec import ClusterSpec, ModelSpec, TrainingSpec, Workload  # noqa: E402
from mindscience.distributed.topology import Layout  # noqa: E402


def train_cases(path: str) -> list:
    """``[(label, Layout, Workload, mode, measured_s)]`` of one ``msdist train -o`` report."""
    data = json.loads(Path(path).read_text())
    lay = data["layout"]
    layout = Layout(**{k: lay[k] for k in ("world_size", "tp", "cp", "pp", "order", "devices_per_node")
                       if k in lay})
    model = dict(data["model"])
    if isinstance(model.get("moe_layer_freq"), list):
        model["moe_layer_freq"] = tuple(model["moe_layer_freq"])
    names = {f.name for f in fields(TrainingSpec)}
    training = TrainingSpec(**{k: v for k, v in data["training"].items() if k in names})
    label = f"{Path(path).name}: tp{layout.tp} cp{layout.cp} pp{layout.pp} dp{layout.dp}"
    return [(label, layout, Workload(model=ModelSpec(**model), training=training), data["training"].get("mode", "jit"),
             data["measured"]["step_time_s"])]


def table_cases(path: str) -> list:
    """The measured layouts of a ``bench/validate_train.py --output`` file, rebuilt as it builds them."""
    from validate_train import layouts

    from mindscience.distributed.costmodel import load_workload
    from mscli.layouts import resolve_model

    data = json.loads(Path(path).read_text())
    command = data.get("command", "")
    mode = "pynative" if "--mode pynative" in command else "jit"
    steps = int(command.split("--steps")[1].split()[0]) if "--steps" in command else 3
    workload = load_workload(resolve_model("tiny-gpt"))
    cases, _ = layouts(workload, dict(steps=steps, mode=mode, micro_batch_size=None, global_batch_size=None))
    measured = {tuple(r["layout"]): r["measured_s"] for r in data["rows"]}
    out = []
    for lay, run, _ in cases:
        key = (lay.tp, lay.cp, lay.pp, lay.dp)
        if key in measured:
            out.append((f"{Path(path).name}: tp{lay.tp} cp{lay.cp} pp{lay.pp} dp{lay.dp}", lay, run, mode,
                        measured[key]))
    return out


def price(cases: list, cores: int, op_us: float, latency_us: float) -> list:
    cluster = ClusterSpec(device="cpu", cores_per_node=cores, op_overhead_us=op_us, intra_node_latency_us=latency_us)
    return [estimate(lay, replace(w, cluster=cluster), mode=mode)["time"]["step_time_s"]
            for _, lay, w, mode, _ in cases]


def score(cases: list, predicted: list) -> float:
    return statistics.median(abs(math.log(p / c[4])) for p, c in zip(predicted, cases))


def main(argv=None) -> int:
    from validate_cpu import spearman

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--train", action="append", default=[], help="an msdist train -o report (repeat)")
    parser.add_argument("--table", action="append", default=[], help="a validate_train.py --output file (repeat)")
    parser.add_argument("--cores", type=int, default=2)
    args = parser.parse_args(argv)
    cases = [c for f in args.train for c in train_cases(f)] + [c for f in args.table for c in table_cases(f)]
    if not cases:
        parser.error("give at least one --train or --table file")
    grid = [10 ** (k / 8) for k in range(8, 33)]  # 10 us .. 10 ms
    best = min(((score(cases, price(cases, args.cores, o, a)), o, a) for o in grid for a in grid))
    _, o0, a0 = best
    fine = [f for f in (0.8, 0.85, 0.9, 0.95, 1.0, 1.05, 1.1, 1.15, 1.2)]
    best = min(((score(cases, price(cases, args.cores, o0 * f, a0 * g)), o0 * f, a0 * g) for f in fine for g in fine))
    _, op_us, latency_us = best
    op_us, latency_us = float(f"{op_us:.2g}"), float(f"{latency_us:.2g}")  # the preset's figures: 2 digits
    predicted = price(cases, args.cores, op_us, latency_us)
    errors = [p / c[4] - 1 for p, c in zip(predicted, cases)]
    print(f"command: python bench/fit_cpu_preset.py {' '.join(argv or sys.argv[1:])}")
    print(f"best: op_overhead_us {op_us:g}, intra_node_latency_us {latency_us:g} ({args.cores} cores); median "
          f"|error| {statistics.median(abs(e) for e in errors):.0%}, Spearman "
          f"{spearman(predicted, [c[4] for c in cases]):.2f} over {len(cases)} steps")
    for (label, *_rest, got), p, e in zip(cases, predicted, errors):
        print(f"  {label}: predicted {p * 1e3:.0f} ms, measured {got * 1e3:.0f} ms ({e:+.0%})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
