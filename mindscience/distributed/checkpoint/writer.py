"""Writing a checkpoint directory: one rank's file and part, then the manifest (no MindSpore).

Used by :func:`mindscience.distributed.checkpoint.save` (each rank calls
:func:`write_rank`, rank 0 :func:`finish` after a barrier), by the offline reshard, and
by tests and benchmarks that build checkpoints from numpy.

Atomicity: everything goes into ``DIR.partial``; every file is written under a
temporary name, fsync'ed and renamed; the manifest is written last, after every rank's
part exists; then ``DIR.partial`` takes the place of ``DIR``:

* an older ``DIR`` is swapped with ``DIR.partial`` in one step (Linux
  ``renameat2(RENAME_EXCHANGE)``), then removed (renamed ``DIR.old`` first): a crash at
  any point leaves the previous ``DIR`` or the new one, each complete;
* where the system cannot swap (not Linux, a file system without it), ``DIR`` is renamed
  ``DIR.old`` and ``DIR.partial`` renamed ``DIR``: a crash between the two leaves no
  ``DIR`` but a complete ``DIR.partial``, which readers use (with a note,
  :func:`~.manifest.open_manifest`) and the next :func:`prepare` moves into place.

Before the manifest exists, a crash leaves the previous ``DIR`` untouched and an
incomplete ``DIR.partial`` (no manifest).
"""

from __future__ import annotations

import json
import os
import shutil
import sys

import numpy as np

from .files import SafetensorsWriter, fsync_dir
from .manifest import (MANIFEST, OLD_SUFFIX, has_manifest, merge_parts, part_file, partial_dir,
                       rank_file, write_json_atomic)
from .plan import layer_index

__all__ = ["partial_dir", "prepare", "write_rank", "finish", "save_arrays", "exchange",
           "LAYOUT_KEYS"]

LAYOUT_KEYS = ("world_size", "tp", "cp", "dp", "pp", "order", "ep", "etp")


def _exchanger():
    """``swap(a, b) -> bool``: exchange two paths atomically (Linux ``renameat2`` with
    ``RENAME_EXCHANGE``); False where the system or file system cannot (then nothing
    changed)."""
    if not sys.platform.startswith("linux"):
        return lambda a, b: False
    try:
        import ctypes

        call = ctypes.CDLL(None, use_errno=True).renameat2
        call.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
        call.restype = ctypes.c_int
    except (OSError, AttributeError):  # pragma: no cover - glibc < 2.28, musl
        return lambda a, b: False
    import errno

    at_fdcwd, rename_exchange = -100, 2

    def swap(a: str, b: str) -> bool:
        if call(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0:
            return True
        err = ctypes.get_errno()
        if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):  # unsupported here
            return False
        raise OSError(err, f"renameat2(RENAME_EXCHANGE) {a} <-> {b}: {os.strerror(err)}")

    return swap


exchange = _exchanger()


def _recover(directory: str) -> None:
    """Finish a replacement a crash interrupted between the fallback's two renames:
    ``DIR`` missing and a complete ``DIR.partial`` (the newest checkpoint) is moved into
    place; with only ``DIR.old`` complete, that one is."""
    if os.path.lexists(directory):
        return
    tmp, old = partial_dir(directory), directory + OLD_SUFFIX
    for source in (tmp, old):
        if has_manifest(source):
            os.replace(source, directory)
            fsync_dir(os.path.dirname(os.path.abspath(directory)))
            return


def prepare(directory: str) -> str:
    """Create an empty ``DIR.partial`` (removing one a crashed save left, after moving a
    complete one into place: see :func:`_recover`). Rank 0 only."""
    directory = str(directory).rstrip("/")
    _recover(directory)
    tmp = partial_dir(directory)
    if os.path.exists(tmp):
        shutil.rmtree(tmp)
    parent = os.path.dirname(os.path.abspath(tmp))
    os.makedirs(parent, exist_ok=True)
    os.makedirs(tmp)
    return tmp


def write_rank(tmp: str, rank: int, stage: int, items, chunks=None, meta=None) -> dict:
    """Write rank ``rank``'s tensors and its manifest part into ``tmp``; returns the part.

    ``items``: ``(global name, dtype tag, global shape, sharding, piece, array)`` with
    ``array`` the local tensor (numpy, BF16 as uint16 bits), or None when ``chunks`` is
    given: ``chunks(name)`` then yields the local tensor's C-ordered chunks. ``meta``
    {name: {"layer", "position", "base"}} (see :mod:`.manifest`); a name without it gets
    the layer index of ``layers.<i>`` in its name and no position.
    """
    items = sorted(items, key=lambda item: item[0])  # same bytes whoever writes the layout
    meta = meta or {}
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
            info = meta.get(name) or {"layer": layer_index(name), "position": None, "base": None}
            part["params"][name] = {"shape": list(gshape), "dtype": dtype, "sharding": sharding,
                                    "key": name, "dim": piece["dim"], "ranges": piece.get("ranges"),
                                    "crc32": writer.tensor_crc[name],
                                    "block_bytes": writer.block_bytes,
                                    "block_crc32": writer.tensor_blocks[name],
                                    "layer": info.get("layer"), "position": info.get("position"),
                                    "base": info.get("base")}
    write_json_atomic(os.path.join(tmp, part_file(rank)), part)
    return part


def finish(directory: str, world_size: int, layout: dict, step=None, extra=None,
           layer_prefixes=None, optimizers=None) -> dict:
    """Merge the ``world_size`` parts in ``DIR.partial`` into the manifest, write it, and
    put the directory in place (see the module doc). Rank 0 only, after every rank's
    :func:`write_rank`."""
    directory = str(directory).rstrip("/")
    tmp = partial_dir(directory)
    parts = []
    for rank in range(world_size):
        with open(os.path.join(tmp, part_file(rank))) as fh:
            parts.append(json.load(fh))
    manifest = merge_parts(parts, {k: layout[k] for k in LAYOUT_KEYS if k in layout}, step, extra,
                           layer_prefixes, optimizers)
    write_json_atomic(os.path.join(tmp, MANIFEST), manifest)
    parent = os.path.dirname(os.path.abspath(directory))
    old = directory + OLD_SUFFIX
    if os.path.lexists(old):
        shutil.rmtree(old)
    if not os.path.lexists(directory):
        os.replace(tmp, directory)
        fsync_dir(parent)
        return manifest
    if exchange(tmp, directory):
        fsync_dir(parent)          # the new DIR is durable; the old one is now at tmp
        os.replace(tmp, old)       # never leave a complete OLD checkpoint named .partial
    else:
        os.replace(directory, old)
        os.replace(tmp, directory)  # a crash just before this: see manifest.open_manifest
    fsync_dir(parent)
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
    # position: the order of ``arrays`` within each stage (what a stage's cell would list)
    meta, count = {}, {}
    for name in arrays:
        stage = stages.get(name, 0)
        meta[name] = {"layer": layer_index(name), "position": count.get(stage, 0), "base": None}
        count[stage] = count.get(stage, 0) + 1
    tmp = prepare(directory)
    try:
        for rank in range(layout.world_size):
            stage = layout.coords(rank)["pp"]
            items = []
            for name, array in arrays.items():
                sharding = shardings.get(name) or {"axis": None, "partition_dim": None,
                                                   "partition_stride": 1, "sequence_parallel": False}
                if stages.get(name, 0) != stage or not writes(layout, rank, sharding["axis"],
                                                               sharding.get("expert")):
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
            write_rank(tmp, rank, stage, items, meta=meta)
        return finish(directory, layout.world_size, layout.to_dict(), step, extra)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
