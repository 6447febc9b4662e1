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
                received gradient of the output; the parameter gradients are summed over
                micro-batches. ``recompute="full"`` (default): the forward is recomputed from
                the kept input (an in-flight micro-batch costs one stage input). Kept
                activations (``"none"``/``"selective"``): ``F{j}`` ran the stage as a
                ``set_grad`` top cell and ``B{j}`` back-propagates that very forward
                (``GradOperation`` on the same input tensor), no second forward.
``SEND_*``,     :func:`mindscience.distributed.p2p.transfer` with the neighbour; two joined by
``RECV_*``      ``+`` are one exchange.
==============  ===============================================================================

Recompute: :func:`~.recompute.runtime_recompute` says what runs for a configuration
(``last_recompute()`` returns it for the last call). Every schedule keeps its forwards
when asked (``"none"``/``"selective"``) and back-propagates them in its own order, in
PyNative and under jit; under jit with collectives in the stage (tp, cp, ep or
``fully_shard``) it recomputes (``"full"``, a
``UserWarning`` once per configuration says why). The last stage computes its loss and
gradients in one pass (nothing to recompute).

Execution: ``mode="pynative"`` runs the stage eagerly; ``mode="jit"`` compiles the stage's
forward and its backward (``ms.jit``), the parameter gradients summed over micro-batches
inside the compiled backward; the schedule itself is Python. The functions are cached on
the stage cell (:mod:`.stage_fns`): rebuilt when its trainable parameters change, and per
``loss_fn`` object, so pass the same ``loss_fn`` every step (a fresh closure is traced, and
under jit compiled, again at each call; MindSpore 2.10 keeps every compiled function, and
the cell it calls, for the life of the process).

Shapes: the first call of a (group, schedule, micro-batches, chunks, mode,
activation_shape) combination exchanges a small header with every transfer (both ends
check shape and dtype and raise the same
:class:`~mindscience.distributed.p2p.P2PMismatchError`, nobody hangs) after one small sum
over the group in which the ranks agree on schedule, m and v and report bad data (so
every rank raises together); the receiver learns the shape there when
``activation_shape`` is None. Later calls move the payload only: the sending rank checks
that each tensor still has the first call's shape and dtype and raises
:class:`PipelineError` otherwise, alone (the receiver cannot know without a collective).
The others wait in their next transfer until the job ends: ``msrun --join=True`` kills
them as soon as the raising rank exits (measured: within the second; msrun itself exits
30 s later, when its scheduler times the rank out). First-stage inputs must share one
shape and dtype.

Example, pp = 2, 4 micro-batches (every rank runs the same call)::

    loss, grads = forward_backward(stage, inputs, targets, loss_fn, schedule="1f1b")
    # loss: the mean over the 4 micro-batches, the same on both stages
    # grads: gradients of that loss for stage.trainable_params()
"""

from __future__ import annotations

import functools
import warnings

import mindspore as ms
import numpy as np
from mindspore import ops

from .. import collectives as C
from .. import p2p
from .arguments import (MODES, PipelineError, check_activation_shape, check_args,
                        check_recompute, data_problem)
from .recompute import runtime_recompute
from .schedules import SCHEDULES, build
from .stage_fns import any_order_recompute, cache_of, stage_fns

# The action lists of one configuration never change, and building them (two placements,
# a simulation, a validation) costs 1-500 ms: once per (schedule, p, m, v), not per step.
_schedule = functools.lru_cache(maxsize=64)(build)
_WARNED: set = set()

__all__ = ["forward_backward", "PipelineError", "stage_parameters", "last_peak",
           "last_recompute", "MODES"]

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


def last_recompute() -> tuple:
    """``(what_runs, reason)`` of the last call (see :func:`.recompute.runtime_recompute`)."""
    return _LAST.get("recompute", ("full", "no call yet"))


def stage_parameters(stage) -> list:
    """The trainable parameters of a stage (a Cell) or of its chunks (a list), in order."""
    cells = list(stage) if isinstance(stage, (list, tuple)) else [stage]
    out = []
    for cell in cells:
        out.extend(cell.trainable_params())
    return out


def _model_parallel(cells) -> int:
    """The ranks a stage's forward exchanges data with (1: no collective inside it).

    ``tp * cp * ep * etp`` of the manager's layout, or at least 2 when a chunk holds
    ``fully_shard`` parameters (gathered over dp-cp in the forward).
    """
    from .. import manager

    n = 1
    if manager.is_initialized():
        n = (manager.get_tensor_parallel_world_size() * manager.get_context_parallel_world_size()
             * manager.get_expert_model_parallel_world_size()
             * manager.get_expert_tensor_parallel_world_size())
    if n == 1 and any(getattr(q, "fsdp", None) is not None
                      for cell in cells for q in cell.get_parameters()):
        n = 2
    return n


def _context_parallel() -> int:
    """The manager's cp size (1 without a layout): jit keeps no stage with cp > 1."""
    from .. import manager

    return manager.get_context_parallel_world_size() if manager.is_initialized() else 1


def _pp_group(group):
    if group is not None:
        return C.resolve_group(group)
    from .. import manager

    return manager.get_pipeline_parallel_group()


def _agree(g, m, v, schedule, problem, keep=False) -> None:
    """Every pp rank runs the same schedule (with kept activations or not), micro-batches
    and chunks, and has good data.

    One small sum over the group at the first call of a configuration. A rank whose own
    micro-batches are bad (``problem``) takes part all the same, so that every rank raises
    here instead of waiting for it in a transfer.
    """
    mine = np.zeros((g.size, 4), np.float32)
    # A kept schedule runs other action lists than its recomputing one: a schedule of its own.
    mine[g.rank] = (m, v, SCHEDULES.index(schedule) + len(SCHEDULES) * bool(keep),
                    problem is not None)
    got = C.all_reduce(ms.Tensor(mine), g).asnumpy()
    if problem is not None:
        raise PipelineError(problem)
    bad = [r for r in range(g.size) if got[r, 3]]
    if bad:
        raise PipelineError(
            f"forward_backward: pipeline rank(s) {bad} of {g.size} passed bad micro-batches "
            "(inputs on the first stage, targets on the last; their own error says which), "
            "so no rank starts the step.")
    if not (got[:, :3] == got[0, :3]).all():
        def name(c):
            kept = int(c) >= len(SCHEDULES)
            return SCHEDULES[int(c) % len(SCHEDULES)] + (" (activations kept)" if kept else "")

        table = "; ".join(f"pipeline rank {r}: m={int(a)} v={int(b)} {name(c)}"
                          for r, (a, b, c, _) in enumerate(got))
        raise PipelineError(
            "forward_backward: the pipeline ranks disagree on the schedule, the number of "
            f"micro-batches or of model chunks, or on recompute ({table}); every rank must "
            "pass the same.")


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
                     activation_shape=None, mode: str = "pynative", group=None,
                     recompute: str = "full", on_chunk_done=None):
    """One training step's forward and backward over ``len(inputs)`` micro-batches.

    Args:
        stage: This rank's ``nn.Cell``; for ``schedule="interleaved"`` the list of the v
            model chunks it holds (chunk c of pipeline rank i is model stage ``c * p + i``,
            Megatron's interleaved assignment).
        inputs: The micro-batches, read on the first stage (Tensors of one shape and
            dtype); other stages pass a list of the same length (entries may be None).
        targets: Read on the last stage (Tensors; entries may be None elsewhere).
        loss_fn: ``loss_fn(output, target) -> scalar`` (the mean over a micro-batch). Pass
            the same object every step: a new one (a fresh ``lambda`` or closure per call)
            is traced again, and under ``mode="jit"`` compiled again, at every call.
        schedule: ``"1f1b"``, ``"gpipe"`` or ``"interleaved"`` (m % p == 0).
        activation_shape: Shape of the tensor between stages (a tuple of positive ints);
            None = learned from the first call's headers. Either way the first call of a
            configuration checks both ends; later calls check on the sending side that
            what it sends still has the shape and dtype of the first call.
        mode: ``"pynative"`` or ``"jit"`` (the stage's forward and backward compiled).
        group: The pipeline group; default the manager's ``pp`` group.
        recompute: ``"full"`` (default): every stage but the last keeps only its input per
            micro-batch in flight and recomputes its forward in the backward. ``"none"`` /
            ``"selective"``: keep the stage forwards until their backwards (no second
            forward; the cells the model marks with ``recompute`` still recompute inside),
            every schedule, in PyNative, and under jit also with tp collectives in the
            stage (with cp > 1 ``mode="jit"`` runs ``"full"``, a ``UserWarning`` once per
            configuration says so); see :func:`~.recompute.runtime_recompute` and
            :func:`last_recompute`.
        on_chunk_done: Called as ``on_chunk_done(c, params, grads)`` right after chunk
            ``c``'s last backward, when its gradients (``grads``, summed over the
            micro-batches, one per ``params``) are final; e.g. to launch their dp-cp
            reduction while the rest of the schedule runs
            (``DistributedOptimizer.grads_ready``). None: nothing is called.

    Returns:
        ``(loss, grads)``: ``loss`` the mean over micro-batches (a float32 scalar tensor,
        the same on every rank of the pipeline group); ``grads`` the gradients of that loss
        for :func:`stage_parameters` ``(stage)``, summed over micro-batches (inside the
        compiled backward under ``mode="jit"``, in place in PyNative).

    Raises:
        PipelineError: bad arguments (before any transfer; at the first call of a
            configuration every rank raises, later only the rank with the bad data), ranks
            that disagree on schedule / m / v, or a stage whose activation or input
            gradient changed shape or dtype since the first call (raised by the sending
            rank alone; under ``msrun --join=True`` its exit ends the job).
        ScheduleError: m not a multiple of p for "interleaved".
        P2PMismatchError: the stages' tensors disagree in shape or dtype (first call).
    """
    check_args(stage, inputs, targets, loss_fn, schedule, mode)
    check_recompute(recompute)
    shape = check_activation_shape(activation_shape)
    g = _pp_group(group)
    p, i = g.size, g.rank
    cells = list(stage) if schedule == "interleaved" else [stage]
    m, v = len(inputs), len(cells)
    stages = p * v
    what_runs, reason = runtime_recompute(schedule, mode, recompute, p, v,
                                          _model_parallel(cells) if mode == "jit" else 1,
                                          context_parallel=_context_parallel())
    keep = what_runs != "full" and p * v > 1
    if recompute != "full" and what_runs == "full" and (schedule, mode, recompute) not in _WARNED:
        _WARNED.add((schedule, mode, recompute))
        warnings.warn(f"forward_backward: {reason}", UserWarning, stacklevel=2)
    _LAST["recompute"] = (what_runs, reason)
    sched = _schedule(schedule, p, m, v)
    problem = data_problem(inputs, targets, i == 0, i == p - 1, p, i)
    # The shapes learned at the first call live on the (first) chunk: they die with it.
    # The other chunks are in the key itself (Cells hash by identity), which keeps them alive.
    learned_all = cache_of(cells[0]).learned
    key = (g.ranks, schedule, m, v, mode, tuple(cells[1:]), shape, keep)
    entry = learned_all.get(key)
    first_call = entry is None
    if first_call and p > 1:
        if keep:
            _agree(g, m, v, schedule, problem, keep=True)
        else:
            _agree(g, m, v, schedule, problem)
    if problem is not None:
        raise PipelineError(problem)
    learned = {} if first_call else entry
    fns = [stage_fns(cell, loss_fn, mode, c * p + i == 0, c * p + i == stages - 1)
           for c, cell in enumerate(cells)]
    if keep and mode == "pynative":
        for c, cell in enumerate(cells):
            if c * p + i != stages - 1:
                any_order_recompute(cell)
    links = _links(g, p, i, ring=v > 1) if p > 1 else {}
    run = _Run(sched, g, p, i, v, fns, inputs, targets, links, learned, first_call, shape, keep)
    run.on_chunk_done = on_chunk_done
    run.execute()
    _LAST["peak"] = run.peak
    if first_call:
        learned_all[key] = learned
    loss = run.loss
    if p > 1:
        loss = C.all_reduce(loss, g)
    grads = []
    for acc in run.grads:
        grads.extend(acc)
    return loss, tuple(grads)


class _Run:
    """One execution of this rank's action list."""

    def __init__(self, sched, g, p, i, v, fns, inputs, targets, links, learned, check, shape,
                 keep=False):
        self.sched, self.g, self.p, self.i, self.v = sched, g, p, i, v
        self.keep_forward = keep
        self.fns, self.inputs, self.targets = fns, inputs, targets
        self.links, self.learned, self.check = links, learned, check
        self.shape = shape
        self.stages = p * v
        self.kept = {}      # (j, c) -> stage input (its forward kept by MindSpore when kept)
        self.out = {}       # ("F"|"B", j, c) -> tensor to send
        self.got = {}       # ("F"|"B", j, c) -> received (or local) tensor
        self.dx = {}        # (j, c) -> last stage's input gradient, from F
        self.grads = [f.zeros() for f in fns]  # per chunk, the parameter-gradient sums
        self.loss = ops.zeros((), ms.float32)
        self.scale = ms.Tensor(1.0 / len(inputs), ms.float32)
        self.in_flight = [0] * v
        self.peak = 0
        self.backwards = [0] * v  # backwards done per chunk
        self.on_chunk_done = None

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
            dx, self.grads[c], self.loss = f.loss(x, self.targets[j], self.scale, self.grads[c],
                                                  self.loss)
            self.dx[(j, c)] = dx
        elif self.keep_forward:
            if any(x is k for k in self.kept.values()):
                # MindSpore finds a kept forward by its input's identity: the same tensor
                # passed for two micro-batches in flight gets a copy of its own.
                x = x.copy()
            y, self.kept[(j, c)] = f.keep(x)
            self._deliver("F", j, gidx, y)
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
        elif self.keep_forward:
            dy = self.got.pop(("B", j, c))
            dx, self.grads[c] = f.backward_kept(self.kept.pop((j, c)), dy, self.grads[c])
        else:
            x = self.kept.pop((j, c))
            dy = self.got.pop(("B", j, c))
            dx, self.grads[c] = f.backward(x, dy, self.grads[c])
        self.in_flight[c] -= 1
        self.backwards[c] += 1
        if self.on_chunk_done is not None and self.backwards[c] == len(self.inputs):
            self.on_chunk_done(c, self.fns[c].params, self.grads[c])
        if gidx > 0:
            self._deliver("B", j, gidx, dx)

    def _check_send(self, a, peer, send):
        """The tensor sent must have the first call's shape and dtype (the receiver uses them).

        Local (no collective): the receiver cannot know, so this rank raises alone.
        """
        key = (a.kind, peer, a.chunk)
        now = (tuple(send.shape), send.dtype)
        if self.check:
            self.learned[key] = now
            return
        want = self.learned.get(key)
        if want is None or want == now:
            return
        what = "activation" if a.kind == "SEND_F" else "input gradient"
        raise PipelineError(
            f"pipeline rank {self.i} (model stage {a.chunk * self.p + self.i}, "
            f"{self.sched.name}) is about to send the {what} of micro-batch {a.microbatch} "
            f"with shape {now[0]} {now[1]} to pipeline rank {peer}, which receives shape "
            f"{want[0]} {want[1]} (exchanged at the first call of this configuration): a "
            "stage's output changed shape or dtype between steps. Keep the micro-batch "
            "shapes fixed, or pass activation_shape=<the new shape> on every rank for such "
            "steps (each distinct activation_shape exchanges shapes once). This rank stops "
            "here, alone: the others wait for it until the job ends (msrun --join=True "
            "kills the other ranks when one exits with an error).")

    def transfer(self, step):
        peer = step[0].peer
        send = None
        recv = None
        for a in step:
            if a.kind.startswith("SEND"):
                send = self.out.pop((a.kind[-1], a.microbatch, a.chunk))
                self._check_send(a, peer, send)
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
