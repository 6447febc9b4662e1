"""The pipeline runtime: run one training step's forwards and backwards over micro-batches.

:func:`forward_backward` builds the schedule of :mod:`.schedules` (pure data) for this
pipeline group and executes this rank's action list, step by step, nothing else:

==============  ===============================================================================
step            what this rank does
==============  ===============================================================================
``F{j}``        first model stage: ``y = stage(inputs[j])``; other stages: on the received
                activation. The last model stage computes ``loss_fn(y, targets[j]) / m`` and
                its gradients at once (``value_and_grad``), keeps the input gradient for
                ``B{j}``. Only the stage INPUT of micro-batch j is kept until ``B{j}``.
``B{j}``        ``grad of sum(stage(x) * dy)`` for the input and the parameters, with ``dy`` the
                received gradient of the output (the forward is recomputed from the kept
                input: full activation recomputation, so an in-flight micro-batch costs one
                stage input); the parameter gradients are summed over micro-batches.
``SEND_*``,     :func:`mindscience.distributed.p2p.transfer` with the neighbour; two joined by
``RECV_*``      ``+`` are one exchange.
==============  ===============================================================================

Execution: ``mode="pynative"`` runs the stage eagerly; ``mode="jit"`` compiles the stage's
forward and its backward (``ms.jit`` of the forward and of the ``ms.grad`` function), once
per stage, shape and schedule; the schedule itself is Python.

Shapes: the first call of a (group, schedule, micro-batches, chunks) combination exchanges
a small header with every transfer (both ends check shape and dtype and raise the same
:class:`~mindscience.distributed.p2p.P2PMismatchError`, nobody hangs); the receiver learns
the shape there when ``activation_shape`` is None. Later calls move the payload only.

Example, pp = 2, 4 micro-batches (every rank runs the same call)::

    loss, grads = forward_backward(stage, inputs, targets, loss_fn, schedule="1f1b")
    # loss: the mean over the 4 micro-batches, the same on both stages
    # grads: gradients of that loss for stage.trainable_params()
"""

from __future__ import annotations

import mindspore as ms
import numpy as np
from mindspore import nn, ops

from .. import collectives as C
from .. import p2p
from .schedules import SCHEDULES, build

__all__ = ["forward_backward", "PipelineError", "stage_parameters", "last_peak"]

MODES = ("pynative", "jit")


class PipelineError(ValueError):
    """Invalid arguments to :func:`forward_backward` (raised before any transfer)."""


# Compiled functions stay alive for the process (MindSpore caches them by identity).
_COMPILED: dict = {}
_LEARNED: dict = {}  # (group, schedule, m, v, mode, cells) -> {(direction, peer, chunk): (shape, dtype)}


_LAST: dict = {}
# Benchmarks set TIMING["intervals"] = [] to get (kind, start, end) of every step, each
# ended by a device synchronization (which costs time: off by default).
TIMING: dict = {}


def _now() -> float:
    import time

    ms.runtime.synchronize()
    return time.perf_counter()


def last_peak() -> int:
    """Micro-batches (x chunks) whose stage inputs the last call kept alive at once."""
    return _LAST.get("peak", 0)


def stage_parameters(stage) -> list:
    """The trainable parameters of a stage (a Cell) or of its chunks (a list), in order."""
    cells = list(stage) if isinstance(stage, (list, tuple)) else [stage]
    out = []
    for cell in cells:
        out.extend(cell.trainable_params())
    return out


def _pp_group(group):
    if group is not None:
        return C.resolve_group(group)
    from .. import manager

    return manager.get_pipeline_parallel_group()


def _check_args(stage, inputs, targets, loss_fn, schedule, mode):
    if schedule not in SCHEDULES:
        raise PipelineError(f"schedule={schedule!r} is unknown: expected one of {', '.join(SCHEDULES)}.")
    if mode not in MODES:
        raise PipelineError(f"mode={mode!r} is invalid: expected one of {', '.join(MODES)}.")
    if schedule == "interleaved":
        if not isinstance(stage, (list, tuple)) or not stage or not all(isinstance(c, nn.Cell) for c in stage):
            raise PipelineError(
                "schedule='interleaved' needs stage = a list of the v model chunks (nn.Cell) this "
                f"rank holds, got {type(stage).__name__}.")
    elif not isinstance(stage, nn.Cell):
        raise PipelineError(
            f"stage must be this rank's nn.Cell for schedule={schedule!r}, got "
            f"{type(stage).__name__} (a list of chunks needs schedule='interleaved').")
    if not isinstance(inputs, (list, tuple)) or not inputs:
        raise PipelineError("inputs must be a non-empty list of micro-batches (entries may be None "
                            "on stages other than the first).")
    if not isinstance(targets, (list, tuple)) or len(targets) != len(inputs):
        raise PipelineError(
            f"targets must be a list as long as inputs ({len(inputs)} micro-batches), got "
            f"{len(targets) if isinstance(targets, (list, tuple)) else type(targets).__name__}.")
    if not callable(loss_fn):
        raise PipelineError("loss_fn must be callable: loss_fn(output, target) -> scalar.")


def _agree(g, m, v, schedule) -> None:
    """Every pp rank runs the same schedule, micro-batches and chunks (checked once)."""
    mine = np.zeros((g.size, 3), np.float32)
    mine[g.rank] = (m, v, SCHEDULES.index(schedule))
    got = C.all_reduce(ms.Tensor(mine), g).asnumpy()
    if not (got == got[0]).all():
        table = "; ".join(f"pipeline rank {r}: m={int(a)} v={int(b)} {SCHEDULES[int(c)]}"
                          for r, (a, b, c) in enumerate(got))
        raise PipelineError(
            "forward_backward: the pipeline ranks disagree on the schedule, the number of "
            f"micro-batches or of model chunks ({table}); every rank must pass the same.")


class _StageFns:
    """The forward, backward and last-stage loss functions of one chunk, eager or compiled."""

    def __init__(self, cell, loss_fn, scale, mode, first, last):
        self.cell = cell
        self.params = cell.trainable_params()
        weights = self.params if self.params else None
        cell_ref = cell

        def forward(x):
            return cell_ref(x)

        def vjp(x, dy):
            return (cell_ref(x).astype(ms.float32) * dy.astype(ms.float32)).sum()

        def loss(x, t):
            return loss_fn(cell_ref(x), t) * scale

        pos = None if first else 0
        self.forward = forward
        self.backward = ms.grad(vjp, grad_position=pos, weights=weights)
        self.loss = ms.value_and_grad(loss, grad_position=pos, weights=weights)
        if mode == "jit":
            self.forward = ms.jit(forward)
            self.backward = ms.jit(self.backward)
            self.loss = ms.jit(self.loss)
        self.first = first
        self.keep = (forward, vjp, loss, self.forward, self.backward, self.loss)

    def split(self, grads):
        """``(input grad or None, parameter grads)`` from a grad function's result."""
        if self.first:
            return None, tuple(grads) if self.params else ()
        if not self.params:
            return grads, ()
        return grads[0], tuple(grads[1])


def _links(g, p, i, ring):
    """This rank's neighbour links, created in the order every rank agrees on."""
    me = g.ranks[i]
    pairs = set()
    for step in (-1, 1):
        j = i + step
        if ring:
            j %= p
        if 0 <= j < p and j != i:
            pairs.add(tuple(sorted((i, j))))
    # Pair (a, b) of pipeline ranks keyed by its lower end, the wrap pair (0, p-1) last.
    ordered = sorted(pairs, key=lambda ab: (ab == (0, p - 1) and p > 2, ab[0]))
    links = {}
    for a, b in ordered:
        other = b if a == i else a
        links[other] = p2p.link(me, g.ranks[other], me, False)
    return links


def forward_backward(stage, inputs, targets, loss_fn, *, schedule: str = "1f1b",
                     activation_shape=None, mode: str = "pynative", group=None):
    """One training step's forward and backward over ``len(inputs)`` micro-batches.

    Args:
        stage: This rank's ``nn.Cell``; for ``schedule="interleaved"`` the list of the v
            model chunks it holds (chunk c of pipeline rank i is model stage ``c * p + i``,
            Megatron's interleaved assignment).
        inputs: The micro-batches, read on the first stage; other stages pass a list of
            the same length (entries may be None).
        targets: Read on the last stage (entries may be None elsewhere).
        loss_fn: ``loss_fn(output, target) -> scalar`` (the mean over a micro-batch).
        schedule: ``"1f1b"``, ``"gpipe"`` or ``"interleaved"`` (m % p == 0).
        activation_shape: Shape of the tensor between stages; None = learned from the
            first call's headers. Either way the first call checks both ends.
        mode: ``"pynative"`` or ``"jit"`` (the stage's forward and backward compiled).
        group: The pipeline group; default the manager's ``pp`` group.

    Returns:
        ``(loss, grads)``: ``loss`` the mean over micro-batches (a float32 scalar tensor,
        the same on every rank of the pipeline group); ``grads`` the gradients of that loss
        for :func:`stage_parameters` ``(stage)``, summed over micro-batches.

    Raises:
        PipelineError: bad arguments, or ranks that disagree on schedule / m / v.
        ScheduleError: m not a multiple of p for "interleaved".
        P2PMismatchError: the stages' tensors disagree in shape or dtype (first call).
    """
    _check_args(stage, inputs, targets, loss_fn, schedule, mode)
    g = _pp_group(group)
    p, i = g.size, g.rank
    cells = list(stage) if schedule == "interleaved" else [stage]
    m, v = len(inputs), len(cells)
    sched = build(schedule, p, m, v)
    # Per model too: another stage (or another activation_shape) learns its shapes anew.
    key = (g.ranks, schedule, m, v, mode, tuple(id(c) for c in cells),
           None if activation_shape is None else tuple(activation_shape))
    learned = _LEARNED.get(key)
    first_call = learned is None
    if first_call:
        if p > 1:
            _agree(g, m, v, schedule)
        learned = {}
    stages = p * v
    fns = []
    for c, cell in enumerate(cells):
        gidx = c * p + i
        fkey = (id(cell), m, mode, gidx == 0, gidx == stages - 1)  # any schedule
        f = _COMPILED.get(fkey)
        if f is None:
            f = _StageFns(cell, loss_fn, 1.0 / m, mode, gidx == 0, gidx == stages - 1)
            _COMPILED[fkey] = f
        fns.append(f)
    links = _links(g, p, i, ring=v > 1) if p > 1 else {}
    run = _Run(sched, g, p, i, v, fns, inputs, targets, links, learned, first_call,
               activation_shape)
    run.execute()
    _LAST["peak"] = run.peak
    _LEARNED[key] = learned
    loss = run.loss
    if p > 1:
        loss = C.all_reduce(loss, g)
    grads = []
    for acc, f in zip(run.grads, fns):
        grads.extend(acc if acc is not None else tuple(ops.zeros(q.shape, q.dtype) for q in f.params))
    return loss, tuple(grads)


class _Run:
    """One execution of this rank's action list."""

    def __init__(self, sched, g, p, i, v, fns, inputs, targets, links, learned, check, shape):
        self.sched, self.g, self.p, self.i, self.v = sched, g, p, i, v
        self.fns, self.inputs, self.targets = fns, inputs, targets
        self.links, self.learned, self.check = links, learned, check
        self.shape = None if shape is None else tuple(int(d) for d in shape)
        self.stages = p * v
        self.kept = {}      # (j, c) -> stage input (until B)
        self.out = {}       # ("F"|"B", j, c) -> tensor to send
        self.got = {}       # ("F"|"B", j, c) -> received (or local) tensor
        self.dx = {}        # (j, c) -> last stage's input gradient, from F
        self.grads = [None] * v
        self.loss = ms.Tensor(0.0, ms.float32)
        self.in_flight = [0] * v
        self.peak = 0

    def execute(self):
        timing = TIMING.get("intervals")
        for step in self.sched.steps[self.i]:
            a = step[0]
            t0 = _now() if timing is not None else 0.0
            if a.kind == "F":
                self.forward(a.microbatch, a.chunk)
            elif a.kind == "B":
                self.backward(a.microbatch, a.chunk)
            else:
                self.transfer(step)
            if timing is not None:
                timing.append((a.kind, t0, _now()))

    def _accumulate(self, c, grads):
        acc = self.grads[c]
        self.grads[c] = grads if acc is None else tuple(x + y for x, y in zip(acc, grads))

    def _deliver(self, kind, j, gidx, tensor):
        """Keep ``tensor`` to send, or hand it to this rank's next chunk (p == 1)."""
        nxt = gidx + 1 if kind == "F" else gidx - 1
        if 0 <= nxt < self.stages and nxt % self.p == self.i:
            self.got[(kind, j, nxt // self.p)] = tensor
        else:
            self.out[(kind, j, gidx // self.p)] = tensor

    def forward(self, j, c):
        gidx = c * self.p + self.i
        f = self.fns[c]
        x = self.inputs[j] if gidx == 0 else self.got.pop(("F", j, c))
        if gidx == self.stages - 1:
            value, grads = f.loss(x, self.targets[j])
            dx, dparams = f.split(grads)
            self.loss = self.loss + value.astype(ms.float32)
            self._accumulate(c, dparams)
            self.dx[(j, c)] = dx
        else:
            self.kept[(j, c)] = x
            self._deliver("F", j, gidx, f.forward(x))
        self.in_flight[c] += 1
        self.peak = max(self.peak, sum(self.in_flight))

    def backward(self, j, c):
        gidx = c * self.p + self.i
        f = self.fns[c]
        if gidx == self.stages - 1:
            dx = self.dx.pop((j, c))
        else:
            x = self.kept.pop((j, c))
            dy = self.got.pop(("B", j, c))
            dx, dparams = f.split(f.backward(x, dy))
            self._accumulate(c, dparams)
        self.in_flight[c] -= 1
        if gidx > 0:
            self._deliver("B", j, gidx, dx)

    def transfer(self, step):
        peer = step[0].peer
        send = None
        recv = None
        for a in step:
            if a.kind.startswith("SEND"):
                send = self.out.pop((a.kind[-1], a.microbatch, a.chunk))
            else:
                recv = a
        spec = None
        if recv is not None:
            spec = self.learned.get((recv.kind, peer, recv.chunk))
        me = self.g.ranks[self.i]
        other = self.g.ranks[peer]
        lk = self.links[peer]
        if self.check:
            what = (f"pipeline step {'+'.join(map(str, step))} between pipeline ranks {self.i} "
                    f"and {peer}")
            expect = None
            if recv is not None:
                expect = ("any", None) if self.shape is None else (self.shape, None)
            spec = p2p.exchange_header(lk, send, expect, what, me, other)
            if recv is not None:
                self.learned[(recv.kind, peer, recv.chunk)] = spec
        got = p2p.transfer(lk, send, None if recv is None else spec[0],
                           None if recv is None else spec[1], check=False)
        if recv is not None:
            self.got[(recv.kind[-1], recv.microbatch, recv.chunk)] = got
