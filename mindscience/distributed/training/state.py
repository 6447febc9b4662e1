"""What a training checkpoint holds, in a form that loads at any layout and ZeRO stage.

:class:`~mindscience.distributed.optimizer.DistributedOptimizer` keeps its moments as
this rank's dim-0 shard (contract C1) at stages 1-3, plus gradient buffers whose size
follows its buckets, and a step counter named after its first parameter: none of that
means the same thing at another layout. A checkpoint instead holds, for every model
parameter, its moments in the parameter's own local shape, linked to it (so the
checkpoint reshards them over tp and pipeline stages like the parameter), and one
replicated step counter::

    state = TrainState(model, optimizer)
    state.pull()                                 # optimizer -> full moments (all-gather over d)
    checkpoint.save(state.cell(), "ckpt/step_4", step=4)
    ...
    checkpoint.load(state.cell(), "ckpt/step_4")  # at any layout
    state.push()                                 # full moments -> this rank's shards

At stage 0 (or a group of one) the full moments ARE the optimizer's, and pull/push only
move the step counter. At stages 1-2 the fp32 main weights are the shards of the model's
weights: push rebuilds them from the loaded weights (exact in fp32; with bf16/fp16 weights
the main weights restart from the rounded weights).
"""

from __future__ import annotations

import numpy as np

import mindspore as ms
from mindspore import Parameter, ParameterTuple, Tensor, nn

from ..collectives import all_gather
from ..optimizer.layout import param_shard, shard_range

STEP_NAME = "optimizer_step"


class _Moments(nn.Cell):
    """The model's parameters (``parameters``, as an optimizer holds them) and, per state
    name, a ParameterTuple of the same length and shapes: the checkpoint links each state to
    its parameter by position (see ``checkpoint.cell._optimizer_bases``)."""

    def __init__(self, params, moments: dict, step: Parameter):
        super().__init__()
        self.parameters = ParameterTuple(params)
        self.state_names = tuple(moments)
        for name, values in moments.items():
            setattr(self, name, ParameterTuple(values))
        self.step = step


class TrainState:
    """The checkpointable state of a model and its DistributedOptimizer.

    Args:
        model: The model Cell.
        optimizer: A DistributedOptimizer built over ``params``.
        params: The parameters the optimizer steps, in its order.
        zero_stage: Its ZeRO stage.
        group: Its group (the dp-cp group by default).

    It reads the optimizer's state Parameters (``state_names``, ``moments``, ``mains``,
    ``step``): the optimizer has no checkpoint interface of its own yet.
    """

    def __init__(self, model, optimizer, params, zero_stage: int, group):
        self.model, self.opt, self.group = model, optimizer, group
        params = list(params)
        self.shards = tuple(param_shard(tuple(p.shape), group.size) for p in params)
        self.params = params
        self.sharded = zero_stage > 0 and group.size > 1
        moments = {}
        for i, name in enumerate(optimizer.state_names):
            mine = optimizer.moments[i]
            if self.sharded:
                moments[name] = [Parameter(Tensor(np.zeros(p.shape, np.float32)), name=f"{p.name}.{name}",
                                           requires_grad=False) for p in params]
            else:
                moments[name] = list(mine)
        self.step = Parameter(Tensor(0, ms.int32), name=STEP_NAME, requires_grad=False)
        self.moments = _Moments(params, moments, self.step)

    def cell(self):
        """The Cell to pass to ``checkpoint.save`` / ``checkpoint.load``."""
        return nn.CellList([self.model, self.moments])

    def _full(self, shard, sh) -> np.ndarray:
        """This parameter's whole state from every rank's shard (all-gather over d, padding cut)."""
        gathered = all_gather(shard, self.group, 0).asnumpy()
        return gathered.reshape((-1,) + tuple(sh.shape[1:]))[: sh.rows].reshape(sh.shape)

    def pull(self) -> None:
        """Optimizer -> checkpoint state (every rank of the optimizer group calls it)."""
        self.step.set_data(Tensor(int(self.opt.step.asnumpy()), ms.int32))
        if not self.sharded:
            return
        for i, name in enumerate(self.opt.state_names):
            for shard, full, sh in zip(self.opt.moments[i], getattr(self.moments, name), self.shards):
                full.set_data(Tensor(self._full(shard, sh).reshape(full.shape), ms.float32))

    def _rows(self, array: np.ndarray, sh) -> np.ndarray:
        start, stop = shard_range(sh.rows, self.group.size, self.group.rank)
        rows = array.reshape((sh.rows,) + tuple(sh.shape[1:]))
        out = np.zeros((sh.shard_rows,) + tuple(sh.shape[1:]), np.float32)
        out[: stop - start] = rows[start:stop]
        return out

    def push(self) -> None:
        """Checkpoint state -> optimizer, after a load (main weights from the loaded weights)."""
        self.opt.step.set_data(Tensor(int(self.step.asnumpy()), self.opt.step.dtype))
        if not self.sharded:
            return
        for i, name in enumerate(self.opt.state_names):
            for shard, full, sh in zip(self.opt.moments[i], getattr(self.moments, name), self.shards):
                shard.set_data(Tensor(self._rows(full.asnumpy(), sh).reshape(shard.shape), ms.float32))
        for main, p, sh in zip(self.opt.mains, self.params, self.shards):
            weights = p.astype(ms.float32).asnumpy() if p.dtype != ms.float32 else p.asnumpy()
            main.set_data(Tensor(self._rows(weights, sh).reshape(main.shape), ms.float32))
