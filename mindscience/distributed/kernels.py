"""Collective kernels as ``nn.Cell`` objects: one object per (group, backend, mode).

The mappings' forward and backward (``construct`` / ``bprop``) call the methods of a
kernel cell. Being a Cell is what lets the same code run in PyNative, under
``mindspore.jit`` and in GRAPH_MODE: a Cell's methods compile, a plain Python object's
would not. Every method takes and returns tensors; group size, group rank and split
sizes are Python ints fixed at construction or passed as constant tuples, so that
compiled code sees them as constants.

Three variants, chosen by :func:`mindscience.distributed.collectives.kernels`:

================  ===============================  ======================================
variant           all-reduce / all-gather           used for
================  ===============================  ======================================
``EagerComposed`` ``mint.distributed`` (in place,   CPU, PyNative (fast: a real gather)
                  list gather)
``GraphComposed`` ``ops.AllReduce(SUM)`` only; the  CPU, compiled code (``mint.distributed``
                  gather is an all-reduce of a      has no graph kernel on CPU, and
                  zero-padded buffer                ``ops.AllGather`` works on the world
                                                    group only)
``Native``        ``ops.AllReduce`` /               Ascend/GPU, every mode
                  ``ops.AllGather`` /
                  ``ops.ReduceScatter`` /
                  ``ops.AlltoAll``
================  ===============================  ======================================

Uneven (``*_v``) collectives are written once, on top of the even ones: pad every
shard to the largest, run the even collective, trim. MindSpore 2.10 also has
``ops.AllGatherV``, ``ops.ReduceScatterV`` and ``ops.AlltoAllV``; the CPU build has no
kernel for any of them (measured) and they are not used, so that Ascend/GPU run the
same padded code whose numbers the CPU tests check.

Example, 2 ranks, group rank r, ``split_sizes=(3, 2)``: ``all_gather_v`` pads rank 1's
``(2, H)`` shard to ``(3, H)``, gathers ``(6, H)`` and keeps rows 0-2 and 3-4: ``(5, H)``.
"""

from __future__ import annotations

import numpy as np
from mindspore import Tensor, mint, nn, ops
from mindspore import dtype as mstype
from mindspore.mint import distributed as md

from . import counters

__all__ = ["EagerComposed", "GraphComposed", "Native"]


# Plain Python helpers of the methods below live ON the kernel cell, not at module
# level: a module function called from both a construct and a bprop made the PyNative
# gradient of an ms.jit-compiled construct fail ("func_graph->get_return() is null",
# measured with narrow() shared by gather_from_hidden's forward and backward).


class _Kernels(nn.Cell):
    """Even collectives from two primitives (``_ar``, ``_gather_parts``); uneven on top."""

    # True where reduce_scatter is composed as all-reduce + own slice (a class constant,
    # so compiled code folds the branch on it).
    reduce_scatter_is_all_reduce = True

    def __init__(self, group_name: str, size: int, rank: int):
        super().__init__()
        self.group_name = group_name
        self.size = size
        self.rank = rank
        self.strided_slice = ops.StridedSlice()

    # ---------------------------------------------------------------- helpers
    def offsets(self, sizes) -> tuple:
        """Start of each shard: ``(3, 2, 2) -> (0, 3, 5)``."""
        out = []
        total = 0
        for s in sizes:
            out.append(total)
            total += s
        return tuple(out)

    def largest(self, sizes) -> int:
        """The largest shard (compiled code has no ``max`` over a tuple)."""
        m = sizes[0]
        for s in sizes:
            if s > m:
                m = s
        return m

    def is_even(self, sizes) -> bool:
        """True when every shard has the same size (the even collectives apply)."""
        for s in sizes:
            if s != sizes[0]:
                return False
        return True

    def _slice(self, x, dim, start, length):
        """``length`` entries of ``x`` from ``start`` along ``dim`` (a non-negative dim).

        A StridedSlice primitive rather than ``ops.narrow``, whose argument validators
        do not compile inside nested cells in GRAPH_MODE (measured).
        """
        begin = []
        end = []
        strides = []
        for i in range(len(x.shape)):
            if i == dim:
                begin.append(start)
                end.append(start + length)
            else:
                begin.append(0)
                end.append(x.shape[i])
            strides.append(1)
        return self.strided_slice(x, tuple(begin), tuple(end), tuple(strides))

    def _narrow(self, x, dim, start, length):
        return self._slice(x, dim, start, length)

    def _chunk(self, x, dim, index, parts):
        dim = dim % len(x.shape)
        n = x.shape[dim] // parts
        return self._narrow(x, dim, index * n, n)

    def _rows(self, x, start, length):
        """Rows ``start:start+length`` of dim 0 (possibly none)."""
        if start == 0 and length == x.shape[0]:
            return x
        if length == 0:
            # An empty shard: a zero-row tensor, not a zero-length slice (whose CPU graph
            # kernel gave wrong neighbouring values in bfloat16, measured). It must still
            # depend on x: when x comes out of a collective, a compiled graph would
            # otherwise drop that collective on this rank only, and the other ranks would
            # wait for it forever (measured: ring all-reduce timeout in jit, [3, 0, 2, 1]).
            return ops.depend(ops.zeros((0,) + tuple(x.shape[1:]), x.dtype), x)
        return self._narrow(x, 0, start, length)

    def _pad_rows(self, x, rows):
        """``x`` padded with zero rows along dim 0 to ``rows`` rows."""
        have = x.shape[0]
        if have == rows:
            return x
        pad = ops.zeros((rows - have,) + tuple(x.shape[1:]), x.dtype)
        if have == 0:
            # All padding, yet still after x (see _rows): the collective this feeds must
            # run in the same order on every rank.
            return ops.depend(pad, x)
        return ops.cat((x, pad), 0)

    # ---------------------------------------------------------------- even ops
    def all_reduce(self, x):
        return self._ar(x)

    def all_gather(self, x, dim):
        return ops.cat(self._gather_parts(x), dim % len(x.shape))

    def reduce_scatter(self, x):
        return self._chunk(self._ar(x), 0, self.rank, self.size)

    def all_to_all(self, x, split_dim, concat_dim):
        # Rank r keeps chunk r (along split_dim) of every rank's x, in group-rank order.
        # Slicing each piece before the concatenation copies |x|, not G*|x|.
        parts = self._gather_parts(x)
        pieces = []
        for p in parts:
            pieces.append(self._chunk(p, split_dim, self.rank, self.size))
        return ops.cat(pieces, concat_dim % len(x.shape))

    def own_slice(self, x, dim):
        return self._chunk(x, dim, self.rank, self.size)

    # ---------------------------------------------------------------- uneven ops
    # Each takes the sizes as a constant tuple and falls back to the even collective
    # when all shards are equal (a branch on constants: folded when compiled).
    def own_rows(self, x, sizes):
        """This rank's ``sizes[rank]`` rows of dim 0 (no communication)."""
        if self.is_even(sizes):
            return self.own_slice(x, 0)
        return self._rows(x, self.offsets(sizes)[self.rank], sizes[self.rank])

    def all_gather_v(self, x, sizes):
        """``(sizes[r], ...)`` on rank r -> ``(sum(sizes), ...)`` on every rank."""
        if self.is_even(sizes):
            return self.all_gather(x, 0)
        m = self.largest(sizes)
        return self._keep_parts(self._gather_parts(self._pad_rows(x, m)), sizes)

    def reduce_scatter_v(self, x, sizes):
        """``(sum(sizes), ...)`` partial sums -> rows of this rank's shard of the sum."""
        if self.is_even(sizes):
            return self.reduce_scatter(x)
        if self.reduce_scatter_is_all_reduce:
            # The composed reduce-scatter is an all-reduce + own rows anyway: reduce the
            # unpadded buffer and keep this rank's rows (no padding copies).
            return self._rows(self._ar(x), self.offsets(sizes)[self.rank], sizes[self.rank])
        m = self.largest(sizes)
        return self._rows(self.reduce_scatter(self._pad_chunks(x, sizes, m)), 0, sizes[self.rank])

    def sequence_to_hidden_v(self, x, sizes):
        """``(sizes[r], ..., H) -> (sum(sizes), ..., H/G)``."""
        if self.is_even(sizes):
            return self.all_to_all(x, -1, 0)
        m = self.largest(sizes)
        y = self.all_to_all(self._pad_rows(x, m), -1, 0)  # (G*m, ..., H/G)
        return self._keep_rows(y, sizes, m)

    def hidden_to_sequence_v(self, x, sizes):
        """``(sum(sizes), ..., H/G) -> (sizes[r], ..., H)``."""
        if self.is_even(sizes):
            return self.all_to_all(x, 0, -1)
        m = self.largest(sizes)
        y = self.all_to_all(self._pad_chunks(x, sizes, m), 0, -1)  # (m, ..., H)
        return self._rows(y, 0, sizes[self.rank])

    def all_to_all_v(self, x, send, recv, m):
        """Uneven all-to-all of dim 0: ``send[j]`` rows of ``x`` (in order) go to group rank
        j; returns the ``recv[i]`` rows from each rank i, concatenated in group-rank order.
        ``m`` is the largest entry of the whole size matrix (every rank pads each chunk to
        it, so the even all-to-all underneath lines up)."""
        y = self.all_to_all(self._pad_chunks(x, send, m), 0, 0)  # (G*m, ...)
        total = 0
        for r in recv:
            total = total + r
        if total == 0:
            return ops.depend(ops.zeros((0,) + tuple(x.shape[1:]), x.dtype), y)
        return self._keep_rows(y, recv, m)

    def _keep_parts(self, parts, sizes):
        """The first ``sizes[i]`` rows of each ``parts[i]``, concatenated along dim 0."""
        kept = []
        for i in range(self.size):
            if sizes[i] > 0:
                kept.append(self._rows(parts[i], 0, sizes[i]))
        return ops.cat(kept, 0)

    def _keep_rows(self, y, sizes, m):
        """Rows ``i*m : i*m + sizes[i]`` of ``y`` for every rank i, concatenated: the
        shards out of G shards padded to ``m`` rows each."""
        kept = []
        for i in range(self.size):
            if sizes[i] > 0:
                kept.append(self._rows(y, i * m, sizes[i]))
        return ops.cat(kept, 0)

    def _pad_chunks(self, x, sizes, m):
        """Dim 0 cut into shards of ``sizes``, each zero-padded to ``m`` rows: ``(G*m, ...)``."""
        starts = self.offsets(sizes)
        chunks = []
        for i in range(self.size):
            chunks.append(self._pad_rows(self._rows(x, starts[i], sizes[i]), m))
        return ops.cat(chunks, 0)


class EagerComposed(_Kernels):
    """CPU, PyNative: ``mint.distributed`` all-reduce and list all-gather.

    Uneven shards are trimmed by a ``cat`` of the padded pieces and one row ``Gather``
    with a cached index, not by a slice per piece and a ``cat``. Measured on 4 ranks on
    2 cores, 16 MiB gathered from (257, 4096) float32 pieces: 331-340 ms against
    410-433 ms for the slices, 301-308 ms for the even gather (docs/BENCHMARKS.md).
    """

    # The CPU Gather kernel has no bfloat16; the rows move as int16 bits (exact).
    _GATHER_AS = {mstype.bfloat16: mstype.int16}
    _ROW_INDEX_CACHE = 64

    def __init__(self, group_name: str, size: int, rank: int):
        super().__init__(group_name, size, rank)
        self._row_index = {}

    def _keep_parts(self, parts, sizes):
        return self._keep_rows(ops.cat(parts, 0), sizes, parts[0].shape[0])

    def _keep_rows(self, y, sizes, m):
        key = (tuple(sizes), m)
        index = self._row_index.get(key)
        if index is None:
            # Bounded: a model whose sequence length changes every step would otherwise
            # keep one index per length seen.
            if len(self._row_index) >= self._ROW_INDEX_CACHE:
                self._row_index.pop(next(iter(self._row_index)))
            index = Tensor(np.concatenate(
                [np.arange(i * m, i * m + sizes[i], dtype=np.int32) for i in range(self.size)]))
            self._row_index[key] = index
        as_dtype = self._GATHER_AS.get(y.dtype)
        if as_dtype is None:
            return ops.gather(y, index, 0)
        return ops.gather(y.contiguous().view(as_dtype), index, 0).view(y.dtype)

    def _ar(self, x):
        # mint all_reduce works in place: reduce a private buffer. Tensor.copy() runs
        # three kernels on CPU (cast, divide, cast back): 5-80x slower than one copy_.
        y = mint.empty(x.shape, dtype=x.dtype).copy_(x.contiguous())
        counters.count()
        md.all_reduce(y, "sum", self.group_name)
        return y

    def _gather_parts(self, x):
        # Uninitialised buffers: the gather overwrites them, and zero-filling G copies
        # cost ~20 % of a 16 MiB gather on CPU (bench/bench_mappings.py, section c).
        parts = [mint.empty(x.shape, dtype=x.dtype) for _ in range(self.size)]
        counters.count()
        md.all_gather(parts, x.contiguous(), self.group_name)
        return parts


class GraphComposed(_Kernels):
    """CPU, compiled: everything from ``ops.AllReduce(SUM)``, the one collective that
    compiles on CPU subgroups (float32/float16; bfloat16 is summed in float32)."""

    def __init__(self, group_name: str, size: int, rank: int):
        super().__init__(group_name, size, rank)
        self.allreduce = ops.AllReduce(ops.ReduceOp.SUM, group_name)

    def _ar(self, x):
        if x.dtype == mstype.bfloat16:
            return ops.cast(self.allreduce(ops.cast(x, mstype.float32)), mstype.bfloat16)
        return self.allreduce(x)

    def _narrow(self, x, dim, start, length):
        # The CPU graph kernels of StridedSlice (and Reshape, Transpose) have no bfloat16;
        # the round trip through float32 is exact.
        if x.dtype == mstype.bfloat16:
            return ops.cast(self._slice(ops.cast(x, mstype.float32), dim, start, length), mstype.bfloat16)
        return self._slice(x, dim, start, length)

    def _gather_parts(self, x):
        # Every rank writes its x into its own slot of a zero buffer; the sum is the
        # gather (x + 0 is exact). Moves G*|x| through an all-reduce.
        slots = []
        for i in range(self.size):
            if i == self.rank:
                slots.append(x)
            else:
                slots.append(ops.zeros(x.shape, x.dtype))
        full = self._ar(ops.cat(slots, 0))
        n = x.shape[0]
        parts = []
        for i in range(self.size):
            parts.append(self._narrow(full, 0, i * n, n))
        return parts


class Native(_Kernels):
    """Ascend/GPU: MindSpore's collective primitives, in every mode.

    UNTESTED on this project's hardware (CPU only); the CPU tests check the same
    padding and slicing code with the composed primitives underneath.
    """

    reduce_scatter_is_all_reduce = False

    def __init__(self, group_name: str, size: int, rank: int):
        super().__init__(group_name, size, rank)
        self.allreduce = ops.AllReduce(ops.ReduceOp.SUM, group_name)
        self.allgather = ops.AllGather(group_name)
        self.reducescatter = ops.ReduceScatter(ops.ReduceOp.SUM, group_name)
        self.alltoall = ops.AlltoAll(size, 0, 0, group_name)

    def _ar(self, x):
        return self.allreduce(x)

    def _gather_parts(self, x):
        full = self.allgather(x)
        n = x.shape[0]
        parts = []
        for i in range(self.size):
            parts.append(self._slice(full, 0, i * n, n))
        return parts

    def all_gather(self, x, dim):
        if dim == 0:
            return self.allgather(x)
        return ops.moveaxis(self.allgather(ops.moveaxis(x, dim, 0)), 0, dim)

    def reduce_scatter(self, x):
        return self.reducescatter(x)

    def all_to_all(self, x, split_dim, concat_dim):
        # One AlltoAll(split 0, concat 0) for any pair of dims: bring split_dim to the
        # front, exchange, then fold the G received chunks into concat_dim.
        nd = len(x.shape)
        split_dim = split_dim % nd
        concat_dim = concat_dim % nd
        front = ops.moveaxis(x, split_dim, 0)
        y = self.alltoall(front)  # (G * n/G, ...) chunk i from rank i
        y = ops.moveaxis(y, 0, split_dim)  # back in place, chunks stacked along split_dim
        shape = tuple(y.shape)
        n = shape[split_dim] // self.size
        y = y.reshape(shape[:split_dim] + (self.size, n) + shape[split_dim + 1:])
        # The chunk axis sits at split_dim; move it just before concat_dim and merge.
        c = concat_dim if concat_dim < split_dim else concat_dim + 1
        y = ops.moveaxis(y, split_dim, c - 1 if c > split_dim else c)
        out_shape = list(shape)
        out_shape[split_dim] = n
        out_shape[concat_dim] = shape[concat_dim] * self.size
        return y.reshape(tuple(out_shape))
