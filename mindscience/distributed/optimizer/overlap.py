"""The dp-cp gradient reduction launched during the backward (``overlap_grad_reduce``).

:class:`GradOverlap` belongs to one :class:`~.distributed.DistributedOptimizer`. The
gradients of a parameter become final either in a ``Parameter.register_hook`` hook
(PyNative, armed by :meth:`GradOverlap.arm` for the last micro-batch's backward) or when
the caller hands them over (:meth:`GradOverlap.grads_ready`, the pipeline after a chunk's
last backward). When every member of a bucket is final, the bucket's fp32 flat buffer is
built exactly as the optimizer step builds it and its collective is launched
asynchronously (``mindspore.mint.distributed.all_reduce(..., async_op=True)``); the step
(:meth:`GradOverlap.take`) waits on the handle and cuts this rank's chunk, so the reduced
values are the non-overlapped step's bit for bit: the same buffer, the same collective
(on CPU the library's reduce-scatter is an all-reduce + this rank's chunk anyway; on the
native backend the asynchronous reduce-scatter is ``reduce_scatter_tensor``, not
measured here).

Collectives are launched in the order the buckets complete, which is the backward's
order and the same on every rank of the group (they run the same model stage).
"""

from __future__ import annotations

import time
import weakref

from mindspore import mint, ops
from mindspore.mint import distributed as md

from .. import collectives as C
from .. import counters

__all__ = ["GradOverlap", "ParamGather", "finish_param_gathers"]


class GradOverlap:
    """Launch state of one optimizer's bucketed reduction (PyNative only).

    Args:
        opt: The :class:`~.distributed.DistributedOptimizer` (its buckets, shards, group and
            kernels).
        skip: Parameter indices whose gradients need a sum over tp or the embedding group
            first (done in the step): their buckets are reduced in the step, not launched.
    """

    def __init__(self, opt, skip):
        self.opt = opt
        self.index = {p.name: i for i, p in enumerate(opt.model_params)}
        self.bucket_of = {}
        for b, bucket in enumerate(opt.buckets):
            for i in bucket.members:
                self.bucket_of[i] = b
        self.early = tuple(opt.comm and not any(i in skip for i in bucket.members)
                           for bucket in opt.buckets)
        self.native = not C.get_backend().composed["reduce_scatter"]
        self.ready = {}       # parameter index -> final gradient
        self.launched = {}    # bucket -> (handle, buffer)
        self.hooks = []
        self.timeline = []    # this step's {"bucket", "launched_s", "waited_s", "done_s"}
        self.open = False     # gradients of a coming step are being marked

    # ----------------------------------------------------------------- arming
    def arm(self, accumulated=None) -> None:
        """Hook every parameter of a launchable bucket for the coming backward.

        Args:
            accumulated: ``{parameter name: gradient summed over the earlier
                micro-batches}`` (None or missing names: this backward's gradient is the
                whole). The hook adds this backward's gradient to it, as the step would.
        """
        self.disarm()
        self.open = False
        self._open()
        accumulated = dict(accumulated or {})
        for i, p in enumerate(self.opt.model_params):
            if not self.early[self.bucket_of[i]]:
                continue
            self.hooks.append(p.register_hook(self._hook(i, accumulated.get(p.name))))

    def disarm(self) -> None:
        """Remove the hooks (the gradients already launched stay launched)."""
        for h in self.hooks:
            h.remove()
        self.hooks = []

    def _hook(self, i, acc):
        def hook(grad):
            self.mark(i, grad if acc is None else acc + grad)
            return None  # the gradient itself is unchanged
        return hook

    def _open(self) -> None:
        """The first gradient of a new step: forget the last step's state and timeline."""
        if not self.open:
            self.reset()
            self.timeline = []
            self.open = True

    # ----------------------------------------------------------------- launching
    def grads_ready(self, grads) -> None:
        """``{parameter name: final gradient}``: launch every bucket they complete."""
        self._open()
        for name, g in grads.items():
            i = self.index.get(name)
            if i is not None and self.early[self.bucket_of[i]]:
                self.mark(i, g)

    def mark(self, i, grad) -> None:
        """Parameter ``i``'s gradient is final; launch its bucket once all members are."""
        self.ready[i] = grad
        b = self.bucket_of[i]
        if b in self.launched:
            return
        if all(j in self.ready for j in self.opt.buckets[b].members):
            self._launch(b)

    def _launch(self, b) -> None:
        opt = self.opt
        flat = opt._flat(self.ready, opt.buckets[b])
        if opt.stage == 1:
            ops.assign(opt.grad_buffers[b], flat)
        group = opt.k_eager.group_name
        counters.count()
        if self.native and opt.stage > 0:
            out = mint.empty((flat.shape[0] // opt.d,), dtype=flat.dtype)
            handle = md.reduce_scatter_tensor(out, flat.contiguous(), "sum", group, async_op=True)
        else:
            # A private buffer, as the synchronous kernel reduces (mint works in place).
            out = mint.empty(flat.shape, dtype=flat.dtype).copy_(flat.contiguous())
            handle = md.all_reduce(out, "sum", group, async_op=True)
        self.launched[b] = (handle, out)
        self.timeline.append({"bucket": b, "launched_s": time.perf_counter()})

    # ----------------------------------------------------------------- the step
    def pending(self) -> bool:
        """True when a bucket was launched for the coming step."""
        return bool(self.launched)

    def take(self, b):
        """Bucket ``b``'s reduced sum (this rank's chunk at stages 1-2), waited on; None when
        it was not launched (the step reduces it)."""
        entry = self.launched.pop(b, None)
        if entry is None:
            return None
        handle, out = entry
        t0 = time.perf_counter()
        handle.wait()
        for row in self.timeline:
            if row["bucket"] == b:
                row["waited_s"], row["done_s"] = t0, time.perf_counter()
        opt = self.opt
        if opt.stage == 0 or self.native:
            return out
        return opt.k_eager._chunk(out, 0, opt.group.rank, opt.d)

    def finish(self) -> None:
        """The step is done: the next gradient marked starts a new one."""
        self.reset()
        self.open = False

    def reset(self) -> None:
        """Forget this step's gradients; wait on anything launched and not taken."""
        self.disarm()
        for handle, _ in self.launched.values():
            handle.wait()
        self.launched = {}
        self.ready = {}


# A weak set of the ParamGather instances with gathers in flight: checkpoint.save finishes
# them before it reads the parameters (it sees the cell, not the optimizer).
_IN_FLIGHT: "weakref.WeakSet" = weakref.WeakSet()


def finish_param_gathers() -> None:
    """Wait on every optimizer's launched weight all-gathers and write the weights
    (``overlap_param_gather``); the parameters are current afterwards. Cheap when none."""
    for gather in list(_IN_FLIGHT):
        gather.finish()


class ParamGather:
    """The updated weights' all-gather, launched at the end of the step (stages 1-2,
    ``overlap_param_gather``, PyNative) and waited on bucket by bucket by the next forward.

    The step launches each bucket's all-gather asynchronously
    (``mindspore.mint.distributed.all_gather(..., async_op=True)``) instead of gathering
    and writing the parameters before it returns. A forward pre-hook on every cell that
    owns a parameter of a launched bucket (:meth:`attach`) waits on that bucket and writes
    its parameters just before the cell runs, so the later buckets' gathers proceed while
    the earlier layers compute (Megatron's ``--overlap-param-gather``). The values are the
    synchronous gather's bit for bit: the same flat buffer, gathered, split and cast
    alike. Anything that reads the parameters otherwise must call :meth:`finish` first
    (the next step does, ``checkpoint.save`` does through :func:`finish_param_gathers`).

    Args:
        opt: The :class:`~.distributed.DistributedOptimizer` (its buckets, group, write-back).
    """

    def __init__(self, opt):
        self.opt = opt
        self.bucket_of = {opt.model_params[i].name: b for b, bucket in enumerate(opt.buckets)
                          for i in bucket.members}
        self.pending = {}       # bucket -> (handle, parts)
        self.hooks = {}         # id(cell) -> (cell, hook handle): the cell kept alive with its id
        self.waited = {"hook": 0, "finish": 0}

    @property
    def attached(self) -> bool:
        return bool(self.hooks)

    def attach(self, cell) -> int:
        """Hook the cells of ``cell`` that own this optimizer's parameters, or read them
        without calling their owner (listed in the cell's ``reads_parameters_of``), each
        cell once; returns how many cells are hooked in all."""
        for _, sub in cell.cells_and_names():
            if id(sub) in self.hooks:
                continue
            own = [p.name for p in sub.parameters_dict(recurse=False).values()]
            # A cell that reads another cell's weight without calling it names that cell.
            for other in getattr(sub, "reads_parameters_of", ()):
                own += [p.name for p in other.get_parameters()]
            buckets = sorted({self.bucket_of[n] for n in own if n in self.bucket_of})
            if buckets:
                self.hooks[id(sub)] = (sub, sub.register_forward_pre_hook(self._hook(tuple(buckets))))
        return len(self.hooks)

    def _hook(self, buckets):
        def hook(cell, inputs):
            if self.pending:
                self.finish(buckets, "hook")
        return hook

    def launch(self, b, flat) -> None:
        """Start bucket ``b``'s all-gather of this rank's ``flat`` updated shards."""
        parts = [mint.empty(flat.shape, dtype=flat.dtype) for _ in range(self.opt.d)]
        counters.count()
        handle = md.all_gather(parts, flat.contiguous(), group=self.opt.k_eager.group_name, async_op=True)
        self.pending[b] = (handle, parts)
        _IN_FLIGHT.add(self)

    def finish(self, buckets=None, why: str = "finish") -> None:
        """Wait on ``buckets`` (default: every launched one) and write their parameters."""
        for b in (sorted(self.pending) if buckets is None else buckets):
            entry = self.pending.pop(b, None)
            if entry is None:
                continue
            handle, parts = entry
            handle.wait()
            self.opt._write_gathered(ops.stack(parts, 0), self.opt.buckets[b])
            self.waited[why] += 1
        if not self.pending:
            _IN_FLIGHT.discard(self)
