"""Run one differentiated function in an execution mode: PyNative, ``ms.jit`` or GRAPH_MODE.

The checks compare the same computation in each mode with the same numpy reference, so
"works compiled" means the same numbers, forward and backward.

=========  ================================================================================
mode       how the loss and its gradient run
=========  ================================================================================
pynative   ``ms.value_and_grad(loss)(x)`` (``ms.grad`` when ``with_value`` is False)
jit        ``ms.jit(ms.value_and_grad(loss))(x)``: the whole grad function compiled
graph      ``set_context(mode=GRAPH_MODE)``, a ``nn.Cell`` whose construct is the loss,
           ``ms.value_and_grad(cell)(x)``; PyNative is restored afterwards
=========  ================================================================================

:func:`value_and_grad_many` differentiates many such cases at once: in a compiled mode
as one graph, chained so that every rank runs their collectives in the same order.
"""

from __future__ import annotations

import mindspore as ms
from mindspore import nn, ops

MODES = ("pynative", "jit", "graph")

# Every function compiled here stays referenced for the life of the process: MindSpore
# caches compiled functions by object identity, and a freed closure's id reused by the
# next case's closure brought back the previous case's graph (measured: a
# reduce_scatter_to_sequence case traced gather_from_sequence's body).
_COMPILED_KEEP_ALIVE: list = []
DEFAULT_MODES = ("pynative", "jit")


def check_mode(mode: str) -> str:
    if mode not in MODES:
        raise ValueError(f"mode {mode!r} is invalid: expected one of {', '.join(MODES)}")
    return mode


class _LossCell(nn.Cell):
    """``construct(*xs) = loss(*xs)``: how GRAPH_MODE differentiates a function."""

    def __init__(self, loss):
        super().__init__()
        self.loss = loss

    def construct(self, *xs):
        return self.loss(*xs)


def value_and_grad(mode: str, loss, x, with_value: bool = True):
    """``((value, aux), grad)`` of ``loss(x) -> (value, aux)`` with respect to ``x``.

    ``loss`` must be a named function or closure (not a lambda, no default arguments:
    compiled code rejects both). With ``with_value=False`` only the gradient is asked
    for (``ms.grad``), and ``value`` is None.
    """
    check_mode(mode)
    if mode == "graph":
        ms.set_context(mode=ms.GRAPH_MODE)
        try:
            cell = _LossCell(loss)
            _COMPILED_KEEP_ALIVE.append(cell)
            return _differentiate(cell, x, with_value)
        finally:
            ms.set_context(mode=ms.PYNATIVE_MODE)
    if mode == "jit":
        return _differentiate(loss, x, with_value, compile_grad=True)
    return _differentiate(loss, x, with_value)


def _differentiate(fn, x, with_value, compile_grad=False):
    if compile_grad:
        _COMPILED_KEEP_ALIVE.append(fn)
    if with_value:
        grad_fn = ms.value_and_grad(fn, grad_position=0, has_aux=True)
        if compile_grad:
            grad_fn = ms.jit(grad_fn)
        (value, aux), grad = grad_fn(x)
        return (value, aux), grad
    grad_fn = ms.grad(fn, grad_position=0, has_aux=True)
    if compile_grad:
        grad_fn = ms.jit(grad_fn)
    grad, aux = grad_fn(x)
    return (None, aux[0] if isinstance(aux, tuple) else aux), grad


class _After(nn.Cell):
    """``construct(x, prev, zero) = x``, run after ``prev``; in the backward, ``prev``'s
    gradient is computed from ``x``'s, so it waits for it.

    Chains the cases of one compiled graph into a fixed order: ``prev`` is the previous
    case's loss (a float32 scalar computed from its mapping's output), so the order is
    forward 0, 1, ..., n-1, then backward n-1, ..., 0. Without it the cases'
    collectives are independent, and on an uneven split (other shapes per rank, an
    empty shard's other ops) ranks ran them in different orders, so that different
    collectives met (measured: a 40-byte ring all-reduce paired with a 64-byte one,
    "Memcpy error"). The link is arithmetic, ``zero * sum(dx)`` with ``zero`` a graph
    input (a runtime 0, which no pass can fold), not a ``depend`` on a zero gradient,
    which the optimizer may prune with the zero; the loss is float32, so the sum this adds
    has a CPU kernel (AddN has none for bfloat16, measured). The values stay exact:
    ``x`` passes unchanged and the previous loss's gradient becomes ``1 + 0``.
    """

    def construct(self, x, prev, zero):
        return ops.depend(x, prev)

    def bprop(self, x, prev, zero, out, dout):
        # One extra zero element before the sum: the CPU sum of an EMPTY tensor (a
        # zero-row shard's gradient) is not 0 (measured, see the mapping checks' loss).
        flat = ops.cat((dout.astype(ms.float32).reshape((-1,)), ops.zeros((1,), ms.float32)))
        return dout, (flat.sum() * zero).astype(prev.dtype), ops.zeros_like(zero)


def _batch_of(losses):
    """``batch(*xs, zero) = (sum_i loss_i(x_i), (value_i...), (aux_i...))``, one graph.

    Each ``x_i`` reaches only its own ``loss_i`` (case i starts after case i-1's loss
    through :class:`_After`, which adds exact zeros), so the gradient with respect to
    ``x_i`` of the sum is exactly ``loss_i``'s gradient. ``zero`` is a 0 passed at run
    time (see :class:`_After`).
    """
    n = len(losses)
    after = _After()

    def batch(*args):
        xs, zero = args[:n], args[n]
        total = ops.zeros((), ms.float32)
        values = ()
        auxs = ()
        for i in range(n):
            x = xs[i]
            if i > 0:
                x = after(x, values[i - 1], zero)
            value, aux = losses[i](x)
            total = total + value.astype(ms.float32)
            values = values + (value,)
            auxs = auxs + (aux,)
        return total, values, auxs

    return batch


def value_and_grad_many(mode: str, losses, xs, with_value: bool = True) -> list:
    """``value_and_grad(mode, loss_i, x_i)`` for every i, compiled as ONE graph.

    Each compilation has a fixed cost on top of its per-op cost, so a battery of N
    small cases compiled one by one pays it N times; compiled together it pays it once
    (measured: 10 mappings fwd+bwd on 2 ranks, 25-35 % less time), and the graph holds
    N mappings as a real train step does. PyNative runs the cases one by one (nothing
    to compile). See :func:`differentiate_batch` for the order the cases run in.

    Returns:
        One ``((value, aux), grad)`` per loss, as :func:`value_and_grad` returns them.
    """
    check_mode(mode)
    losses, xs = tuple(losses), tuple(xs)
    if mode == "pynative" or len(losses) == 1:
        return [value_and_grad(mode, loss, x, with_value) for loss, x in zip(losses, xs)]
    values, auxs, grads, _ = differentiate_batch(mode, losses, xs, with_value=with_value)
    return [((value, aux), grad) for value, aux, grad in zip(values, auxs, grads)]


def differentiate_batch(mode: str, losses, xs, weights=None, with_value: bool = True):
    """Differentiate ``loss_i(x_i) -> (value_i, aux_i)`` for every i as ONE compiled graph.

    ``mode`` is "jit" (the grad function under ``ms.jit``) or "graph" (GRAPH_MODE). The
    cases run in their order (see :class:`_After`), so callers must give every rank the
    same cases in the same order; their shapes may differ between ranks (an uneven
    split). ``weights`` (Parameters) are differentiated as well.

    Returns:
        ``(values, auxs, input_grads, weight_grads)``: tuples over the cases (``values``
        all None when ``with_value`` is False), and the weights' gradients in the order
        of ``weights`` (None without weights).
    """
    if mode not in ("jit", "graph"):
        raise ValueError(f"mode {mode!r} is invalid here: expected 'jit' or 'graph'")
    batch = _batch_of(tuple(losses))
    _COMPILED_KEEP_ALIVE.append(batch)
    differentiate = ms.value_and_grad if with_value else ms.grad
    options = dict(grad_position=tuple(range(len(xs))), weights=weights, has_aux=True)
    args = tuple(xs) + (ms.Tensor(0.0, ms.float32),)  # see _After: a runtime zero
    if mode == "graph":
        ms.set_context(mode=ms.GRAPH_MODE)
        try:
            cell = _LossCell(batch)
            _COMPILED_KEEP_ALIVE.append(cell)
            result = differentiate(cell, **options)(*args)
        finally:
            ms.set_context(mode=ms.PYNATIVE_MODE)
    else:
        grad_fn = differentiate(batch, **options)
        _COMPILED_KEEP_ALIVE.append(grad_fn)
        result = ms.jit(grad_fn)(*args)
    if with_value:
        (_, values, auxs), grads = result
    else:
        grads, (values, auxs) = result
        values = (None,) * len(xs)
    input_grads, weight_grads = grads if weights is not None else (grads, None)
    return values, auxs, input_grads, weight_grads
