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

from mindspore import mint, ops
from mindspore.mint import distributed as md

from .. import collectives as C
from .. import counters

__all__ = ["GradOverlap"]


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

