"""tests/_jobs.py: the union spec of the job families, each family's view of the shared
launch, and the relaunch of families that another family's failure kept from running
(the launcher is replaced by a fake that runs no process)."""

from __future__ import annotations

import pytest

import _jobs
from mindscience.distributed.harness.launcher import LaunchResult


def _family(name, checks, layout=None, modules=(), world_size=4, timeout=10.0):
    spec = {"checks": [{"name": c, "params": {}} for c in checks], "modules": list(modules)}
    if layout:
        spec["layout"] = layout
    return _jobs.Family(name, spec, world_size, timeout, (f"test_{name}.py",), (f"/p/{name}",))


def _result(states, ok=True, failures=()):
    return LaunchResult(ok=ok, returncode=0, timed_out=False, duration_s=1.0, ranks=states,
                        failures=list(failures), log_dir="/tmp/x", command=[])


def _state(spec, upto, status="done"):
    """A rank that finished ``upto`` checks of ``spec`` (one record each, step = position)."""
    records = [{"check": item["name"], "step": i, "passed": True}
               for i, item in enumerate(spec["checks"][:upto]) if item["name"] != _jobs.ENTER_CHECK]
    return {"status": status, "done": upto, "total": len(spec["checks"]), "records": records,
            "timings": {"checks": [{"name": c["name"], "s": 1.0} for c in spec["checks"][:upto]]}}


@pytest.fixture
def registry(monkeypatch):
    """An empty family registry for the test; the session's is put back afterwards."""
    monkeypatch.setattr(_jobs, "_FAMILIES", {})
    monkeypatch.setattr(_jobs, "_RESULTS", {})
    monkeypatch.setattr(_jobs, "_LAUNCHES", [])
    monkeypatch.setattr(_jobs, "_SELECTED", None)
    return _jobs


def test_union_spec_opens_each_family_with_enter_and_merges_modules():
    a = _family("a", ["x.one", "x.two"], layout={"world_size": 4, "tp": 2}, modules=["_a_checks"])
    b = _family("b", ["y.one"], modules=["_a_checks", "_b_checks"])
    spec, ranges = _jobs.merge_specs([a, b])
    names = [c["name"] for c in spec["checks"]]
    assert names == ["jobs.enter", "x.one", "x.two", "jobs.enter", "y.one"]
    assert spec["checks"][0]["params"] == {"family": "a", "layout": {"world_size": 4, "tp": 2}}
    assert spec["checks"][3]["params"] == {"family": "b", "layout": None}
    assert spec["modules"] == ["_jobs_checks", "_a_checks", "_b_checks"]
    assert ranges == {"a": (0, 3), "b": (3, 5)}


def test_view_keeps_the_family_records_with_steps_from_its_first_check():
    a, b = _family("a", ["x.one", "x.two"]), _family("b", ["y.one"])
    spec, ranges = _jobs.merge_specs([a, b])
    result = _result({r: _state(spec, 5) for r in range(4)})
    view_b = _jobs.family_view(result, *ranges["b"])
    assert view_b.ok and view_b.failures == []
    assert [(x["check"], x["step"]) for x in view_b.ranks[0]["records"]] == [("y.one", 0)]
    assert view_b.ranks[0]["timings"]["checks"] == [{"name": "y.one", "s": 1.0}]
    assert (view_b.ranks[2]["done"], view_b.ranks[2]["total"]) == (1, 1)
    view_a = _jobs.family_view(result, *ranges["a"])
    assert [x["step"] for x in view_a.ranks[3]["records"]] == [0, 1]
    assert view_a.passed


def test_a_failure_after_a_family_leaves_it_ok_and_fails_the_family_it_hit():
    a, b, c = _family("a", ["x.one"]), _family("b", ["y.one", "y.two"]), _family("c", ["z.one"])
    spec, ranges = _jobs.merge_specs([a, b, c])
    failure = {"rank": 1, "kind": "error", "reason": "ValueError in y.two", "log_tail": ""}
    states = {r: _state(spec, 4, "running") for r in range(4)}
    states[1] = _state(spec, 4, "error")  # position 4 is y.two
    result = _result(states, ok=False, failures=[failure])
    assert _jobs.first_unfinished(result) == 4
    assert _jobs.family_view(result, *ranges["a"]).ok
    view_b = _jobs.family_view(result, *ranges["b"])
    assert not view_b.ok and view_b.failures == [failure]
    assert view_b.ranks[1]["status"] == "error" and view_b.ranks[1]["done"] == 1


def test_run_launches_the_selected_families_once_and_relaunches_the_unreached(registry, monkeypatch):
    """b fails in the first union: a keeps its records, b reports the failure, c and d run
    in a second launch; a family nobody selected is launched on its own."""
    for name, checks in [("a", ["x.one"]), ("b", ["y.one"]), ("c", ["z.one"]), ("d", ["w.one"]),
                         ("solo", ["s.one"])]:
        fam = _family(name, checks)
        registry.register(name, fam.spec, world_size=4, timeout=10.0 + len(name),
                          test_files=fam.test_files, paths=fam.paths)
    registry.register("eight", _family("eight", ["e.one"]).spec, world_size=8, timeout=5,
                      test_files=("test_eight.py",))
    assert registry.select(["test_a.py", "test_b.py", "test_c.py", "test_d.py", "test_eight.py",
                            "test_other.py"]) == ["a", "b", "c", "d", "eight"]
    calls = []

    def fake_launch(spec, world_size, *, timeout, env):
        names = [c["params"]["family"] for c in spec["checks"] if c["name"] == _jobs.ENTER_CHECK]
        calls.append((names, world_size, timeout, env["PYTHONPATH"]))
        fail_at = next((i for i, c in enumerate(spec["checks"]) if c["name"] == "y.one"), None)
        if fail_at is None:
            return _result({r: _state(spec, len(spec["checks"])) for r in range(world_size)})
        states = {r: _state(spec, fail_at, "error" if r == 0 else "running") for r in range(world_size)}
        return _result(states, ok=False, failures=[{"rank": 0, "kind": "error", "reason": "boom"}])

    monkeypatch.setattr("mindscience.distributed.harness.launch", fake_launch)
    assert registry.run("c").ok
    assert [c[0] for c in calls] == [["a", "b", "c", "d"], ["c", "d"]]
    assert calls[0][2] == 11 * 4 and calls[0][1] == 4
    assert calls[0][3].split(":")[:5] == [_jobs.HERE, "/p/a", "/p/b", "/p/c", "/p/d"]
    assert registry.run("a").ok and not registry.run("b").ok and registry.run("d").ok
    assert registry.run("solo").ok and calls[-1][0] == ["solo"]
    assert registry.run("eight").ok and calls[-1][:2] == (["eight"], 8)
    assert len(calls) == 4 and len(registry.launches()) == 4
