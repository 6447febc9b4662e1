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
"""

from __future__ import annotations

import mindspore as ms
from mindspore import nn

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
    """``construct(x) = loss(x)``: how GRAPH_MODE differentiates a function."""

    def __init__(self, loss):
        super().__init__()
        self.loss = loss

    def construct(self, x):
        return self.loss(x)


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
