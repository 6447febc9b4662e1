"""Vocabulary-parallel embedding (Megatron's ``VocabParallelEmbedding``).

The ``[V, D]`` table is split by rows over the ``G`` ranks of the tensor-parallel (tp)
group: group rank ``r`` holds rows ``r*V/G .. (r+1)*V/G - 1`` in ``.weight``. Every rank
looks the (full) ids up in its own rows; an id that another rank owns gives a zero row
here, so the sum over the group of the partial lookups is the dense lookup. That sum is
an all-reduce, or with ``sequence_parallel=True`` a reduce-scatter over the sequence
(dim 0), which hands each tp rank its chunk of the sequence for the sequence-parallel
layers that follow.

Example, tp = 2, ``VocabParallelEmbedding(6, 4)``: rank 0 holds rows 0-2 of the table,
rank 1 rows 3-5. For ids ``[[1], [4]]`` (shape ``(S=2, B=1)``) rank 0 looks up
``[row 1, 0]`` and rank 1 ``[0, row 4]``; after the all-reduce both hold
``[row 1, row 4]`` of shape ``(2, 1, 4)``. With ``sequence_parallel=True`` rank 0 gets
``[row 1]`` and rank 1 ``[row 4]``, each ``(1, 1, 4)``.

The lookup is ``ops.gather`` (``mint.nn.functional.embedding`` has no CPU kernel in
MindSpore 2.10, measured); its gradient scatters into this rank's rows only, so each
rank's table gradient is exactly its rows of the dense table's gradient. Runs in
PyNative, under ``ms.jit`` and in GRAPH_MODE.
"""

from __future__ import annotations

import numbers
from typing import Optional

import numpy as np

import mindspore as ms
from mindspore import nn, ops

from .. import mappings
from ..collectives import compiling
from ..sharding import mark_sharding
from .init import initialize_affine_weight
from .linear import GroupLike, _tp_group

__all__ = ["VocabParallelEmbedding", "vocab_range"]


def vocab_range(num_embeddings: int, rank: int, size: int) -> tuple:
    """``(start, end)``: the ids group rank ``rank`` of ``size`` owns (``end`` exclusive).

    ``vocab_range(8, 1, 4) == (2, 4)``.
    """
    per_rank = num_embeddings // size
    return rank * per_rank, (rank + 1) * per_rank


def check_ids(where: str, ids, num_embeddings: int, what: str = "ids") -> None:
    """Raise ValueError if an id is outside ``[0, num_embeddings)`` (eager only: it reads
    the values, so call it before any collective)."""
    values = ids.asnumpy() if hasattr(ids, "asnumpy") else np.asarray(ids)
    if not values.size:
        return
    low, high = int(values.min()), int(values.max())
    if low < 0 or high >= num_embeddings:
        bad = low if low < 0 else high
        raise ValueError(
            f"{where}: {what} must lie in [0, {num_embeddings}) (the full vocabulary), got "
            f"{bad} (min {low}, max {high}, shape {tuple(values.shape)}). Map unknown tokens "
            "to a valid id (e.g. an <unk> row) before the lookup."
        )


class VocabParallelEmbedding(nn.Cell):
    """Embedding table split by rows (the vocabulary) over the tensor-parallel group.

    Under the same ``mindspore.set_seed``, the shards of all tp ranks put back together
    equal the table a dense ``initializer(init_method, (V, D))`` draws (default
    ``"normal"``, sigma 0.01, as ``mindspore.nn.Embedding``), for any tp size.

    Args:
        num_embeddings: Vocabulary size V of the whole table; must be divisible by tp.
        embedding_dim: Embedding size D.
        init_method: Initializer of the full ``[V, D]`` table (an Initializer, its name,
            or a full Tensor). Default ``"normal"``.
        sequence_parallel: Reduce-scatter the output over the sequence (dim 0 of the
            ids): ``(S, ...)`` ids give ``(S/tp, ..., D)``. Otherwise all-reduce: every
            rank gets ``(S, ..., D)``.
        param_init_dtype: Dtype of the table (default float32).
        group: Override the group to shard over (a ParallelGroup or a backend name).
            Default: the manager's tp group, or a size-1 group if not initialized.

    Inputs:
        input_ids: Integer tensor of ids of the full vocabulary, the same on every tp
            rank, any shape (``(S, B)`` with the sequence first under sequence
            parallelism).
        split_sizes: Sequence parallelism only: the output rows of each tp rank for an
            uneven sequence (summing to S), as the mappings take them.

    Outputs:
        ``input_ids.shape + (D,)`` in the table's dtype, or this rank's sequence chunk
        with ``sequence_parallel``.

    Raises:
        ValueError: ``num_embeddings`` not divisible by tp (construction); in PyNative,
            an id outside ``[0, num_embeddings)`` (before any collective; compiled code
            cannot read values, and such an id gives a zero row there).
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, *, init_method=None,
                 sequence_parallel: bool = False, param_init_dtype=None,
                 group: Optional[GroupLike] = None):
        super().__init__()
        cls = type(self).__name__
        for key, value in (("num_embeddings", num_embeddings), ("embedding_dim", embedding_dim)):
            if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value <= 0:
                raise ValueError(f"{cls}: {key}={value!r} must be a positive integer.")
        self.group = _tp_group(group)
        tp = self.group.size
        if num_embeddings % tp:
            padded = -(-num_embeddings // tp) * tp
            raise ValueError(
                f"{cls}: num_embeddings={num_embeddings} is not divisible by the "
                f"tensor-parallel size {tp} (group {list(self.group.ranks)}): each rank holds "
                f"num_embeddings/{tp} rows of the table. Pad the vocabulary to a multiple of "
                f"{tp} (e.g. num_embeddings={padded}; the extra rows are never looked up), "
                "or choose another tp size."
            )
        self.num_embeddings = int(num_embeddings)
        self.embedding_dim = int(embedding_dim)
        self.sequence_parallel = bool(sequence_parallel)
        self.tp_size, self.tp_rank = tp, self.group.rank
        self.vocab_start, self.vocab_end = vocab_range(self.num_embeddings, self.tp_rank, tp)
        self.num_embeddings_per_partition = self.vocab_end - self.vocab_start
        dtype = ms.float32 if param_init_dtype is None else param_init_dtype
        self.weight = initialize_affine_weight(
            (self.num_embeddings, self.embedding_dim), tp, 0,
            "normal" if init_method is None else init_method, dtype,
            tp_rank=self.tp_rank, name="weight")
        # Split over tp whatever its size (as Column/Row mark theirs): a tp = 1 checkpoint then
        # records the split dim, and `msdist checkpoint reshard` can cut it for a larger tp.
        mark_sharding(self.weight, "tp", 0)
        # The CPU Gather kernel has no bfloat16 (measured): look such a table up in float32.
        self._gather_f32 = (ms.get_context("device_target") == "CPU"
                            and dtype in (ms.bfloat16,))

    def _check_call(self, ids, split_sizes) -> None:
        cls = type(self).__name__
        if ids.dtype not in (ms.int32, ms.int64, ms.int16, ms.int8, ms.uint8):
            raise ValueError(f"{cls}: input_ids must be an integer tensor, got dtype {ids.dtype}.")
        if self.sequence_parallel and len(ids.shape) < 1:
            raise ValueError(
                f"{cls}: sequence_parallel=True expected ids of shape (S, ...) with the "
                f"sequence first, got shape {tuple(ids.shape)}.")
        if split_sizes is not None and not self.sequence_parallel:
            raise ValueError(f"{cls}: split_sizes={split_sizes!r} needs sequence_parallel=True.")

    def _lookup(self, ids):
        """This rank's partial lookup: its rows, zeros for the ids other ranks own."""
        weight = self.weight
        if self._gather_f32:
            weight = ops.cast(weight, ms.float32)
        if self.tp_size == 1:
            out = ops.gather(weight, ids, 0)
        else:
            outside = ops.logical_or(ids < self.vocab_start, ids >= self.vocab_end)
            keep = ops.logical_not(outside)
            local = (ids - self.vocab_start) * keep.astype(ids.dtype)
            out = ops.gather(weight, local, 0)
            out = out * ops.expand_dims(keep.astype(out.dtype), -1)
        if self._gather_f32:
            out = ops.cast(out, self.weight.dtype)
        return out

    def construct(self, input_ids, split_sizes=None):
        self._check_call(input_ids, split_sizes)
        if not compiling():
            check_ids(type(self).__name__, input_ids, self.num_embeddings)
        out = self._lookup(input_ids)
        if self.tp_size == 1:
            if split_sizes is not None:
                mappings.reduce_scatter_to_sequence(out, self.group, split_sizes=split_sizes)
            return out
        if self.sequence_parallel:
            return mappings.reduce_scatter_to_sequence(out, self.group, split_sizes=split_sizes)
        return mappings.reduce_from_all(out, self.group)

    def extend_repr(self):
        return (f"num_embeddings={self.num_embeddings} (rows {self.vocab_start}-"
                f"{self.vocab_end - 1} here), embedding_dim={self.embedding_dim}, "
                f"sequence_parallel={self.sequence_parallel}, tp={self.tp_size}")
