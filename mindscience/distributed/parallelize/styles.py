"""The parallel styles of a :func:`~mindscience.distributed.parallelize.parallelize_module`
plan, and the row arithmetic they imply (pure Python: no MindSpore import).

A style says how ONE submodule of a dense model runs over the tensor-parallel (tp)
group:

======================  ==================================  =============================
style                   applies to                          becomes
======================  ==================================  =============================
``ColwiseParallel``     ``nn.Dense``, ``mint.nn.Linear``    ``ColumnParallelLinear``: the
                                                            output features split
``RowwiseParallel``     ``nn.Dense``, ``mint.nn.Linear``    ``RowParallelLinear``: the
                                                            input features split
``VocabParallel``       ``nn.Embedding``,                   ``VocabParallelEmbedding``:
                        ``mint.nn.Embedding``               the vocabulary rows split
``SequenceParallel``    any Cell that works token by token  unchanged; under sequence
                        (a norm)                            parallelism it runs on this
                                                            rank's rows and its
                                                            parameters are marked
                                                            ``sequence_parallel``
``HeadParallel``        a Cell with integer head counts     unchanged but for those
                        (an attention)                      attributes, divided by tp
======================  ==================================  =============================

Each style is a small frozen dataclass; a plan is ``{fnmatch pattern: style}``.
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass, field
from typing import Optional, Tuple, Union

__all__ = ["ColwiseParallel", "RowwiseParallel", "VocabParallel", "SequenceParallel",
           "HeadParallel", "ParallelStyle", "ParallelizePlanError", "chunk_widths",
           "column_rows", "column_order"]


class ParallelizePlanError(ValueError):
    """A plan that cannot be applied: raised before the model is changed at all."""


def _check_flag(style: str, key: str, value, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if not isinstance(value, bool):
        expected = "True, False or None (inherit)" if allow_none else "True or False"
        raise ParallelizePlanError(f"{style}: {key}={value!r} is invalid: expected {expected}.")


def _is_int(value) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


class ParallelStyle:
    """Base of the styles (lets a plan check its values with one ``isinstance``)."""


@dataclass(frozen=True)
class ColwiseParallel(ParallelStyle):
    """Split a linear layer's OUTPUT features (the rows of its ``[out, in]`` weight).

    Args:
        gather_output: All-gather the output's last dim so every rank gets the full
            output (e.g. an output head before a plain loss). False keeps this rank's
            ``out/tp`` features, to feed a ``RowwiseParallel`` layer.
        sequence_parallel: The input is this rank's rows of the sequence (dim 0),
            all-gathered before the matmul. None inherits ``parallelize_module``'s
            ``sequence_parallel``.
        chunks: A fused projection: an int ``n`` (``n`` equal chunks, e.g. 3 for
            ``q|k|v``) or the chunk widths (e.g. ``(h, kv, kv)`` for grouped-query
            attention). Each chunk is split over tp on its own, so that every rank holds
            whole heads of each: at tp = 2 a ``[q; k; v]`` weight gives rank 0
            ``[q0; k0; v0]`` and rank 1 ``[q1; k1; v1]``. None: one contiguous split.
    """

    gather_output: bool = False
    sequence_parallel: Optional[bool] = None
    chunks: Union[None, int, Tuple[int, ...]] = field(default=None)

    def __post_init__(self):
        _check_flag("ColwiseParallel", "gather_output", self.gather_output)
        _check_flag("ColwiseParallel", "sequence_parallel", self.sequence_parallel, True)
        chunks = self.chunks
        if chunks is None:
            return
        if _is_int(chunks):
            if chunks < 1:
                raise ParallelizePlanError(
                    f"ColwiseParallel: chunks={chunks!r} is invalid: expected a positive number "
                    "of equal chunks (3 for a fused q|k|v), or their widths.")
            return
        if (isinstance(chunks, (tuple, list)) and chunks
                and all(_is_int(c) and c > 0 for c in chunks)):
            object.__setattr__(self, "chunks", tuple(int(c) for c in chunks))
            return
        raise ParallelizePlanError(
            f"ColwiseParallel: chunks={chunks!r} is invalid: expected None, a positive int "
            "(equal chunks) or a tuple of positive chunk widths, e.g. (h, kv, kv).")


@dataclass(frozen=True)
class RowwiseParallel(ParallelStyle):
    """Split a linear layer's INPUT features (the columns of its ``[out, in]`` weight).

    The partial products are summed over tp (all-reduce), or summed and split along the
    sequence (reduce-scatter) under sequence parallelism. The bias stays whole.

    Args:
        input_is_parallel: The input is already this rank's slice of the last dim (the
            output of a ``ColwiseParallel(gather_output=False)`` layer). False: the full
            input is split here.
        sequence_parallel: Reduce-scatter the output along dim 0 instead of all-reducing
            it. None inherits ``parallelize_module``'s ``sequence_parallel``.
    """

    input_is_parallel: bool = True
    sequence_parallel: Optional[bool] = None

    def __post_init__(self):
        _check_flag("RowwiseParallel", "input_is_parallel", self.input_is_parallel)
        _check_flag("RowwiseParallel", "sequence_parallel", self.sequence_parallel, True)


@dataclass(frozen=True)
class VocabParallel(ParallelStyle):
    """Split an embedding table by rows (the vocabulary); the partial lookups are summed
    over tp (all-reduce, or reduce-scatter along dim 0 of the ids under sequence
    parallelism).

    Args:
        sequence_parallel: None inherits ``parallelize_module``'s ``sequence_parallel``.
    """

    sequence_parallel: Optional[bool] = None

    def __post_init__(self):
        _check_flag("VocabParallel", "sequence_parallel", self.sequence_parallel, True)


@dataclass(frozen=True)
class SequenceParallel(ParallelStyle):
    """A module that works token by token (a LayerNorm, an RMSNorm): under sequence
    parallelism it runs unchanged on this rank's rows of the sequence, and its parameters
    are marked ``sequence_parallel`` so that ``GradientFinalizer`` (or the distributed
    optimizer) sums their gradients over tp. Without sequence parallelism it sees the
    whole sequence on every rank and nothing is marked (its gradients are already whole),
    so one plan serves both settings.

    Args:
        sequence_parallel: None inherits ``parallelize_module``'s ``sequence_parallel``.
    """

    sequence_parallel: Optional[bool] = None

    def __post_init__(self):
        _check_flag("SequenceParallel", "sequence_parallel", self.sequence_parallel, True)


@dataclass(frozen=True)
class HeadParallel(ParallelStyle):
    """An attention module whose projections are split over tp: divide its integer
    head-count attributes by tp, so that ``construct`` reshapes this rank's
    ``heads/tp`` heads.

    ``HeadParallel("num_heads")`` on a module with ``self.num_heads = 8`` sets it to 4 at
    tp = 2. Only attributes that ``construct`` reads take effect (a shape computed in
    ``__init__`` from them is not recomputed); list every attribute that counts heads or
    features of the split projections (e.g. ``"num_heads", "num_kv_heads"``, or a
    ``"hidden_size"`` used in a reshape).

    Args:
        *attributes: Names of integer attributes of the module. Default ``("num_heads",)``.
    """

    attributes: Tuple[str, ...] = ("num_heads",)

    def __init__(self, *attributes: str):
        attributes = tuple(attributes) or ("num_heads",)
        for name in attributes:
            if not isinstance(name, str) or not name.isidentifier():
                raise ParallelizePlanError(
                    f"HeadParallel: attribute {name!r} is invalid: expected the name of an "
                    "integer attribute of the module, e.g. HeadParallel('num_heads').")
        if len(set(attributes)) != len(attributes):
            raise ParallelizePlanError(
                f"HeadParallel: attributes {attributes} name one attribute twice; it would be "
                "divided twice. List each once.")
        object.__setattr__(self, "attributes", attributes)

    def __repr__(self):
        return f"HeadParallel({', '.join(repr(a) for a in self.attributes)})"


# ----------------------------------------------------------------------------- row arithmetic
def chunk_widths(chunks, out_features: int) -> Tuple[int, ...]:
    """The widths of the fused chunks of a ``[out_features, in]`` weight.

    ``chunk_widths(None, 12) == (12,)``, ``chunk_widths(3, 12) == (4, 4, 4)``,
    ``chunk_widths((8, 2, 2), 12) == (8, 2, 2)``.

    Raises:
        ValueError: ``n`` not dividing ``out_features``, or widths not summing to it.
    """
    if chunks is None:
        return (out_features,)
    if _is_int(chunks):
        if out_features % chunks:
            raise ValueError(f"chunks={chunks} does not divide out_features={out_features} "
                             "into equal chunks")
        return (out_features // chunks,) * chunks
    widths = tuple(int(c) for c in chunks)
    if sum(widths) != out_features:
        raise ValueError(f"chunk widths {widths} sum to {sum(widths)}, not out_features="
                         f"{out_features}")
    return widths


def column_rows(widths, size: int, rank: int) -> list:
    """The ``(start, stop)`` rows of the full weight that tp ``rank`` of ``size`` holds, in
    local order: this rank's ``1/size`` of every chunk.

    Example, a GQA ``q|k|v`` of widths ``(8, 4, 4)`` at tp = 2, rank 1:
    ``[(4, 8), (10, 12), (14, 16)]`` (q rows 4-7, k rows 2-3, v rows 2-3 of their chunks).
    """
    rows, offset = [], 0
    for width in widths:
        per = width // size
        rows.append((offset + rank * per, offset + (rank + 1) * per))
        offset += width
    return rows


def column_order(widths, size: int) -> list:
    """A permutation of the rows such that tp rank ``r`` holds the ``r``-th contiguous
    ``1/size`` of the permuted weight: the concatenation over ranks of
    :func:`column_rows`. One chunk gives the identity.

    Example, ``q|k|v`` of 2 rows each at tp = 2: rank 0 holds rows 0, 2, 4 (``q0 k0 v0``)
    and rank 1 rows 1, 3, 5, so ``column_order((2, 2, 2), 2) == [0, 2, 4, 1, 3, 5]``.
    """
    order = []
    for rank in range(size):
        for start, stop in column_rows(widths, size, rank):
            order.extend(range(start, stop))
    return order
