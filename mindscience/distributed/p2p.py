"""Point-to-point transfers: a ring shift for any group and Megatron's pipeline sends.

Two families:

* :func:`ring_shift` ``(x, group, offset=1)``: group rank r sends ``x`` to group rank
  ``(r + offset) mod n`` and returns what ``(r - offset) mod n`` sent. Differentiable (the
  gradient shifts back by ``-offset``) in PyNative, under ``mindspore.jit`` and in
  GRAPH_MODE, like the mappings. Ring attention passes its k/v blocks with it.
* Megatron's names over this rank's pipeline group (``manager``'s ``pp`` group):
  :func:`send_forward`, :func:`recv_forward`, :func:`send_backward`,
  :func:`recv_backward`, :func:`send_forward_recv_backward`,
  :func:`send_backward_recv_forward`. Eager (the schedule is Python); at the first or
  last stage the missing neighbour makes the call a no-op that returns None.

How a tensor moves (the backend is chosen where the collectives choose it,
:func:`mindscience.distributed.collectives.get_backend`):

===========  =============================================================================
backend      one transfer between neighbours a and b
===========  =============================================================================
composed     a 2-rank communicator per neighbour pair (``msdp2p-<a>-<b>``). Eager
(CPU)        (``mint.distributed``): a gather over the pair, one way (the receiver's own
             part is dropped) or both. Compiled (``ops.AllReduce``, bfloat16 summed in
             float32, exact): a one-way send is a sum of ``x`` (sender) and zeros
             (receiver). Only the one tensor moves between the two ranks; no other rank
             of the group takes part.
native       ``ops.Send`` / ``ops.Receive`` on the same pair communicator (Ascend/GPU;
             UNTESTED on this project's hardware, which is CPU only)
===========  =============================================================================

Why: MindSpore 2.10's CPU build has no working point-to-point call in any API family
(``mint.distributed.send/recv/isend/irecv`` look for ``hccl_world_group``,
``batch_isend_irecv`` has no kernel, ``ops.Send``/``ops.Receive`` are unsupported), while a
sum or gather over a 2-rank group works eagerly and compiled.

Ordering: the pair transfers are blocking rendezvous between two ranks. A ring shift
over n > 2 ranks runs its two transfers in one order that every rank agrees on (pair
``{s, s+offset}`` keyed by ``(s mod 2, s)`` when n is even and the offset odd, else by
``s``), so the lowest pending pair can always proceed: no deadlock, and for an even ring
the even pairs move at once, then the odd ones. Pair communicators are created the same
way, in that agreed order, by the members only.

Mismatched ends: with ``check=True`` (the default) every eager call first exchanges a
small header (shape and dtype of what each end sends and expects) and raises
:class:`P2PMismatchError` on BOTH ends when they disagree, before the payload moves, so
nobody hangs. Both ends must pass the same ``check``. Compiled code has static shapes and
skips the header.

Example, 4 ranks in one group, rank r holds ``x = [r]``::

    ring_shift(x, group)             # rank 0: [3.], rank 1: [0.], rank 2: [1.], rank 3: [2.]
    ring_shift(x, group, offset=-1)  # rank 0: [1.], rank 1: [2.], ...

Pipeline, pp = 2 (ranks 0 and 1)::

    # rank 0 (first stage)                 # rank 1 (last stage)
    send_forward(y)                        x = recv_forward((4, 8), ms.float32)
    g = recv_backward((4, 8), ms.float32)  send_backward(dx)
"""

from __future__ import annotations

import numbers

import numpy as np
from mindspore import Tensor, nn, ops
from mindspore import dtype as mstype

from . import collectives as C
from .collectives import GroupLike, compiling
from .group import ParallelGroup

__all__ = [
    "P2PMismatchError", "ring_shift", "send_forward", "recv_forward", "send_backward",
    "recv_backward", "send_forward_recv_backward", "send_backward_recv_forward",
    "pair_group", "link", "transfer", "exchange_header",
]

_DTYPES = (mstype.float32, mstype.float16, mstype.bfloat16, mstype.float64, mstype.int32,
           mstype.int64, mstype.int8, mstype.uint8, mstype.bool_, mstype.int16)
_MAX_NDIM = 8
_SIG = 3 + _MAX_NDIM  # present flag, ndim, the dims (zero-padded), the dtype code


class P2PMismatchError(ValueError):
    """The two ends of a transfer disagree on the shape or dtype of what moves."""


# ------------------------------------------------------------------ pair groups
_PAIRS: dict = {}


def _create_backend_group(name, ranks):
    from mindspore.communication import create_group

    create_group(name, list(ranks))


def pair_group(rank_a: int, rank_b: int, my_rank: int) -> ParallelGroup:
    """The 2-rank group of global ranks ``rank_a`` and ``rank_b`` seen from ``my_rank``.

    Created on first use by the two members only (a collective call between them) and
    cached for the process; the name ``msdp2p-<low>-<high>`` is the same on both ends.
    """
    lo, hi = sorted((int(rank_a), int(rank_b)))
    if lo == hi:
        raise ValueError(f"a point-to-point pair needs two different ranks, got {lo} twice")
    if my_rank not in (lo, hi):
        raise ValueError(f"rank {my_rank} is not a member of the pair ({lo}, {hi})")
    group = _PAIRS.get((lo, hi))
    if group is None:
        if compiling():
            raise RuntimeError(
                f"the point-to-point pair ({lo}, {hi}) has no communicator yet and none can be "
                "created inside compiled code: call the transfer once eagerly first")
        name = f"msdp2p-{lo}-{hi}"
        _create_backend_group(name, (lo, hi))
        group = ParallelGroup(key="p2p", ranks=(lo, hi), rank=0 if my_rank == lo else 1,
                              backend_name=name)
        _PAIRS[(lo, hi)] = group
    return group


# ------------------------------------------------------------------ link kernels
class _ComposedLink(nn.Cell):
    """One neighbour pair over a 2-rank collective (CPU). ``me`` is 0 or 1 in the pair.

    Eagerly a transfer is a 2-rank all-gather (the receiver's own part is discarded): it
    moves the bytes once each way in one round, where the all-reduce takes two rounds and
    an addition. Measured on 4 ranks, 2 cores (medians of 15): a shift of the 4-rank ring
    took 64 / 68 / 216 ms at 1 KiB / 256 KiB / 4 MiB over gathers against 85 / 108 / 251 ms
    over all-reduces. Compiled, the CPU gather is itself an all-reduce of twice the bytes,
    so there the partner adds zeros to an all-reduce (the sum it receives is x, exactly).
    """

    def __init__(self, group: ParallelGroup, compiled: bool):
        super().__init__()
        self.k = C.kernels(group, compiled)
        self.me = group.rank
        self.by_gather = not compiled

    def send(self, x):
        if self.by_gather:
            return self.k._gather_parts(x)[self.me]
        return self.k.all_reduce(x)

    def recv(self, zeros):
        if self.by_gather:
            return self.k._gather_parts(zeros)[1 - self.me]
        return self.k.all_reduce(zeros)

    def exchange(self, x):
        parts = self.k._gather_parts(x)
        return parts[1 - self.me]


class _NativeLink(nn.Cell):
    """One neighbour pair over ``ops.Send`` / ``ops.Receive`` (Ascend/GPU, untested here)."""

    def __init__(self, group: ParallelGroup, compiled: bool):
        super().__init__()
        self.group_name = group.group_name
        self.me = group.rank
        self.other = 1 - group.rank
        self.sender = ops.Send(0, self.other, group=self.group_name)

    def send(self, x):
        return ops.depend(x, self.sender(x))

    def recv(self, zeros):
        receiver = ops.Receive(0, self.other, tuple(zeros.shape), zeros.dtype, group=self.group_name)
        return receiver(ops.depend(zeros, zeros))

    def exchange(self, x):
        zeros = ops.zeros(x.shape, x.dtype)
        if self.me == 0:
            t = self.send(x)
            return self.recv(ops.depend(zeros, t))
        y = self.recv(zeros)
        self.send(ops.depend(x, y))
        return y


_LINKS: dict = {}


def link(rank_a: int, rank_b: int, my_rank: int, compiled=None):
    """The transfer cell between global ranks ``rank_a`` and ``rank_b`` (cached per mode).

    ``compiled``: for code that compiles (None asks :func:`compiling`, which only a
    function called from traced code can; a Cell's ``__init__`` must pass it).
    """
    if compiled is None:
        compiled = compiling()
    g = pair_group(rank_a, rank_b, my_rank)
    backend = C.get_backend().name
    key = (g.ranks, backend, compiled)
    cell = _LINKS.get(key)
    if cell is None:
        cell = (_NativeLink if backend == "native" else _ComposedLink)(g, compiled)
        _LINKS[key] = cell
    return cell


# ------------------------------------------------------------------ headers
def _dtype_code(dtype) -> int:
    for i, d in enumerate(_DTYPES):
        if d == dtype:
            return i + 1
    raise ValueError(f"p2p: unsupported dtype {dtype}: expected one of {', '.join(map(str, _DTYPES))}")


def _signature(shape, dtype, flag=1.0) -> list:
    """``[flag, ndim, d0, ..., d7, code]``; flag 0 = nothing moves, 1 = exact, 2 = any
    tensor (a receiver that learns the shape), 3 = this shape, any dtype."""
    if shape is None:
        return [float(flag if flag == 2.0 else 0.0)] + [0.0] * (_SIG - 1)
    shape = tuple(int(d) for d in shape)
    if len(shape) > _MAX_NDIM:
        raise ValueError(f"p2p: tensors of rank > {_MAX_NDIM} are not supported, got shape {shape}")
    dims = list(shape) + [0] * (_MAX_NDIM - len(shape))
    code = 0.0 if dtype is None else float(_dtype_code(dtype))
    return [float(flag), float(len(shape))] + [float(d) for d in dims] + [code]


def _describe(sig) -> str:
    if sig[0] == 0:
        return "nothing"
    if sig[0] == 2:
        return "any tensor"
    ndim = int(sig[1])
    dims = tuple(int(d) for d in sig[2:2 + ndim])
    dtype = "any dtype" if sig[-1] == 0 else str(_DTYPES[int(sig[-1]) - 1])
    return f"shape {dims} {dtype}"


def _fits(sent, expected) -> bool:
    """Does what one end sends fit what the other expects?"""
    if expected[0] == 2:
        return sent[0] == 1
    if expected[0] == 3:
        return sent[0] == 1 and sent[1:-1] == expected[1:-1]
    return sent == expected


def _spec(sig):
    ndim = int(sig[1])
    return tuple(int(d) for d in sig[2:2 + ndim]), _DTYPES[int(sig[-1]) - 1]


def exchange_header(lk, send, expect, what, me_rank, other_rank):
    """Swap headers over link ``lk``: what each end sends, and what it expects to receive.

    Args:
        send: The tensor this end sends, or None.
        expect: None (nothing received), ``("any", None)`` (learn the shape and dtype),
            ``(shape, None)`` (this shape, any dtype) or ``(shape, dtype)``.

    Returns:
        ``(shape, dtype)`` of the tensor the other end sends (None when it sends nothing).

    Raises:
        P2PMismatchError: on BOTH ends, when either direction does not fit.
    """
    mine_send = _signature(None if send is None else send.shape, None if send is None else send.dtype)
    if expect is None:
        mine_expect = _signature(None, None, 0.0)
    elif expect[0] == "any":
        mine_expect = _signature(None, None, 2.0)
    else:
        mine_expect = _signature(expect[0], expect[1], 1.0 if expect[1] is not None else 3.0)
    theirs = lk.exchange(Tensor(np.asarray(mine_send + mine_expect, np.float32))).asnumpy().tolist()
    their_send, their_expect = theirs[:_SIG], theirs[_SIG:]
    problems = []
    if not _fits(their_send, mine_expect):
        problems.append(f"rank {me_rank} expects {_describe(mine_expect)} from rank {other_rank}, "
                        f"which sends {_describe(their_send)}")
    if not _fits(mine_send, their_expect):
        problems.append(f"rank {me_rank} sends {_describe(mine_send)} to rank {other_rank}, "
                        f"which expects {_describe(their_expect)}")
    if problems:
        raise P2PMismatchError(
            f"{what}: the two ends disagree: " + "; ".join(problems) + ". Pass the receiving "
            "call the shape and dtype that the other end sends (for the pipeline: the "
            "activation_shape every stage exchanges).")
    return _spec(their_send) if their_send[0] == 1 else None


def transfer(lk, send=None, recv_shape=None, recv_dtype=None, *, check=True, what="p2p",
             me_rank=0, other_rank=1):
    """One eager transfer over link ``lk``: send ``send`` and/or receive a tensor.

    Returns the received tensor (or None when nothing is received). A send and a receive
    of the same shape and dtype go as one exchange.
    """
    if check:
        exchange_header(lk, send, None if recv_shape is None else (recv_shape, recv_dtype),
                        what, me_rank, other_rank)
    if send is not None and recv_shape is not None:
        if tuple(send.shape) == tuple(recv_shape) and send.dtype == recv_dtype:
            return lk.exchange(send.contiguous())
        # Different shapes each way: two transfers, the pair's rank 0 sending first.
        if lk.me == 0:
            lk.send(send)
            return lk.recv(ops.zeros(tuple(recv_shape), recv_dtype))
        got = lk.recv(ops.zeros(tuple(recv_shape), recv_dtype))
        lk.send(send)
        return got
    if send is not None:
        lk.send(send)
        return None
    if recv_shape is not None:
        return lk.recv(ops.zeros(tuple(recv_shape), recv_dtype))
    return None


# ------------------------------------------------------------------ ring shift
def _pair_key(sender: int, n: int, offset: int) -> tuple:
    # Both members of pair {s, s+offset} compute the same key from s: one total order.
    return ((sender % 2) if (n % 2 == 0 and offset % 2 == 1) else 0, sender)


class _RingShift(nn.Cell):
    def __init__(self, g: ParallelGroup, offset: int, compiled: bool):
        super().__init__()
        n, r = g.size, g.rank
        me = g.ranks[r]
        dst, src = (r + offset) % n, (r - offset) % n
        self.exchange_only = dst == src
        if self.exchange_only:
            self.out_link = link(me, g.ranks[dst], me, compiled)
            self.in_link = self.out_link
            self.send_first = True
        else:
            self.send_first = _pair_key(r, n, offset) < _pair_key(src, n, offset)
            # Create the two communicators in the agreed order too.
            if self.send_first:
                self.out_link = link(me, g.ranks[dst], me, compiled)
                self.in_link = link(g.ranks[src], me, me, compiled)
            else:
                self.in_link = link(g.ranks[src], me, me, compiled)
                self.out_link = link(me, g.ranks[dst], me, compiled)

    def construct(self, x):
        if self.exchange_only:
            return self.out_link.exchange(x)
        zeros = ops.zeros(x.shape, x.dtype)
        if self.send_first:
            t = self.out_link.send(x)
            return self.in_link.recv(ops.depend(zeros, t))
        y = self.in_link.recv(ops.depend(zeros, x))
        t = self.out_link.send(ops.depend(x, y))
        return ops.depend(y, t)

    def bprop(self, x, out, dout):
        # The gradient of what arrived from src goes back to src (the inverse shift), over
        # the same two pairs in the same agreed order as the forward.
        dout = ops.depend(dout, out)
        if self.exchange_only:
            return (self.out_link.exchange(dout),)
        zeros = ops.zeros(dout.shape, dout.dtype)
        if self.send_first:
            g = self.out_link.recv(ops.depend(zeros, dout))
            t = self.in_link.send(ops.depend(dout, g))
            return (ops.depend(g, t),)
        t = self.in_link.send(dout)
        return (self.out_link.recv(ops.depend(zeros, t)),)


_RING_CELLS: dict = {}


def _check_ring_signature(x, g: ParallelGroup, offset: int) -> None:
    """Every rank's shape and dtype, summed into its own slot over the group; all raise alike."""
    n = g.size
    rows = np.zeros((n, _SIG), np.float32)
    rows[g.rank] = _signature(x.shape, x.dtype)
    got = C.all_reduce(Tensor(rows), g).asnumpy()
    if not (got == got[0]).all():
        table = ", ".join(f"group rank {i}: {_describe(got[i].tolist())}" for i in range(n))
        raise P2PMismatchError(
            f"ring_shift(offset={offset}) on group {g.key!r} ranks {list(g.ranks)}: every rank "
            f"must pass a tensor of the same shape and dtype, got {table}")


def ring_shift(x, group: GroupLike, offset: int = 1, *, check: bool = True):
    """Send ``x`` to group rank ``(r + offset) mod n``; return what ``(r - offset) mod n`` sent.

    Args:
        x: Tensor, the same shape and dtype on every rank of the group.
        group: A ParallelGroup (from the manager) or a backend group name.
        offset: Any integer; ``offset % n == 0`` returns ``x``.
        check: Eagerly, first compare every rank's shape and dtype (one small sum over
            the group) and raise the same error everywhere if they differ. The same value
            on every rank.

    Returns:
        The tensor of group rank ``(r - offset) mod n``, same shape and dtype. The
        gradient of the output flows back to the rank that sent it.

    Raises:
        TypeError: ``offset`` is not an integer.
        P2PMismatchError: ranks pass different shapes or dtypes (eager, ``check=True``).

    Example (group ranks 0..3, rank r holds ``[r]``): ``ring_shift(x, g)`` gives rank 0
    ``[3.]`` and rank 1 ``[0.]``; an upstream gradient ``[10. * r]`` gives rank 0 the
    gradient ``[10.]`` (from rank 1, which holds rank 0's value).
    """
    if isinstance(offset, bool) or not isinstance(offset, numbers.Integral):
        raise TypeError(f"ring_shift: offset={offset!r} must be an integer")
    g = C.resolve_group(group)
    n = g.size
    if n == 1 or offset % n == 0:
        return x
    off = int(offset) % n
    compiled = compiling()
    if check and not compiled:
        _check_ring_signature(x, g, offset)
    key = (g, off, compiled, C.get_backend().name if not compiled else None)
    cell = _RING_CELLS.get(key)
    if cell is None:
        cell = _RingShift(g, off, compiled)
        _RING_CELLS[key] = cell
    return cell(x)


# ------------------------------------------------------------------ pipeline sends
def _pp_group(group):
    if group is not None:
        return C.resolve_group(group)
    from . import manager

    return manager.get_pipeline_parallel_group()


def _neighbour(g: ParallelGroup, step: int):
    """The global rank of the stage ``step`` away in the (non-wrapping) pipeline, or None."""
    other = g.rank + step
    if other < 0 or other >= g.size:
        return None
    return g.ranks[other]


def _eager(name):
    if compiling():
        raise RuntimeError(
            f"p2p.{name} runs eagerly only (the pipeline schedule is Python): call it outside "
            "ms.jit / GRAPH_MODE, and compile the stage's forward and backward instead")


def _pp_transfer(name, step, send, recv_shape, recv_dtype, group, check):
    _eager(name)
    g = _pp_group(group)
    other = _neighbour(g, step)
    if other is None:
        return None
    me = g.ranks[g.rank]
    lk = link(me, other, me)
    what = f"p2p.{name} (pipeline rank {g.rank} of {g.size})"
    return transfer(lk, send, recv_shape, recv_dtype, check=check, what=what,
                    me_rank=me, other_rank=other)


def send_forward(x, *, group=None, check: bool = True) -> None:
    """Send this stage's output ``x`` to the next stage (no-op on the last stage)."""
    _pp_transfer("send_forward", 1, x, None, None, group, check)


def recv_forward(shape, dtype=mstype.float32, *, group=None, check: bool = True):
    """The previous stage's output, a ``shape``/``dtype`` tensor (None on the first stage)."""
    return _pp_transfer("recv_forward", -1, None, tuple(shape), dtype, group, check)


def send_backward(grad, *, group=None, check: bool = True) -> None:
    """Send the gradient of this stage's input to the previous stage (no-op on the first)."""
    _pp_transfer("send_backward", -1, grad, None, None, group, check)


def recv_backward(shape, dtype=mstype.float32, *, group=None, check: bool = True):
    """The gradient of this stage's output from the next stage (None on the last stage)."""
    return _pp_transfer("recv_backward", 1, None, tuple(shape), dtype, group, check)


def send_forward_recv_backward(x, shape, dtype=mstype.float32, *, group=None,
                               check: bool = True):
    """Send ``x`` to the next stage and receive the gradient of it, in one exchange.

    None (and nothing sent) on the last stage.
    """
    return _pp_transfer("send_forward_recv_backward", 1, x, tuple(shape), dtype, group, check)


def send_backward_recv_forward(grad, shape, dtype=mstype.float32, *, group=None,
                               check: bool = True):
    """Send ``grad`` to the previous stage and receive its next output, in one exchange.

    None (and nothing sent) on the first stage.
    """
    return _pp_transfer("send_backward_recv_forward", -1, grad, tuple(shape), dtype, group, check)

