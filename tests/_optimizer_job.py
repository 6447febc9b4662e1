"""The ONE 4-rank msrun job of test_optimizer.py (a launch costs 15-25 s before any check).

The checks live next to the tests (tests/_optimizer_checks.py), imported by the workers
through ``spec["modules"]`` with tests/ on their PYTHONPATH. Layouts are grouped so the
parallel groups are re-created only when the layout changes: tp2 x dp2, then dp4, then
pp2 x dp2 (1F1B; the embedding and the LM head tied).
"""

from __future__ import annotations

import os

import _jobs

WORLD_SIZE = 4
# Measured (2026-12-05, shared 2-core machine): the job took 175-205 s at load ~0-14, and the
# whole test file took 517 s at load 35-46. The limit leaves room for the loaded case.
TIMEOUT_S = 1500
HERE = os.path.dirname(os.path.abspath(__file__))

_TP2 = {"tp": 2}
_DP4 = {"tp": 1}
_PP2 = {"tp": 1, "pp": 2}


def _train(layout, **params):
    return {"name": "optimizer.train", "params": {**layout, **params}}


CLIP = 0.5
SPEC = {
    "modules": ["_optimizer_checks"],
    "checks": [
        # tp2 x dp2, clipped: stages 0, 1 and 3 (fully_shard) eagerly (one reference),
        # bf16 weights at stage 2, stage 2 under ms.jit and stage 1 in GRAPH_MODE (one
        # compiled reference), every bad input
        _train(_TP2, stage=0, clip=CLIP),
        _train(_TP2, stage=1, clip=CLIP),
        _train(_TP2, stage=3, clip=CLIP),
        _train(_TP2, stage=2, clip=CLIP, dtype="bfloat16"),
        _train(_TP2, stage=2, clip=CLIP, mode="jit"),
        _train(_TP2, stage=1, clip=CLIP, mode="graph"),
        {"name": "optimizer.errors", "params": _TP2},
        # overlap_grad_reduce vs not, bit for bit (one bucket per parameter)
        {"name": "optimizer.overlap", "params": {**_TP2, "stages": [0, 1, 2]}},
        # dp4, unclipped: padding (rows 18 and 50 over 4 ranks), small buckets, stage 3
        _train(_DP4, stage=2, bucket_size_mb=0.002),
        _train(_DP4, stage=3),
        {"name": "optimizer.overlap", "params": {**_DP4, "stages": [0, 1, 2], "gpt": True}},
        # pp2 x dp2, 1F1B, tied embedding and LM head, clipped
        _train(_PP2, stage=2, clip=CLIP),
        {"name": "optimizer.overlap", "params": {**_PP2, "stages": [0, 2]}},
    ],
}


# 8 ranks, tp2 x pp2 (1F1B, tied embedding and LM head) x dp2: every ZeRO stage, each in
# PyNative and with the stages' forward and backward under ms.jit, against the same
# PyNative reference (GradientFinalizer + the numpy AdamW), clipped. These run in the
# session's 8-rank launch, with tests/test_mappings.py's checks when both files run.
WORLD_SIZE_8 = 8
TIMEOUT_8_S = 900
_TP2_PP2 = {"tp": 2, "pp": 2}
SPEC_8 = {
    "modules": ["_optimizer_checks"],
    "checks": [_train(_TP2_PP2, stage=stage, clip=CLIP, mode=mode)
               for mode in ("pynative", "jit") for stage in (0, 1, 2, 3)],
}

_jobs.register("optimizer", SPEC, world_size=WORLD_SIZE, timeout=TIMEOUT_S,
               test_files=("test_optimizer.py",), paths=(HERE,))
_jobs.register("optimizer8", SPEC_8, world_size=WORLD_SIZE_8, timeout=TIMEOUT_8_S,
               test_files=("test_optimizer.py",), paths=(HERE,))


def run_job():
    """This family's part of the session's shared launch (``_jobs.py``), a LaunchResult."""
    return _jobs.run("optimizer")


def run_job8():
    """The 8-rank checks' part of the session's shared 8-rank launch, a LaunchResult."""
    return _jobs.run("optimizer8")


def describe_failures(result) -> str:
    lines = [f"launch ok={result.ok} timed_out={result.timed_out} logs: {result.log_dir}"]
    for failure in result.failures:
        lines.append(f"rank {failure['rank']} {failure['kind']}: {failure['reason']}")
        lines.extend("    " + line for line in (failure.get("log_tail") or "").splitlines()[-25:])
    return "\n".join(lines)


def records_of(result, check: str) -> list:
    """Every rank's records of ``check``."""
    out = []
    for _, state in sorted(result.ranks.items()):
        for record in (state or {}).get("records", []):
            if record.get("check") == check:
                out.append(record)
    return out
