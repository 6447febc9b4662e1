"""The ONE 4-rank msrun job of test_parallelize.py (a launch costs ~20 s before any check).

Checks (``_parallelize_checks.py``, imported by the ranks through the spec's "modules"):
parity with the dense model at tp2 x dp2 and at tp4, with and without sequence
parallelism (tp4 with it under ``ms.jit``); a checkpoint saved at tp2 x dp2 for the parent
to load into the dense model; ``examples/parallelize_dense.py`` at tp2 x dp2.
The result is cached for the pytest session.
"""

from __future__ import annotations

import functools
import os
import tempfile

import _jobs

WORLD_SIZE = 4
# Measured 2026-12-05 on the shared 2-core machine: checks 39 s (the ms.jit case 10 s) plus
# 13 s of import and init at load average 16; 79 s at load ~30; 149 s (+32 s) at load ~50.
TIMEOUT_S = 420

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
EXAMPLES_DIR = os.path.join(os.path.dirname(TESTS_DIR), "examples")

PARITY_CASES = [  # (tp, sequence_parallel, mode), in run order (tp2 first: one reinit)
    (2, False, "pynative"), (2, True, "pynative"), (4, False, "pynative"), (4, True, "jit"),
]


EXAMPLE_STEPS = 3


def spec(directory: str) -> dict:
    checks = [{"name": "parallelize.checkpoint",
               "params": {"tp": 2, "directory": os.path.join(directory, "tp2")}},
              {"name": "parallelize.example", "params": {"tp": 2, "steps": EXAMPLE_STEPS}}]
    checks[1:1] = [{"name": "parallelize.parity",
                    "params": {"tp": tp, "sequence_parallel": sp, "mode": mode}}
                   for tp, sp, mode in PARITY_CASES if tp == 2]
    checks += [{"name": "parallelize.parity", "params": {"tp": tp, "sequence_parallel": sp, "mode": mode}}
               for tp, sp, mode in PARITY_CASES if tp == 4]
    return {"checks": checks, "modules": ["_parallelize_checks"]}


@functools.lru_cache(maxsize=None)
def directory() -> str:
    """The session's folder for the checkpoint the ranks save (``folder/tp2``)."""
    return tempfile.mkdtemp(prefix="msdist_parallelize_")


_jobs.register("parallelize", lambda: spec(directory()), world_size=WORLD_SIZE, timeout=TIMEOUT_S,
               test_files=("test_parallelize.py",), paths=(TESTS_DIR, EXAMPLES_DIR))


def run_job():
    """This family's part of the session's shared launch (``_jobs.py``):
    ``(LaunchResult, folder)``; the checkpoint saved at tp2 x dp2 is ``folder/tp2``."""
    return _jobs.run("parallelize"), directory()


def describe_failures(result) -> str:
    return _jobs.describe_failures(result, tail=15)


def records_of(result, check: str) -> list:
    """Every rank's records of ``check``, each with its rank."""
    return _jobs.records_of(result, check, with_rank=True)
