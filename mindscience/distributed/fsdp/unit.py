"""The units of ``fully_shard`` in PyNative: one bucketed all-gather and one reduce-scatter each.

Each ``fully_shard(cell)`` call makes one :class:`FsdpUnit` of the parameters it shards.
While a fully sharded cell runs eagerly, the first read of one of a unit's parameters
gathers the whole unit: every shard of a dtype flattened into one buffer, ONE
``mint.distributed.all_gather`` of it, then split into the full tensors (padding rows
cut). The gather is a custom autograd function (``_Function``) whose backward is ONE
reduce-scatter of the unit's flat gradient divided by d (the dp-cp mean of contract C3),
run as the unit's backward ends.

``reshard_after_forward``: the unit's gathered tensors are registered while its forward
runs, and a ``saved_tensors_hooks`` pack hook replaces every saved tensor that IS one of
them (same storage, shape and dtype) by a small key, so autodiff keeps no full weight;
the first unpack in the backward gathers the unit again (no forward re-run). A derived
copy the forward saves (``W.T`` fed to a matmul) stays alive as any activation does.

``prefetch``: when a unit gathers in the forward, the next unit of the last forward's
order (recorded from the previous outermost call, the same on every rank) starts its
gather asynchronously (``async_op=True``); in the backward, the first unpack of a unit
starts the gather of the unit before it. Every rank issues the same collectives in the
same order because the order is the program's.

Counters: :func:`gathered_bytes` adds a unit's full bytes when its gather is issued and
subtracts them when the gathered weights are dropped (the forward's end when they are
not kept for the backward, else the unit's reduce-scatter); :func:`peak_gathered_bytes`
is the most seen since :func:`reset_gathered_bytes`.
"""

from __future__ import annotations

import weakref

import numpy as np

__all__ = ["FsdpUnit", "gathered_bytes", "peak_gathered_bytes", "reset_gathered_bytes",
           "units_of"]


class _Bytes:
    alive = 0
    peak = 0


def gathered_bytes() -> int:
    """Bytes of gathered (full) weights of fully sharded units alive now (PyNative)."""
    return _Bytes.alive


def peak_gathered_bytes() -> int:
    """The most :func:`gathered_bytes` since the last :func:`reset_gathered_bytes`."""
    return _Bytes.peak


def reset_gathered_bytes() -> None:
    """Start a new peak from the bytes alive now (and zero each unit's collective counts)."""
    _Bytes.peak = _Bytes.alive
    for unit in _all_units():
        unit.reset_counts()


_BUSY: set = set()  # units with a gather in flight or a backward regather held
_UNITS: list = []  # weak references: a dropped model's units go with it


def _all_units() -> list:
    alive = [ref() for ref in _UNITS]
    if len([u for u in alive if u is None]) > 64:
        _UNITS[:] = [ref for ref, u in zip(_UNITS, alive) if u is not None]
    return [u for u in alive if u is not None]


def units_of(cell) -> list:
    """The :class:`FsdpUnit` objects of ``cell`` and its sub-cells, in registration order."""
    mine = {id(unit.cell) for _, sub in cell.cells_and_names()
            for unit in [sub.__dict__.get("_fsdp_unit")] if unit is not None}
    return [unit for unit in _all_units() if id(unit.cell) in mine]


class _Order:
    """The units in the order of their first gather in the last outermost call."""

    forward: list = []
    seen: list = []


def _next_of(unit, step):
    order = _Order.forward
    for i, u in enumerate(order):
        if u is unit:
            j = i + step
            return order[j] if 0 <= j < len(order) else None
    return None


class _Packed:
    """What autodiff keeps instead of a gathered weight of a resharding unit."""

    __slots__ = ("unit", "index")

    def __init__(self, unit, index):
        self.unit, self.index = unit, index


_SAVED: dict = {}  # data_ptr -> (unit, index, shape, dtype) of live gathered weights
_SAVED_KINDS: dict = {}  # (shape, dtype) -> how many of them


def _register(unit, full):
    for j, t in enumerate(full):
        kind = (tuple(t.shape), t.dtype)
        _SAVED[t.data_ptr()] = (unit, j) + kind
        _SAVED_KINDS[kind] = _SAVED_KINDS.get(kind, 0) + 1


def _unregister(full):
    for t in full:
        entry = _SAVED.pop(t.data_ptr(), None)
        if entry is not None:
            kind = entry[2:]
            _SAVED_KINDS[kind] -= 1
            if not _SAVED_KINDS[kind]:
                del _SAVED_KINDS[kind]


def _pack(t):
    # The shape first: data_ptr() waits for the tensor's producer (PyNative runs ops
    # asynchronously), so only a possible weight pays for it.
    if (tuple(t.shape), t.dtype) not in _SAVED_KINDS:
        return t
    entry = _SAVED.get(t.data_ptr())
    if entry is not None and tuple(t.shape) == entry[2] and t.dtype == entry[3] and t.is_contiguous():
        return _Packed(entry[0], entry[1])
    return t


def _unpack(p):
    if isinstance(p, _Packed):
        return p.unit.backward_value(p.index)
    return p


def _runtime():
    import mindspore as ms
    from mindspore import mint, ops
    from mindspore import dtype as mstype
    import mindspore.mint.distributed as md
    from mindspore.common._grad_function import _Function
    from mindspore.common.api import _pynative_executor

    return ms, mint, ops, mstype, md, _Function, _pynative_executor


def grad_recording() -> bool:
    """True while autodiff records the eager forward (``ms.grad``, ``value_and_grad``)."""
    return bool(_runtime()[6].requires_grad())


_GATHER = None


def _gather_fn():
    """The autograd function: forward one gather per bucket, backward one reduce-scatter."""
    global _GATHER
    if _GATHER is not None:
        return _GATHER
    _, _, _, _, _, Function, _ = _runtime()

    class _UnitGather(Function):  # pylint: disable=abstract-method
        @staticmethod
        def forward(ctx, unit, kept, *shards):
            ctx.unit, ctx.kept = unit, kept
            return unit.split(unit.collect())

        @staticmethod
        def backward(ctx, *douts):
            unit = ctx.unit
            grads = unit.reduce_scatter(douts)
            if ctx.kept:
                unit.free()
            elif unit.bwd_full is not None:
                unit.bwd_full = None
                unit.free()
            if unit.pending is not None:  # prefetched for a backward that did not need it
                unit.drain()
            _BUSY.discard(unit)
            return (None, None) + tuple(grads)

    _GATHER = _UnitGather
    return _GATHER


def _fresh(x, ops, mstype):
    """A tensor of its own with x's values (exact; CPU has no Clone kernel)."""
    if x.dtype in (mstype.float32, mstype.float16, mstype.float64):
        return ops.mul(x, 1)
    return ops.cast(ops.cast(x, mstype.float32), x.dtype)


class FsdpUnit:
    """The parameters one ``fully_shard`` call sharded, gathered and reduced together.

    Attributes:
        cell: The cell ``fully_shard`` was called on.
        params: Its shard Parameters, in table order (each once).
        group: The ParallelGroup they are sharded over.
        reshard: Whether the gathered weights are freed after the forward (PyNative).
        prefetch: Whether this unit's gather starts the next unit's.
        bytes: Full (unpadded) bytes of the unit's parameters, what one gather holds.
        counts: ``forward_gathers``, ``backward_gathers``, ``prefetched`` (gathers
            launched ahead) and ``reduce_scatters`` since the last reset.
    """

    def __init__(self, cell, params, group, reshard, prefetch):
        self.cell, self.params, self.group = cell, list(params), group
        self.reshard, self.prefetch = bool(reshard), bool(prefetch)
        self.index = {id(p): i for i, p in enumerate(self.params)}
        self._layout = (None, None)  # (dtypes, buckets) of the last gather
        self.full = None  # the forward's gathered tensors while the unit runs
        self.bwd_full = None  # the backward's, from the first unpack to the reduce-scatter
        self.pending = None  # (handle or None, parts, flat inputs) of a gather in flight
        self.active = 0
        self.held_bytes = 0  # bytes of one gathered copy, as counted
        self.kept = False  # the forward's gathered weights stay alive for the backward
        self.live = 0  # gathered copies counted in _Bytes.alive
        self.counts = {}
        self.reset_counts()
        _UNITS.append(weakref.ref(self))

    def reset_counts(self):
        self.counts = {"forward_gathers": 0, "backward_gathers": 0, "prefetched": 0,
                       "reduce_scatters": 0}

    @property
    def bytes(self) -> int:
        """Full (unpadded) bytes of the unit's parameters in their dtypes now."""
        return int(sum(int(np.prod(p.fsdp.full_shape, dtype=np.int64)) * p.itemsize
                       for p in self.params))

    @property
    def buckets(self):
        """``[(dtype, [(param index, offset, numel), ...], total)]``, one per dtype.

        From the parameters' dtypes now (a model may cast its shards after fully_shard).
        """
        dtypes = tuple(p.dtype for p in self.params)
        if self._layout[0] != dtypes:
            self._layout = (dtypes, self._buckets())
        return self._layout[1]

    def _buckets(self):
        by_dtype = {}
        for i, p in enumerate(self.params):
            by_dtype.setdefault(p.dtype, []).append(i)
        out = []
        for dtype, idx in by_dtype.items():
            entries, off = [], 0
            for i in idx:
                n = int(np.prod(self.params[i].fsdp.shard_shape, dtype=np.int64))
                entries.append((i, off, n))
                off += n
            out.append((dtype, entries, off))
        return out

    # ------------------------------------------------------------------ collectives
    def _issue(self, async_op):
        _, mint, ops, _, md, _, _ = _runtime()
        from .. import counters

        d = self.group.size
        launched = []
        self.held_bytes = self.bytes
        for dtype, entries, total in self.buckets:
            flat = ops.cat([self.params[i].reshape(-1) for i, _, _ in entries]) \
                if len(entries) > 1 else self.params[entries[0][0]].reshape(-1).contiguous()
            parts = [mint.empty((total,), dtype=dtype) for _ in range(d)]
            counters.count()
            handle = md.all_gather(parts, flat, group=self.group.group_name, async_op=async_op)
            launched.append((handle if async_op else None, parts, flat))
        self.live += 1
        _Bytes.alive += self.held_bytes
        _Bytes.peak = max(_Bytes.peak, _Bytes.alive)
        return launched

    def launch_prefetch(self):
        """Start this unit's gather asynchronously, unless it is gathered or in flight."""
        if self.pending is not None or self.full is not None or self.bwd_full is not None:
            return
        self.pending = self._issue(True)
        self.counts["prefetched"] += 1
        _BUSY.add(self)

    def collect(self):
        """The gathered parts of every bucket: the prefetched ones, or gathered now."""
        if self.pending is not None:
            launched, self.pending = self.pending, None
            for handle, _, _ in launched:
                handle.wait()
            return launched
        return self._issue(False)

    def drain(self):
        """Drop a prefetched gather that nothing used (waited first: the ranks joined it)."""
        if self.pending is not None:
            self.collect()
            self.free()

    def free(self):
        if self.live > 0:
            self.live -= 1
            _Bytes.alive -= self.held_bytes

    def split(self, launched):
        """The full tensors (padding cut, local shapes) of every parameter, in order.

        Each is a tensor of its own (a ``cat`` of the ranks' rows, not a view): autodiff
        copies a view that a custom function returns, and the pack hook must see the very
        tensor the model reads.
        """
        _, _, ops, mstype, _, _, _ = _runtime()
        out = [None] * len(self.params)
        for (_, entries, _), (_, parts, _) in zip(self.buckets, launched):
            for i, off, _ in entries:
                info = self.params[i].fsdp
                rest = tuple(info.shard_shape[1:])
                width = int(np.prod(rest, dtype=np.int64))
                pieces = []
                for k in range(self.group.size):
                    valid = min(info.shard_rows, max(0, info.rows - k * info.shard_rows))
                    if valid:
                        pieces.append(parts[k][off:off + valid * width].reshape((valid,) + rest))
                full = ops.cat(pieces, 0) if len(pieces) > 1 else _fresh(pieces[0], ops, mstype)
                if not info.full_shape:  # a 0-d parameter, gathered as one row
                    full = _fresh(full.reshape(()), ops, mstype)
                out[i] = full
        return tuple(out)

    def reduce_scatter(self, douts):
        """Shard gradients: ONE reduce-scatter per bucket of the padded flat gradient / d."""
        _, _, ops, mstype, _, _, _ = _runtime()
        from .. import collectives as C

        self.counts["reduce_scatters"] += 1
        d = self.group.size
        k = C.kernels(self.group, False)
        grads = [None] * len(self.params)
        for dtype, entries, total in self.buckets:
            cols = []
            for i, _, n in entries:
                info = self.params[i].fsdp
                rest = tuple(info.shard_shape[1:])
                g = ops.cast(douts[i], mstype.float32).reshape((info.rows,) + rest)
                if info.pad:
                    g = ops.cat((g, ops.zeros((info.pad,) + rest, mstype.float32)), 0)
                cols.append(g.reshape(d, n))
            buf = ops.cat(cols, 1) if len(cols) > 1 else cols[0]
            flat = k.reduce_scatter(buf).reshape(-1)
            for i, off, n in entries:
                shape = tuple(self.params[i].fsdp.shard_shape)
                # The mean's scaling per parameter makes each gradient a tensor of its own,
                # not a view of the flat buffer (a view gradient breaks PyNative's
                # accumulation and CPU's copy_, see mappings._fresh).
                grads[i] = ops.cast(flat[off:off + n].reshape(shape) * (1.0 / d), dtype)
        return grads

    # ------------------------------------------------------------------ forward / backward
    def _gather_forward(self, kept):
        self.counts["forward_gathers"] += 1
        if self not in _Order.seen:
            _Order.seen.append(self)
        if self.prefetch:
            nxt = _next_of(self, 1)
            if nxt is not None and not nxt.active:
                # Launched before this unit's own wait: both gathers are in flight at once.
                nxt.launch_prefetch()
        full = _gather_fn().apply(self, kept, *self.params)
        return full if isinstance(full, tuple) else (full,)

    def read(self, shard):
        """The full tensor of ``shard`` for an eager read inside a fully sharded call."""
        i = self.index[id(shard)]
        if self.full is not None:
            return self.full[i]
        recording = grad_recording()
        if self.active:
            self.kept = recording and not self.reshard
            self.full = self._gather_forward(self.kept)
            if self.reshard and recording:
                _register(self, self.full)
            return self.full[i]
        # Read outside the unit's own call (a tied weight read by another cell): gathered
        # once per outermost call and kept for the backward.
        full = _State.foreign.get(id(self))
        if full is None:
            full = self._gather_forward(recording)
            _State.foreign[id(self)] = full
            if not recording:
                _State.foreign_free.append(self)
        return full[i]

    def backward_value(self, index):
        """A gathered weight that the backward unpacks: the unit gathered again, once."""
        if self.bwd_full is None:
            self.counts["backward_gathers"] += 1
            launched = self.collect()
            if self.prefetch:
                prev = _next_of(self, -1)
                if prev is not None and prev.reshard:
                    prev.launch_prefetch()
            self.bwd_full = self.split(launched)
            _BUSY.add(self)
        return self.bwd_full[index]

    def __repr__(self):
        return (f"FsdpUnit({type(self.cell).__name__}, params={len(self.params)}, "
                f"bytes={self.bytes}, reshard={self.reshard}, prefetch={self.prefetch})")


class _State:
    """Eager calls of fully sharded cells (the depth of nesting) and what they gathered."""

    depth = 0
    foreign: dict = {}
    foreign_free: list = []


def enter():
    if _State.depth == 0:
        _begin_pass()
    _State.depth += 1


def leave():
    _State.depth -= 1
    if _State.depth == 0:
        _end_pass()


def _begin_pass():
    for unit in list(_BUSY):  # a stale prefetch or regather (a backward that did not finish)
        unit.drain()
        if unit.bwd_full is not None:
            unit.bwd_full = None
            unit.free()
    _BUSY.clear()
    _Order.seen = []


def _end_pass():
    if _Order.seen:
        _Order.forward = list(_Order.seen)
    for unit in list(_BUSY):  # prefetched for a unit this call did not run
        if unit.pending is not None:
            unit.drain()
        if unit.bwd_full is None:
            _BUSY.discard(unit)
    for unit in _State.foreign_free:
        unit.free()
    _State.foreign, _State.foreign_free = {}, []


def call_unit(unit, call, args, kwargs):
    """Run the unit's cell: gathers on first read, frees or packs at the end."""
    ms = _runtime()[0]
    if unit.active or ms.get_context("mode") != ms.PYNATIVE_MODE:
        return call(*args, **kwargs)
    unit.active += 1
    try:
        if unit.reshard and grad_recording():
            with ms.saved_tensors_hooks(_pack, _unpack):
                return call(*args, **kwargs)
        return call(*args, **kwargs)
    finally:
        unit.active -= 1
        if unit.full is not None:
            _unregister(unit.full)
            if not unit.kept:
                unit.free()
        unit.full = None
