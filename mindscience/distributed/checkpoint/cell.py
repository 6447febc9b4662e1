"""``save`` / ``load`` of a MindSpore Cell's parameters as a layout-independent checkpoint.

The only module of the package that imports MindSpore.
"""

from __future__ import annotations

import json
import numbers
import shutil
import warnings
from typing import Optional

import numpy as np

import mindspore as ms

from ..sharding import get_sharding
from ..topology.layout import Layout
from .errors import CheckpointError, CheckpointExpertCountError
from .files import st_dtype_of
from .manifest import CheckpointReader
from .plan import (expert_entries, expert_name, expert_sharding, global_shape_from_local,
                   layer_index, local_shape, piece_for, rename_layers, writes)
from . import zero
from .writer import LAYOUT_KEYS, finish, prepare, write_rank

__all__ = ["save", "save_async", "agree_written", "PendingSave", "load", "set_global_layer_names",
           "named_parameters", "layer_prefixes"]

_OFFSET_ATTR = "_msdist_layer_offsets"


def set_global_layer_names(cell, first_layer: int, prefix: str = "layers"):
    """Name this pipeline stage's layers by their GLOBAL index in checkpoints.

    A stage that holds layers ``first_layer ..`` of the model as ``<prefix>.0 ..``
    (e.g. an ``nn.CellList`` attribute ``layers``) calls this once; every parameter name
    containing ``<prefix>.<i>`` (the optimizer's moments too) is then saved and loaded
    as ``<prefix>.<i + first_layer>``. Example, 8 layers on pp = 2: stage 1 holds
    ``layers.0-3`` and calls ``set_global_layer_names(stage, 4)``; its
    ``layers.2.mlp.fc1.weight`` is ``layers.6.mlp.fc1.weight`` in the checkpoint, the
    name the same weight has on pp = 1 or on stage 3 of pp = 4.

    The prefix is also what marks a global layer for an offline reshard to another pp:
    ``save`` records each parameter's layer index (the number after one of the
    prefixes given here, ``layers`` if none was) in the manifest. A model whose layers
    are named otherwise, e.g. ``blocks.<i>``, calls
    ``set_global_layer_names(model, 0, prefix="blocks")`` even at pp = 1.

    Returns ``cell``.
    """
    offsets = dict(getattr(cell, _OFFSET_ATTR, {}) or {})
    offsets[prefix] = int(first_layer)
    object.__setattr__(cell, _OFFSET_ATTR, offsets)
    return cell


def _optimizer_cells(cell) -> list:
    """``(path, optimizer cell, its parameters)`` of every optimizer inside ``cell``: an
    ``nn.Optimizer``, a ``mindspore.mint.optim`` / ``experimental.optim`` optimizer, or
    any cell holding the parameters it updates as a ``parameters`` ParameterTuple/list."""
    out = []
    for path, sub in cell.cells_and_names():
        params = vars(sub).get("parameters")
        if isinstance(params, (ms.ParameterTuple, list, tuple)) and params and all(
                isinstance(p, ms.Parameter) for p in params):
            out.append((path, sub, list(params)))
    return out


def _tail_match(state_name: str, base_name: str) -> int:
    """How many trailing name components of ``base_name`` (after those it shares, in
    front, with ``state_name``: an optimizer's own prefix) end ``state_name``; 0 if the
    rest does not. ``("1.exp_avg.layers.0.weight", "1.layers.0.weight")`` -> 3."""
    s, b = state_name.split("."), base_name.split(".")
    k = 0
    while k < min(len(s), len(b)) - 1 and s[k] == b[k]:
        k += 1
    tail = b[k:]
    return len(tail) if len(s) > len(tail) and s[-len(tail):] == tail else 0


def _optimizer_bases(cell) -> tuple:
    """``(bases, problems)``: id(optimizer state) -> the parameter it belongs to, and the
    states that could not be attributed although they have the local shape of a sharded
    parameter of their optimizer (``(path, state, base)``).

    Attribution, per optimizer: by its structure first (each ParameterTuple attribute as
    long as its parameters, position by position, same shape: ``nn.Adam``'s
    ``moment1``, ``nn.AdamWeightDecay``'s ``adam_m``, ``mint.optim.AdamW``'s
    ``exp_avg``); then by name and local shape (``<prefix>.<parameter name>``, the name
    ``ParameterTuple.clone(prefix=...)`` gives). A state marked with ``mark_sharding``
    keeps its own mark (see :func:`_entries`).
    """
    bases, problems = {}, []
    for path, opt, params in _optimizer_cells(cell):
        param_ids = {id(p) for p in params}
        for key, value in vars(opt).items():
            if key in ("parameters", "_parameters") or not isinstance(value, ms.ParameterTuple):
                continue
            if len(value) == len(params):
                for state, base in zip(value, params):
                    if id(state) not in param_ids and tuple(state.shape) == tuple(base.shape):
                        bases[id(state)] = base
        for name, state in opt.parameters_and_names():
            if id(state) in param_ids or id(state) in bases or _marked(state):
                continue
            scored = sorted(((_tail_match(state.name, b.name), i) for i, b in enumerate(params)
                             if tuple(b.shape) == tuple(state.shape)), reverse=True)
            if scored and scored[0][0] and (len(scored) == 1 or scored[1][0] < scored[0][0]):
                bases[id(state)] = params[scored[0][1]]
                continue
            # One element: a step counter, a learning rate, a beta power (replicated),
            # even where a tiny sharded bias has one element per rank.
            sharded = [b for b in params if tuple(b.shape) == tuple(state.shape)
                       and get_sharding(b)["axis"] is not None and int(np.prod(state.shape)) > 1]
            if sharded:
                problems.append((f"{path}.{name}" if path else name, state, sharded[0]))
    return bases, problems


def _marked(param) -> bool:
    return hasattr(param, "parallel_axis") or getattr(param, "tensor_model_parallel", False)


def _expert(param) -> bool:
    """An expert parameter (dim 0 = this ep rank's local experts), see :mod:`.plan`."""
    return bool(getattr(param, "expert_parallel", False))


def _transient(param) -> bool:
    """A buffer a model marks as not part of its state (``param.checkpoint = False``:
    e.g. GPTModel's per-step MoE statistics)."""
    return getattr(param, "checkpoint", True) is False


def _entries(cell) -> list:
    """``(global name, parameter, sharding, base global name, position, expert)`` per
    parameter (see :func:`named_parameters`); ``position`` is its index in the cell's
    parameter order (an optimizer state has its base parameter's); ``expert``: it (or its
    base) is an expert parameter, stored per expert (:mod:`.plan`). Buffers marked
    ``checkpoint = False`` are left out. A DistributedOptimizer's state
    belongs to the parameter it was built for, and its gradient buffers (the last step's)
    are left out (:func:`.zero.discover`).

    Raises:
        CheckpointError: two parameters with one global name; optimizer state that
            cannot be attributed to its parameter but has a sharded parameter's shape.
    """
    offsets = getattr(cell, _OFFSET_ATTR, {}) or {}
    bases, problems = _optimizer_bases(cell)
    infos, transient, _ = zero.discover(cell)
    bases.update({k: info.base for k, info in infos.items() if info.base is not None})
    out, seen, index = [], set(), {}
    for name, param in cell.parameters_and_names():
        if id(param) in seen or id(param) in transient or _transient(param):
            continue
        seen.add(id(param))
        for prefix, offset in offsets.items():
            name = rename_layers(name, offset, prefix)
        index[id(param)] = len(index)
        out.append([name, param])
    names = {id(p): n for n, p in out}
    if problems:
        path, state, base = problems[0]
        raise CheckpointError(
            f"optimizer state {path!r} (local shape {tuple(state.shape)}) cannot be matched "
            f"to the parameter it belongs to, and it has the local shape of the sharded "
            f"parameter {names.get(id(base), base.name)!r} ({get_sharding(base)}): saved as "
            "replicated, only one rank's slice would be kept. Mark it like its parameter, "
            "e.g. mark_sharding(state, axis='tp', partition_dim=0), or with axis=None if it "
            "really is replicated.")
    entries = []
    for name, param in out:
        base = bases.get(id(param))
        if base is not None and id(base) not in names:
            base = None  # its parameter is not part of this cell: keep the state's own mark
        # an explicit mark on the state wins over its parameter's
        source = param if base is None or _marked(param) else base
        expert = _expert(param) or (base is not None and _expert(base))
        entries.append((name, param, get_sharding(source), None if base is None else names[id(base)],
                        index[id(param if base is None else base)], expert))
    all_names = [e[0] for e in entries]
    if len(set(all_names)) != len(all_names):
        dup = sorted({n for n in all_names if all_names.count(n) > 1})[0]
        raise CheckpointError(f"two parameters share the global name {dup!r}; rename one.")
    return entries


def layer_prefixes(cell) -> list:
    """The layer prefixes of ``cell`` (those given to :func:`set_global_layer_names`, or
    ``["layers"]``): the name part that marks a global layer index in checkpoints."""
    return list(getattr(cell, _OFFSET_ATTR, {}) or {}) or ["layers"]


def named_parameters(cell) -> list:
    """``(global name, parameter, sharding)`` for every parameter of ``cell``.

    The global name is the parameter's path in ``cell.parameters_and_names()`` (the
    first one of a shared parameter), with ``layers.<i>`` renumbered as set by
    :func:`set_global_layer_names`. Optimizer state (moments) has the sharding of the
    parameter it belongs to (see :func:`_optimizer_bases`). A tensor that is also dim-0
    sharded over a group (ZeRO stages 1-3, ``fully_shard``) is listed with its shard;
    ``save`` and ``load`` turn it into its tp-local whole and back (see :mod:`.zero`).

    Raises:
        CheckpointError: see :func:`_entries`.
    """
    return [(name, param, sharding) for name, param, sharding, _, _, _ in _entries(cell)]


def _world():
    from .. import manager

    if manager.is_initialized():
        from mindspore.communication import get_rank

        return manager.get_layout(), get_rank()
    return Layout(world_size=1), 0


def _barrier(layout: Layout) -> None:
    """Every rank got here. A blocking world all-reduce: ``mint.distributed.barrier``
    returns at once on CPU (it logs "CPU device is not supported"; measured)."""
    _world_sum(layout, np.ones(1, np.float32))


def _world_sum(layout: Layout, values: np.ndarray) -> np.ndarray:
    if layout.world_size == 1:
        return values
    from mindspore import mint

    t = ms.Tensor(values.astype(np.float32))
    mint.distributed.all_reduce(t)
    return t.asnumpy()


def _to_numpy(param):
    """(dtype tag, numpy array) of a parameter; bfloat16 as its uint16 bits."""
    if param.dtype == ms.bfloat16:
        f32 = param.astype(ms.float32).asnumpy()
        return "BF16", (f32.view(np.uint32) >> 16).astype(np.uint16)
    arr = param.asnumpy()
    return st_dtype_of(arr), np.require(arr, requirements="C")


def _to_tensor(array: np.ndarray, tag: str, param) -> ms.Tensor:
    if tag == "BF16":
        array = (array.astype(np.uint32) << 16).view(np.float32)
    # np.require, not ascontiguousarray: that one turns a 0-d array (a step counter) 1-d.
    return ms.Tensor(np.require(array, requirements="C")).astype(param.dtype)


def _tag(param) -> str:
    """The safetensors dtype tag of a parameter."""
    if param.dtype == ms.bfloat16:
        return "BF16"
    return st_dtype_of(np.zeros(0, ms.dtype_to_nptype(param.dtype)))


def _fill_sharded(items: list, shards: list) -> None:
    """Put the unsharded value of each dim-0 sharded tensor (``shards``: ``(index in
    items or None, ShardInfo, Parameter)``, the same order on every rank of a group) in
    its item. 16-bit floats travel as float32 (exact; CPU gathers of them are not
    assumed), and bfloat16 goes back to its bits."""
    gathered = zero.gather_full([(info, _gather_numpy(param)) for _, info, param in shards])
    for (at, _, param), full in zip(shards, gathered):
        if at is None:
            continue
        name, tag, gshape, sharding, piece, _ = items[at]
        if tag == "BF16":
            full = (np.asarray(full, np.float32).view(np.uint32) >> 16).astype(np.uint16)
        else:
            full = full.astype(ms.dtype_to_nptype(param.dtype), copy=False)
        items[at] = (name, tag, gshape, sharding, piece, np.require(full, requirements="C"))


def _gather_numpy(param) -> np.ndarray:
    if param.dtype in (ms.bfloat16, ms.float16):
        return param.astype(ms.float32).asnumpy()
    return param.asnumpy()


def _expert_parts(name: str, local, sharding: dict, layout: Layout, rank: int, base=None) -> list:
    """``[(checkpoint name, global expert index, sharding, global shape, piece)]`` of the
    local experts of an expert parameter (or of its optimizer state: ``base``) of
    (unsharded) local shape ``local``."""
    count = int(local[0]) * int(getattr(layout, "ep", 1) or 1)
    parts = []
    for k, ename in expert_entries(name, int(local[0]), layout, rank, base):
        esh = expert_sharding(sharding, k, count)
        gshape = global_shape_from_local(ename, tuple(local[1:]), esh, layout)
        parts.append((ename, k, esh, gshape, piece_for(ename, gshape, esh, layout, rank)))
    return parts


def _split_experts(items: list, experts: dict) -> list:
    """The items with every expert parameter's item replaced by one item per local expert."""
    if not experts:
        return items
    out = []
    for at, item in enumerate(items):
        if at not in experts:
            out.append(item)
            continue
        _, tag, _, _, _, array = item
        for j, (ename, _, esh, gshape, piece) in enumerate(experts[at]):
            out.append((ename, tag, gshape, esh, piece, np.require(array[j], requirements="C")))
    return out


def _optimizer_records(cell, records: list) -> list:
    """What the cell's optimizers are, for the manifest: the DistributedOptimizers'
    records (:func:`.zero.discover`), then the class of every other optimizer."""
    return records + [{"class": type(opt).__name__} for _, opt, _ in _optimizer_cells(cell)]


def _layout_dict(layout: Layout) -> dict:
    return {k: v for k, v in layout.to_dict().items() if k in LAYOUT_KEYS}


def _check_step(step):
    """``step`` as an int (numpy integers converted) or None."""
    if step is None:
        return None
    if isinstance(step, (bool, np.bool_)) or not isinstance(step, numbers.Integral):
        raise CheckpointError(f"save: step={step!r} ({type(step).__name__}) is invalid: expected "
                              "an int or None (numpy integers are converted). Pass int(step).")
    return int(step)


def _check_extra(extra) -> None:
    try:
        json.dumps(extra, allow_nan=False)
    except (TypeError, ValueError) as err:
        raise CheckpointError(f"save: extra={extra!r} is not JSON-serializable ({err}): pass "
                              "plain dicts, lists, strings, finite numbers, bools and None.") from None


def _agree(layout: Layout, rank: int, error, directory: str, phase: str) -> None:
    """Every rank learns which ranks failed ``phase`` (a world all-reduce of a one-hot
    vector) and, if any did, every rank raises: the failed ones their own error, the
    others one naming them. So one rank's failure (a full disk, a bad argument) never
    leaves the others waiting at a barrier."""
    flags = np.zeros(layout.world_size, np.float32)
    flags[rank] = error is not None
    failed = [r for r, f in enumerate(_world_sum(layout, flags)) if f]
    if not failed:
        return
    if isinstance(error, CheckpointError):
        raise error
    if error is not None:
        raise CheckpointError(f"save to {directory} failed on rank {rank} while {phase} "
                              f"({type(error).__name__}: {error}); nothing was saved.") from error
    raise CheckpointError(f"save to {directory} failed on rank(s) {', '.join(map(str, failed))} "
                          f"while {phase} (see that rank's error); nothing was saved.")


def _host_copy(name: str, array: np.ndarray, buffers: Optional[dict]) -> np.ndarray:
    """A copy of ``array`` in host memory, into ``buffers[name]`` when it has the shape and
    dtype (the previous save's buffer: reusing it spares the page faults of fresh memory)."""
    buf = None if buffers is None else buffers.get(name)
    if buf is None or buf.shape != array.shape or buf.dtype != array.dtype:
        buf = np.empty_like(array, order="C")
        if buffers is not None:
            buffers[name] = buf
    np.copyto(buf, array)
    return buf


def _stage(cell, directory, step, extra, copy: bool, buffers: Optional[dict] = None) -> dict:
    """The collective part of a save, on every rank: check the arguments, create
    ``DIR.partial`` (rank 0), gather the sharded tensors and hold every tensor this rank
    writes as numpy (``copy``: a copy of its own, in ``buffers`` when given, so training
    may go on changing the parameters while it is written). The ranks agree on the
    outcome of each phase."""
    layout, rank = _world()
    directory = str(directory)
    error, items, meta, shards, records, prefixes = None, [], {}, [], [], []
    experts: dict = {}  # index in items -> the per-expert parts of an expert parameter
    try:
        step = _check_step(step)
        _check_extra(extra)
        prefixes = layer_prefixes(cell)
        infos, _, records = zero.discover(cell)
        records = _optimizer_records(cell, records)
        for name, param, sharding, base, position, expert in _entries(cell):
            info = infos.get(id(param))
            if info is not None and info.role == "main" and info.base.dtype == ms.float32:
                continue  # equal to the float32 weight (see .zero); load derives it
            sharded = info is not None and info.sharded
            local = info.full_shape if sharded else tuple(param.shape)
            if expert:  # one entry per global expert (see .plan)
                parts = _expert_parts(name, local, sharding, layout, rank, base)
                mine = writes(layout, rank, parts[0][2]["axis"], parts[0][2]["expert"])
                if sharded:
                    shards.append((len(items) if mine else None, info, param))
                if not mine:
                    continue
                experts[len(items)] = parts
                tag, array = _to_numpy(param) if not sharded else (_tag(param), None)
                if copy and array is not None:
                    array = np.array(array, copy=True)
                items.append((name, tag, local, sharding, None, array))
                meta.update({ename: {"layer": layer_index(base or name, prefixes),
                                     "position": position, "base": base and expert_name(base, k)}
                             for ename, k, _, _, _ in parts})
                continue
            gshape = global_shape_from_local(name, local, sharding, layout)
            mine = writes(layout, rank, sharding["axis"])
            if sharded:  # every rank of the group takes part in the all-gather
                shards.append((len(items) if mine else None, info, param))
            if not mine:
                continue
            piece = piece_for(name, gshape, sharding, layout, rank)
            tag, array = _to_numpy(param) if not sharded else (_tag(param), None)
            if copy and array is not None:
                array = _host_copy(name, array, buffers)  # asnumpy shares the parameter's memory
            items.append((name, tag, gshape, sharding, piece, array))
            meta[name] = {"layer": layer_index(base or name, prefixes), "position": position,
                          "base": base}
        if rank == 0:
            prepare(directory)
    except Exception as err:  # noqa: BLE001 - every rank must learn of it (see _agree)
        error = err
    _agree(layout, rank, error, directory, "preparing the save")
    try:
        _fill_sharded(items, shards)  # gathered into new arrays: copies already
        items = _split_experts(items, experts)
    except Exception as err:  # noqa: BLE001
        error = err
    _agree(layout, rank, error, directory, "gathering its sharded tensors")
    return {"layout": layout, "rank": rank, "directory": directory, "items": items, "meta": meta,
            "step": step, "extra": extra, "prefixes": prefixes, "records": records}


def _weights_current() -> None:
    """Write the weights of any optimizer step whose all-gathers are still in flight
    (``overlap_param_gather``): the parameters read or loaded here are then current."""
    from ..optimizer.overlap import finish_param_gathers

    finish_param_gathers()


def save(cell, directory, *, step: Optional[int] = None, extra: Optional[dict] = None) -> str:
    """Save ``cell``'s parameters (all ranks call it) as a checkpoint directory.

    Each rank writes only the parameters it owns (see :mod:`.plan`: its shard of a
    split parameter; a replicated one only on the group's first rank) to
    ``rank_<r>.safetensors``; rank 0 writes ``manifest.json`` when every rank has
    finished, and puts ``DIR.partial`` in place of ``DIR`` (see :mod:`.writer`). Pass a
    cell that holds the optimizer too (e.g. ``nn.CellList([network, optimizer])``) to
    save its moments.

    The arguments are checked on every rank before anything is written, and the ranks
    agree on the outcome of each phase (a world all-reduce): if any rank fails, every
    rank raises (none hangs), the partial directory is removed and the previous
    checkpoint stays in place.

    Args:
        cell: The model (with optimizer) of this rank.
        directory: The checkpoint directory (replaced atomically if it exists).
        step: Training step (an int, numpy integers accepted, or None), kept in the manifest.
        extra: JSON-serializable data kept in the manifest (returned by :func:`load`).

    Returns:
        ``directory``.

    Raises:
        CheckpointError: a bad ``step`` or ``extra``; an optimizer state that cannot be
            attributed (see :func:`named_parameters`); a failure on any rank.
    """
    _weights_current()
    from .manifest import partial_dir

    staged = _stage(cell, directory, step, extra, copy=False)
    layout, rank, directory = staged["layout"], staged["rank"], staged["directory"]
    items, meta = staged["items"], staged["meta"]
    step, extra, prefixes, records = (staged[k] for k in ("step", "extra", "prefixes", "records"))
    error = None
    try:
        write_rank(partial_dir(directory), rank, layout.coords(rank)["pp"], items, meta=meta)
    except Exception as err:  # noqa: BLE001
        error = err
    try:
        _agree(layout, rank, error, directory, "writing its rank file")
    except CheckpointError:
        if rank == 0:
            shutil.rmtree(partial_dir(directory), ignore_errors=True)
        raise
    if rank == 0:
        try:
            finish(directory, layout.world_size, _layout_dict(layout), step, extra, prefixes,
                   records)
        except Exception as err:  # noqa: BLE001
            error = err
    _agree(layout, rank, error, directory,
           f"writing the manifest and renaming (msdist checkpoint inspect {directory} says "
           "which checkpoint is in place)")
    return directory


class PendingSave:
    """A checkpoint being written in the background (:func:`save_async`).

    Attributes:
        directory: The checkpoint directory.
        step: Its step.
        host_copy_s: Seconds the caller was held: the host copy (and the collectives of
            the sharded tensors), what the training loop stalls for.
        written_s: Seconds the background write took (None until it ended).
        error: The exception the write raised on this rank (None until :meth:`wait`).
    """

    def __init__(self, directory: str, step, host_copy_s: float):
        self.directory, self.step, self.host_copy_s = directory, step, host_copy_s
        self.written_s = None
        self.error = None
        self._thread = None

    def done(self) -> bool:
        return self._thread is None or not self._thread.is_alive()

    def wait(self) -> Optional[BaseException]:
        """Join the writer; returns its error on this rank (None: this rank's part is
        written and, on rank 0, the checkpoint is in place)."""
        if self._thread is not None:
            self._thread.join()
        return self.error


def _failed_marker(rank: int) -> str:
    return f"rank_{rank:05d}.failed"


def _wait_for_parts(tmp: str, world_size: int, timeout_s: float) -> None:
    """Rank 0's background writer: wait until every rank's part is in ``DIR.partial``."""
    import os
    import time

    from .manifest import part_file

    deadline = time.monotonic() + timeout_s
    while True:
        failed = [r for r in range(world_size) if os.path.exists(os.path.join(tmp, _failed_marker(r)))]
        if failed:
            raise CheckpointError(f"save to {tmp} failed on rank(s) {', '.join(map(str, failed))} while "
                                  "writing in the background; nothing was saved.")
        if all(os.path.exists(os.path.join(tmp, part_file(r))) for r in range(world_size)):
            return
        if time.monotonic() > deadline:
            raise CheckpointError(f"save to {tmp}: not every rank wrote its part within {timeout_s:g} s; "
                                  "nothing was saved.")
        time.sleep(0.05)


def save_async(cell, directory, *, step: Optional[int] = None, extra: Optional[dict] = None,
               before_write=None, after_finish=None, timeout_s: float = 3600.0,
               host_buffers: Optional[dict] = None) -> PendingSave:
    """Start a save of ``cell`` (all ranks call it) and return while it is written.

    The caller is held for the host copy only: the collectives of :func:`save` (checks,
    ``DIR.partial`` created by rank 0, sharded tensors gathered) and a copy of every
    tensor this rank writes into host memory. A background thread then writes this
    rank's file and part; rank 0's waits for every rank's part, writes the manifest last
    and puts the directory in place, exactly as :func:`save` does, so the checkpoint is
    visible (listed, resumable) only once it is whole and durable; a crash before that
    leaves the previous checkpoint as the newest. No collective runs in the background:
    the ranks meet through the files of ``DIR.partial`` (a rank whose write fails leaves
    ``rank_<r>.failed`` there).

    Call :meth:`PendingSave.wait` on every rank before the next save (at most one in
    flight) and before the end; agree on the outcome with :func:`agree_written`.

    Args:
        cell, directory, step, extra: As for :func:`save`.
        before_write: Called in the background thread before writing (fault injection).
        after_finish: Called on rank 0 in the background thread once the checkpoint is in
            place (``--keep-last``).
        timeout_s: How long rank 0 waits for the other ranks' parts.
        host_buffers: A dict kept between saves (one in flight at a time): the host copy
            goes into the previous save's arrays of the same name, shape and dtype.
    """
    _weights_current()
    import os
    import threading
    import time

    from .manifest import partial_dir

    started = time.perf_counter()
    staged = _stage(cell, directory, step, extra, copy=True, buffers=host_buffers)
    pending = PendingSave(staged["directory"], staged["step"], time.perf_counter() - started)
    layout, rank = staged["layout"], staged["rank"]
    tmp = partial_dir(staged["directory"])

    def write():
        t0 = time.perf_counter()
        try:
            if before_write is not None:
                before_write()
            write_rank(tmp, rank, layout.coords(rank)["pp"], staged["items"], meta=staged["meta"])
            staged["items"] = None  # free the host copy
            if rank == 0:
                _wait_for_parts(tmp, layout.world_size, timeout_s)
                finish(staged["directory"], layout.world_size, _layout_dict(layout), staged["step"],
                       staged["extra"], staged["prefixes"], staged["records"])
                if after_finish is not None:
                    after_finish()
        except BaseException as err:  # noqa: BLE001 - reported by wait()
            pending.error = err
            try:
                if rank == 0:
                    shutil.rmtree(tmp, ignore_errors=True)
                elif os.path.isdir(tmp):
                    with open(os.path.join(tmp, _failed_marker(rank)), "w") as fh:
                        fh.write(f"{type(err).__name__}: {err}\n")
            except OSError:
                pass
        pending.written_s = time.perf_counter() - t0

    pending._thread = threading.Thread(target=write, name=f"msdist-save-{staged['step']}", daemon=True)
    pending._thread.start()
    return pending


def agree_written(pending: PendingSave) -> None:
    """Wait for ``pending`` on every rank and agree on it (a world all-reduce): if any
    rank's background write failed, every rank raises :class:`CheckpointError`."""
    layout, rank = _world()
    error = pending.wait()
    _agree(layout, rank, error, pending.directory, "writing in the background")


def _saved_expert_count(reader, name: str, base=None):
    """The expert count the checkpoint holds for the expert parameter ``name`` (None: none)."""
    entry = reader.params.get(expert_name(name, 0, base))
    if entry is None:
        return None
    return int((entry["sharding"].get("expert") or {}).get("count") or 0) or None


def _check_expert_count(reader, name, param, info, layout, base=None) -> None:
    """Raise :class:`CheckpointExpertCountError` when the checkpoint holds another number of
    experts for the expert parameter ``name`` than this model (nothing when it lacks it)."""
    sharded = info is not None and info.sharded
    count = tuple(info.full_shape if sharded else param.shape)[0] * int(getattr(layout, "ep", 1) or 1)
    saved = _saved_expert_count(reader, name, base)
    if saved is not None and saved != count:
        raise CheckpointExpertCountError(
            f"parameter {name!r}: the checkpoint {reader.directory} holds {saved} experts, this "
            f"model {count} (num_moe_experts): expert weights are not re-cut to another expert "
            f"count. Build the model with num_moe_experts={saved} to load it (any ep dividing "
            f"{saved} works), or start from another checkpoint.")


def _read_experts(reader, name, param, sharding, info, layout, rank, strict, base=None):
    """``(checkpoint names, local array, dtype tag)`` of this rank's experts of the expert
    parameter ``name`` (stacked on dim 0, then this rank's ZeRO rows), or None when the
    checkpoint lacks it and ``strict`` is off.

    Raises:
        CheckpointExpertCountError: the checkpoint holds another number of experts.
        CheckpointError: missing (strict) or of a shape this layout cannot split.
    """
    sharded = info is not None and info.sharded
    have = tuple(info.full_shape if sharded else param.shape)
    count = have[0] * int(getattr(layout, "ep", 1) or 1)
    saved = _saved_expert_count(reader, name, base)
    if saved is None:
        if strict:
            raise CheckpointError(f"expert parameter {name!r} of the model is missing from the "
                                  f"checkpoint {reader.directory} (no {expert_name(name, 0, base)!r}; "
                                  "strict=True).")
        return None
    _check_expert_count(reader, name, param, info, layout, base)
    arrays, names, dtype = [], [], None
    for k, ename in expert_entries(name, have[0], layout, rank, base):
        entry = reader.params.get(ename)
        if entry is None:
            raise CheckpointError(f"expert {k} of {name!r} ({ename!r}) is missing from the "
                                  f"checkpoint {reader.directory}: it is incomplete.")
        esh = expert_sharding(sharding, k, count)
        piece = piece_for(ename, entry["shape"], esh, layout, rank)
        want = local_shape(entry["shape"], piece)
        if tuple(want) != have[1:]:
            raise CheckpointError(
                f"parameter {name!r}: this rank's shape per expert is {have[1:]}, but expert {k}'s "
                f"global shape {tuple(entry['shape'])} split as {esh} at etp="
                f"{getattr(layout, 'etp', layout.tp)} gives {want}.")
        arrays.append(np.array(reader.read_piece(ename, piece)))
        names.append(ename)
        dtype = entry["dtype"]
    array = np.stack(arrays)
    if sharded:  # this rank's rows of the dim-0 shard, zero padded
        array = zero.shard_of(array, info.group.size, info.group.rank)
    return names, array, dtype


def load(cell, directory, *, strict: bool = True) -> dict:
    """Load a checkpoint into ``cell`` at the CURRENT layout, whatever the saved one.

    Every rank reads only the byte ranges of its own slices (memory-mapped), verifies
    the checksums of the blocks holding them (1 MiB blocks, :mod:`.blocks`; a dim-1
    split reads a segment of every row, so its blocks are all of the stored tensor's),
    and assigns nothing until every rank has read everything (a world all-reduce of the
    outcome): on any error no parameter of any rank is modified.

    Args:
        cell: The model (with optimizer, as saved) of this rank, at the new layout.
        directory: A checkpoint written by :func:`save` or ``msdist checkpoint reshard``.
        strict: Every parameter of the cell must be in the checkpoint and every
            checkpoint parameter in some rank's cell.

    Returns:
        ``{"step", "extra", "layout" (the saved one), "loaded" (this rank's names),
        "note"}``: ``note`` is None, or says that a save stopped while moving its
        complete ``DIR.partial`` into place and that one was read (also a warning).

    Raises:
        CheckpointIntegrityError: missing, truncated or corrupt files; no manifest.
        CheckpointError: unknown format version; a missing or extra parameter
            (``strict``); a global shape the current layout cannot split; a local shape
            that does not match.
    """
    _weights_current()
    layout, rank = _world()
    error, values, mains = None, [], []
    names_all: list = []
    try:
        reader = CheckpointReader(str(directory), verify=True)
        names_all = sorted(reader.params)
        infos, _, records = zero.discover(cell)
        zero.check_records(reader.manifest.get("optimizers"), _optimizer_records(cell, records),
                           directory)
        derived = []  # main weights the checkpoint lacks: set from the loaded weights
        entries = _entries(cell)
        # Another expert count first: the router's shape differs too, but this is the fix.
        for name, param, _, base, _, expert in entries:
            if expert:
                _check_expert_count(reader, name, param, infos.get(id(param)), layout, base)
        for name, param, sharding, base, _, expert in entries:
            info = infos.get(id(param))
            sharded = info is not None and info.sharded
            if expert:
                if (info is not None and info.role == "main"
                        and _saved_expert_count(reader, name, base) is None):
                    derived.append((param, name, info))  # a float32 main weight: not saved
                    continue
                got = _read_experts(reader, name, param, sharding, info, layout, rank, strict, base)
                if got is not None:
                    names, array, dtype = got
                    values.append((param, names, _to_tensor(array, dtype, param)))
                continue
            entry = reader.params.get(name)
            if entry is None:
                if info is not None and info.role == "main":
                    derived.append((param, name, info))
                    continue
                if strict:
                    raise CheckpointError(f"parameter {name!r} of the model is missing from the "
                                          f"checkpoint {directory} (strict=True).")
                continue
            piece = piece_for(name, entry["shape"], sharding, layout, rank)
            want = local_shape(entry["shape"], piece)
            have = info.full_shape if sharded else tuple(param.shape)
            if have != want:
                raise CheckpointError(
                    f"parameter {name!r}: this rank's shape is {have}"
                    + (f" (unsharded; it holds {tuple(param.shape)})" if sharded else "")
                    + f", but the checkpoint's global shape {tuple(entry['shape'])} split as "
                    f"{sharding} at tp={layout.tp} gives {want}.")
            array = np.array(reader.read_piece(name, piece))
            if sharded:  # this rank's rows of the dim-0 shard, zero padded
                array = zero.shard_of(array, info.group.size, info.group.rank)
            values.append((param, name, _to_tensor(array, entry["dtype"], param)))
        loaded = {id(param): value for param, _, value in values}
        mains = [(param, ms.Tensor(zero.derive_main(info, loaded, param.shape)))
                 for param, _, info in derived]
    except CheckpointError as err:
        error = err
    except Exception as err:  # noqa: BLE001 - the other ranks must not wait for this one
        error = CheckpointError(f"load of {directory} failed on rank {rank} "
                                f"({type(err).__name__}: {err}); nothing was modified.")
        error.__cause__ = err
    # Same-length vectors on every rank: first the outcome, then (same manifest everywhere)
    # which checkpoint parameters some rank's model consumed.
    failed = _world_sum(layout, np.array([error is not None], np.float32))[0]
    if error is not None:
        raise error
    if failed:
        raise CheckpointError(f"load of {directory} failed on {int(failed)} other rank(s) "
                              "(see their errors); nothing was modified.")
    if strict:
        index = {n: i for i, n in enumerate(names_all)}
        used = np.zeros(max(1, len(names_all)), np.float32)
        for _, name, _ in values:
            for one in ([name] if isinstance(name, str) else name):
                used[index[one]] = 1
        used = _world_sum(layout, used)
        extra = [n for n, i in index.items() if not used[i]]
        if extra:
            raise CheckpointError(
                f"checkpoint {directory} has {len(extra)} parameter(s) that no rank's model "
                f"holds (strict=True), e.g. {extra[0]!r}; nothing was modified. Pass "
                "strict=False to ignore them.")
    for param, _, value in values:
        param.set_data(value)
    for param, value in mains:
        param.set_data(value)
    manifest = reader.manifest
    if reader.note and rank == 0:
        warnings.warn(reader.note, stacklevel=2)
    return {"step": manifest.get("step"), "extra": manifest.get("extra"),
            "layout": manifest["layout"],
            "loaded": [m for _, n, _ in values for m in ([n] if isinstance(n, str) else n)],
            "note": reader.note}
