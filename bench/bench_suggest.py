"""Whole-process timing of ``msdist suggest`` and of ``msdist plan --model`` (issue: cost model).

Measures the wall time of the ``msdist`` process, as a user sees it:
* ``msdist suggest`` for 65,536 devices (16 per node) with each bundled model preset
  (target <= 2 s), and for 4,096 devices; the MoE presets (deepseek-v3, qwen3-30b-a3b,
  mixtral-8x7b) search the expert axes too; at 65,536 devices also searching the
  micro-batch sizes 1, 2, 4, 8 (target <= 2 s);
* ``msdist plan LAYOUT --model M`` against the same ``msdist plan LAYOUT`` without a model,
  at 65,536 ranks (JSON) and at 64 ranks (tables) (target: ratio <= 1.2);
* that neither command imports MindSpore.

Run:  python bench/bench_suggest.py [--repeat 7]
Prints markdown tables (best and median of N runs; ratios of the medians).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys

from bench_plan import ROOT, msdist, timed

PROBE = """
import sys
import mscli.main as m
for argv in {commands!r}:
    sys.argv = ["msdist", *argv]
    try:
        m.main()
    except SystemExit:
        pass
print("mindspore imported:", any(k.split(".")[0] == "mindspore" for k in sys.modules), file=sys.stderr)
"""


def mindspore_imported(commands: list[list[str]]) -> str:
    """Run the commands in one interpreter and report whether MindSpore got imported."""
    out = subprocess.run([sys.executable, "-c", PROBE.format(commands=commands)], capture_output=True,
                         text=True, cwd=ROOT)
    return out.stderr.strip().splitlines()[-1]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeat", type=int, default=7)
    args = parser.parse_args()
    big = str(ROOT / "layouts/ascend-65536.yaml")
    # sci-transformer-s trains 64 samples per step: no layout of 65,536 devices has dp <= 64.
    suggest_cases = [
        (f"--model {model} --world {world} --devices-per-node 16 --format json",
         ["suggest", "--model", model, "--world", str(world), "--devices-per-node", "16", "--format", "json"])
        for world, models in ((65536, ("gpt3-175b", "gqa-7b", "deepseek-v3", "qwen3-30b-a3b", "mixtral-8x7b")),
                              (4096, ("gpt3-175b", "gqa-7b", "sci-transformer-s", "deepseek-v3")))
        for model in models
    ]  # the MoE presets also search ep (divisors of the experts) and etp in {1, tp} for every size
    # The step-time search over four micro-batch sizes (target <= 2 s at 65,536 devices).
    suggest_cases += [
        (f"--model {model} --world 65536 --devices-per-node 16 --micro-batch-sizes 1,2,4,8 --format json",
         ["suggest", "--model", model, "--world", "65536", "--devices-per-node", "16", "--micro-batch-sizes",
          "1,2,4,8", "--format", "json"])
        for model in ("gpt3-175b", "gqa-7b")
    ]
    plan_pairs = [
        ("ascend-65536 --format json", [big, "--format", "json"], ["--model", "gpt3-175b"]),
        ("ascend-64-ep8 (rich tables)", ["ascend-64-ep8"], ["--model", "mixtral-8x7b"]),
        ("ascend-64 (rich tables)", ["ascend-64"], ["--model", "gqa-7b"]),
    ]
    print(f"python {sys.version.split()[0]}, {os.cpu_count()} cores, best/median of {args.repeat} runs\n")
    print("| command | best s | median s |")
    print("|---|---|---|")
    for label, argv in suggest_cases:
        t = timed(msdist() + argv, args.repeat)
        print(f"| `msdist suggest {label}` | {min(t):.3f} | {statistics.median(t):.3f} |")
    print("\n| `msdist plan` | without --model, median s | with --model, median s | ratio |")
    print("|---|---|---|---|")
    for label, argv, model in plan_pairs:
        # Alternate the two so that machine load hits both alike.
        plain, costed = [], []
        for _ in range(args.repeat):
            plain += timed(msdist() + ["plan", *argv], 1)
            costed += timed(msdist() + ["plan", *argv, *model], 1)
        a, b = statistics.median(plain), statistics.median(costed)
        print(f"| {label} {' '.join(model)} | {a:.3f} | {b:.3f} | {b / a:.2f} |")
    print()
    print(mindspore_imported([
        ["suggest", "--model", "gpt3-175b", "--world", "65536", "--devices-per-node", "16", "--format", "json"],
        ["plan", big, "--model", "gpt3-175b", "--format", "json"],
    ]))


if __name__ == "__main__":
    main()
