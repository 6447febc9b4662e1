"""Test-only harness checks that run the scripts in ``examples/`` inside a harness job.

Imported by the worker through ``spec["modules"]`` (``["_examples_checks"]``, with tests/ on
the ranks' PYTHONPATH, see tests/_layers_job.py and tests/test_mappings.py); ``msdist
verify`` runs none of them, so they live beside the tests, not under ``harness/checks``.

Each check imports the script and calls its ``run(**params)``; the script's record (its
comparison with the dense model) is the check's record:

* ``examples.tp_mlp``, ``examples.attention_tp``, ``examples.attention_ulysses``,
  ``examples.attention_cp_allgather``: under the parallel sizes ``tp`` / ``cp`` (the
  manager is re-initialized when they differ from the groups in force, see
  :func:`mindscience.distributed.harness.checks.layers._ensure_parallel`).
* ``examples.train_transformer`` (GPTModel, tp x cp x dp) and ``examples.train_pipeline``
  (GPTModel, tp x pp x dp): under ``layout`` (a dict of sizes; dp from the world), then
  the layout in force is restored.
* ``examples.inside_train_transformer`` (the hand-wired block; ``tp`` / ``cp``, default
  2 x 2) and ``examples.inside_train_pipeline`` (the hand-cut stages; ``layout``, default
  tp2 x pp2): the same, for the "how it works inside" scripts.

The scripts are found in ``examples/`` of the source checkout, or in
``$MSDIST_EXAMPLES_DIR``. Example spec (4 ranks; an uneven sequence over cp = 4)::

    {"modules": ["_examples_checks"],
     "checks": [{"name": "examples.attention_ulysses",
                 "params": {"tp": 1, "cp": 4, "seq_len": 1003, "batch": 1}}]}
"""

from __future__ import annotations

import importlib
import os
import sys

from mindscience.distributed.harness.checks.groups import current_layout_args, ensure_manager, restore
from mindscience.distributed.harness.checks.layers import _case, _ensure_parallel
from mindscience.distributed.harness.checks.p2p import under_layout
from mindscience.distributed.harness.registry import CheckContext, check

EXAMPLES_ENV = "MSDIST_EXAMPLES_DIR"


def examples_dir() -> str:
    """``$MSDIST_EXAMPLES_DIR``, else ``examples/`` of the source checkout."""
    env = os.environ.get(EXAMPLES_ENV)
    if env:
        return os.path.abspath(env)
    # .../<root>/tests -> <root>/examples
    return os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples")


def load_example(name: str):
    """Import ``examples/<name>.py`` (its folder goes on sys.path for its ``_common``)."""
    folder = examples_dir()
    if not os.path.isfile(os.path.join(folder, f"{name}.py")):
        raise FileNotFoundError(
            f"example {name}.py not found in {folder}: run from a source checkout, or set "
            f"{EXAMPLES_ENV} to the folder holding the examples."
        )
    if folder not in sys.path:
        sys.path.insert(0, folder)  # the examples import their sibling _common.py
    return importlib.import_module(name)


def _missing(name: str, exc: Exception) -> dict:
    return {"check": f"examples.{name}", "passed": False, "max_error": None, "reason": str(exc)}


def _run_example(ctx, name, tp, cp, **params) -> dict:
    try:
        module = load_example(name)
    except FileNotFoundError as exc:
        return _missing(name, exc)
    _ensure_parallel(ctx, tp, cp)
    record = module.run(**params)
    record.setdefault("check", f"examples.{name}")
    record.setdefault("group", "world")
    if params:
        record["case"] = _case(**params)
    return record


def _run_under_layout(ctx, name, layout, params) -> dict:
    """``examples/<name>.py``'s ``run(**params)`` under ``layout``, then the layout in force again."""
    try:
        module = load_example(name)
    except FileNotFoundError as exc:
        return _missing(name, exc)

    def body(manager):
        record = module.run(**params)
        record.setdefault("check", f"examples.{name}")
        record.setdefault("group", "world")
        if params:
            record["case"] = _case(**params)
        return [record]

    return under_layout(ctx, layout, body)[0]


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


@check("examples.train_transformer")
def example_train_transformer(ctx: CheckContext, layout=None, **params) -> dict:
    """examples/train_transformer.py: GPTModel at ``layout`` (default tp2 x cp2) vs dense."""
    return _run_under_layout(ctx, "train_transformer", layout or {"tp": 2, "cp": 2}, params)


@check("examples.train_pipeline")
def example_train_pipeline(ctx: CheckContext, layout=None, **params) -> dict:
    """examples/train_pipeline.py: GPTModel at ``layout`` (default tp2 x pp2) under each
    schedule vs dense."""
    return _run_under_layout(ctx, "train_pipeline", layout or {"tp": 2, "pp": 2}, params)


@check("examples.inside_train_transformer")
def example_inside_train_transformer(ctx: CheckContext, tp=2, cp=2, **params) -> dict:
    """examples/inside_train_transformer.py: jit and PyNative loss curves vs the dense model."""
    manager = ensure_manager(ctx)
    previous = current_layout_args(manager)
    try:
        return _run_example(ctx, "inside_train_transformer", tp, cp, **params)
    finally:
        restore(manager, previous)


@check("examples.inside_train_pipeline")
def example_inside_train_pipeline(ctx: CheckContext, layout=None, **params) -> dict:
    """examples/inside_train_pipeline.py: each schedule's loss curve and weights vs dense."""
    return _run_under_layout(ctx, "inside_train_pipeline", layout or {"tp": 2, "pp": 2}, params)
