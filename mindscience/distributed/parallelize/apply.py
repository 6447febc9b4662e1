"""Apply a validated plan: build the parallel layers from the dense weights and swap them in.

Each replaced module becomes the library's layer over the tp group, holding this rank's
slice of the dense module's own weights (nothing is re-drawn: a pretrained model keeps
its values), with the dense parameter names, so ``model.parameters_and_names()``,
checkpoints and optimizers built by name see the same names as before.
"""

from __future__ import annotations

import warnings

import numpy as np

import mindspore as ms
from mindspore import Tensor, nn

from ..modules.embedding import VocabParallelEmbedding
from ..modules.linear import ColumnParallelLinear, RowParallelLinear, _tp_group
from ..sharding import mark_sharding
from .plan import Match, embedding_table, resolve_plan
from .styles import (ColwiseParallel, HeadParallel, ParallelizePlanError, RowwiseParallel,
                     SequenceParallel, VocabParallel, column_order)

__all__ = ["parallelize_module"]


def parallelize_module(model, plan: dict, sequence_parallel: bool = False, *, tp_group=None):
    """Split the submodules of a dense model over the tensor-parallel group, in place.

    ``plan`` maps fnmatch patterns over the names of ``model.cells_and_names()`` to
    styles. Matched ``nn.Dense`` / ``mint.nn.Linear`` layers become
    ``ColumnParallelLinear`` / ``RowParallelLinear``, matched ``nn.Embedding`` /
    ``mint.nn.Embedding`` a ``VocabParallelEmbedding``, each holding this rank's slice of
    the dense weights and marked for checkpoints (:mod:`..sharding`); norms under
    ``SequenceParallel`` get their parameters marked ``sequence_parallel``; attention
    modules under ``HeadParallel`` get their head counts divided by tp. Parameter names
    as seen from ``model`` do not change.

    Example, tp = 2 (ranks 0 and 1), an MLP block ``fc1: Dense(16, 64)``,
    ``fc2: Dense(64, 16)``::

        parallelize_module(model, {"embed": VocabParallel(),
                                   "layers.*.fc1": ColwiseParallel(),
                                   "layers.*.fc2": RowwiseParallel(),
                                   "layers.*.norm": SequenceParallel()})
        # rank 0: layers.0.fc1.weight = dense rows 0-31, layers.0.fc2.weight = columns 0-31
        # rank 1: rows 32-63 and columns 32-63; the fc2 biases are whole on both.

    The whole plan is validated before anything changes: on error the model is untouched.

    Args:
        model: The root Cell of the dense model.
        plan: ``{pattern: style}`` (see :mod:`.styles`).
        sequence_parallel: Run the matched layers with sequence-parallel communication
            (activations between them hold ``S/tp`` rows of dim 0 on each rank); a style's
            own ``sequence_parallel`` overrides it.
        tp_group: The group to split over (a ParallelGroup or a backend name). Default:
            the manager's tensor-parallel group, or a size-1 group when parallel groups are
            not initialized (the model then stays numerically dense).

    Returns:
        ``model``.

    Raises:
        ParallelizePlanError: (a ``ValueError``) for any bad plan; see
            :func:`.plan.resolve_plan`.
    """
    if not isinstance(model, nn.Cell):
        raise ParallelizePlanError(f"parallelize_module: model={type(model).__name__} is not a "
                                   "mindspore.nn.Cell. Pass the root Cell of the model.")
    if not isinstance(sequence_parallel, bool):
        raise ParallelizePlanError(f"parallelize_module: sequence_parallel={sequence_parallel!r} "
                                   "is invalid: expected True or False.")
    group = _tp_group(tp_group)
    matches = resolve_plan(model, plan, group.size, sequence_parallel)
    # Build every replacement before swapping any in: the swap itself cannot fail.
    replacements = [(m, _build(m, group)) for m in matches]
    for m in matches:
        if len(m.widths) > 1 and len(set(m.widths)) > 1:
            warnings.warn(
                f"parallelize_module: {m.name!r} is a fused projection of unequal chunks "
                f"{m.widths}; the sharding marks (partition_stride) describe equal chunks only, "
                "so its checkpoints resume at the same tensor-parallel size but are not "
                "resharded (nor loaded into the dense model) correctly. Use equal chunks, or "
                "separate q and kv layers, for layout-portable checkpoints.",
                UserWarning, stacklevel=2)
    for m, new in replacements:
        if new is not None:
            _replace_child(m.parent, m.key, new)
        elif isinstance(m.style, SequenceParallel):
            if m.sequence_parallel:
                for param in m.cell.get_parameters():
                    param.sequence_parallel = True
        elif isinstance(m.style, HeadParallel):
            for attr in m.style.attributes:
                setattr(m.cell, attr, getattr(m.cell, attr) // group.size)
            m.cell._msdist_head_parallel = group.size  # noqa: SLF001 - refuse a second pass
    return model


def _replace_child(parent, key: str, new) -> None:
    """Put ``new`` in ``parent``'s child slot ``key`` without renaming any parameter
    (``CellList.__setitem__`` would prefix the names again)."""
    parent.insert_child_to_cell(key, new)
    if isinstance(parent, nn.SequentialCell):
        # SequentialCell runs the list it cached from its children when they were set.
        parent.cell_list = list(parent._cells.values())  # noqa: SLF001


# ----------------------------------------------------------------------------- building
def _full(param) -> np.ndarray:
    """The parameter's values as numpy (bfloat16 has no numpy dtype: go through float32)."""
    if param.dtype == ms.bfloat16:
        return param.float().asnumpy()
    return param.asnumpy()


def _tensor(array: np.ndarray, like) -> Tensor:
    return Tensor(np.ascontiguousarray(array), dtype=like.dtype)


def _adopt(new_param, old_param) -> None:
    """Give the new shard the dense parameter's identity as the model sees it."""
    new_param.name = old_param.name
    new_param.requires_grad = old_param.requires_grad


def _build(m: Match, group):
    """The replacement Cell for ``m`` (None for the styles that change the module in place)."""
    if isinstance(m.style, (ColwiseParallel, RowwiseParallel)):
        return _build_linear(m, group)
    if isinstance(m.style, VocabParallel):
        return _build_embedding(m, group)
    return None


def _build_linear(m: Match, group):
    cell, style = m.cell, m.style
    out_f, in_f = tuple(cell.weight.shape)
    bias = getattr(cell, "bias", None)
    if bias is not None and type(cell) is nn.Dense and not cell.has_bias:
        bias = None
    activation = cell.activation if type(cell) is nn.Dense and cell.activation_flag else None
    weight = _full(cell.weight)
    bias_values = None if bias is None else _full(bias)
    common = dict(bias=bias is not None, use_sequence_parallel=m.sequence_parallel,
                  param_init_dtype=cell.weight.dtype, compute_dtype=None, group=group)
    if isinstance(style, ColwiseParallel):
        # Rows permuted so that each rank's contiguous 1/tp is its share of every chunk.
        order = column_order(m.widths, group.size)
        common.update(weight_init=_tensor(weight[order], cell.weight),
                      bias_init=None if bias is None else _tensor(bias_values[order], bias))
        cls = ColumnParallelLinear if activation is None else _ColumnWithActivation
        new = cls(in_f, out_f, gather_output=style.gather_output, **common)
        if len(m.widths) > 1:
            _mark_chunks(m, new)
    else:
        common.update(weight_init=_tensor(weight, cell.weight),
                      bias_init=None if bias is None else _tensor(bias_values, bias))
        cls = RowParallelLinear if activation is None else _RowWithActivation
        new = cls(in_f, out_f, input_is_parallel=style.input_is_parallel, **common)
    if activation is not None:
        new.activation = activation
    _adopt(new.weight, cell.weight)
    if bias is not None:
        _adopt(new.bias, bias)
    new.set_train(cell.training)
    return new


def _mark_chunks(m: Match, layer) -> None:
    """Sharding marks of a fused projection: each rank holds its 1/tp of every chunk."""
    widths = m.widths
    params = [layer.weight] + ([layer.bias] if layer.bias is not None else [])
    if len(set(widths)) == 1:
        # Equal chunks are the interleaved split the checkpoints know (partition_stride).
        for param in params:
            mark_sharding(param, axis="tp", partition_dim=0, partition_stride=len(widths))
        return
    # Unequal chunks (grouped-query q|k|v): no partition_stride describes them; the widths
    # are recorded for readers that know (and parallelize_module warns).
    for param in params:
        param.partition_chunks = widths


def _build_embedding(m: Match, group):
    cell = m.cell
    table = embedding_table(cell)
    vocab, dim = tuple(table.shape)
    cls = _DenseNamedEmbedding if type(cell) is nn.Embedding else VocabParallelEmbedding
    new = cls(vocab, dim, init_method=_tensor(_full(table), table),
              sequence_parallel=m.sequence_parallel, param_init_dtype=table.dtype, group=group)
    _adopt(new.embedding_table if cls is _DenseNamedEmbedding else new.weight, table)
    new.set_train(cell.training)
    return new


# ----------------------------------------------------------------------------- adapters
class _ColumnWithActivation(ColumnParallelLinear):
    """A ColumnParallelLinear that applies an ``nn.Dense``'s activation (elementwise, so
    running it on this rank's output features is the dense activation's slice)."""

    def construct(self, x, split_sizes=None):
        return self.activation(super().construct(x, split_sizes))


class _RowWithActivation(RowParallelLinear):
    """A RowParallelLinear that applies an ``nn.Dense``'s activation after the reduction
    and the bias, where the dense layer applies it."""

    def construct(self, x, split_sizes=None):
        return self.activation(super().construct(x, split_sizes))


class _DenseNamedEmbedding(VocabParallelEmbedding):
    """A VocabParallelEmbedding whose table is called ``embedding_table``, as in
    ``mindspore.nn.Embedding``, so the parameter path (``embed.embedding_table``) is kept."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        table = self._params.pop("weight")
        self.embedding_table = table

    def _lookup(self, ids):
        # VocabParallelEmbedding._lookup on ``embedding_table`` (its table attribute).
        weight = self.embedding_table
        if self._gather_f32:
            weight = weight.astype(ms.float32)
        if self.tp_size == 1:
            out = ms.ops.gather(weight, ids, 0)
        else:
            outside = ms.ops.logical_or(ids < self.vocab_start, ids >= self.vocab_end)
            keep = ms.ops.logical_not(outside)
            local = (ids - self.vocab_start) * keep.astype(ids.dtype)
            out = ms.ops.gather(weight, local, 0)
            out = out * ms.ops.expand_dims(keep.astype(out.dtype), -1)
        if self._gather_f32:
            out = out.astype(self.embedding_table.dtype)
        return out
