"""The ONE 4-rank msrun job of test_checkpoint_zero.py (a launch costs 15-25 s before any
check runs): the uninterrupted reference, then the chain stage 3 (fully_shard, dp4) ->
stage 1 (tp2 x dp2) -> stage 0 (tp1), then the offline reshard of a stage-2 checkpoint.

The checks live next to the tests (tests/_checkpoint_zero_checks.py), imported by the
workers through ``spec["modules"]`` with tests/ on their PYTHONPATH.
"""

from __future__ import annotations

import os

import _jobs

WORLD_SIZE = 4
TIMEOUT_S = 300
HERE = os.path.dirname(os.path.abspath(__file__))
STEPS = 6

SPEC = {
    "modules": ["_checkpoint_zero_checks"],
    "checks": [
        {"name": "ckzero.reference", "params": {"steps": STEPS}},
        {"name": "ckzero.chain", "params": {"legs": [2, 2]}},
        {"name": "ckzero.offline", "params": {"first": 3}},
    ],
}


_jobs.register("checkpoint_zero", SPEC, world_size=WORLD_SIZE, timeout=TIMEOUT_S,
               test_files=("test_checkpoint_zero.py",), paths=(HERE,))


def run_job():
    """This family's part of the session's shared launch (``_jobs.py``), a LaunchResult."""
    return _jobs.run("checkpoint_zero")


def describe_failures(result) -> str:
    return _jobs.describe_failures(result, tail=30)


def records_of(result, check: str) -> list:
    """Every rank's records of ``check``, as ``(rank, record)``."""
    return [(r.pop("rank"), r) for r in _jobs.records_of(result, check, with_rank=True)]
