"""Writing a checkpoint directory: one rank's file and part, then the manifest (no MindSpore).

Used by :func:`mindscience.distributed.checkpoint.save` (each rank calls
:func:`write_rank`, rank 0 :func:`finish` after a barrier), by the offline reshard, and
by tests and benchmarks that build checkpoints from numpy.

Atomicity: everything goes into ``DIR.partial``; every file is written under a
temporary name, fsync'ed and renamed; the manifest is written last, after every rank's
part exists; then ``DIR.partial`` is renamed to ``DIR`` (an older ``DIR`` is moved
aside first and removed after). A crash at any point leaves the previous ``DIR``
untouched and at most an incomplete ``DIR.partial`` (no manifest).
"""

from __future__ import annotations

import json
import os
import shutil

import numpy as np

from .files import SafetensorsWriter, fsync_dir
from .manifest import (MANIFEST, PARTIAL_SUFFIX, merge_parts, part_file, rank_file,
                       write_json_atomic)

__all__ = ["partial_dir", "prepare", "write_rank", "finish", "save_arrays", "LAYOUT_KEYS"]

LAYOUT_KEYS = ("world_size", "tp", "cp", "dp", "pp", "order")


def partial_dir(directory: str) -> str:
    return str(directory).rstrip("/") + PARTIAL_SUFFIX


def prepare(directory: str) -> str:
    """Create an empty ``DIR.partial`` (removing one a crashed save left). Rank 0 only."""
    tmp = partial_dir(directory)
    if os.path.exists(tmp):
        shutil.rmtree(tmp)
    parent = os.path.dirname(os.path.abspath(tmp))
    os.makedirs(parent, exist_ok=True)
    os.makedirs(tmp)
    return tmp


def write_rank(tmp: str, rank: int, stage: int, items, chunks=None) -> dict:
    """Write rank ``rank``'s tensors and its manifest part into ``tmp``; returns the part.

    ``items``: ``(global name, dtype tag, global shape, sharding, piece, array)`` with
    ``array`` the local tensor (numpy, BF16 as uint16 bits), or None when ``chunks`` is
    given: ``chunks(name)`` then yields the local tensor's C-ordered chunks.
    """
    items = sorted(items, key=lambda item: item[0])  # same bytes whoever writes the layout
    part = {"rank": rank, "stage": stage, "file": None, "bytes": 0, "crc32": None, "params": {}}
    if items:
        from .plan import local_shape

        file = rank_file(rank)
        writer = SafetensorsWriter(os.path.join(tmp, file),
                                   [(n, dt, local_shape(gs, pc)) for n, dt, gs, _, pc, _ in items])
        try:
            for name, _, _, _, _, array in items:
                for chunk in (chunks(name) if array is None else (array,)):
                    writer.write(name, chunk)
            writer.close()
        except BaseException:
            writer.abort()
            raise
        part.update(file=file, bytes=writer.total_bytes, crc32=writer.file_crc)
        for name, dtype, gshape, sharding, piece, _ in items:
            part["params"][name] = {"shape": list(gshape), "dtype": dtype, "sharding": sharding,
                                    "key": name, "dim": piece["dim"], "ranges": piece.get("ranges"),
                                    "crc32": writer.tensor_crc[name]}
    write_json_atomic(os.path.join(tmp, part_file(rank)), part)
    return part


def finish(directory: str, world_size: int, layout: dict, step=None, extra=None) -> dict:
    """Merge the ``world_size`` parts in ``DIR.partial`` into the manifest, write it, and
    rename the directory into place. Rank 0 only, after every rank's :func:`write_rank`."""
    directory = str(directory).rstrip("/")
    tmp = partial_dir(directory)
    parts = []
    for rank in range(world_size):
        with open(os.path.join(tmp, part_file(rank))) as fh:
            parts.append(json.load(fh))
    manifest = merge_parts(parts, {k: layout[k] for k in LAYOUT_KEYS if k in layout}, step, extra)
    write_json_atomic(os.path.join(tmp, MANIFEST), manifest)
    old = None
    if os.path.exists(directory):
        old = directory + ".old"
        if os.path.exists(old):
            shutil.rmtree(old)
        os.replace(directory, old)
    os.replace(tmp, directory)
    fsync_dir(os.path.dirname(os.path.abspath(directory)))
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    return manifest


def save_arrays(directory: str, arrays: dict, layout, shardings: dict = None, stages: dict = None,
                step=None, extra=None, dtypes: dict = None) -> dict:
    """Write full numpy tensors as ``layout`` would have saved them (tests, benchmarks, or
    converting a dense model): ``arrays`` {global name: array}, ``shardings`` {name:
    sharding dict} (default replicated), ``stages`` {name: pp stage} (default 0),
    ``dtypes`` {name: tag} (e.g. ``"BF16"`` for uint16 bit patterns; default from numpy).
    Arrays are sliced per rank, as views where possible. Returns the manifest."""
    from .files import st_dtype_of
    from .plan import piece_for, writes

    shardings, stages, dtypes = shardings or {}, stages or {}, dtypes or {}
    tmp = prepare(directory)
    try:
        for rank in range(layout.world_size):
            stage = layout.coords(rank)["pp"]
            items = []
            for name, array in arrays.items():
                sharding = shardings.get(name) or {"axis": None, "partition_dim": None,
                                                   "partition_stride": 1, "sequence_parallel": False}
                if stages.get(name, 0) != stage or not writes(layout, rank, sharding["axis"]):
                    continue
                piece = piece_for(name, array.shape, sharding, layout, rank)
                if piece["dim"] is None:
                    local = array
                else:
                    idx = [slice(None)] * array.ndim
                    parts = []
                    for g0, g1, _ in piece["ranges"]:
                        idx[piece["dim"]] = slice(g0, g1)
                        parts.append(array[tuple(idx)])
                    local = parts[0] if len(parts) == 1 else np.concatenate(parts, piece["dim"])
                tag = dtypes.get(name) or st_dtype_of(array)
                items.append((name, tag, array.shape, sharding, piece, np.ascontiguousarray(local)))
            write_rank(tmp, rank, stage, items)
        return finish(directory, layout.world_size, layout.to_dict(), step, extra)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
