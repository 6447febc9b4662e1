"""The ONE msrun job of test_fsdp.py: 4 ranks, every multi-process fully_shard check.

Layouts (each rebuilt by the checks with manager.initialize_parallel): dp4, tp2 x dp2
and pp2 x dp2. Compiled modes dominate the time (each compiles one model; measured
15-45 s per graph on the shared 2-core machine), so each compiled mode appears once per
layout that needs it: ms.jit at dp4 and under the pipeline, GRAPH_MODE at tp2 x dp2.

``python tests/_fsdp_job.py`` runs it and prints every rank's records (the bench uses
the "fsdp.bench" check the same way, see docs/BENCHMARKS.md, "`fully_shard` (ZeRO-3 / FSDP)").
"""

from __future__ import annotations

import json
import os
import sys

import _jobs

WORLD_SIZE = 4
# Measured 360 s of checks (399 s in all) with the machine at load average ~45 (other
# jobs); 88 s of checks (100 s in all) at load average ~2 (2026-12-05). fsdp.gpt adds
# several minutes under load (its 6 runs of 3 steps alone took 1,297 s at load 20-35).
TIMEOUT_S = 1500
HERE = os.path.dirname(os.path.abspath(__file__))

SPEC = {
    "modules": ["_fsdp_checks", "_fsdp_gpt_checks", "_fsdp_unit_checks"],
    "checks": [
        {"name": "fsdp.parity", "params": {"tp": 1, "modes": ["pynative", "jit"],
                                           "reshard": [False, True]}},
        # three blocks + root as four units: reshard x prefetch in PyNative, and tp2 x dp2
        # once (compiled, the default flags run as reshard_after_forward=False: fsdp.parity's
        # jit and graph runs, with the block a unit of its own; a jit run here cost 34 s of CPU)
        {"name": "fsdp.units", "params": {"tp": 1, "modes": ["pynative"]}},
        {"name": "fsdp.train", "params": {"steps": 5}},
        {"name": "fsdp.bf16", "params": {"modes": ["pynative", "jit"]}},
        {"name": "fsdp.parity", "params": {"tp": 2, "modes": ["pynative", "graph"]}},
        {"name": "fsdp.units", "params": {"tp": 2, "modes": ["pynative"], "combos": [[True, True]]}},
        {"name": "fsdp.pipeline", "params": {"schedules": ["1f1b", "gpipe"],
                                             "modes": ["pynative"]}},
        {"name": "fsdp.pipeline", "params": {"schedules": ["1f1b"], "modes": ["jit"]}},
        # GPTModel (tied head) at ZeRO 3 vs 0: every layout once, each mode at dp4
        {"name": "fsdp.gpt", "params": {"steps": 2, "layouts": [
            {"tp": 1, "modes": ["pynative", "jit"]}, {"tp": 2, "modes": ["pynative"]},
            {"tp": 1, "pp": 2, "modes": ["jit"]}]}},
    ],
}


def _env():
    path = os.environ.get("PYTHONPATH", "")
    return {"PYTHONPATH": HERE + (os.pathsep + path if path else "")}


_jobs.register("fsdp", SPEC, world_size=WORLD_SIZE, timeout=TIMEOUT_S,
               test_files=("test_fsdp.py",), paths=(HERE,))


def run_job():
    """This family's part of the session's shared launch (``_jobs.py``), a LaunchResult."""
    return _jobs.run("fsdp")


def run_spec(spec, timeout=TIMEOUT_S):
    from mindscience.distributed.harness import launch

    return launch(spec, WORLD_SIZE, timeout=timeout, env=_env())


def describe_failures(result) -> str:
    lines = [f"launch ok={result.ok} timed_out={result.timed_out} logs: {result.log_dir}"]
    for failure in result.failures:
        lines.append(f"rank {failure['rank']} {failure['kind']}: {failure['reason']}")
        lines.extend("    " + line for line in (failure.get("log_tail") or "").splitlines()[-15:])
    return "\n".join(lines)


def records_of(result, check: str) -> list:
    """Every rank's records of the check named ``check``."""
    out = []
    for rank, state in sorted(result.ranks.items()):
        for record in (state or {}).get("records", []):
            if record.get("check") == check:
                out.append(record)
    return out


if __name__ == "__main__":
    spec = SPEC
    if len(sys.argv) > 1 and sys.argv[1] == "bench":
        spec = {"modules": ["_fsdp_checks"], "checks": [{"name": "fsdp.bench", "params": {}}]}
    result = run_spec(spec)
    print(describe_failures(result))
    for rank, state in sorted(result.ranks.items()):
        for record in (state or {}).get("records", []):
            print(rank, json.dumps(record))
