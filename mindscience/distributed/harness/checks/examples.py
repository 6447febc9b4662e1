"""Checks that run the examples in ``examples/`` inside a harness job.

Each check imports the script and calls its ``run(**params)`` under the parallel sizes
``tp`` / ``cp`` (the manager is re-initialized when they differ from the groups in
force, see :func:`.layers._ensure_parallel`); the script's record (its comparison with
the dense model) is the check's record:

* ``examples.tp_mlp``, ``examples.attention_tp``, ``examples.attention_ulysses``,
  ``examples.attention_cp_allgather``.

The scripts are found next to the package in a source checkout, or in
``$MSDIST_EXAMPLES_DIR``. Example spec (4 ranks; an uneven sequence over cp = 4)::

    {"checks": [{"name": "examples.attention_ulysses",
                 "params": {"tp": 1, "cp": 4, "seq_len": 1003, "batch": 1}}]}
"""

from __future__ import annotations

import importlib
import os
import sys

from ..registry import CheckContext, check
from .layers import _case, _ensure_parallel

EXAMPLES_ENV = "MSDIST_EXAMPLES_DIR"


def examples_dir() -> str:
    """``$MSDIST_EXAMPLES_DIR``, else ``examples/`` of the source checkout."""
    env = os.environ.get(EXAMPLES_ENV)
    if env:
        return os.path.abspath(env)
    here = os.path.dirname(os.path.abspath(__file__))
    # .../<root>/mindscience/distributed/harness/checks -> <root>/examples
    return os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(here)))), "examples")


def _load_example(name: str):
    folder = examples_dir()
    if not os.path.isfile(os.path.join(folder, f"{name}.py")):
        raise FileNotFoundError(
            f"example {name}.py not found in {folder}: run from a source checkout, or set "
            f"{EXAMPLES_ENV} to the folder holding the examples."
        )
    if folder not in sys.path:
        sys.path.insert(0, folder)  # the examples import their sibling _common.py
    return importlib.import_module(name)


def _run_example(ctx, name, tp, cp, **params) -> dict:
    try:
        module = _load_example(name)
    except FileNotFoundError as exc:
        return {"check": f"examples.{name}", "passed": False, "max_error": None, "reason": str(exc)}
    _ensure_parallel(ctx, tp, cp)
    record = module.run(**params)
    record.setdefault("check", f"examples.{name}")
    record.setdefault("group", "world")
    if params:
        record["case"] = _case(**params)
    return record


@check("examples.tp_mlp")
def example_tp_mlp(ctx: CheckContext, tp=None, cp=None, **params) -> dict:
    """examples/tp_mlp.py: tensor-parallel MLP training, loss curve vs dense."""
    return _run_example(ctx, "tp_mlp", tp, cp, **params)


@check("examples.attention_tp")
def example_attention_tp(ctx: CheckContext, tp=None, cp=None, **params) -> dict:
    """examples/attention_tp.py: Megatron tensor-parallel attention vs dense."""
    return _run_example(ctx, "attention_tp", tp, cp, **params)


@check("examples.attention_ulysses")
def example_attention_ulysses(ctx: CheckContext, tp=None, cp=None, **params) -> dict:
    """examples/attention_ulysses.py: Ulysses context-parallel attention vs dense."""
    return _run_example(ctx, "attention_ulysses", tp, cp, **params)


@check("examples.attention_cp_allgather")
def example_attention_cp_allgather(ctx: CheckContext, tp=None, cp=None, **params) -> dict:
    """examples/attention_cp_allgather.py: context parallelism by all-gathered k/v vs dense."""
    return _run_example(ctx, "attention_cp_allgather", tp, cp, **params)
