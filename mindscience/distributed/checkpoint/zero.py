"""Sharded optimizer state (ZeRO 1-3) and fully sharded parameters in checkpoints.

Design: a checkpoint never depends on the ZeRO stage or the optimizer group. What a
rank holds as a dim-0 shard over a group (contract C1: the fp32 main weights and the
moments of a :class:`~mindscience.distributed.optimizer.DistributedOptimizer` at stages
1-3, a parameter passed to :func:`~mindscience.distributed.fsdp.fully_shard`) is saved
in its tp-local shape, exactly as a stage-0 run holds it:

* ``save`` all-gathers the shards over their group (one flat all-gather per group and
  dtype, in buckets of at most 64 MiB), drops the padding rows and hands the tensor
  to the ordinary writer, which lets one rank of the group write it, linked to its base
  parameter (``base`` in the manifest) like any optimizer moment;
* ``load`` reads the tp-local slice as for stage 0 and keeps this rank's rows, zero
  padded (the padding is never read from disk: its state stays 0).

So a stage-3 checkpoint at dp4 loads at stage 1 on tp2 x dp2 or at stage 0 on tp1, and
``msdist checkpoint reshard`` handles it unchanged. The price: a rank of each group holds
one bucket of full tensors while saving, and every rank reads its whole tp-local slice
while loading.

Other rules:

* a float32 parameter has no separate main weight (the optimizer updates the parameter
  itself, see ``optimizer.overlap_rules.main_weight_bytes``); the fp32 main weights of
  bf16 / fp16 parameters are saved. A main weight missing from the checkpoint is set
  from the loaded weight (this rank's rows), so a checkpoint of a plain run resumes at
  any stage;
* the gradient buffers are the last step's and are not saved;
* the step counter (``<optimizer path>.step``) is a replicated tensor, and a learning
  rate schedule is evaluated at it: the schedule resumes where it was;
* the manifest records each optimizer's kind (``"optimizers"``); loading with another
  kind (adamw vs sgd) fails with one line naming the first difference.

MindSpore is imported only inside the functions that need it; the arithmetic at the
bottom is pure numpy.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np

from .errors import CheckpointError

__all__ = ["ShardInfo", "discover", "gather_full", "record_mismatch", "consolidate", "shard_of",
           "derive_main"]

GATHER_BUCKET_BYTES = 64 << 20


@dataclass(frozen=True)
class ShardInfo:
    """How a tensor of this rank relates to its checkpoint entry.

    Attributes:
        base: The model Parameter the state belongs to (None for a model parameter).
        group: The ParallelGroup it is dim-0 sharded over (None: not sharded).
        full_shape: Its shape in the checkpoint (the tp-local shape, unsharded).
        role: ``"param"``, ``"main"``, ``"moment"`` or ``"step"``.
    """

    base: object
    group: object
    full_shape: tuple
    role: str

    @property
    def sharded(self) -> bool:
        return self.group is not None and self.group.size > 1


def _optimizers(cell) -> list:
    from ..optimizer.distributed import DistributedOptimizer

    return [(path, sub) for path, sub in cell.cells_and_names()
            if isinstance(sub, DistributedOptimizer)]


def discover(cell) -> tuple:
    """``(infos, transient, records)`` of ``cell``.

    ``infos``: id(Parameter) -> :class:`ShardInfo` for fully sharded parameters and every
    DistributedOptimizer state; ``transient``: ids of what is not saved (gradient
    buffers); ``records``: one dict per optimizer (``kind``, ``state``, ``zero_stage``,
    ``group_size``, ``class``), in cell order, for the manifest.
    """
    infos, transient = {}, set()
    for _, param in cell.parameters_and_names():
        fsdp = getattr(param, "fsdp", None)
        if fsdp is not None and id(param) not in infos:
            infos[id(param)] = ShardInfo(None, fsdp.group, tuple(fsdp.full_shape), "param")
    records = []
    for _, opt in _optimizers(cell):
        records.append({"class": "DistributedOptimizer", "kind": opt.kind,
                        "state": list(opt.state_names), "zero_stage": int(opt.stage),
                        "group_size": int(opt.d)})
        group = opt.group if opt.stage > 0 else None
        params = _model_params(opt)
        every = tuple(range(len(params)))
        # mains: one per parameter that is not float32 (a float32 parameter is its own)
        main_of = tuple(getattr(opt, "main_members", every))
        groups = [("main", list(opt.mains), main_of)] + [("moment", list(m), every)
                                                          for m in opt.moments]
        for role, states, members in groups:
            for state, i in zip(states, members):
                infos[id(state)] = ShardInfo(params[i], group, tuple(opt.shards[i].shape), role)
        infos[id(opt.step)] = ShardInfo(None, None, tuple(opt.step.shape), "step")
        transient.update(id(b) for b in opt.grad_buffers)
    return infos, transient, records


def _model_params(opt) -> list:
    """The parameters ``opt`` steps, in its order (``model_params``; ``params`` before)."""
    params = getattr(opt, "model_params", None)
    return list(params if params is not None else opt.params)


def gather_full(items: list) -> list:
    """The unsharded tensors of ``items`` (``(ShardInfo, numpy shard)`` in the same order
    on every rank of each group), as numpy arrays of their ``full_shape``.

    One all-gather per group and dtype per bucket of at most GATHER_BUCKET_BYTES (of the
    gathered result): the collectives are issued in the items' order, which is the same
    on every rank of a group (they hold the same model stage).
    """
    import mindspore as ms

    from ..collectives import all_gather

    out = [None] * len(items)
    pending: dict = {}

    def flush(key):
        members = pending.pop(key, None)
        if not members:
            return
        group = items[members[0]][0].group
        flat = np.concatenate([items[i][1].reshape(-1) for i in members])
        gathered = all_gather(ms.Tensor(flat), group).asnumpy().reshape(group.size, -1)
        start = 0
        for i in members:
            info, shard = items[i]
            stop = start + shard.size
            out[i] = consolidate(gathered[:, start:stop], info.full_shape)
            start = stop

    sizes: dict = {}
    for i, (info, shard) in enumerate(items):
        key = (info.group.key, tuple(info.group.ranks), shard.dtype.str)
        nbytes = shard.nbytes * info.group.size
        if key in pending and sizes[key] + nbytes > GATHER_BUCKET_BYTES:
            flush(key)
        if key not in pending:
            pending[key], sizes[key] = [], 0
        pending[key].append(i)
        sizes[key] += nbytes
    for key in list(pending):
        flush(key)
    return out


def derive_main(info: ShardInfo, loaded: dict, shape) -> np.ndarray:
    """The fp32 main weight (of ``shape``) of ``info`` from its base parameter's value
    (``loaded``: the values being assigned, by id; else the parameter's current data):
    this rank's rows at stages 1-2, the shard itself at stage 3, the whole at stage 0."""
    import mindspore as ms

    value = loaded.get(id(info.base))
    data = (info.base if value is None else value).astype(ms.float32).asnumpy()
    if info.sharded and getattr(info.base, "fsdp", None) is None:
        data = shard_of(data.reshape(info.full_shape), info.group.size, info.group.rank)
    return data.reshape(tuple(shape))


def record_mismatch(saved, current, directory) -> Optional[str]:
    """One line naming the first difference between the optimizers a checkpoint was saved
    with (``saved``, the manifest's ``"optimizers"``, None for an older checkpoint) and
    this model's (``current``), or None when they agree or either side has none.
    The ZeRO stage and group size may differ (that is what a reshard is for); the class
    and the kind (adamw, adam, sgd, and SGD's state) may not."""
    if not saved or not current:
        return None
    for i, (s, c) in enumerate(zip(saved, current)):
        for key in ("class", "kind", "state"):
            if s.get(key) != c.get(key):
                what = {"class": "optimizer class", "kind": "optimizer kind",
                        "state": "optimizer state"}[key]
                return (f"checkpoint {directory}: optimizer {i} {what} differs: saved "
                        f"{_show(s.get(key))}, this model's {_show(c.get(key))}; build the "
                        f"optimizer as it was saved ({_describe(s)}) to resume from it.")
    if len(saved) != len(current):
        return (f"checkpoint {directory}: saved with {len(saved)} optimizer(s), this model has "
                f"{len(current)}; pass a cell holding the same optimizers.")
    return None


def _show(value) -> str:
    if isinstance(value, list):
        return "(" + ", ".join(value) + ")" if value else "(no state)"
    return repr(value)


def _describe(record) -> str:
    if record.get("class") != "DistributedOptimizer":
        return str(record.get("class"))
    return f"DistributedOptimizer(optimizer={record.get('kind')!r})"


def check_records(saved, current, directory) -> None:
    """Raise CheckpointError with :func:`record_mismatch`'s line, if any."""
    problem = record_mismatch(saved, current, directory)
    if problem:
        raise CheckpointError(problem)


# --------------------------------------------------------------------------- arithmetic
def consolidate(gathered: np.ndarray, full_shape) -> np.ndarray:
    """The unsharded tensor from every group rank's padded shard.

    ``gathered`` holds the ``d`` shards in group-rank order, each flattened (``(d, c*rest)``)
    or stacked (``(d*c, *rest)``); the padding rows (the last ``d*c - r``) are dropped.
    Example: ``r = 5`` rows over ``d = 4`` (c = 2): rows 0-1, 2-3, 4 + pad, pad + pad ->
    the 5 rows, shape ``full_shape``.
    """
    full_shape = tuple(int(s) for s in full_shape)
    rows = full_shape[0] if full_shape else 1
    rest = int(np.prod(full_shape[1:], dtype=np.int64)) if len(full_shape) > 1 else 1
    flat = np.asarray(gathered).reshape(-1)
    if flat.size % rest:
        raise CheckpointError(f"consolidate: {flat.size} gathered elements are not whole rows "
                              f"of {rest} for the shape {full_shape}.")
    stacked = flat.reshape(-1, rest)
    if stacked.shape[0] < rows:
        raise CheckpointError(f"consolidate: {stacked.shape[0]} gathered rows, fewer than the "
                              f"{rows} of the shape {full_shape}.")
    return np.ascontiguousarray(stacked[:rows]).reshape(full_shape)


def shard_of(full: np.ndarray, d: int, k: int) -> np.ndarray:
    """Group rank ``k``'s C1 shard of ``full`` over ``d`` ranks: rows
    ``[k*c, min((k+1)*c, r))`` zero-padded to ``c = ceil(r / d)`` rows (a 0-d tensor is
    one row). Example: 5 rows over 4 ranks -> rank 2 holds row 4 and one zero row."""
    full = np.asarray(full)
    shaped = full.reshape((1,) if full.ndim == 0 else full.shape)
    rows = shaped.shape[0]
    c = -(-rows // d)
    start, stop = min(k * c, rows), min((k + 1) * c, rows)
    out = np.zeros((c,) + shaped.shape[1:], full.dtype)
    out[: stop - start] = shaped[start:stop]
    return out
