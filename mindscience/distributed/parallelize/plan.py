"""Match a plan against a model and validate all of it before anything changes.

:func:`resolve_plan` turns ``{pattern: style}`` into one :class:`Match` per submodule,
checking every rule first; any problem raises one :class:`ParallelizePlanError` that
names the module, its type and shape, and the fix. Nothing here modifies the model.
"""

from __future__ import annotations

import difflib
import fnmatch
from dataclasses import dataclass
from typing import Optional

from mindspore import mint, nn

from ..modules.embedding import VocabParallelEmbedding
from ..modules.linear import ColumnParallelLinear, RowParallelLinear
from .styles import (ColwiseParallel, HeadParallel, ParallelizePlanError, ParallelStyle,
                     RowwiseParallel, SequenceParallel, VocabParallel, chunk_widths)

__all__ = ["Match", "resolve_plan", "describe_module", "LINEAR_TYPES", "EMBEDDING_TYPES"]

# Exact types: a subclass may override construct, which a replacement would silently drop.
LINEAR_TYPES = (nn.Dense, mint.nn.Linear)
EMBEDDING_TYPES = (nn.Embedding, mint.nn.Embedding)
_REPLACING = (ColwiseParallel, RowwiseParallel, VocabParallel)
_PARALLEL_LAYERS = (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding)


@dataclass
class Match:
    """One styled submodule: where it sits and what it becomes.

    Attributes:
        name: Its name in ``model.cells_and_names()`` (``"layers.0.fc1"``).
        cell: The module.
        parent: The module holding it (None for the root).
        key: Its child key in ``parent``.
        style: The style.
        pattern: The plan pattern that matched it.
        sequence_parallel: The effective setting (the style's, else the plan's).
        widths: ColwiseParallel only: the fused chunk widths (one chunk: ``(out,)``).
    """

    name: str
    cell: object
    parent: Optional[object]
    key: str
    style: ParallelStyle
    pattern: str
    sequence_parallel: bool
    widths: tuple = ()


def _type_name(cell) -> str:
    """The public path of the cell's class (``mindspore.nn.LayerNorm``), else its module's."""
    cls = type(cell)
    for public, namespace in (("mindspore.nn", nn), ("mindspore.mint.nn", mint.nn)):
        if getattr(namespace, cls.__name__, None) is cls:
            return f"{public}.{cls.__name__}"
    return f"{cls.__module__}.{cls.__qualname__}"


def linear_shape(cell) -> tuple:
    """``(out_features, in_features)`` of a dense linear, from its weight."""
    return tuple(cell.weight.shape)


def embedding_table(cell):
    """The table Parameter of a dense embedding (``embedding_table`` or ``weight``)."""
    return cell.embedding_table if type(cell) is nn.Embedding else cell.weight


def describe_module(name: str, cell) -> str:
    """``module 'layers.0.fc1' (mindspore.nn.Dense, weight [out, in] = (64, 16))``."""
    kind = _type_name(cell)
    if type(cell) in LINEAR_TYPES:
        return f"module {name!r} ({kind}, weight [out, in] = {linear_shape(cell)})"
    if type(cell) in EMBEDDING_TYPES:
        return f"module {name!r} ({kind}, table [vocab, dim] = {tuple(embedding_table(cell).shape)})"
    return f"module {name!r} ({kind})"


def _fail(message: str):
    raise ParallelizePlanError(message)


def _check_plan_object(plan) -> None:
    if not isinstance(plan, dict) or not plan:
        _fail(f"parallelize_module: plan={plan!r} is invalid: expected a non-empty dict of "
              "{'submodule pattern': style}, e.g. {'layers.*.fc1': ColwiseParallel()}.")
    for pattern, style in plan.items():
        if not isinstance(pattern, str) or not pattern:
            _fail(f"parallelize_module: plan key {pattern!r} is invalid: expected a non-empty "
                  "fnmatch pattern over the names of model.cells_and_names(), e.g. 'layers.*.fc1'.")
        if not isinstance(style, ParallelStyle):
            _fail(f"parallelize_module: plan[{pattern!r}] = {style!r} is invalid: expected a style "
                  "instance (ColwiseParallel(), RowwiseParallel(), VocabParallel(), "
                  "SequenceParallel() or HeadParallel(...)); note the parentheses.")


def _nothing_matched(pattern: str, names: list) -> None:
    close = difflib.get_close_matches(pattern, names, n=3, cutoff=0.4)
    hint = f" Close names: {', '.join(repr(n) for n in close)}." if close else ""
    shown = ", ".join(repr(n) for n in names[:12]) + (", ..." if len(names) > 12 else "")
    _fail(f"parallelize_module: pattern {pattern!r} matches no submodule. Patterns are fnmatch "
          f"patterns over the names of model.cells_and_names() ({shown}).{hint} Fix the "
          "pattern or remove it from the plan.")


def _check_not_parallel(m: Match) -> None:
    layer = next((t for t in _PARALLEL_LAYERS if isinstance(m.cell, t)), None)
    if layer is not None:
        _fail(f"parallelize_module: {type(m.style).__name__} on module {m.name!r}: it is already "
              f"a {layer.__name__} (parallelize_module ran on this model before, or the model "
              "builds the parallel layer itself). Leave it out of the plan.")


def _check_linear(m: Match, tp: int) -> None:
    cell, style, where = m.cell, m.style, describe_module(m.name, m.cell)
    label = type(style).__name__
    _check_not_parallel(m)
    if type(cell) not in LINEAR_TYPES:
        _fail(f"parallelize_module: {label} on {where}: {label} applies to mindspore.nn.Dense "
              "or mindspore.mint.nn.Linear only (exact types: a subclass may compute something "
              "else). Match the linear layer itself, or leave this module out of the plan"
              + (" (use VocabParallel() for an embedding)." if type(cell) in EMBEDDING_TYPES else "."))
    activation = getattr(cell, "activation", None) if type(cell) is nn.Dense else None
    if activation is not None and hasattr(activation, "get_parameters") and \
            list(activation.get_parameters()):
        _fail(f"parallelize_module: {label} on {where}: its activation "
              f"{type(activation).__name__} has parameters, which would need splitting too. "
              "Build the Dense with activation=None and apply the activation after it, or "
              "leave this module out of the plan.")
    out_f, in_f = linear_shape(cell)
    if isinstance(style, RowwiseParallel):
        if in_f % tp:
            _fail(f"parallelize_module: RowwiseParallel on {where}: in_features={in_f} is not "
                  f"divisible by the tensor-parallel size {tp} (each rank holds in/{tp} input "
                  f"features). Choose in_features as a multiple of {tp}, another tp size, or "
                  "leave this module out of the plan.")
        return
    try:
        widths = chunk_widths(style.chunks, out_f)
    except ValueError as exc:
        _fail(f"parallelize_module: ColwiseParallel(chunks={style.chunks!r}) on {where}: {exc}. "
              "Give the number of equal fused chunks (3 for q|k|v) or their widths, summing "
              f"to out_features={out_f}.")
    bad = [w for w in widths if w % tp]
    if bad:
        what = (f"out_features={out_f}" if len(widths) == 1 else
                f"the fused chunk widths {widths} (each chunk is split over tp on its own)")
        _fail(f"parallelize_module: ColwiseParallel on {where}: {what} not divisible by the "
              f"tensor-parallel size {tp}. Choose sizes that are multiples of {tp}, another "
              "tp size, or leave this module out of the plan.")
    if len(widths) > 1 and style.gather_output:
        _fail(f"parallelize_module: ColwiseParallel(chunks={style.chunks!r}, gather_output=True) "
              f"on {where}: the gathered output of a fused projection would come in rank order "
              "(q0 k0 v0 q1 k1 v1), not the dense order. Keep gather_output=False (the "
              "attention then runs on this rank's heads) or drop chunks.")
    m.widths = widths


def _check_embedding(m: Match, tp: int) -> None:
    cell, where = m.cell, describe_module(m.name, m.cell)
    _check_not_parallel(m)
    if type(cell) not in EMBEDDING_TYPES:
        _fail(f"parallelize_module: VocabParallel on {where}: VocabParallel applies to "
              "mindspore.nn.Embedding or mindspore.mint.nn.Embedding only. Match the embedding "
              "itself, or leave this module out of the plan"
              + (" (use ColwiseParallel/RowwiseParallel for a linear)." if type(cell) in LINEAR_TYPES
                 else "."))
    if type(cell) is mint.nn.Embedding:
        for key, off in (("padding_idx", None), ("max_norm", None), ("scale_grad_by_freq", False)):
            value = getattr(cell, key, off)
            if value not in (off, None):
                _fail(f"parallelize_module: VocabParallel on {where}: {key}={value!r} is not "
                      f"supported by the vocabulary-parallel lookup. Build the embedding without "
                      f"{key}, or leave this module out of the plan.")
    vocab = tuple(embedding_table(cell).shape)[0]
    if vocab % tp:
        padded = -(-vocab // tp) * tp
        _fail(f"parallelize_module: VocabParallel on {where}: the vocabulary {vocab} is not "
              f"divisible by the tensor-parallel size {tp} (each rank holds vocab/{tp} rows). "
              f"Pad the vocabulary to a multiple of {tp} (e.g. {padded}; extra rows are never "
              "looked up), choose another tp size, or leave this module out of the plan.")


def _check_heads(m: Match, tp: int) -> None:
    cell, where = m.cell, describe_module(m.name, m.cell)
    done = getattr(cell, "_msdist_head_parallel", None)
    if done is not None:
        _fail(f"parallelize_module: HeadParallel on {where}: its attributes were already divided "
              f"by tp={done} (parallelize_module ran on this model before). Parallelize a fresh "
              "dense model once.")
    for attr in m.style.attributes:
        value = getattr(cell, attr, None)
        if isinstance(value, bool) or not isinstance(value, int):
            _fail(f"parallelize_module: HeadParallel({attr!r}) on {where}: the module has no integer "
                  f"attribute {attr!r} (got {value!r}). Name the attributes that count heads, e.g. "
                  "HeadParallel('num_heads', 'num_kv_heads').")
        if value % tp:
            _fail(f"parallelize_module: HeadParallel on {where}: {attr}={value} is not divisible by "
                  f"the tensor-parallel size {tp} (each rank runs {attr}/{tp}). Choose a tp size "
                  f"that divides {value}, or leave this module out of the plan.")


def _is_inside(child: str, parent: str) -> bool:
    return parent == "" or child.startswith(parent + ".")


def _check_nesting(matches: list) -> None:
    for outer in matches:
        if not isinstance(outer.style, (SequenceParallel,) + _REPLACING):
            continue
        for inner in matches:
            if inner is outer or not _is_inside(inner.name, outer.name):
                continue
            if isinstance(outer.style, SequenceParallel) and isinstance(inner.style, HeadParallel):
                continue
            _fail(f"parallelize_module: {describe_module(inner.name, inner.cell)} gets "
                  f"{inner.style!r} (pattern {inner.pattern!r}) inside "
                  f"{describe_module(outer.name, outer.cell)}, which gets {outer.style!r} "
                  f"(pattern {outer.pattern!r}): {type(outer.style).__name__} covers every "
                  "parameter below it. Style either the parent or its children, not both.")


def _paths(cell, prefix="") -> dict:
    """``{id(cell): [every path to it]}`` (``cells_and_names`` lists a shared cell once)."""
    out: dict = {}
    for key, child in cell._cells.items():  # noqa: SLF001
        if child is None:
            continue
        path = f"{prefix}.{key}" if prefix else key
        out.setdefault(id(child), []).append(path)
        for ident, paths in _paths(child, path).items():
            out.setdefault(ident, []).extend(paths)
    return out


def _check_shared(matches: list, model) -> None:
    paths = _paths(model)
    for m in matches:
        others = [p for p in paths.get(id(m.cell), []) if p != m.name]
        if isinstance(m.style, _REPLACING) and others:
            _fail(f"parallelize_module: {type(m.style).__name__} on "
                  f"{describe_module(m.name, m.cell)}: the same module object is also "
                  f"{', '.join(repr(o) for o in others)}; replacing it in one place would "
                  "leave the dense module in the other. Build separate modules, or leave it "
                  "out of the plan.")
    owners = {}
    for name, cell in model.cells_and_names():
        for key, param in cell._params.items():  # noqa: SLF001 - the direct owners
            if param is not None:
                owners.setdefault(id(param), []).append(f"{name}.{key}" if name else key)
    for m in matches:
        if not isinstance(m.style, _REPLACING):
            continue
        for key, param in m.cell._params.items():  # noqa: SLF001
            own = f"{m.name}.{key}" if m.name else key
            others = [w for w in owners.get(id(param), []) if w != own]
            if param is not None and others:
                _fail(f"parallelize_module: {type(m.style).__name__} on "
                      f"{describe_module(m.name, m.cell)}: its parameter {key!r} is shared with "
                      f"{', '.join(others)} (tied weights); splitting one owner would leave the "
                      "other with a stale full tensor. Untie them, or leave this module out of "
                      "the plan.")


def resolve_plan(model, plan: dict, tp: int, sequence_parallel: bool) -> list:
    """One :class:`Match` per styled submodule of ``model``, every rule checked.

    Args:
        model: The root Cell.
        plan: ``{fnmatch pattern: style}`` over the names of ``model.cells_and_names()``.
        tp: The tensor-parallel size.
        sequence_parallel: The plan-wide default for styles whose ``sequence_parallel`` is None.

    Raises:
        ParallelizePlanError: a pattern matching nothing, a style on a module type it does
            not support, a size tp does not divide, two styles on one module, nested styles,
            tied parameters, the root replaced.
    """
    _check_plan_object(plan)
    cells = list(model.cells_and_names())
    names = [n for n, _ in cells if n]
    by_name = dict(cells)
    seen: dict = {}
    matches = []
    for pattern, style in plan.items():
        hits = [(n, c) for n, c in cells if fnmatch.fnmatchcase(n, pattern)]
        if not hits:
            _nothing_matched(pattern, names)
        for name, cell in hits:
            if name in seen:
                other = seen[name]
                _fail(f"parallelize_module: {describe_module(name, cell)} is matched by two plan "
                      f"entries: {other.pattern!r} -> {other.style!r} and {pattern!r} -> {style!r}. "
                      "Give each module one style (narrow one of the patterns).")
            parent_name, _, key = name.rpartition(".")
            if not name and isinstance(style, _REPLACING):
                _fail(f"parallelize_module: {type(style).__name__} on the root cell "
                      f"({describe_module('', cell)}): the root cannot be replaced in place. Wrap "
                      "the layer in a parent Cell and parallelize that.")
            sp = style.sequence_parallel if getattr(style, "sequence_parallel", None) is not None \
                else sequence_parallel
            m = Match(name=name, cell=cell, parent=by_name.get(parent_name) if name else None,
                      key=key, style=style, pattern=pattern, sequence_parallel=bool(sp))
            seen[name] = m
            matches.append(m)
    for m in matches:
        if isinstance(m.style, (ColwiseParallel, RowwiseParallel)):
            _check_linear(m, tp)
        elif isinstance(m.style, VocabParallel):
            _check_embedding(m, tp)
        elif isinstance(m.style, HeadParallel):
            _check_heads(m, tp)
    _check_nesting(matches)
    _check_shared(matches, model)
    return matches
