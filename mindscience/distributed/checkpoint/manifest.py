"""The checkpoint directory, its manifest, and a reader of global slices (no MindSpore).

A checkpoint is a directory::

    manifest.json                  written last: the checkpoint exists once it does
    rank_00000.safetensors         what rank 0 owns (tensors keyed by global name)
    rank_00000.json                rank 0's part of the manifest (merged by rank 0)
    ...

``manifest.json`` (format version 2)::

    {"format": "msdist-checkpoint", "format_version": 2, "step": 10, "extra": {...},
     "layout": {"world_size": 4, "tp": 2, "cp": 1, "dp": 2, "pp": 1, "order": "tp-cp-dp-pp"},
     "layer_prefixes": ["layers"],
     "optimizers": [{"class": "DistributedOptimizer", "kind": "adamw", "zero_stage": 1,
                     "state": ["exp_avg", "exp_avg_sq"], "group_size": 2}],
     "files": {"rank_00000.safetensors": {"rank": 0, "bytes": 1234, "crc32": "89ab01cd"}},
     "parameters": {"layers.0.mlp.fc1.weight": {
         "shape": [64, 16], "dtype": "F32", "stage": 0, "layer": 0, "position": 3,
         "base": null,
         "sharding": {"axis": "tp", "partition_dim": 0, "partition_stride": 1, ...},
         "shards": [{"file": "rank_00000.safetensors", "key": "layers.0.mlp.fc1.weight",
                     "dim": 0, "ranges": [[0, 32, 0]], "crc32": "...",
                     "block_bytes": 1048576, "block_crc32": "0a1b2c3d..."}, ...],
         "copies": []}}}

``optimizers`` (only when the saved cell held optimizers) says what they were, so that
``load`` refuses another kind (see :mod:`.zero`: sharded optimizer state is saved
unsharded, so the stage and group size may differ). ``shards`` hold each element exactly
once; ``copies`` are further identical pieces (a parameter that several pipeline stages
hold, such as the optimizer's step counter), checked to agree. ``layer`` is the
parameter's global layer index (None outside the layers; for optimizer state, that of
its ``base`` parameter), ``position`` its index in its stage's parameter order (an
optimizer state has its base's): with them an offline reshard places parameters on
pipeline stages (:mod:`.plan`). ``block_crc32`` (see :mod:`.blocks`) lets ``load``
verify only the blocks it reads. Version 1 (no blocks, no layer/position) is still read:
its tensors are verified whole.
See :mod:`.plan` for pieces and :mod:`.files` for checksums.

Crash window of a save replacing ``DIR``: :mod:`.writer` swaps ``DIR.partial`` and
``DIR`` atomically where the system can; where it cannot, a crash between its two
renames leaves no ``DIR``, the previous checkpoint in ``DIR.old`` and the new, complete
one in ``DIR.partial``: :func:`open_manifest` then reads ``DIR.partial`` (with a note).
"""

from __future__ import annotations

import json
import os

import numpy as np

from .blocks import block_crcs, split_crcs, touched_blocks
from .errors import CheckpointError, CheckpointFormatError, CheckpointIntegrityError
from .files import NUMPY_DTYPES, crc_hex, fsync_dir, read_header, tensor_view
from .schema import validate_manifest

__all__ = ["FORMAT", "FORMAT_VERSION", "READ_VERSIONS", "MANIFEST", "rank_file", "part_file",
           "write_json_atomic", "read_manifest", "open_manifest", "merge_parts",
           "CheckpointReader"]

FORMAT = "msdist-checkpoint"
FORMAT_VERSION = 2
READ_VERSIONS = (1, 2)
MANIFEST = "manifest.json"
PARTIAL_SUFFIX = ".partial"
OLD_SUFFIX = ".old"


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


def has_manifest(directory: str) -> bool:
    """Whether ``directory`` holds a manifest (a save wrote it last: the checkpoint is whole)."""
    return os.path.isfile(os.path.join(directory, MANIFEST))


def partial_dir(directory: str) -> str:
    """Where a save of ``directory`` builds the checkpoint: ``DIR.partial``."""
    return str(directory).rstrip("/") + PARTIAL_SUFFIX


def open_manifest(directory: str) -> tuple:
    """``(manifest, data directory, note)`` of the checkpoint ``directory``.

    The data directory is ``directory``, except in the state a save's fallback (two
    renames) leaves when killed between them: ``directory`` missing and a complete
    ``directory.partial`` (it has its manifest, written after every rank's files): that
    is the new checkpoint, read from there, and ``note`` says so. ``note`` is None
    otherwise.

    Raises:
        CheckpointIntegrityError: no checkpoint (with what is there instead), no
            manifest, a manifest that is not valid JSON or is malformed.
        CheckpointFormatError: an unknown format or format version.
    """
    directory = str(directory)
    base = directory.rstrip("/") or directory
    partial, old = partial_dir(base), base + OLD_SUFFIX
    note = None
    if not os.path.isdir(directory):
        if os.path.exists(directory):
            raise CheckpointIntegrityError(f"{directory}: not a directory (a checkpoint is a "
                                           f"directory holding {MANIFEST}).")
        if has_manifest(partial):
            note = (f"{directory} is missing but {partial} is complete: a save finished writing "
                    f"and was stopped while moving it into place; reading {partial}. The next "
                    f"save to {directory} moves it into place first (or rename it yourself).")
            directory = partial
        else:
            hint = ""
            if os.path.isdir(partial):
                hint = (f" {partial} exists: a save that did not finish; it is incomplete and "
                        "cannot be loaded.")
            if has_manifest(old):
                hint += (f" {old} holds the previous complete checkpoint: rename it to "
                         f"{directory} to use it.")
            raise CheckpointIntegrityError(f"{directory}: no checkpoint directory.{hint}")
    path = os.path.join(directory, MANIFEST)
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
        raise CheckpointFormatError(f"{path}: not an {FORMAT} manifest (format="
                                    f"{manifest.get('format') if isinstance(manifest, dict) else None!r}).")
    version = manifest.get("format_version")
    if isinstance(version, bool) or version not in READ_VERSIONS:
        raise CheckpointFormatError(
            f"{path}: unknown format_version {version!r}: this msdist reads versions "
            f"{', '.join(map(str, READ_VERSIONS))}. Use the msdist release that wrote it.")
    validate_manifest(manifest, path, version)
    return manifest, directory, note


def read_manifest(directory: str) -> dict:
    """The manifest of ``directory``, checked (see :func:`open_manifest`)."""
    return open_manifest(directory)[0]


def merge_parts(parts: list, layout: dict, step=None, extra=None, layer_prefixes=None,
                optimizers=None) -> dict:
    """The manifest from the ranks' parts (each ``{"rank", "file", "bytes", "crc32",
    "stage", "params": {name: {"shape", "dtype", "sharding", "key", "dim", "ranges",
    "crc32", "block_bytes", "block_crc32", "layer", "position", "base"}}}``), in rank
    order; a piece seen twice becomes a copy. ``optimizers`` (what the saved cell's
    optimizers were, see :mod:`.zero`) is kept when given."""
    files, params = {}, {}
    for part in sorted(parts, key=lambda p: p["rank"]):
        if part.get("file"):
            files[part["file"]] = {"rank": part["rank"], "bytes": part["bytes"], "crc32": part["crc32"]}
        for name, info in part["params"].items():
            shard = {"file": part["file"], "key": info["key"], "dim": info["dim"],
                     "ranges": info.get("ranges"), "crc32": info["crc32"],
                     "block_bytes": info["block_bytes"], "block_crc32": info["block_crc32"]}
            entry = params.get(name)
            if entry is None:
                entry = params[name] = {"shape": info["shape"], "dtype": info["dtype"],
                                        "sharding": info["sharding"], "stage": part["stage"],
                                        "layer": info.get("layer"), "position": info.get("position"),
                                        "base": info.get("base"), "shards": [], "copies": []}
            elif entry["shape"] != info["shape"] or entry["dtype"] != info["dtype"]:
                raise CheckpointError(
                    f"parameter {name!r}: rank {part['rank']} holds global shape {info['shape']} "
                    f"{info['dtype']}, an earlier rank {entry['shape']} {entry['dtype']}: one "
                    "global name must mean one tensor (see set_global_layer_names for stages).")
            same = [s for s in entry["shards"]
                    if s["dim"] == shard["dim"] and s["ranges"] == shard["ranges"]]
            (entry["copies"] if same else entry["shards"]).append(shard)
    manifest = {"format": FORMAT, "format_version": FORMAT_VERSION, "step": step, "extra": extra,
                "layout": layout, "layer_prefixes": list(layer_prefixes or ["layers"]),
                "files": files, "parameters": dict(sorted(params.items()))}
    if optimizers:
        manifest["optimizers"] = optimizers
    return manifest


def _empty(shape, dtype, scratch) -> np.ndarray:
    nbytes = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
    if scratch is None or scratch.nbytes < nbytes:
        return np.empty(shape, dtype)
    return scratch[:nbytes].view(dtype).reshape(shape)


class CheckpointReader:
    """Reads global slices of a checkpoint's parameters through memory maps.

    Only the byte ranges of the requested slices are touched. With ``verify``, the
    blocks (:mod:`.blocks`) holding those bytes are checksummed, each once, before the
    slice is handed out: a rank reads its slices rounded out to block edges, never the
    whole checkpoint (a version-1 checkpoint has no block checksums: each tensor read is
    verified whole). :attr:`bytes_verified` counts the bytes checksummed.

    Raises (at construction): the errors of :func:`open_manifest`; (on read) a missing
    or truncated file, a tensor whose stored shape or dtype is not the manifest's, a
    checksum mismatch.
    """

    def __init__(self, directory: str, verify: bool = True):
        self.manifest, self.directory, self.note = open_manifest(str(directory))
        self.params = self.manifest["parameters"]
        self.verify = verify
        self.bytes_verified = 0
        self._headers: dict = {}
        self._verified: dict = {}  # (file, key) -> bool per block (True: verified)
        self._owner = {(s["file"], s["key"]): name for name, e in self.params.items()
                       for s in e["shards"] + e["copies"]}

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
        """A read-only memory map of the stored tensor of ``shard`` (not verified: see
        :meth:`read_box`), its shape and dtype checked against the manifest."""
        from .plan import local_shape

        path, header, start = self._header(shard["file"])
        key = shard["key"]
        if key not in header:
            raise CheckpointIntegrityError(f"{path}: tensor {key!r} is missing.")
        name = self._owner.get((shard["file"], key))
        if name is not None:
            entry = self.params[name]
            want = list(local_shape(entry["shape"], shard))
            got = header[key]
            if got.get("shape") != want or got.get("dtype") != entry["dtype"]:
                raise CheckpointIntegrityError(
                    f"{path}: parameter {name!r}: the file holds {got.get('dtype')} "
                    f"{got.get('shape')}, the manifest says {entry['dtype']} {want} (global "
                    f"shape {entry['shape']}): the checkpoint is corrupt.")
        return tensor_view(path, header, start, key)

    def _verify(self, shard: dict, box) -> None:
        """Checksum the not yet verified blocks of ``shard``'s stored tensor holding the
        local slice ``box`` (one ``(start, stop)`` per dim)."""
        if not self.verify:
            return
        path, header, start = self._header(shard["file"])
        info = header[shard["key"]]
        b, e = info["data_offsets"]
        tag = (shard["file"], shard["key"])
        block = shard.get("block_bytes")
        if block is None:  # format 1: one checksum per stored tensor
            block, want = max(1, e - b), [shard["crc32"]]
        else:
            want = split_crcs(shard["block_crc32"])
        done = self._verified.get(tag)
        if done is None:
            done = self._verified[tag] = np.zeros(len(want), bool)
        itemsize = np.dtype(NUMPY_DTYPES[info["dtype"]]).itemsize
        todo = touched_blocks(info["shape"], itemsize, box, block)
        todo = todo[~done[todo]]
        if not todo.size:
            return
        # consecutive blocks are checksummed through one map
        cuts = np.nonzero(np.diff(todo) != 1)[0] + 1
        with open(path, "rb") as fh:
            for run in np.split(todo, cuts):
                first = int(run[0]) * block
                length = min((int(run[-1]) + 1) * block, e - b) - first
                crcs = block_crcs(fh, start + b + first, length, block)
                self.bytes_verified += length
                for i, crc in zip(run.tolist(), crcs):
                    if crc_hex(crc) != want[i]:
                        lo = start + b + i * block
                        raise CheckpointIntegrityError(
                            f"{path}: checksum mismatch in tensor {shard['key']!r} (bytes "
                            f"{lo}:{min(lo + block, start + e)}, crc32 {crc_hex(crc)}, the "
                            f"manifest records {want[i]}): the file is corrupt.")
        done[todo] = True

    def read_box(self, name: str, box: dict, scratch=None) -> np.ndarray:
        """The global slice of ``name`` given by ``box`` ({dim: (start, stop)}, other dims
        whole), assembled from the shards that intersect it, each verified first (the
        blocks holding the slice). May be a read-only view of the memory-mapped file: copy
        it (``np.array``) to keep it. A slice that must be assembled goes into ``scratch``
        (a 1-D uint8 array, reused by a streaming caller that consumes each slice before
        asking for the next) when it is large enough."""
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
                view = self.view(shard)
                self._verify(shard, [s.indices(n)[:2] for s, n in zip(src, view.shape)])
                part = view[tuple(src)]
                if (sd is None or tuple(part.shape) == tuple(shape)) and part.flags.c_contiguous:
                    # One shard holds the whole box contiguously: hand out the memory-mapped
                    # slice itself (no copy; the caller copies or streams it).
                    return part
                if out is None:
                    out = _empty(shape, part.dtype, scratch)
                out[tuple(dst)] = part
        # A whole stored tensor (dim None) covers any box; a split one must cover the box's
        # extent along its dim.
        split = entry["shards"][0]["dim"] if entry["shards"] else None
        want = shape[split] if split is not None else None
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
