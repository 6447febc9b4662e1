"""What ships under ``mindscience/distributed/harness/checks`` is what ``msdist verify`` and
``msdist train`` run: every check their specs can name is registered from there, and every
check registered from there is named by one of their specs or is a listed exception.

Checks that only the test suite runs live beside the tests (``tests/_*_checks.py``) and
reach the ranks through ``spec["modules"]``. No rank is started here.
"""

from __future__ import annotations

import importlib

import pytest

from mindscience.distributed.harness import registry
from mindscience.distributed.topology import Layout

SHIPPED = "mindscience.distributed.harness.checks"

# Registered from harness/checks although no verify/train spec names them: each shares its
# module (and its machinery) with a check that verify runs, or belongs to the harness itself.
# Moving them out would split one battery across two places; the test suite runs them.
EXCEPTIONS = {
    "basic.ping": "the harness's own smoke check (launch() docstring, launcher tests)",
    "basic.allreduce": "the harness's own smoke check (launch() docstring, launcher tests)",
    "layers.column": "finer cases of the layer battery behind layers.dense_equivalence",
    "layers.row": "finer cases of the layer battery behind layers.dense_equivalence",
    "layers.matrix": "finer cases of the layer battery behind layers.dense_equivalence",
    "layers.init_exact": "finer cases of the layer battery behind layers.dense_equivalence",
    "layers.errors": "error paths of the layers verify checks",
    "attention.layer": "the tp x cp attention layer, on the machinery of attention.methods",
    "mappings.errors": "error paths of the mappings verify checks (mappings.all)",
    "p2p.errors": "error paths of the p2p calls verify checks (p2p.ring, p2p.pipeline)",
    "pipeline.errors": "error paths of the pipeline runtime verify checks (pipeline.step)",
}


def _shipped_checks() -> set:
    for name in registry.CHECK_MODULES:
        importlib.import_module(name)
    return {name for name, fn in registry._CHECKS.items()  # noqa: SLF001 - the registry itself
            if fn.__module__.startswith(SHIPPED + ".")}


def _spec_names(spec: dict) -> set:
    return {c["name"] for c in spec["checks"]}


def _verify_and_train_checks() -> set:
    """Every check name a ``msdist verify`` or ``msdist train`` spec can hold."""
    from mscli import verify_report as vr
    from mscli.commands import train, verify

    names = set()
    # Each branch of build_spec: tp, cp and pp > 1, both kinds, each mode set.
    for modes in (vr.MODES, ("pynative",), ("jit",)):
        names |= _spec_names(vr.build_spec(Layout(world_size=8, tp=2, cp=2, pp=2),
                                           kinds=vr.CHECK_KINDS, modes=modes))
    names |= _spec_names(vr.build_spec(Layout(world_size=2), kinds=vr.CHECK_KINDS))
    # experts split (ep > 1): the moe family and the all-to-all bandwidth rows
    names |= _spec_names(vr.build_spec(Layout(world_size=4, tp=2, ep=2), kinds=vr.CHECK_KINDS))
    names |= {verify.parse_fault(text)["name"] for text in ("crash:0", "hang:0:5")}
    layout = Layout(world_size=4, tp=2)
    names.add(verify.model_check(layout, "tiny-gpt")["name"])
    workload, opts = train.model_and_options(layout, "tiny-gpt", steps=2, mode="jit")
    names |= _spec_names(train.build_spec(layout, workload, opts, None))
    return names


@pytest.fixture(scope="module")
def shipped():
    pytest.importorskip("mindspore")  # some check modules import it at module level
    return _shipped_checks()


def test_every_check_verify_or_train_can_run_ships_in_harness_checks(shipped):
    wanted = _verify_and_train_checks()
    assert {"layout.init", "mappings.all", "pipeline.step", "train.dense_compare",
            "train.step", "fault.crash", "bandwidth.sweep"} <= wanted  # the enumeration works
    missing = sorted(wanted - shipped)
    assert not missing, f"named by verify/train specs but not registered from {SHIPPED}: {missing}"


def test_harness_checks_holds_nothing_verify_and_train_never_run(shipped):
    wanted = _verify_and_train_checks()
    assert not set(EXCEPTIONS) & wanted, "an exception that a spec names is no exception"
    unused = sorted(shipped - wanted - set(EXCEPTIONS))
    assert not unused, (f"registered from {SHIPPED} but never put in a verify/train spec: {unused}. "
                        "Move a test-only check next to the tests (tests/_*_checks.py, loaded "
                        "through spec['modules']) or list it in EXCEPTIONS with the reason.")
    stale = sorted(set(EXCEPTIONS) - shipped)
    assert not stale, f"EXCEPTIONS names checks that are not registered any more: {stale}"


def test_test_only_check_modules_are_not_shipped():
    """The checks moved out of harness/checks are not in the worker's default import list."""
    for gone in ("examples", "training", "checkpoint", "checkpoint_resume", "manager"):
        assert f"{SHIPPED}.{gone}" not in registry.CHECK_MODULES
        with pytest.raises(ModuleNotFoundError):
            importlib.import_module(f"{SHIPPED}.{gone}")
