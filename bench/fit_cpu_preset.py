"""Fit the ``cpu`` preset's per-call constants to ``msdist train`` steps measured on this machine.

The preset's step model (docs/COST_MODEL.md, "Ranks sharing cores"): every term of a
rank is ``ranks / cores`` times longer when the ranks of a node outnumber its cores, each
operator launch costs ``op_overhead_us``, each collective call ``intra_node_latency_us`` and
each byte ``1 / intra_node_gbps`` on a core of its own. This script searches those three
constants (a log grid of 16 points a decade; the compiled step is linear in them) for the
smallest median |log(predicted / measured)| over every measured step it is given:

* ``--train FILE``: ``msdist train ... -o FILE`` reports (layout, model, training, mode and the
  measured step are in the report);
* ``--table FILE``: ``python bench/validate_train.py --output FILE`` results (tiny-gpt on
  every layout of 8 ranks);
* ``--recorded FILE``: steps written down with their source, model preset and layout
  (``bench/cpu_preset_steps.json``: the quiet runs the preset was fitted to).

The preset's fit (all three constants free; 23 quiet steps of 2026-12-07, 1, 4 and 8 ranks):
``python bench/fit_cpu_preset.py --recorded bench/cpu_preset_steps.json``.

The other preset values stay (peak, memory); ``--cores`` is the machine's (2 here).
Prints the best pair, the median |error|, Spearman's rank correlation and each step.

Run:  python bench/fit_cpu_preset.py [--recorded steps.json] [--train dp4.json] [--table vt.json] [--cores 2]
"""

from __future__ import annotations

import argparse
import json
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


def recorded_cases(path: str) -> list:
    """The steps of a ``bench/cpu_preset_steps.json``-style file: ``train`` entries (a model preset, layout
    sizes, training keys over the preset's, the mode, the measured step) and a ``table`` as
    :func:`table_cases` reads it."""
    from mindscience.distributed.costmodel import load_workload
    from mscli.layouts import resolve_model

    data = json.loads(Path(path).read_text())
    out = []
    for entry in data.get("train", []):
        workload = load_workload(resolve_model(entry["model"]))
        workload = replace(workload, training=replace(workload.training, **entry["training"]))
        layout = Layout(**{"devices_per_node": entry["layout"]["world_size"], **entry["layout"]})
        out.append((f"{Path(path).name}: {entry['label']}", layout, workload, entry["mode"], entry["measured_s"]))
    if "table" in data:
        out += table_cases(data["table"], Path(path).name)
    return out


def table_cases(path, name: str | None = None) -> list:
    """The measured layouts of a ``bench/validate_train.py --output`` file, rebuilt as it builds them."""
    from validate_train import layouts

    from mindscience.distributed.costmodel import load_workload
    from mscli.layouts import resolve_model

    data = path if isinstance(path, dict) else json.loads(Path(path).read_text())
    name = name or Path(path).name
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
            out.append((f"{name}: tp{lay.tp} cp{lay.cp} pp{lay.pp} dp{lay.dp}", lay, run, mode,
                        measured[key]))
    return out


def price(cases: list, cores: int, op_us: float, latency_us: float, gbps: float) -> list:
    cluster = ClusterSpec(device="cpu", cores_per_node=cores, op_overhead_us=op_us, intra_node_latency_us=latency_us,
                          intra_node_gbps=gbps)
    return [estimate(lay, replace(w, cluster=cluster), mode=mode)["time"]["step_time_s"]
            for _, lay, w, mode, _ in cases]


def linear_terms(cases: list, cores: int):
    """Per case ``(base, per op_us, per latency_us, per 1/gbps)``: in the compiled mode's step model (no
    overlap to hide behind) the step is linear in the three constants, so four pricings give it."""
    import numpy as np

    tiny = 1e-6
    base = np.array(price(cases, cores, 0.0, tiny, 1 / tiny))
    per_op = np.array(price(cases, cores, 1.0, tiny, 1 / tiny)) - base
    per_latency = np.array(price(cases, cores, 0.0, 1.0 + tiny, 1 / tiny)) - base
    per_inverse_gbps = np.array(price(cases, cores, 0.0, tiny, 1.0)) - base
    return base, per_op, per_latency, per_inverse_gbps


def main(argv=None) -> int:
    import numpy as np

    from validate_cpu import spearman

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--train", action="append", default=[], help="an msdist train -o report (repeat)")
    parser.add_argument("--table", action="append", default=[], help="a validate_train.py --output file (repeat)")
    parser.add_argument("--recorded", action="append", default=[],
                        help="a file of recorded steps, e.g. bench/cpu_preset_steps.json (repeat)")
    parser.add_argument("--cores", type=int, default=2)
    parser.add_argument("--op-us", type=float, help="fix op_overhead_us instead of fitting it")
    parser.add_argument("--latency-us", type=float, help="fix intra_node_latency_us instead of fitting it")
    parser.add_argument("--gbps", type=float, help="fix intra_node_gbps instead of fitting it")
    args = parser.parse_args(argv)
    cases = ([c for f in args.recorded for c in recorded_cases(f)] + [c for f in args.train for c in train_cases(f)]
             + [c for f in args.table for c in table_cases(f)])
    if not cases:
        parser.error("give at least one --recorded, --train or --table file")
    measured = np.array([c[4] for c in cases])
    base, per_op, per_latency, per_inverse_gbps = linear_terms(cases, args.cores)
    # A log grid: 1 us .. 100 ms per operator and per call, 0.001 .. 10 GB/s.
    ops = np.array([args.op_us]) if args.op_us else 10 ** np.arange(0, 5.01, 1 / 16)
    calls = np.array([args.latency_us]) if args.latency_us else 10 ** np.arange(0, 5.01, 1 / 16)
    gbps = np.array([args.gbps]) if args.gbps else 10 ** np.arange(-3, 1.01, 1 / 16)
    o, a, g = np.meshgrid(ops, calls, gbps, indexing="ij")
    pred = (base[None, None, None, :] + o[..., None] * per_op + a[..., None] * per_latency
            + (1 / g)[..., None] * per_inverse_gbps)
    score = np.median(np.abs(np.log(pred / measured)), axis=-1)
    i = np.unravel_index(np.argmin(score), score.shape)
    op_us, latency_us, bw = (float(f"{x:.2g}") for x in (o[i], a[i], g[i]))  # the preset's figures: 2 digits
    predicted = price(cases, args.cores, op_us, latency_us, bw)
    errors = [p / c[4] - 1 for p, c in zip(predicted, cases)]
    print(f"command: python bench/fit_cpu_preset.py {' '.join(argv or sys.argv[1:])}")
    print(f"best: op_overhead_us {op_us:g}, intra_node_latency_us {latency_us:g}, intra_node_gbps {bw:g} "
          f"({args.cores} cores); median |error| {statistics.median(abs(e) for e in errors):.0%}, Spearman "
          f"{spearman(predicted, [c[4] for c in cases]):.2f} over {len(cases)} steps")
    for (label, *_rest, got), p, e in zip(cases, predicted, errors):
        print(f"  {label}: predicted {p * 1e3:.0f} ms, measured {got * 1e3:.0f} ms ({e:+.0%})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
