"""Offline work on a checkpoint directory: inspect, reshard, merge (numpy + files only).

What ``msdist checkpoint inspect | reshard | merge`` runs. Every function streams: a
tensor is read and written in slabs of rows (``files.CHUNK_BYTES``), so the resident
memory stays within about one tensor whatever the checkpoint's size. ``progress`` is an
optional callable given the bytes processed since its last call.
"""

from __future__ import annotations

import os
import shutil
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from .blocks import BLOCK_BYTES
from .errors import CheckpointError, CheckpointIntegrityError
from .files import CHUNK_BYTES, NUMPY_DTYPES, SafetensorsWriter, file_checksum, read_header
from .manifest import CheckpointReader, open_manifest
from .plan import layer_index, layout_from_dict, local_shape, piece_for, place_stages, writes
from .writer import finish, prepare, write_rank

__all__ = ["inspect", "reshard", "merge", "param_bytes"]


def param_bytes(entry: dict) -> int:
    return int(np.prod(entry["shape"], dtype=np.int64)) * np.dtype(NUMPY_DTYPES[entry["dtype"]]).itemsize


def _coverage_problem(name: str, entry: dict):
    shards = entry["shards"]
    if not shards:
        return f"parameter {name!r}: no shard holds it"
    dims = {s["dim"] for s in shards}
    if len(dims) > 1:
        return f"parameter {name!r}: shards split different dims {sorted(dims, key=str)}"
    dim = dims.pop()
    if dim is None:
        return None if len(shards) == 1 else f"parameter {name!r}: {len(shards)} whole copies as shards"
    spans = sorted((g0, g1) for s in shards for g0, g1, _ in s["ranges"])
    pos, size = 0, entry["shape"][dim]
    for g0, g1 in spans:
        if g0 != pos:
            what = "covered twice" if g0 < pos else "not covered"
            lo, hi = (g0, pos) if g0 < pos else (pos, g0)
            return f"parameter {name!r}: elements {lo}:{hi} of dim {dim} are {what}"
        pos = g1
    if pos != size:
        return f"parameter {name!r}: elements {pos}:{size} of dim {dim} are not covered"
    return None


def inspect(directory: str, checksums: bool = True, progress=None) -> dict:
    """Describe a checkpoint and judge its integrity.

    Returns a dict with ``ok``, ``complete``, ``problems`` (one line each, naming the
    file or parameter), ``notes`` (e.g. read from ``DIR.partial``: see
    :func:`~.manifest.open_manifest`), ``layout``, ``step``, ``optimizers`` (what the
    saved cell's optimizers were, see :mod:`.zero`; None if not recorded), ``parameters`` (name,
    shape, dtype, sharding, bytes, stage, shards, copies), ``files`` (file, rank, bytes,
    crc32, status) and ``checksums`` (whether they were verified: each file's, each
    tensor's and each block's).

    Raises:
        CheckpointFormatError: a manifest of an unknown format or version.
    """
    directory = str(directory)
    data = {"directory": directory, "ok": False, "complete": False, "checksums": bool(checksums),
            "problems": [], "notes": [], "parameters": [], "files": [], "layout": None,
            "step": None}
    try:
        manifest, source, note = open_manifest(directory)
    except CheckpointIntegrityError as err:
        data["problems"].append(str(err))
        data["files"] = [{"file": f, "status": "present"} for f in sorted(os.listdir(directory))
                         ] if os.path.isdir(directory) else []
        return data
    if note:
        data["notes"].append(note)
    data.update(complete=True, layout=manifest["layout"], step=manifest.get("step"),
                extra=manifest.get("extra"), format_version=manifest["format_version"],
                source=source, optimizers=manifest.get("optimizers"))
    problems = data["problems"]
    headers, tensor_crcs, block_crcs = {}, {}, {}
    sizes = {s["file"]: s.get("block_bytes") for e in manifest["parameters"].values()
             for s in e["shards"] + e["copies"]}
    for file, info in sorted(manifest["files"].items()):
        path = os.path.join(source, file)
        row = {"file": file, "rank": info["rank"], "bytes": info["bytes"], "crc32": info["crc32"],
               "status": "ok"}
        data["files"].append(row)
        try:
            headers[file] = read_header(path)
            if headers[file][2] != info["bytes"]:
                raise CheckpointIntegrityError(f"{path}: truncated: {headers[file][2]} bytes, the "
                                               f"manifest records {info['bytes']}.")
            if checksums:
                got, tensor_crcs[file], block_crcs[file] = file_checksum(
                    path, progress, sizes.get(file) or BLOCK_BYTES)
                if got != info["crc32"]:
                    raise CheckpointIntegrityError(f"{path}: checksum mismatch (crc32 {got}, the "
                                                   f"manifest records {info['crc32']}).")
        except CheckpointIntegrityError as err:
            headers.pop(file, None)
            row["status"] = "missing" if "missing file" in str(err) else "corrupt"
            problems.append(str(err).replace("missing file", f"missing rank file (rank {info['rank']})"))
    for name, entry in manifest["parameters"].items():
        data["parameters"].append({
            "name": name, "shape": entry["shape"], "dtype": entry["dtype"],
            "sharding": entry["sharding"], "bytes": param_bytes(entry), "stage": entry.get("stage", 0),
            "shards": len(entry["shards"]), "copies": len(entry["copies"])})
        problem = _coverage_problem(name, entry)
        if problem:
            problems.append(problem)
        for shard in entry["shards"] + entry["copies"]:
            if shard["file"] not in manifest["files"]:
                problems.append(f"parameter {name!r}: its file {shard['file']} is not in the manifest")
                continue
            if shard["file"] not in headers:
                continue  # the file's own problem is reported
            tensor = headers[shard["file"]][0].get(shard["key"])
            want = list(local_shape(entry["shape"], shard))
            if tensor is None or tensor["shape"] != want or tensor["dtype"] != entry["dtype"]:
                problems.append(f"parameter {name!r}: {shard['file']} holds "
                                f"{tensor and (tensor['dtype'], tensor['shape'])}, expected "
                                f"{(entry['dtype'], want)}: the checkpoint is corrupt")
            elif checksums and tensor_crcs[shard["file"]].get(shard["key"]) != shard["crc32"]:
                problems.append(f"parameter {name!r}: checksum mismatch in {shard['file']}")
            elif (checksums and shard.get("block_crc32") is not None
                  and shard["block_bytes"] == (sizes.get(shard["file"]) or BLOCK_BYTES)
                  and block_crcs[shard["file"]].get(shard["key"]) != shard["block_crc32"]):
                problems.append(f"parameter {name!r}: the block checksums of {shard['file']} in "
                                "the manifest disagree with its data (load would refuse it)")
        primary = {(s["dim"], str(s["ranges"])): s["crc32"] for s in entry["shards"]}
        for copy in entry["copies"]:
            if primary.get((copy["dim"], str(copy["ranges"]))) != copy["crc32"]:
                problems.append(f"parameter {name!r}: the copy in {copy['file']} disagrees with "
                                "the shard it replicates")
    data["total_bytes"] = sum(p["bytes"] for p in data["parameters"])
    data["ok"] = not problems
    return data


# reshard streams in smaller slabs than CHUNK_BYTES: two output files are written at
# once, each holding one slab of mapped source pages and one assembled slab.
RESHARD_SLAB_BYTES = 16 << 20


def _rows_per_slab(shape, itemsize: int, slab_bytes: int = CHUNK_BYTES) -> int:
    row = int(np.prod(shape[1:], dtype=np.int64)) * itemsize if len(shape) > 1 else itemsize
    return max(1, slab_bytes // max(1, row))


def _piece_chunks(reader: CheckpointReader, name: str, piece: dict, progress,
                  slab_bytes: int = CHUNK_BYTES, scratch=None):
    """The local tensor of ``piece``, in C-ordered slabs of rows (each valid until the
    next is asked for when ``scratch`` is given)."""
    entry = reader.params[name]
    shape = local_shape(entry["shape"], piece)
    if not shape:
        chunk = reader.read_piece(name, piece)
        yield chunk
        if progress is not None:
            progress(chunk.nbytes)
        return
    step = _rows_per_slab(shape, np.dtype(NUMPY_DTYPES[entry["dtype"]]).itemsize, slab_bytes)
    for a in range(0, shape[0], step):
        chunk = reader.read_piece(name, piece, rows=(a, min(a + step, shape[0])), scratch=scratch)
        yield chunk
        if progress is not None:
            progress(chunk.nbytes)


def _new_meta(params: dict, stages: dict, prefixes) -> dict:
    """Layer, position and base of each parameter in the resharded manifest: positions
    renumbered per new stage in the saved order, so that the output is what a save at
    the new layout records (a format-1 source gets its layers from the names)."""
    def key(n):
        e = params[n]
        return (e.get("stage", 0), -1 if e.get("position") is None else e["position"], n)

    meta, count = {}, {}
    model = [n for n in sorted(params, key=key) if params[n].get("base") not in params]
    for name in model:
        entry = params[name]
        layer = entry["layer"] if "layer" in entry else layer_index(name, prefixes)
        meta[name] = {"layer": layer, "position": count.get(stages[name], 0), "base": None}
        count[stages[name]] = count.get(stages[name], 0) + 1
    for name, entry in params.items():
        if name not in meta:
            base = meta[entry["base"]]
            meta[name] = {"layer": base["layer"], "position": base["position"], "base": entry["base"]}
    return meta


def reshard(directory: str, out: str, layout, progress=None, verify: bool = True,
            workers: int = 2) -> dict:
    """Write the checkpoint as ``layout`` (a Layout) would have saved it.

    Every parameter is checked to be splittable first; ``out`` is built as
    ``out.partial`` and renamed at the end. Returns the new manifest. ``workers`` new
    rank files are written at once (threads: the copies, checksums and fsyncs release
    the GIL, so one file's disk flush overlaps the next one's copy).

    Raises:
        CheckpointError: ``out`` exists; a parameter the new layout cannot split.
        CheckpointIntegrityError: a missing, truncated or corrupt source file.
    """
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
        raise CheckpointError(f"workers={workers!r}: expected a positive integer (files "
                              "written at once; 2 suits most disks).")
    reader = CheckpointReader(directory, verify=verify)
    reader.check_files()
    params = reader.params
    saved = layout_from_dict(reader.manifest["layout"])
    stages = place_stages(params, saved.pp, layout.pp)
    meta = _new_meta(params, stages, reader.manifest.get("layer_prefixes") or ["layers"])
    plan = {}  # rank -> [(name, piece)]
    for name, entry in params.items():
        axis, expert = entry["sharding"].get("axis"), entry["sharding"].get("expert")
        stage = stages[name]
        for rank in range(layout.world_size):
            if layout.coords(rank)["pp"] == stage and writes(layout, rank, axis, expert):
                piece = piece_for(name, entry["shape"], entry["sharding"], layout, rank)
                plan.setdefault(rank, []).append((name, piece))
    if os.path.exists(str(out)):
        raise CheckpointError(f"{out} exists: the output must be a new path. Remove it or "
                              "choose another.")
    tmp = prepare(str(out))

    def one_rank(rank):
        items = plan.get(rank, [])
        pieces = dict(items)
        scratch = np.empty(RESHARD_SLAB_BYTES, np.uint8)
        return write_rank(tmp, rank, layout.coords(rank)["pp"],
                          [(n, params[n]["dtype"], params[n]["shape"], params[n]["sharding"], p,
                            None) for n, p in items],
                          chunks=lambda n: _piece_chunks(reader, n, pieces[n], progress,
                                                         RESHARD_SLAB_BYTES, scratch),
                          meta=meta)
    try:
        if workers == 1:
            for rank in range(layout.world_size):
                one_rank(rank)
        else:
            with ThreadPoolExecutor(max_workers=workers) as pool:
                futures = [pool.submit(one_rank, rank) for rank in range(layout.world_size)]
                try:
                    for future in futures:
                        future.result()
                except BaseException:
                    for future in futures:
                        future.cancel()
                    raise
        manifest = finish(str(out), layout.world_size, layout.to_dict(),
                          reader.manifest.get("step"), reader.manifest.get("extra"),
                          reader.manifest.get("layer_prefixes"), reader.manifest.get("optimizers"))
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return manifest


def merge(directory: str, out_file: str, progress=None, verify: bool = True) -> dict:
    """One dense safetensors file with every full tensor, keyed by global name (written
    under a temporary name and renamed). Returns ``{name: shape}``.

    Raises:
        CheckpointError: ``out_file`` exists.
        CheckpointIntegrityError: a missing, truncated or corrupt source file.
    """
    out_file = str(out_file)
    if os.path.exists(out_file):
        raise CheckpointError(f"{out_file} exists: remove it or choose another name.")
    reader = CheckpointReader(directory, verify=verify)
    reader.check_files()
    params = reader.params
    whole = {"dim": None}
    writer = SafetensorsWriter(out_file, [(n, e["dtype"], e["shape"]) for n, e in params.items()],
                               metadata={"format": "np", "msdist_step": reader.manifest.get("step")})
    try:
        for name in params:
            for chunk in _piece_chunks(reader, name, whole, progress):
                writer.write(name, chunk)
        writer.close()
    except BaseException:
        writer.abort()
        raise
    return {n: e["shape"] for n, e in params.items()}
