"""One msrun launch for the multi-process job families of a pytest session.

A launch costs 13-25 s on the 2-core machine before any check runs (MindSpore's import
and ``init()`` on every rank), and each test file that needs ranks used to launch its own
job. Each family still describes its checks in its own ``tests/_<name>_job.py`` and
registers them here::

    _jobs.register("optimizer", SPEC, world_size=4, timeout=TIMEOUT_S,
                   test_files=("test_optimizer.py",), paths=(HERE,))
    result = _jobs.run("optimizer")     # that family's view of the launch

``conftest.py`` tells this module (:func:`select`) which test files have multiprocess
tests selected in the session. The first :func:`run` of a selected family launches the
union of the selected families of its world size that have no result yet, once: each
family's checks preceded by ``jobs.enter`` (``_jobs_checks.py``), which gives the family
what a fresh rank has (no parallel groups, the family's spec layout, PyNative, the RNG
streams of a fresh process, an empty scratch). Every family then gets its own view of
the result (:func:`family_view`): only its records, ``"step"`` counted from its own first
check, ``ok`` when every rank got past its last check. A family that another family's
failure kept from running is launched again with the families after it, so one broken
family fails only its own tests.

Outside pytest (benches: ``python tests/_x_job.py``), or for a family that is not
selected, :func:`run` launches that family's spec alone.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Callable, Iterable, Mapping, Union

HERE = os.path.dirname(os.path.abspath(__file__))
ENTER_CHECK = "jobs.enter"
ENTER_MODULE = "_jobs_checks"


@dataclasses.dataclass(frozen=True)
class Family:
    """One test file's (or a few files') battery of checks.

    Attributes:
        name: Unique name, e.g. ``"optimizer"``.
        spec: The harness spec (``{"checks", "modules", "layout"}``), or a function
            returning it (called once, when the family is launched).
        world_size: Ranks of the job.
        timeout: Seconds the family's checks may take (a union gets the sum).
        test_files: Base names of the test files that read its records.
        paths: Folders the ranks need on PYTHONPATH for the spec's "modules".
    """

    name: str
    spec: Union[Mapping, Callable[[], Mapping]]
    world_size: int
    timeout: float
    test_files: tuple
    paths: tuple = ()

    def resolved_spec(self) -> dict:
        return dict(self.spec() if callable(self.spec) else self.spec)


_FAMILIES: dict = {}
_SELECTED: set | None = None  # family names; None outside a pytest session
_RESULTS: dict = {}           # family name -> its view (a LaunchResult)
_LAUNCHES: list = []          # every union launched: (family names, LaunchResult)


def register(name: str, spec, *, world_size: int, timeout: float, test_files: Iterable[str],
             paths: Iterable[str] = ()) -> Family:
    """Declare a family (again on re-import: the latest declaration wins)."""
    family = Family(name, spec, int(world_size), float(timeout), tuple(test_files), tuple(paths))
    _FAMILIES[name] = family
    return family


def families() -> dict:
    return dict(_FAMILIES)


def select(test_files: Iterable[str]) -> list:
    """Mark the families whose test files have selected multiprocess tests; returns their names."""
    global _SELECTED
    files = set(test_files)
    _SELECTED = {f.name for f in _FAMILIES.values() if files.intersection(f.test_files)}
    return sorted(_SELECTED)


def run(name: str):
    """The family's view of the launch that ran its checks (launched on first use)."""
    if name in _RESULTS:
        return _RESULTS[name]
    family = _FAMILIES[name]
    if _SELECTED is not None and name in _SELECTED:
        # Every selected family of this size still without a result, in a stable order.
        group = [_FAMILIES[n] for n in sorted(_SELECTED)
                 if n not in _RESULTS and _FAMILIES[n].world_size == family.world_size]
    else:
        group = [family]
    while name not in _RESULTS:
        group = [f for f in group if f.name not in _RESULTS]
        _launch(group)
    return _RESULTS[name]


def merge_specs(group: list) -> tuple:
    """The union spec of ``group`` and each family's ``(enter index, stop)`` in it."""
    checks, modules, ranges = [], [ENTER_MODULE], {}
    for family in group:
        spec = family.resolved_spec()
        start = len(checks)
        checks.append({"name": ENTER_CHECK,
                       "params": {"family": family.name, "layout": spec.get("layout")}})
        checks.extend(spec["checks"])
        ranges[family.name] = (start, len(checks))
        modules.extend(m for m in spec.get("modules") or [] if m not in modules)
    return {"checks": checks, "modules": modules}, ranges


def _pythonpath(group: list) -> str:
    paths = [HERE]
    for family in group:
        paths.extend(p for p in family.paths if p not in paths)
    paths.extend(p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and p not in paths)
    return os.pathsep.join(paths)


def _launch(group: list) -> None:
    """Launch the union of ``group``; store the view of every family it ran (or failed in)."""
    from mindscience.distributed.harness import launch

    spec, ranges = merge_specs(group)
    result = launch(spec, group[0].world_size, timeout=sum(f.timeout for f in group),
                    env={"PYTHONPATH": _pythonpath(group)})
    _LAUNCHES.append(([f.name for f in group], result))
    stuck = first_unfinished(result)  # >= 0: the first family always gets its view
    for family in group:
        start, stop = ranges[family.name]
        if stuck >= start:  # it ran, or failed inside its own checks
            _RESULTS[family.name] = family_view(result, start, stop)


def first_unfinished(result) -> int:
    """The lowest spec position a rank did not finish (the spec's length when all did)."""
    positions = []
    for rank, state in result.ranks.items():
        state = state or {}
        if state.get("status") != "done":
            positions.append(int(state.get("done") or 0))
    if not positions:
        return max(int((s or {}).get("total") or 0) for s in result.ranks.values())
    return min(positions)


def family_view(result, start: int, stop: int):
    """The part of ``result`` that belongs to spec positions ``[start, stop)``
    (``start`` is the family's ``jobs.enter``): its records with ``"step"`` counted from
    its first check, its check timings, and ``ok`` when every rank finished them."""
    first = start + 1
    ranks = {}
    for rank, state in result.ranks.items():
        if state is None:
            ranks[rank] = None
            continue
        records = [{**r, "step": r["step"] - first} for r in state.get("records", [])
                   if first <= r.get("step", -1) < stop]
        timings = dict(state.get("timings") or {})
        timings["checks"] = list(timings.get("checks") or [])[first:stop]
        done = int(state.get("done") or 0)
        finished = state.get("status") == "done" or done >= stop
        ranks[rank] = {**state, "records": records, "timings": timings,
                       "done": min(max(done - first, 0), stop - first), "total": stop - first,
                       "status": "done" if finished else state.get("status")}
    completed = first_unfinished(result) >= stop
    return dataclasses.replace(
        result, ranks=ranks, ok=bool(completed and all(ranks.values())),
        failures=[] if completed else list(result.failures),
        timed_out=bool(result.timed_out and not completed))


def launches() -> list:
    """``[(family names, LaunchResult)]`` of the launches made so far (for reports)."""
    return list(_LAUNCHES)


def records_of(result, check: str, with_rank: bool = False, prefix: bool = False) -> list:
    """Every rank's records of ``check`` (of every check starting with it when ``prefix``),
    rank by rank (each tagged ``"rank"`` when asked)."""
    out = []
    for rank, state in sorted(result.ranks.items()):
        for record in (state or {}).get("records", []):
            name = record.get("check") or ""
            if name == check or (prefix and name.startswith(check)):
                out.append({**record, "rank": int(rank)} if with_rank else record)
    return out


def describe_failures(result, tail: int = 25) -> str:
    """A launch's failures for an assertion message: each rank's reason and its log's last lines."""
    lines = [f"launch ok={result.ok} timed_out={result.timed_out} logs: {result.log_dir}"]
    for failure in result.failures:
        lines.append(f"rank {failure['rank']} {failure['kind']}: {failure['reason']}")
        lines.extend("    " + line for line in (failure.get("log_tail") or "").splitlines()[-tail:])
    return "\n".join(lines)
