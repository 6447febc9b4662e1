"""Validation of a manifest's structure, before anything trusts it (no MindSpore).

A manifest edited by hand, cut short by a bad copy or written by another tool must fail
with one line naming the field, not with a ``KeyError`` deep in a reader, and not pass
``inspect`` only to fail in ``reshard`` (a layout without ``tp`` would be read as tp1).
Everything here raises :class:`~.errors.CheckpointIntegrityError` (the checkpoint on
disk is corrupt: exit 1 in the CLI).
"""

from __future__ import annotations

import numbers
import re

import numpy as np

from .errors import CheckpointIntegrityError
from .files import NUMPY_DTYPES

__all__ = ["validate_manifest", "LAYOUT_REQUIRED"]

LAYOUT_REQUIRED = ("world_size", "tp", "cp", "dp", "pp")
_HEX8 = re.compile(r"^[0-9a-f]{8}$")
_HEXN = re.compile(r"^(?:[0-9a-f]{8})*$")
_AXES = (None, "tp", "cp", "dp", "etp")


def _int(value, minimum=0) -> bool:
    return (isinstance(value, numbers.Integral) and not isinstance(value, bool)
            and value >= minimum)


class _Checker:
    def __init__(self, path: str):
        self.path = path

    def fail(self, what: str):
        raise CheckpointIntegrityError(f"{self.path}: corrupt manifest: {what}. Restore the "
                                       "checkpoint from a copy or save it again.")

    def mapping(self, value, what: str) -> dict:
        if not isinstance(value, dict):
            self.fail(f"{what} is {type(value).__name__ if value is not None else 'missing'}, "
                      "expected an object")
        return value

    def seq(self, value, what: str) -> list:
        if not isinstance(value, list):
            self.fail(f"{what} is {value!r}, expected a list")
        return value


def _layout(c: _Checker, manifest: dict):
    from ..topology.errors import LayoutError
    from ..topology.layout import Layout

    lay = c.mapping(manifest.get("layout"), '"layout"')
    for key in LAYOUT_REQUIRED:
        if not _int(lay.get(key), 1):
            c.fail(f'layout {key}={lay.get(key)!r} (expected a positive integer; the layout '
                   f'needs each of {", ".join(LAYOUT_REQUIRED)})')
    try:
        kwargs = {k: lay[k] for k in LAYOUT_REQUIRED}
        for key in ("order", "ep", "etp"):
            if lay.get(key) is not None:
                kwargs[key] = lay[key]
        return Layout(**kwargs)
    except LayoutError as err:
        c.fail(f"layout {dict(lay)} is not a valid layout ({err})")


def _shard(c: _Checker, name: str, i: int, shard, entry: dict, version: int) -> None:
    what = f"parameter {name!r} shard {i}"
    c.mapping(shard, what)
    for key in ("file", "key"):
        if not isinstance(shard.get(key), str):
            c.fail(f"{what}: {key}={shard.get(key)!r}, expected a string")
    if not isinstance(shard.get("crc32"), str) or not _HEX8.match(shard["crc32"]):
        c.fail(f"{what}: crc32={shard.get('crc32')!r}, expected 8 hex digits")
    dim, shape = shard.get("dim"), entry["shape"]
    if dim is not None:
        if not _int(dim) or dim >= len(shape):
            c.fail(f"{what}: dim={dim!r} for the global shape {shape}")
        for span in c.seq(shard.get("ranges"), f"{what} ranges"):
            if (not isinstance(span, list) or len(span) != 3 or not all(_int(v) for v in span)
                    or not span[0] < span[1] <= shape[dim]):
                c.fail(f"{what}: range {span!r} is not [start, stop, local start] within "
                       f"dim {dim} of size {shape[dim]}")
    if version >= 2:
        block, crcs = shard.get("block_bytes"), shard.get("block_crc32")
        if not _int(block, 1) or not isinstance(crcs, str) or not _HEXN.match(crcs):
            c.fail(f"{what}: block_bytes={block!r} / block_crc32 is not a block size and a "
                   "string of 8-hex-digit CRCs")
        local = list(shape)
        if dim is not None:
            local[dim] = sum(g1 - g0 for g0, g1, _ in shard["ranges"])
        nbytes = int(np.prod(local, dtype=np.int64)) * np.dtype(NUMPY_DTYPES[entry["dtype"]]).itemsize
        if len(crcs) // 8 != -(-nbytes // block):
            c.fail(f"{what}: {len(crcs) // 8} block checksums for {nbytes} bytes in blocks of "
                   f"{block} (expected {-(-nbytes // block)})")


def _parameter(c: _Checker, name: str, entry, layout, version: int) -> None:
    what = f"parameter {name!r}"
    c.mapping(entry, what)
    shape = entry.get("shape")
    if not isinstance(shape, list) or not all(_int(s) for s in shape):
        c.fail(f"{what}: shape={shape!r}, expected a list of non-negative integers")
    if entry.get("dtype") not in NUMPY_DTYPES:
        c.fail(f"{what}: dtype={entry.get('dtype')!r}, expected one of {', '.join(NUMPY_DTYPES)}")
    sharding = c.mapping(entry.get("sharding"), f"{what} sharding")
    axis = sharding.get("axis")
    if axis not in _AXES:
        c.fail(f"{what}: sharding axis={axis!r}, expected one of tp, cp, dp, etp or null")
    expert = sharding.get("expert")
    if expert is not None:
        c.mapping(expert, f"{what} sharding expert")
        if not (_int(expert.get("count"), 1) and _int(expert.get("index"))
                and expert["index"] < expert["count"]):
            c.fail(f"{what}: sharding expert={expert!r}, expected {{'index': k, 'count': E}} "
                   "with 0 <= k < E")
    if axis is not None:
        if not _int(sharding.get("partition_dim")) or sharding["partition_dim"] >= len(shape):
            c.fail(f"{what}: partition_dim={sharding.get('partition_dim')!r} for shape {shape}")
        if not _int(sharding.get("partition_stride", 1), 1):
            c.fail(f"{what}: partition_stride={sharding.get('partition_stride')!r}")
    stage = entry.get("stage", 0)
    if not _int(stage) or stage >= layout.pp:
        c.fail(f"{what}: stage={stage!r}, expected 0..{layout.pp - 1} (pp={layout.pp})")
    for key in ("layer", "position"):
        if entry.get(key) is not None and not _int(entry[key]):
            c.fail(f"{what}: {key}={entry[key]!r}, expected a non-negative integer or null")
    for key in ("shards", "copies"):
        for i, shard in enumerate(c.seq(entry.get(key), f"{what} {key}")):
            _shard(c, name, i, shard, entry, version)


def validate_manifest(manifest: dict, path: str, version: int) -> None:
    """Raise :class:`CheckpointIntegrityError` naming the first malformed field of
    ``manifest`` (read from ``path``, format ``version``)."""
    c = _Checker(path)
    layout = _layout(c, manifest)
    if manifest.get("step") is not None and not _int(manifest["step"], -2 ** 63):
        c.fail(f"step={manifest['step']!r}, expected an integer or null")
    files = c.mapping(manifest.get("files"), '"files"')
    for file, info in files.items():
        c.mapping(info, f"file {file!r}")
        if not _int(info.get("rank")) or info["rank"] >= layout.world_size:
            c.fail(f"file {file!r}: rank={info.get('rank')!r}, expected 0..{layout.world_size - 1}")
        if not _int(info.get("bytes")):
            c.fail(f"file {file!r}: bytes={info.get('bytes')!r}")
        if not isinstance(info.get("crc32"), str) or not _HEX8.match(info["crc32"]):
            c.fail(f"file {file!r}: crc32={info.get('crc32')!r}, expected 8 hex digits")
    optimizers = manifest.get("optimizers")
    if optimizers is not None:
        for i, record in enumerate(c.seq(optimizers, '"optimizers"')):
            if not isinstance(record, dict) or not isinstance(record.get("class"), str):
                c.fail(f"optimizers[{i}]={record!r}, expected an object with a string \"class\"")
    params = c.mapping(manifest.get("parameters"), '"parameters"')
    for name, entry in params.items():
        _parameter(c, name, entry, layout, version)
