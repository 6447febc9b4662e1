"""The ONE 4-rank msrun job of test_recompute.py (a launch costs ~20 s before any check).

The checks live next to the tests (``_recompute_checks.py``); the worker imports them
through ``spec["modules"]`` with this folder on ``PYTHONPATH``. Layouts: tp2 x cp2 for
the layer set and the RNG tracker, tp2 x pp2 and pp2 x dp2 for the pipeline runtime.
"""

from __future__ import annotations

import os

import _jobs

WORLD_SIZE = 4
# Checks measured at 155 s (load average 27) and, with a jit pipeline case since dropped,
# 230-310 s (load 30-50) on the shared 2-core machine; no quiet machine was available.
TIMEOUT_S = 600

_TP2_CP2 = {"tp": 2, "cp": 2}
_TP2_PP2 = {"tp": 2, "pp": 2}
_PP2_DP2 = {"tp": 1, "pp": 2}
SPEC = {
    "modules": ["_recompute_checks"],
    "layout": {"world_size": WORLD_SIZE, **_TP2_CP2},
    "checks": [
        # PyNative: every layer and method, both ways; compiled (seconds per graph): one
        # attention method per mode and one way each
        {"name": "recompute.layers", "params": {"layout": _TP2_CP2}},
        {"name": "recompute.layers", "params": {"layout": _TP2_CP2, "modes": ["jit"],
                                                "variants": ["cells"], "methods": ["ulysses"]}},
        {"name": "recompute.layers", "params": {"layout": _TP2_CP2, "modes": ["graph"],
                                                "variants": ["selective"],
                                                "methods": ["allgather_kv"]}},
        {"name": "recompute.rng", "params": {"layout": _TP2_CP2}},
        # Every schedule x mode x recompute against the dense model, the stage forwards
        # counted: tp2 x pp2 (kept in jit too, the tp collectives in the stage) and pp2 x dp2
        {"name": "recompute.pipeline", "params": {"layout": _TP2_PP2, "tag": "tp2pp2"}},
        {"name": "recompute.pipeline", "params": {"layout": _PP2_DP2, "tag": "pp2dp2"}},
    ],
}
_ALL = "ring+ulysses+allgather_kv"
LAYER_GROUPS = (f"pynative.cells.{_ALL}", f"pynative.selective.{_ALL}", "jit.cells.ulysses",
                "graph.selective.allgather_kv")


_jobs.register("recompute", SPEC, world_size=WORLD_SIZE, timeout=TIMEOUT_S,
               test_files=("test_recompute.py",), paths=(os.path.dirname(os.path.abspath(__file__)),))


def run_job():
    """This family's part of the session's shared launch (``_jobs.py``), a LaunchResult."""
    return _jobs.run("recompute")


def records_of(result, check: str) -> list:
    """Every rank's records of ``check``."""
    return _jobs.records_of(result, check)


def describe_failures(result) -> str:
    return _jobs.describe_failures(result, tail=15)
