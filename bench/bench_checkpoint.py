"""Benchmark the offline checkpoint tools on a synthetic checkpoint of >= 2 GiB.

    python bench/bench_checkpoint.py                       # 2 GiB, tp2 -> tp4, in a temp dir
    python bench/bench_checkpoint.py --gib 4 --dir /data   # another size / disk
    python bench/bench_checkpoint.py --repeat 3            # best and median of 3

Builds a tp2 x dp2 checkpoint (16 column/row weights of 128 MiB each, plus small
replicated ones: what `save` writes, streamed so the builder never holds a tensor),
then times, each in a fresh child process whose peak resident memory is sampled with
psutil (and read from ``getrusage`` after it exits, which includes mapped file pages):

* ``cp -r`` of the checkpoint directory (the disk's copy speed, same disk);
* ``reshard`` tp2 -> tp4 (``offline.reshard``: reads every element once through memory
  maps, checksums each source tensor, writes and checksums the new files), and the same
  with ``verify=False`` (``--no-verify``: the source checksums are not recomputed);
* ``inspect`` without checksums (manifest + headers + sizes) and with them (reads all);
* what ``load`` reads: the checkpoint resharded to tp1, then tp8 rank 3's slices of every
  tensor read as ``load`` reads them (``CheckpointReader.read_piece``, block checksums
  verified) after the files' pages were dropped from the page cache
  (``posix_fadvise(DONTNEED)``, allowed without root on one's own files); the bytes
  checksummed (reported by the reader) and the bytes the kernel brought into the page
  cache (``mincore``), split by dim-0 and dim-1 tensors.

Throughput is bytes of tensor data over wall time. Nothing is dropped from the page
cache (that needs root and would disturb the other users of a shared machine), so the
source is warm for every contender alike. Everything is removed at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from mindscience.distributed.checkpoint.plan import piece_for, writes  # noqa: E402
from mindscience.distributed.checkpoint.writer import finish, prepare, write_rank  # noqa: E402
from mindscience.distributed.topology.layout import Layout  # noqa: E402

ROWS, COLS = 8192, 4096  # one 128 MiB float32 tensor
SLAB_ROWS = 1024


def _sharding(dim):
    return {"axis": "tp" if dim is not None else None, "partition_dim": dim,
            "partition_stride": 1, "sequence_parallel": False}


def build(directory: str, gib: float) -> dict:
    """A tp2 x dp2 checkpoint of ``gib`` GiB, data streamed slab by slab."""
    layout = Layout(world_size=4, tp=2)
    count = max(1, int(round(gib * 1024 / 128)))
    params = {}
    for i in range(count):
        dim = i % 2  # alternate column (dim 0) and row (dim 1) splits
        params[f"layers.{i // 2}.{'fc1' if dim == 0 else 'fc2'}.weight"] = ((ROWS, COLS), _sharding(dim))
    for i in range(count // 2):
        params[f"layers.{i}.norm.weight"] = ((COLS,), _sharding(None))
    tmp = prepare(directory)
    for rank in range(layout.world_size):
        items = []
        for name, (shape, sh) in params.items():
            if writes(layout, rank, sh["axis"]):
                items.append((name, "F32", shape, sh, piece_for(name, shape, sh, layout, rank), None))
        pieces = {n: (gs, pc) for n, _, gs, _, pc, _ in items}

        def chunks(name, pieces=pieces, rank=rank):
            gshape, piece = pieces[name]
            from mindscience.distributed.checkpoint.plan import local_shape

            shape = local_shape(gshape, piece)
            base = np.arange(int(np.prod(shape[1:], dtype=np.int64)), dtype=np.float32)
            for a in range(0, shape[0], SLAB_ROWS):
                rows = min(SLAB_ROWS, shape[0] - a)
                yield (base[None, :] + np.arange(a, a + rows, dtype=np.float32)[:, None] * 1e-3
                       + rank).reshape((rows,) + tuple(shape[1:]))
        write_rank(tmp, rank, 0, items, chunks=chunks)
    return finish(directory, layout.world_size, layout.to_dict(), step=0)


LOAD_READ = """
import ctypes, json, mmap, os, sys, time
import numpy as np
from mindscience.distributed.checkpoint.manifest import CheckpointReader
from mindscience.distributed.checkpoint.plan import piece_for
from mindscience.distributed.topology.layout import Layout

src, tp, rank = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
libc = ctypes.CDLL(None, use_errno=True)
libc.mmap.restype = ctypes.c_void_p
libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]

def resident(path):
    size, page = os.path.getsize(path), mmap.PAGESIZE
    with open(path, "rb") as fh:
        addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fh.fileno(), 0)
    vec = ctypes.create_string_buffer(-(-size // page))
    libc.mincore(addr, size, vec)
    libc.munmap(addr, size)
    return sum(b & 1 for b in vec.raw) * page

files = [os.path.join(src, f) for f in os.listdir(src) if f.endswith(".safetensors")]
for path in files:
    fd = os.open(path, os.O_RDONLY)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    os.close(fd)
before = sum(resident(p) for p in files)
layout = Layout(world_size=tp, tp=tp)
reader = CheckpointReader(src)
out = {"resident_before": before, "by_dim": {}}
t = time.perf_counter()
for name, entry in reader.params.items():
    piece = piece_for(name, entry["shape"], entry["sharding"], layout, rank)
    v0 = reader.bytes_verified
    got = np.array(reader.read_piece(name, piece))
    key = str(entry["sharding"]["partition_dim"])
    row = out["by_dim"].setdefault(key, {"tensor_bytes": 0, "slice_bytes": 0, "verified": 0})
    row["tensor_bytes"] += int(np.prod(entry["shape"])) * got.itemsize
    row["slice_bytes"] += got.nbytes
    row["verified"] += reader.bytes_verified - v0
    del got
out["read_s"] = time.perf_counter() - t
out["verified"] = reader.bytes_verified
out["resident_after"] = sum(resident(p) for p in files)
out["checkpoint_bytes"] = sum(os.path.getsize(p) for p in files)
print(json.dumps(out))
"""


def data_bytes(directory: str) -> int:
    return sum(os.path.getsize(os.path.join(directory, f)) for f in os.listdir(directory))


def run_child(argv, env=None) -> dict:
    """Wall time and peak RSS (psutil samples every 5 ms; getrusage of the child)."""
    import psutil

    t0 = time.perf_counter()
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    ps = psutil.Process(proc.pid)
    peak = 0
    while proc.poll() is None:
        try:
            peak = max(peak, ps.memory_info().rss)
        except psutil.Error:
            pass
        time.sleep(0.005)
    wall = time.perf_counter() - t0
    out, err = proc.communicate()
    if proc.returncode:
        raise RuntimeError(f"{argv} failed: {err.decode()[-2000:]}")
    import resource

    ru_peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024
    return {"wall_s": wall, "psutil_peak_rss": peak, "ru_maxrss_children": ru_peak,
            "stdout": out.decode()}


def py(code: str) -> list:
    return [sys.executable, "-c", f"import sys; sys.path.insert(0, {ROOT!r})\n{code}"]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gib", type=float, default=2.0)
    ap.add_argument("--dir", default=None, help="where to build (default: a temp dir on /tmp's disk)")
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--json", default=None, help="write the figures to this file")
    args = ap.parse_args(argv)
    root = tempfile.mkdtemp(prefix="msdist_bench_ckpt_", dir=args.dir)
    src, out = os.path.join(root, "tp2"), os.path.join(root, "tp4")
    try:
        t0 = time.perf_counter()
        manifest = build(src, args.gib)
        build_s = time.perf_counter() - t0
        nbytes = data_bytes(src)
        largest = max(int(np.prod(e["shape"])) * 4 for e in manifest["parameters"].values())
        print(f"built {nbytes / 2**30:.2f} GiB ({len(manifest['parameters'])} tensors, largest "
              f"{largest / 2**20:.0f} MiB) in {build_s:.1f} s", file=sys.stderr)
        tp4 = os.path.join(root, "tp4.yaml")
        with open(tp4, "w") as fh:
            fh.write("world_size: 4\ntp: 4\n")
        runs = {"cp": [], "reshard": [], "reshard_no_verify": [], "inspect_fast": [],
                "inspect_checksums": []}
        load_reads = []
        for _ in range(args.repeat):
            for path in (out, root + "/copy"):
                shutil.rmtree(path, ignore_errors=True)
            runs["cp"].append(run_child(["cp", "-r", src, root + "/copy"]))
            shutil.rmtree(root + "/copy")
            runs["reshard"].append(run_child(py(
                "from mindscience.distributed.checkpoint import offline\n"
                "from mindscience.distributed.topology.layout import Layout\n"
                f"offline.reshard({src!r}, {out!r}, Layout(world_size=4, tp=4))")))
            shutil.rmtree(out)
            runs["reshard_no_verify"].append(run_child(py(
                "from mindscience.distributed.checkpoint import offline\n"
                "from mindscience.distributed.topology.layout import Layout\n"
                f"offline.reshard({src!r}, {out!r}, Layout(world_size=4, tp=4), verify=False)")))
            runs["inspect_fast"].append(run_child(py(
                "import time; from mindscience.distributed.checkpoint import offline\n"
                f"t = time.perf_counter(); d = offline.inspect({out!r}, checksums=False)\n"
                "print(time.perf_counter() - t, d['ok'])")))
            runs["inspect_checksums"].append(run_child(py(
                "import time; from mindscience.distributed.checkpoint import offline\n"
                f"t = time.perf_counter(); d = offline.inspect({out!r}, checksums=True)\n"
                "print(time.perf_counter() - t, d['ok'])")))
        tp1 = os.path.join(root, "tp1")
        run_child(py("from mindscience.distributed.checkpoint import offline\n"
                     "from mindscience.distributed.topology.layout import Layout\n"
                     f"offline.reshard({src!r}, {tp1!r}, Layout(world_size=1))"))
        for _ in range(args.repeat):
            child = run_child(py(LOAD_READ) + [tp1, "8", "3"])
            load_reads.append(dict(json.loads(child["stdout"]), peak_rss_mib=child["psutil_peak_rss"] / 2**20))
        result = {"gib": nbytes / 2**30, "tensors": len(manifest["parameters"]),
                  "largest_tensor_mib": largest / 2**20, "build_s": build_s}
        for key, rs in runs.items():
            walls = [r["wall_s"] for r in rs]
            result[key] = {"best_s": min(walls), "median_s": statistics.median(walls),
                           "peak_rss_mib": max(r["psutil_peak_rss"] for r in rs) / 2**20}
            if key.startswith("inspect"):
                inner = [float(r["stdout"].split()[0]) for r in rs]
                result[key]["in_process_s"] = min(inner)
                result[key]["ok"] = all(r["stdout"].split()[1] == "True" for r in rs)
        result["reshard"]["ru_maxrss_mib"] = max(r["ru_maxrss_children"] for r in runs["reshard"]) / 2**20
        result["reshard_vs_cp"] = result["cp"]["best_s"] / result["reshard"]["best_s"]
        result["reshard_no_verify_vs_cp"] = result["cp"]["best_s"] / result["reshard_no_verify"]["best_s"]
        result["reshard_gib_s"] = nbytes / 2**30 / result["reshard"]["best_s"]
        result["cp_gib_s"] = nbytes / 2**30 / result["cp"]["best_s"]
        result["reshard_peak_rss_vs_largest"] = result["reshard"]["peak_rss_mib"] / (largest / 2**20)
        best = min(load_reads, key=lambda r: r["read_s"])
        result["load_tp8_rank3_of_tp1"] = {
            "read_s_best": best["read_s"], "checkpoint_mib": best["checkpoint_bytes"] / 2**20,
            "verified_mib": best["verified"] / 2**20,
            "page_cache_mib": max(r["resident_after"] - r["resident_before"] for r in load_reads) / 2**20,
            "peak_rss_mib": max(r["peak_rss_mib"] for r in load_reads),
            "by_dim": {d: {k: v / 2**20 for k, v in row.items()} for d, row in best["by_dim"].items()}}
        print(json.dumps(result, indent=1))
        if args.json:
            with open(args.json, "w") as fh:
                json.dump(result, fh, indent=1)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
