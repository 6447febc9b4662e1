"""``save`` / ``load`` of a MindSpore Cell's parameters as a layout-independent checkpoint.

The only module of the package that imports MindSpore.
"""

from __future__ import annotations

from typing import Optional

import numpy as np

import mindspore as ms
from mindspore import nn

from ..sharding import get_sharding
from ..topology.layout import Layout
from .errors import CheckpointError
from .files import st_dtype_of
from .manifest import CheckpointReader
from .plan import global_shape_from_local, local_shape, piece_for, rename_layers, writes
from .writer import LAYOUT_KEYS, finish, prepare, write_rank

__all__ = ["save", "load", "set_global_layer_names", "named_parameters"]

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

    Returns ``cell``.
    """
    offsets = dict(getattr(cell, _OFFSET_ATTR, {}) or {})
    offsets[prefix] = int(first_layer)
    object.__setattr__(cell, _OFFSET_ATTR, offsets)
    return cell


def _optimizer_bases(cell) -> dict:
    """id(optimizer state tensor) -> the parameter it belongs to (Adam's moments etc.)."""
    bases = {}
    for _, sub in cell.cells_and_names():
        if not isinstance(sub, nn.Optimizer):
            continue
        params = list(sub.parameters)
        for key, value in vars(sub).items():
            if key in ("parameters", "_parameters") or not isinstance(value, ms.ParameterTuple):
                continue
            if len(value) == len(params):
                for state, base in zip(value, params):
                    if tuple(state.shape) == tuple(base.shape):
                        bases[id(state)] = base
    return bases


def named_parameters(cell) -> list:
    """``(global name, parameter, sharding)`` for every parameter of ``cell``.

    The global name is the parameter's path in ``cell.parameters_and_names()`` (the
    first one of a shared parameter), with ``layers.<i>`` renumbered as set by
    :func:`set_global_layer_names`. Optimizer state (moments) has the sharding of the
    parameter it belongs to.
    """
    offsets = getattr(cell, _OFFSET_ATTR, {}) or {}
    bases = _optimizer_bases(cell)
    out, seen = [], set()
    for name, param in cell.parameters_and_names():
        if id(param) in seen:
            continue
        seen.add(id(param))
        for prefix, offset in offsets.items():
            name = rename_layers(name, offset, prefix)
        out.append((name, param, get_sharding(bases.get(id(param), param))))
    names = [n for n, _, _ in out]
    if len(set(names)) != len(names):
        dup = sorted({n for n in names if names.count(n) > 1})[0]
        raise CheckpointError(f"two parameters share the global name {dup!r}; rename one.")
    return out


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


def _layout_dict(layout: Layout) -> dict:
    return {k: v for k, v in layout.to_dict().items() if k in LAYOUT_KEYS}


def save(cell, directory, *, step: Optional[int] = None, extra: Optional[dict] = None) -> str:
    """Save ``cell``'s parameters (all ranks call it) as a checkpoint directory.

    Each rank writes only the parameters it owns (see :mod:`.plan`: its shard of a
    split parameter; a replicated one only on the group's first rank) to
    ``rank_<r>.safetensors``; rank 0 writes ``manifest.json`` after a barrier, when every
    rank has finished, and renames ``DIR.partial`` into place. Pass a cell that holds
    the optimizer too (e.g. ``nn.CellList([network, optimizer])``) to save its moments.

    Args:
        cell: The model (with optimizer) of this rank.
        directory: The checkpoint directory (replaced atomically if it exists).
        step: Training step, kept in the manifest.
        extra: JSON-serializable data kept in the manifest (returned by :func:`load`).

    Returns:
        ``directory``.
    """
    import json

    if extra is not None:
        try:
            json.dumps(extra)
        except (TypeError, ValueError) as err:
            raise CheckpointError(f"save: extra={extra!r} is not JSON-serializable ({err}).") from None
    layout, rank = _world()
    items = []
    for name, param, sharding in named_parameters(cell):
        gshape = global_shape_from_local(name, tuple(param.shape), sharding, layout)
        if not writes(layout, rank, sharding["axis"]):
            continue
        piece = piece_for(name, gshape, sharding, layout, rank)
        tag, array = _to_numpy(param)
        items.append((name, tag, gshape, sharding, piece, array))
    directory = str(directory)
    if rank == 0:
        prepare(directory)
    _barrier(layout)
    from .writer import partial_dir

    write_rank(partial_dir(directory), rank, layout.coords(rank)["pp"], items)
    _barrier(layout)
    if rank == 0:
        finish(directory, layout.world_size, _layout_dict(layout), step, extra)
    _barrier(layout)
    return directory


def load(cell, directory, *, strict: bool = True) -> dict:
    """Load a checkpoint into ``cell`` at the CURRENT layout, whatever the saved one.

    Every rank reads only the byte ranges of its own slices (memory-mapped), checks each
    saved tensor it reads against its checksum, and assigns nothing until every rank has
    read everything (a world all-reduce of the outcome): on any error no parameter of
    any rank is modified.

    Args:
        cell: The model (with optimizer, as saved) of this rank, at the new layout.
        directory: A checkpoint written by :func:`save` or ``msdist checkpoint reshard``.
        strict: Every parameter of the cell must be in the checkpoint and every
            checkpoint parameter in some rank's cell.

    Returns:
        ``{"step", "extra", "layout" (the saved one), "loaded" (this rank's names)}``.

    Raises:
        CheckpointIntegrityError: missing, truncated or corrupt files; no manifest.
        CheckpointError: unknown format version; a missing or extra parameter
            (``strict``); a global shape the current layout cannot split; a local shape
            that does not match.
    """
    layout, rank = _world()
    error, values = None, []
    names_all: list = []
    try:
        reader = CheckpointReader(str(directory), verify=True)
        names_all = sorted(reader.params)
        for name, param, sharding in named_parameters(cell):
            entry = reader.params.get(name)
            if entry is None:
                if strict:
                    raise CheckpointError(f"parameter {name!r} of the model is missing from the "
                                          f"checkpoint {directory} (strict=True).")
                continue
            piece = piece_for(name, entry["shape"], sharding, layout, rank)
            want = local_shape(entry["shape"], piece)
            if tuple(param.shape) != want:
                raise CheckpointError(
                    f"parameter {name!r}: this rank's shape is {tuple(param.shape)}, but the "
                    f"checkpoint's global shape {tuple(entry['shape'])} split as {sharding} at "
                    f"tp={layout.tp} gives {want}.")
            values.append((param, name, _to_tensor(np.array(reader.read_piece(name, piece)),
                                                   entry["dtype"], param)))
    except CheckpointError as err:
        error = err
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
            used[index[name]] = 1
        used = _world_sum(layout, used)
        extra = [n for n, i in index.items() if not used[i]]
        if extra:
            raise CheckpointError(
                f"checkpoint {directory} has {len(extra)} parameter(s) that no rank's model "
                f"holds (strict=True), e.g. {extra[0]!r}; nothing was modified. Pass "
                "strict=False to ignore them.")
    for param, _, value in values:
        param.set_data(value)
    manifest = reader.manifest
    return {"step": manifest.get("step"), "extra": manifest.get("extra"),
            "layout": manifest["layout"], "loaded": [n for _, n, _ in values]}
