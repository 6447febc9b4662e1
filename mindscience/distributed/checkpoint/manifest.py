"""The checkpoint directory, its manifest, and a reader of global slices (no MindSpore).

A checkpoint is a directory::

    manifest.json                  written last: the checkpoint exists once it does
    rank_00000.safetensors         what rank 0 owns (tensors keyed by global name)
    rank_00000.json                rank 0's part of the manifest (merged by rank 0)
    ...

``manifest.json``::

    {"format": "msdist-checkpoint", "format_version": 1, "step": 10, "extra": {...},
     "layout": {"world_size": 4, "tp": 2, "cp": 1, "dp": 2, "pp": 1, "order": "tp-cp-dp-pp"},
     "files": {"rank_00000.safetensors": {"rank": 0, "bytes": 1234, "crc32": "89ab01cd"}},
     "parameters": {"layers.0.mlp.fc1.weight": {
         "shape": [64, 16], "dtype": "F32", "stage": 0,
         "sharding": {"axis": "tp", "partition_dim": 0, "partition_stride": 1, ...},
         "shards": [{"file": "rank_00000.safetensors", "key": "layers.0.mlp.fc1.weight",
                     "dim": 0, "ranges": [[0, 32, 0]], "crc32": "..."}, ...],
         "copies": []}}}

``shards`` hold each element exactly once; ``copies`` are further identical pieces (a
parameter that several pipeline stages hold, such as the optimizer's step counter),
checked to agree. See :mod:`.plan` for pieces and :mod:`.files` for checksums.
"""

from __future__ import annotations

import json
import os

import numpy as np

from .errors import CheckpointError, CheckpointIntegrityError
from .files import crc_hex, fsync_dir, range_crc, read_header, tensor_view

__all__ = ["FORMAT", "FORMAT_VERSION", "MANIFEST", "rank_file", "part_file", "write_json_atomic",
           "read_manifest", "merge_parts", "CheckpointReader"]

FORMAT = "msdist-checkpoint"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
PARTIAL_SUFFIX = ".partial"


def rank_file(rank: int) -> str:
    return f"rank_{rank:05d}.safetensors"


def part_file(rank: int) -> str:
    return f"rank_{rank:05d}.json"


def write_json_atomic(path: str, data) -> None:
    """Write JSON under a temporary name, fsync, rename, fsync the directory."""
    tmp = str(path) + ".tmp"
    with open(tmp, "w") as fh:
        json.dump(data, fh, indent=1, sort_keys=True)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)
    fsync_dir(os.path.dirname(os.path.abspath(path)))


def read_manifest(directory: str) -> dict:
    """The manifest of ``directory``, with its format checked.

    Raises:
        CheckpointIntegrityError: no manifest (not a checkpoint, or a save that did not
            finish), or one that is not valid JSON.
        CheckpointError: an unknown format or format version.
    """
    directory = str(directory)
    path = os.path.join(directory, MANIFEST)
    if not os.path.isdir(directory):
        hint = ""
        if os.path.isdir(directory + PARTIAL_SUFFIX):
            hint = (f" {directory}{PARTIAL_SUFFIX} exists: a save that did not finish; it is "
                    "incomplete and cannot be loaded.")
        raise CheckpointIntegrityError(f"{directory}: no checkpoint directory.{hint}")
    if not os.path.isfile(path):
        raise CheckpointIntegrityError(
            f"{directory}: incomplete: no {MANIFEST} (the manifest is written last, so this "
            "is a save that did not finish, or not a checkpoint).")
    try:
        with open(path) as fh:
            manifest = json.load(fh)
    except ValueError as err:
        raise CheckpointIntegrityError(f"{path}: corrupt manifest ({err}).") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise CheckpointError(f"{path}: not an {FORMAT} manifest (format="
                              f"{manifest.get('format') if isinstance(manifest, dict) else None!r}).")
    version = manifest.get("format_version")
    if version != FORMAT_VERSION:
        raise CheckpointError(f"{path}: unknown format_version {version!r}: this msdist reads "
                              f"version {FORMAT_VERSION}. Use the msdist release that wrote it.")
    return manifest


def merge_parts(parts: list, layout: dict, step=None, extra=None) -> dict:
    """The manifest from the ranks' parts (each ``{"rank", "file", "bytes", "crc32",
    "stage", "params": {name: {"shape", "dtype", "sharding", "key", "dim", "ranges",
    "crc32"}}}``), in rank order; a piece seen twice becomes a copy."""
    files, params = {}, {}
    for part in sorted(parts, key=lambda p: p["rank"]):
        if part.get("file"):
            files[part["file"]] = {"rank": part["rank"], "bytes": part["bytes"], "crc32": part["crc32"]}
        for name, info in part["params"].items():
            shard = {"file": part["file"], "key": info["key"], "dim": info["dim"],
                     "ranges": info.get("ranges"), "crc32": info["crc32"]}
            entry = params.get(name)
            if entry is None:
                entry = params[name] = {"shape": info["shape"], "dtype": info["dtype"],
                                        "sharding": info["sharding"], "stage": part["stage"],
                                        "shards": [], "copies": []}
            elif entry["shape"] != info["shape"] or entry["dtype"] != info["dtype"]:
                raise CheckpointError(
                    f"parameter {name!r}: rank {part['rank']} holds global shape {info['shape']} "
                    f"{info['dtype']}, an earlier rank {entry['shape']} {entry['dtype']}: one "
                    "global name must mean one tensor (see set_global_layer_names for stages).")
            same = [s for s in entry["shards"]
                    if s["dim"] == shard["dim"] and s["ranges"] == shard["ranges"]]
            (entry["copies"] if same else entry["shards"]).append(shard)
    return {"format": FORMAT, "format_version": FORMAT_VERSION, "step": step, "extra": extra,
            "layout": layout, "files": files, "parameters": dict(sorted(params.items()))}


def _empty(shape, dtype, scratch) -> np.ndarray:
    nbytes = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
    if scratch is None or scratch.nbytes < nbytes:
        return np.empty(shape, dtype)
    return scratch[:nbytes].view(dtype).reshape(shape)


class CheckpointReader:
    """Reads global slices of a checkpoint's parameters through memory maps.

    Only the byte ranges of the requested slices are touched, except with ``verify``:
    then each saved tensor is checksummed (whole) the first time it is read.

    Raises (at construction): the errors of :func:`read_manifest`; (on read) a missing
    or truncated file, a checksum mismatch.
    """

    def __init__(self, directory: str, verify: bool = True):
        self.directory = str(directory)
        self.manifest = read_manifest(self.directory)
        self.params = self.manifest["parameters"]
        self.verify = verify
        self._headers: dict = {}
        self._checked: set = set()

    def check_files(self, names=None) -> None:
        """Open (header, size) every file holding ``names`` (default all) up front, so a
        missing or truncated file fails before anything is read."""
        wanted = self.params if names is None else names
        for name in wanted:
            for shard in self.params[name]["shards"]:
                self._header(shard["file"])

    def _header(self, file: str):
        if file not in self._headers:
            path = os.path.join(self.directory, file)
            info = self.manifest["files"].get(file, {})
            if not os.path.exists(path):
                raise CheckpointIntegrityError(
                    f"{path}: missing rank file (rank {info.get('rank', '?')} of the saved layout).")
            header, start, size = read_header(path)
            if info.get("bytes") is not None and size != info["bytes"]:
                raise CheckpointIntegrityError(f"{path}: truncated: {size} bytes, the manifest "
                                               f"records {info['bytes']}.")
            self._headers[file] = (path, header, start)
        return self._headers[file]

    def view(self, shard: dict) -> np.ndarray:
        path, header, start = self._header(shard["file"])
        if shard["key"] not in header:
            raise CheckpointIntegrityError(f"{path}: tensor {shard['key']!r} is missing.")
        arr = tensor_view(path, header, start, shard["key"])
        tag = (shard["file"], shard["key"])
        if self.verify and tag not in self._checked:
            b, e = header[shard["key"]]["data_offsets"]
            with open(path, "rb") as fh:
                got = crc_hex(range_crc(fh, start + b, e - b))
            if got != shard["crc32"]:
                raise CheckpointIntegrityError(
                    f"{path}: checksum mismatch in tensor {shard['key']!r} (crc32 {got}, the "
                    f"manifest records {shard['crc32']}): the file is corrupt.")
            self._checked.add(tag)
        return arr

    def read_box(self, name: str, box: dict, scratch=None) -> np.ndarray:
        """The global slice of ``name`` given by ``box`` ({dim: (start, stop)}, other dims
        whole), assembled from the shards that intersect it. May be a read-only view of
        the memory-mapped file: copy it (``np.array``) to keep it. A slice that must be
        assembled goes into ``scratch`` (a 1-D uint8 array, reused by a streaming caller
        that consumes each slice before asking for the next) when it is large enough."""
        entry = self.params[name]
        shape = list(entry["shape"])
        for d, (a, b) in box.items():
            shape[d] = b - a
        out = None
        covered = 0
        for shard in entry["shards"]:
            sd = shard["dim"]
            spans = shard["ranges"] if sd is not None else [None]
            for span in spans:
                src = [slice(None)] * len(shape)
                dst = [slice(None)] * len(shape)
                for d, (a, b) in box.items():
                    if d != sd:
                        src[d] = slice(a, b)
                if sd is not None:
                    g0, g1, l0 = span
                    a, b = box.get(sd, (0, entry["shape"][sd]))
                    lo, hi = max(a, g0), min(b, g1)
                    if lo >= hi:
                        continue
                    src[sd] = slice(l0 + lo - g0, l0 + hi - g0)
                    dst[sd] = slice(lo - a, hi - a)
                    covered += hi - lo
                else:
                    covered = None
                part = self.view(shard)[tuple(src)]
                if (sd is None or tuple(part.shape) == tuple(shape)) and part.flags.c_contiguous:
                    # One shard holds the whole box contiguously: hand out the memory-mapped
                    # slice itself (no copy; the caller copies or streams it).
                    return part
                if out is None:
                    out = _empty(shape, part.dtype, scratch)
                out[tuple(dst)] = part
        want = shape[entry["shards"][0]["dim"]] if entry["shards"] else None
        if out is None or covered != want:
            raise CheckpointIntegrityError(
                f"{self.directory}: parameter {name!r} is not fully covered by its shards.")
        return out

    def read_piece(self, name: str, piece: dict, rows=None, scratch=None) -> np.ndarray:
        """A rank's local tensor for ``piece`` (see :mod:`.plan`), optionally only the
        local rows ``rows = (a, b)`` of dim 0 (``scratch``: see :meth:`read_box`)."""
        shape = self.params[name]["shape"]
        if not shape:
            return self.read_box(name, {})
        dim = piece["dim"]
        if dim is None or dim != 0:
            box = {0: rows} if rows is not None else {}
            if dim is None:
                return self.read_box(name, box, scratch)
            if len(piece["ranges"]) == 1:
                (g0, g1, _), = piece["ranges"]
                return self.read_box(name, {**box, dim: (g0, g1)}, scratch)
            parts = [self.read_box(name, {**box, dim: (g0, g1)}) for g0, g1, _ in piece["ranges"]]
            return parts[0] if len(parts) == 1 else np.concatenate(parts, axis=dim)
        out = []
        for g0, g1, l0 in piece["ranges"]:
            a, b = (l0, l0 + g1 - g0) if rows is None else rows
            lo, hi = max(a, l0), min(b, l0 + g1 - g0)
            if lo < hi:
                out.append(self.read_box(name, {0: (g0 + lo - l0, g0 + hi - l0)}))
        return out[0] if len(out) == 1 else np.concatenate(out, axis=0)
