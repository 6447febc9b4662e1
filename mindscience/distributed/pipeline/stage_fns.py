"""A model chunk's forward, backward and last-stage loss, eager or compiled, cached on the chunk.

:func:`stage_fns` returns the functions :mod:`.runtime` runs for one ``nn.Cell``:

* ``forward(x) -> y``;
* ``backward(x, dy, acc) -> (dx, acc)``: the gradient of ``sum(cell(x) * dy)`` for the
  input (None on the first model stage) and the trainable parameters, the latter added to
  the accumulators ``acc``;
* ``loss(x, t, scale, acc, loss_acc) -> (dx, acc, loss_acc)`` on the last model stage:
  ``loss_fn(cell(x), t) * scale`` and its gradients, both added to accumulators;
* kept activations (the runtime's ``recompute="none"|"selective"``): ``keep(x) -> (y,
  pending)`` runs the chunk as a top cell with ``set_grad(True)`` (its ``construct``
  compiled under jit), and ``backward_kept(pending, dy, acc) -> (dx, acc)`` back-propagates
  that forward (``GradOperation(sens_param=True)`` on the same input tensor: MindSpore
  finds the stored forward by the input's identity), in any order, without a second
  forward; :func:`any_order_recompute` lets the ``Cell.recompute()``-ed cells inside do
  the same (see :mod:`.recompute`, measured).

Accumulation (``python bench/bench_pipeline_accumulate.py --mode jit|pynative``, one
process on this shared 2-core CPU, 4 layers of 64x64 + bias = 8 parameters, 8 micro-batches,
40 steps per variant interleaved; the same sums in every variant; docs/BENCHMARKS.md):
under ``ms.jit`` the sum over micro-batches is part of the compiled backward (the
accumulators go in as separate arguments, ``acc + g`` comes out): medians 14-40 ms per
step against 45-290 ms for a Python ``acc + g`` per parameter and micro-batch after the
compiled backward (every eager add is a dispatch on a loaded CPU), 2.4-9x in every run.
In PyNative the gradients go in place (``ops.assign_add``) into zero buffers made for the
step: the minimum per step lower than the Python ``+``'s in 6 of 7 runs (48-65 against
52-61 ms), the median in 5 of 7 (the medians follow the machine's load). Two things that
do not work on MindSpore 2.10 CPU: ``Tensor.add_`` returns the sum and leaves the tensor
unchanged (so in-place adds are probed once, with a Python sum as the fallback); a tuple
of tensors passed to a compiled function is a constant, recompiled for every new value (so
the accumulators go in one argument each).

Cache: the functions live in the cell's own ``__dict__``, not in a module-level table (a
copy or a pickle of the cell starts with an empty cache), and are rebuilt when the cell's
trainable parameters change (a parameter frozen with ``requires_grad = False`` after the
first call drops out of the gradients). In PyNative they die with the cell. Under
``mode="jit"`` MindSpore 2.10 itself keeps every function it compiled, and through its
closure the cell, for the life of the process (measured: a cell whose compiled forward
ran once is never freed, whoever else lets go of it). Loss functions are matched by
identity (a bound method by its object and function), the last :data:`MAX_LOSS_FNS` per
cell kept: a new ``loss_fn`` object is traced, and under jit compiled (and kept by
MindSpore), anew; so pass the same object every step, not a fresh ``lambda`` or closure.
"""

from __future__ import annotations

import types

import mindspore as ms
from mindspore import nn, ops

__all__ = ["stage_fns", "MAX_LOSS_FNS", "any_order_recompute"]

_ATTR = "_msdist_pipeline_fns"
MAX_LOSS_FNS = 4  # loss functions kept per cell and mode (oldest dropped first)

# The compiled accumulation ``acc + g`` of every parameter as ONE HyperMap node (the
# same ``a + b`` per tensor, so the same bits). MindSpore 2.10 unrolls a generator,
# ``tuple(a + b for a, b in zip(acc, g))``, into one hasnext/next/list-add per
# parameter that its type inference walks again and again: measured (one process,
# ``ms.jit`` of that line alone) 1.3 s of compile for 28 tensors and 2.7 s for 56,
# against 0.1 s for the HyperMap; a Python loop building a tuple or a list costs
# 0.4-1.2 s. The tiny-gpt step (2 layers, 28 parameters) compiled in 3.2-3.8 CPU s
# with the generator (docs/COMPILED_MODE.md, "Compile time").
_add = ops.MultitypeFuncGraph("msdist_accumulate")


@_add.register("Tensor", "Tensor")
def _add_tensors(a, b):
    return a + b


_ADD_EACH = ops.HyperMap(_add)


class _Cache:
    """What one cell keeps: its forward/backward per (mode, first) and its losses."""

    def __init__(self):
        self.params = None  # the trainable parameters the functions were built for
        self.chunks = {}    # (mode, first) -> _Chunk
        self.losses = []    # [(loss_fn, mode, first, fn)], newest last
        self.learned = {}   # the runtime's per-configuration state (shapes exchanged)

    # A deep copy or a pickle of the cell must not carry compiled functions of the original.
    def __deepcopy__(self, memo):
        return _Cache()

    def __reduce__(self):
        return (_Cache, ())


def cache_of(cell) -> _Cache:
    """The cell's cache, created on first use (in the cell's ``__dict__``, not a Cell attribute)."""
    cache = cell.__dict__.get(_ATTR)
    if cache is None:
        cache = _Cache()
        object.__setattr__(cell, _ATTR, cache)
    return cache


def _same_fn(a, b) -> bool:
    if a is b:
        return True
    # obj.method makes a new bound-method object at every access.
    return (isinstance(a, types.MethodType) and isinstance(b, types.MethodType)
            and a.__self__ is b.__self__ and a.__func__ is b.__func__)


class _Chunk:
    """Forward and backward of one cell (they do not depend on the loss)."""

    def __init__(self, cell, params, mode, first):
        self.params = params
        self.first = first
        self.jit = mode == "jit"
        cell_ref = cell

        def forward(x):
            return cell_ref(x)

        def vjp(x, dy):
            return (cell_ref(x).astype(ms.float32) * dy.astype(ms.float32)).sum()

        self.forward = ms.jit(forward) if self.jit else forward
        self._grad = None
        self._out_dtype = None
        if first and not params:
            return  # nothing to differentiate: no input gradient, no parameters
        kept = (_KeptJit if self.jit else _Kept)(cell)
        kept.set_grad(True)
        self._kept = kept
        gop = ops.GradOperation(get_all=not first, get_by_list=bool(params), sens_param=True)
        self._kept_grad = gop(kept, ms.ParameterTuple(params)) if params else gop(kept)
        grad = ms.grad(vjp, grad_position=None if first else 0,
                       weights=list(params) if params else None)
        split = _splitter(first, bool(params))
        if not self.jit:
            self._grad = lambda x, dy: split(grad(x, dy))
        elif first:
            def fused_first(x, dy, *acc):
                _, g = split(grad(x, dy))
                return _ADD_EACH(acc, g)
            self._grad = ms.jit(fused_first)
        else:
            def fused(x, dy, *acc):
                dx, g = split(grad(x, dy))
                return (dx,) + _ADD_EACH(acc, g)
            self._grad = ms.jit(fused)

    def keep(self, x):
        """``(y, pending)``: the forward, its activations kept for :meth:`backward_kept`.

        The forward runs as a top cell with ``set_grad(True)`` (the chunk inside a wrapper
        cell, its ``construct`` compiled under jit); MindSpore keeps what the backward needs
        under the identity of ``x``, so ``pending`` holds ``x`` itself (the same object
        goes back in ``backward_kept``; a new tensor with equal values would run the
        forward again).
        """
        if self._grad is None:
            return self.forward(x), None
        y = self._kept(x)
        self._out_dtype = y.dtype
        return y, x

    def backward_kept(self, pending, dy, acc):
        """``(dx, acc)`` from a kept forward: as :meth:`backward`, without recomputing.

        Kept forwards may be back-propagated in any order, each once (measured on MindSpore
        2.10 CPU, also with tensor-parallel all-reduces inside and under jit; see
        :mod:`.recompute`). Under jit a ``bprop`` Cell called more than once in the kept
        graph would hand every consumer its last call's output: the compiled mappings copy
        their output out of their shared cells for this (``mappings._OwnOutput``); a user's
        own ``bprop`` Cell used twice in a stage needs the same (``ops.deepcopy`` of its
        output, in the caller).
        """
        if pending is None:
            return None, acc
        x = pending
        # dy arrives in the activation's dtype (the next stage's input gradient); the
        # backward takes exactly the output's.
        if dy.dtype != self._out_dtype:
            dy = dy.astype(self._out_dtype)
        out = self._kept_grad(x, dy)
        if self.first:
            return None, _add_into(acc, tuple(out))
        if not self.params:
            return out[0], acc
        return out[0][0], _add_into(acc, tuple(out[1]))

    def backward(self, x, dy, acc):
        """``(dx, acc)``: the input gradient (None on the first stage) and ``acc`` + this one's."""
        if self._grad is None:
            return None, acc
        if self.jit:
            out = self._grad(x, dy, *acc)
            if self.first:
                return None, tuple(out)
            return out[0], tuple(out[1:])
        dx, g = self._grad(x, dy)
        return dx, _add_into(acc, g)


class _Kept(nn.Cell):
    """The chunk as a top cell of its own, run with ``set_grad(True)`` for kept forwards.

    ``auto_prefix=False``: holding the chunk must not rename its parameters.
    """

    def __init__(self, cell):
        super().__init__(auto_prefix=False)
        self.chunk = cell

    def construct(self, x):
        return self.chunk(x)


class _KeptJit(_Kept):
    """:class:`_Kept` with a compiled ``construct`` (``mode="jit"``)."""

    @ms.jit
    def construct(self, x):
        return self.chunk(x)


_ANY_ORDER: dict = {}


def _ptr(x):
    return x.data_ptr() if isinstance(x, ms.Tensor) else None


def _any_order_cls(base):
    """``base`` (MindSpore's PyNative recompute cell, or a subclass) back-propagating its
    forwards in any order.

    MindSpore 2.10's ``_RecomputeCell`` keeps the inputs of its forwards in a stack and
    re-runs the newest in each ``bprop``: kept forwards back-propagated oldest-first get
    another micro-batch's recomputed activations (measured: wrong gradients). Its
    ``bprop`` receives the forward's input tensor (the same data, measured): the entry of
    the forward with that input is moved to the top of the stack first, with the random
    state that forward started from (MindSpore keeps only the newest one).
    """
    cls = _ANY_ORDER.get(base)
    if cls is not None:
        return cls

    class AnyOrder(base):
        def construct(self, *args, **kwargs):
            out = super().construct(*args, **kwargs)
            self.__dict__.setdefault("_msdist_rng", []).append(self.cpu_rng_state)
            return out

        def bprop(self, *args):
            rng = self.__dict__.setdefault("_msdist_rng", [])
            key = _ptr(args[0]) if args else None
            stacks = [self.args, self.kwargs, rng]
            extra = self.__dict__.get("stream_states")  # random.recompute's replay cell
            if isinstance(extra, list):
                stacks.append(extra)
            n = len(self.args)
            at = n - 1
            if key is not None:
                for idx in range(n - 1, -1, -1):
                    saved = self.args[idx]
                    if saved and _ptr(saved[0]) == key:
                        at = idx
                        break
            for stack in stacks:
                if len(stack) == n and 0 <= at < n - 1:
                    stack.append(stack.pop(at))
            if rng:
                self.cpu_rng_state = rng.pop()
            return super().bprop(*args)

    AnyOrder.__name__ = AnyOrder.__qualname__ = f"AnyOrder{base.__name__}"
    _ANY_ORDER[base] = AnyOrder
    return AnyOrder


def any_order_recompute(cell) -> int:
    """Let every ``Cell.recompute()``-ed cell in ``cell`` back-propagate kept forwards in
    any order (PyNative); returns how many ``cell`` holds. Idempotent."""
    n = 0
    for _, sub in cell.cells_and_names():
        rc = getattr(sub, "_recompute_cell", None)
        if rc is None:
            continue
        n += 1
        if type(rc).__name__.startswith("AnyOrder"):
            continue
        if not (callable(getattr(rc, "bprop", None)) and hasattr(rc, "args")
                and hasattr(rc, "cpu_rng_state")):
            continue  # not the recompute cell measured here: left as it is
        rc.__class__ = _any_order_cls(type(rc))
    return n


def _splitter(first, has_params):
    """``(input grad or None, parameter grads)`` from a grad function's result."""
    def split(grads):
        if first:
            return None, tuple(grads) if has_params else ()
        if not has_params:
            return grads, ()
        return grads[0], tuple(grads[1])
    return split


_IN_PLACE: dict = {}


def _assign_add_works() -> bool:
    """Does ``ops.assign_add`` update a plain Tensor in place here? (Probed once.)

    It does on MindSpore 2.10 CPU, while ``Tensor.add_`` silently does not; a backend on
    which the probe fails gets the Python sum instead of silently zero gradients.
    """
    ok = _IN_PLACE.get("ok")
    if ok is None:
        z = ops.zeros((2,), ms.float32)
        try:
            ops.assign_add(z, ops.ones((2,), ms.float32))
            ok = bool((z.asnumpy() == 1).all())
        except (RuntimeError, TypeError, ValueError):
            ok = False
        _IN_PLACE["ok"] = ok
    return ok


def _add_into(acc, grads) -> tuple:
    """``acc + grads``: in place into ``acc`` (fresh buffers of this step) where that works."""
    if _assign_add_works():
        for a, g in zip(acc, grads):
            ops.assign_add(a, g)
        return acc
    return tuple(a + g for a, g in zip(acc, grads))


class _Loss:
    """The last stage's ``loss_fn(cell(x), t) * scale`` with its gradients, accumulated."""

    def __init__(self, cell, params, loss_fn, mode, first):
        self.first = first
        self.jit = mode == "jit"
        cell_ref = cell

        def loss(x, t, scale):
            value = loss_fn(cell_ref(x), t)
            return value * scale.astype(value.dtype)

        if first and not params:
            # Nothing to differentiate (a one-stage pipeline without parameters).
            def value_and_grads(x, t, scale):
                return loss(x, t, scale), None, ()
        else:
            vg = ms.value_and_grad(loss, grad_position=None if first else 0,
                                   weights=list(params) if params else None)
            split = _splitter(first, bool(params))

            def value_and_grads(x, t, scale):
                value, grads = vg(x, t, scale)
                dx, g = split(grads)
                return value, dx, g

        if not self.jit:
            self._fn = value_and_grads
        elif first:
            def fused_first(x, t, scale, loss_acc, *acc):
                value, _, g = value_and_grads(x, t, scale)
                return (loss_acc + value.astype(ms.float32),) + _ADD_EACH(acc, g)
            self._fn = ms.jit(fused_first)
        else:
            def fused(x, t, scale, loss_acc, *acc):
                value, dx, g = value_and_grads(x, t, scale)
                return (loss_acc + value.astype(ms.float32), dx) + _ADD_EACH(acc, g)
            self._fn = ms.jit(fused)

    def __call__(self, x, t, scale, acc, loss_acc):
        """``(dx, acc, loss_acc)``; in PyNative ``acc`` and ``loss_acc`` grow in place."""
        if self.jit:
            out = self._fn(x, t, scale, loss_acc, *acc)
            if self.first:
                return None, tuple(out[1:]), out[0]
            return out[1], tuple(out[2:]), out[0]
        value, dx, g = self._fn(x, t, scale)
        (loss_acc,) = _add_into((loss_acc,), (value.astype(ms.float32),))
        return dx, _add_into(acc, g), loss_acc


class StageFns:
    """The functions of one chunk for one call: ``forward``, ``backward``, ``loss``."""

    def __init__(self, chunk: _Chunk, loss):
        self.params = chunk.params
        self.forward = chunk.forward
        self.backward = chunk.backward
        self.keep = chunk.keep
        self.backward_kept = chunk.backward_kept
        self.loss = loss

    def zeros(self) -> tuple:
        """Fresh gradient accumulators at zero, one per trainable parameter.

        Fresh per step in both modes: PyNative adds into them in place, and a compiled
        function that returned one of its inputs unchanged (a parameter with a zero
        gradient) would hand the caller a buffer that a later step reuses.
        """
        return tuple(ops.zeros(q.shape, q.dtype) for q in self.params)


def stage_fns(cell, loss_fn, mode: str, first: bool, last: bool) -> StageFns:
    """The cached (or new) functions of ``cell`` as model stage first/last, in ``mode``."""
    cache = cache_of(cell)
    params = tuple(cell.trainable_params())
    if cache.params is None or len(params) != len(cache.params) or any(
            a is not b for a, b in zip(params, cache.params)):
        cache.params = params
        cache.chunks.clear()
        cache.losses.clear()
    chunk = cache.chunks.get((mode, first))
    if chunk is None:
        chunk = cache.chunks[(mode, first)] = _Chunk(cell, params, mode, first)
    loss = None
    if last:
        for entry in cache.losses:
            if entry[1] == mode and entry[2] == first and _same_fn(entry[0], loss_fn):
                loss = entry[3]
                break
        if loss is None:
            loss = _Loss(cell, params, loss_fn, mode, first)
            same = [e for e in cache.losses if e[1] == mode and e[2] == first]
            if len(same) >= MAX_LOSS_FNS:
                cache.losses.remove(same[0])
            cache.losses.append((loss_fn, mode, first, loss))
    return StageFns(chunk, loss)
