"""Whole-process timing of ``msdist plan ... --svg`` (issue 19: pictures).

Measures the wall time of the ``msdist`` process, as a user sees it:
* ``msdist plan ascend-65536 --svg FILE`` (the bar: 3 s), and with ``--png``
* ``msdist plan ascend-64 --svg FILE`` and ``--model gpt3-175b --svg FILE``
* the same commands without a picture, so the picture's own cost is the difference

Run:  python bench/bench_pictures.py [--repeat 5]
Prints a markdown table (best and median of N runs) and the sizes of the files written.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile

from bench_plan import msdist, timed


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        svg, png = os.path.join(tmp, "p.svg"), os.path.join(tmp, "p.png")
        cases = [
            ("plan ascend-65536 (no picture)", ["plan", "ascend-65536"], None),
            ("plan ascend-65536 --svg", ["plan", "ascend-65536", "--svg", svg], svg),
            ("plan ascend-65536 --png", ["plan", "ascend-65536", "--png", png], png),
            ("plan ascend-64 (no picture)", ["plan", "ascend-64"], None),
            ("plan ascend-64 --svg", ["plan", "ascend-64", "--svg", svg], svg),
            ("plan ascend-64 --model gpt3-175b (no picture)", ["plan", "ascend-64", "--model", "gpt3-175b"], None),
            ("plan ascend-64 --model gpt3-175b --svg", ["plan", "ascend-64", "--model", "gpt3-175b", "--svg", svg],
             svg),
        ]
        print(f"| command | best s | median s | file |\n|---|---|---|---|")
        for label, argv, out in cases:
            times = timed(msdist() + argv, args.repeat)
            size = f"{os.path.getsize(out) / 1024:.0f} KiB" if out else "-"
            print(f"| `msdist {' '.join(a if a not in (svg, png) else os.path.basename(a) for a in argv)}` "
                  f"| {min(times):.2f} | {statistics.median(times):.2f} | {size} |")


if __name__ == "__main__":
    main()
