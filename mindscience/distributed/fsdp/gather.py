"""How a sharded parameter is read: the all-gather Cell and the gathering properties.

Each cell that owns sharded parameters becomes a subclass of its own class whose
parameter attributes are properties (:func:`sharded_class`). Compiled code always
gathers, one all-gather Cell per parameter read; eager code reads the parameter's unit
(:mod:`.unit`: one bucketed gather per unit) while a fully sharded cell is being called
(its ``__call__`` counts the depth) and otherwise returns the shard Parameter, so that
user code outside a forward (``repr``, optimizers, checkpoints) starts no collective.
MindSpore is imported on first use only.
"""

from __future__ import annotations

from .layout import FsdpParamInfo, shard_shape
from .unit import _State as unit_state
from .unit import call_unit, enter, leave

SHARD_PREFIX = "_fsdp_shard_"
EAGER_PREFIX = "_fsdp_eager_"
GRAPH_PREFIX = "_fsdp_graph_"


def runtime():
    import mindspore as ms
    from mindspore import nn, ops
    from mindspore import dtype as mstype

    from .. import collectives as C
    return ms, nn, ops, mstype, C


_GATHER_CLASS = None


def gather_class():
    """The all-gather Cell class (built once, on first use, so MindSpore loads lazily)."""
    global _GATHER_CLASS
    if _GATHER_CLASS is not None:
        return _GATHER_CLASS
    _, nn, ops, mstype, _ = runtime()

    class _GatherParam(nn.Cell):
        """Forward: all-gather the shard, cut the padding, give the local shape.
        Backward: the gradient padded, reduce-scattered and divided by d (the group mean).

        The reshape and the row cut run in float32 for bfloat16 parameters (the CPU graph
        kernels of Reshape and StridedSlice have no bfloat16; the round trip is exact), and
        the reduce-scatter sums float32.
        """

        def __init__(self, kernels, info: FsdpParamInfo, dtype):
            super().__init__()
            self.k = kernels
            self.full_shape = tuple(info.full_shape)
            self.rest = tuple(shard_shape(info.full_shape, info.group.size)[1:])
            self.rows = info.rows
            self.pad = info.pad
            self.scale = 1.0 / info.group.size
            self.dtype = dtype
            self.low = dtype == mstype.bfloat16
            self.slice = ops.StridedSlice()

        def _first_rows(self, x):
            if self.pad == 0:
                return x
            begin = [0] * len(x.shape)
            end = list(x.shape)
            end[0] = self.rows
            return self.slice(x, tuple(begin), tuple(end), (1,) * len(x.shape))

        def _padded(self, g):
            if self.pad == 0:
                return g
            return ops.cat((g, ops.zeros((self.pad,) + self.rest, g.dtype)), 0)

        def construct(self, shard):
            full = self.k.all_gather(shard, 0)
            if self.low:
                full = ops.cast(full, mstype.float32)
            full = self._first_rows(full).reshape(self.full_shape)
            if self.low:
                full = ops.cast(full, self.dtype)
            return full

        def bprop(self, shard, out, dout):
            g = ops.cast(dout, mstype.float32).reshape((self.rows,) + self.rest)
            g = self.k.reduce_scatter(self._padded(g)) * self.scale
            # A contiguous tensor of its own: the eager reduce-scatter's chunk is a view
            # (see mappings._fresh for what a view gradient breaks in PyNative).
            return (ops.cast(g, self.dtype).contiguous(),)

    _GATHER_CLASS = _GatherParam
    return _GATHER_CLASS


def _eager_value(cell, attr):
    shard = cell.__dict__[SHARD_PREFIX + attr]
    if unit_state.depth == 0:
        return shard
    unit = getattr(shard, "_fsdp_unit", None)
    if unit is None:  # a size-1 group: the shard is the whole parameter
        return shard
    return unit.read(shard)


def _make_property(attr):
    _, _, _, _, C = runtime()
    compiling = C.compiling
    shard_key = SHARD_PREFIX + attr
    graph_key = GRAPH_PREFIX + attr

    def get(self):
        if compiling():
            # Compiled: one gather per parameter read, kept to the backward (reshard and
            # prefetch run in PyNative only, see rules.fsdp_runtime).
            return getattr(self, graph_key)(getattr(self, shard_key))
        return _eager_value(self, attr)

    get.__name__ = attr
    return property(get, doc=f"The full {attr!r} while the cell runs; its shard otherwise.")


_CLASSES: dict = {}


def sharded_class(cls, attrs: tuple):
    """``cls`` with the attributes ``attrs`` read through gathering properties."""
    key = (cls, attrs)
    sub = _CLASSES.get(key)
    if sub is not None:
        return sub
    base_call = cls.__call__

    def __call__(self, *args, **kwargs):
        enter()
        try:
            unit = self.__dict__.get("_fsdp_unit")
            if unit is None:
                return base_call(self, *args, **kwargs)
            return call_unit(unit, base_call, (self,) + args, kwargs)
        finally:
            leave()

    namespace = {"__call__": __call__, "_fsdp_attrs": attrs, "__module__": cls.__module__,
                 "__doc__": cls.__doc__}
    for attr in attrs:
        namespace[attr] = _make_property(attr)
    sub = type(f"FullyShard{cls.__name__}", (cls,), namespace)
    _CLASSES[key] = sub
    return sub


def install(sub, attrs, g):
    """Put the shards in ``sub``'s parameter table; on d > 1 read them through properties."""
    for attr, new in attrs:
        sub._params[attr] = new
    if g.size == 1:
        return  # the shard is the whole parameter: nothing to gather
    names = tuple(sorted(set(getattr(type(sub), "_fsdp_attrs", ())) | {a for a, _ in attrs}))
    base = type(sub).__mro__[1] if hasattr(type(sub), "_fsdp_attrs") else type(sub)
    sub.__class__ = sharded_class(base, names)
    for attr, new in attrs:
        eager, graph = new._fsdp_gathers
        object.__setattr__(sub, SHARD_PREFIX + attr, new)
        object.__setattr__(sub, EAGER_PREFIX + attr, eager)
        object.__setattr__(sub, GRAPH_PREFIX + attr, graph)
