"""Named checks that worker ranks run, and the records they return.

A check is a function ``fn(ctx, **params)`` registered under a dotted name. It runs in
every rank and returns one record or a list of records, each a dict with at least::

    {"check": "mapping.copy_to_all", "group": "tp", "passed": True, "max_error": 0.0}

(plus any JSON-serialisable extras, e.g. "dtype", "shape", "time_us"). The parent
process merges the records of all ranks: a check/group passes when it passed on every
rank, and its max_error is the largest over ranks.

Check modules live in ``mindscience.distributed.harness.checks``; the worker imports
the modules listed in :data:`CHECK_MODULES` before running anything, then the spec's own
``"modules"``. What ships there is what ``msdist verify`` and ``msdist train`` put in their
specs (tests/test_harness.py holds the list of exceptions); checks that only the test
suite runs live beside it (``tests/_*_checks.py``) and reach the ranks through
``spec["modules"]`` with tests/ on their PYTHONPATH.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

CHECK_MODULES = (
    "mindscience.distributed.harness.checks.basic",
    "mindscience.distributed.harness.checks.layout",
    "mindscience.distributed.harness.checks.mappings",
    "mindscience.distributed.harness.checks.layers",
    "mindscience.distributed.harness.checks.attention",
    "mindscience.distributed.harness.checks.vocab",
    "mindscience.distributed.harness.checks.bandwidth",
    "mindscience.distributed.harness.checks.compute",
    "mindscience.distributed.harness.checks.p2p",
    "mindscience.distributed.harness.checks.pipeline",
    "mindscience.distributed.harness.checks.train",
    "mindscience.distributed.harness.checks.moe",
)

_CHECKS: dict[str, Callable] = {}


def check(name: str):
    """Register ``fn`` as the check called ``name``."""

    def register(fn):
        if name in _CHECKS and _CHECKS[name] is not fn:
            raise ValueError(f"check {name!r} is registered twice")
        _CHECKS[name] = fn
        return fn

    return register


def get_check(name: str) -> Callable:
    try:
        return _CHECKS[name]
    except KeyError:
        raise KeyError(
            f"unknown check {name!r}: expected one of {', '.join(sorted(_CHECKS)) or '(none loaded)'}"
        ) from None


def registered_checks() -> list[str]:
    return sorted(_CHECKS)


@dataclass
class CheckContext:
    """What a check knows about the rank it runs in.

    Attributes:
        rank: Global rank.
        world_size: Number of ranks.
        layout: The ``topology.Layout`` the job runs, or None.
        out_dir: Folder where this job's per-rank results go.
        scratch: Free-form dict that checks may use to pass state to later checks.
    """

    rank: int
    world_size: int
    layout: Any = None
    out_dir: str = ""
    scratch: dict = field(default_factory=dict)
