"""Sharded checkpoints offline, format version 2: block checksums (a rank reads only its
slices), manifest validation, the crash window of a replacing save, pipeline-stage
placement by recorded layer and position, and the CLI's exit codes for each.

Checkpoints are built from numpy with ``writer.save_arrays``, as in test_checkpoint.py.
"""

import ctypes
import json
import mmap
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

from mindscience.distributed.checkpoint import (CheckpointError, CheckpointFormatError,
                                                CheckpointIntegrityError, blocks, manifest, offline)
from mindscience.distributed.checkpoint.manifest import CheckpointReader
from mindscience.distributed.checkpoint.plan import piece_for
from mindscience.distributed.checkpoint.writer import save_arrays
from mindscience.distributed.topology.layout import Layout


def _sh(dim=None, stride=1):
    if dim is None:
        return {"axis": None, "partition_dim": None, "partition_stride": 1, "sequence_parallel": False}
    return {"axis": "tp", "partition_dim": dim, "partition_stride": stride, "sequence_parallel": False}


ROWS, COLS = 1000, 520  # float32: 2,080 bytes a row, 2,080,000 bytes


def _big(path, block=64 << 10, monkeypatch=None):
    """A tp1 checkpoint of one dim-0-split and one dim-1-split tensor, 64 KiB blocks."""
    rng = np.random.default_rng(0)
    arrays = {"col.weight": rng.standard_normal((ROWS, COLS)).astype(np.float32),
              "row.weight": rng.standard_normal((COLS, ROWS)).astype(np.float32)}
    monkeypatch.setattr(blocks, "BLOCK_BYTES", block)
    save_arrays(str(path), arrays, Layout(world_size=1),
                {"col.weight": _sh(0), "row.weight": _sh(1)}, step=1)
    return arrays


def _spy(monkeypatch):
    """Record every byte range the reader checksums (the only reads besides the header
    and the returned slice, which lies inside them)."""
    seen = []
    real = manifest.block_crcs

    def spy(fh, start, length, block, *args, **kwargs):
        seen.append((start, length))
        return real(fh, start, length, block, *args, **kwargs)

    monkeypatch.setattr(manifest, "block_crcs", spy)
    return seen


def test_touched_blocks_by_hand():
    # (8, 4) float32: 16-byte rows; blocks of 32 bytes hold 2 rows each.
    assert blocks.touched_blocks((8, 4), 4, [(2, 5), (0, 4)], 32).tolist() == [1, 2]
    assert blocks.touched_blocks((8, 4), 4, [(0, 8), (3, 4)], 32).tolist() == [0, 1, 2, 3]
    assert blocks.touched_blocks((8, 4), 4, [(0, 2), (3, 4)], 32).tolist() == [0]
    assert blocks.touched_blocks((), 4, [], 32).tolist() == [0]
    assert blocks.touched_blocks((0, 4), 4, [(0, 0), (0, 4)], 32).tolist() == []
    # rows of 256 bytes, blocks of 64: a 1-column segment per row touches every 4th block
    assert blocks.touched_blocks((3, 64), 4, [(0, 3), (20, 21)], 64).tolist() == [1, 5, 9]


def test_block_crcs_combine_to_the_tensor_crc():
    import zlib

    data = np.random.default_rng(1).integers(0, 256, 10_000, dtype=np.uint8).tobytes()
    acc = blocks.BlockCrc(4096)
    for i in range(0, len(data), 777):
        acc.update(memoryview(data[i:i + 777]))
    acc.finish()
    assert acc.blocks == [zlib.crc32(data[i:i + 4096]) for i in range(0, 10_000, 4096)]
    assert acc.total() == zlib.crc32(data)
    a, b = data[:1234], data[1234:]
    assert blocks._crc32_combine_py(zlib.crc32(a), zlib.crc32(b), len(b)) == zlib.crc32(data)


def test_tp8_rank_of_tp1_checkpoint_reads_an_eighth(tmp_path, monkeypatch):
    arrays = _big(tmp_path / "c", monkeypatch=monkeypatch)
    block = 64 << 10
    entry = json.loads((tmp_path / "c" / "manifest.json").read_text())["parameters"]["col.weight"]
    assert entry["shards"][0]["block_bytes"] == block
    assert len(entry["shards"][0]["block_crc32"]) == 8 * -(-ROWS * COLS * 4 // block)  # 32 blocks
    total, tp8 = ROWS * COLS * 4, Layout(world_size=8, tp=8)
    for rank in (0, 3, 7):
        seen = _spy(monkeypatch)
        reader = CheckpointReader(str(tmp_path / "c"))
        piece = piece_for("col.weight", (ROWS, COLS), _sh(0), tp8, rank)
        got = np.array(reader.read_piece("col.weight", piece))
        lo, hi = rank * 125, (rank + 1) * 125
        np.testing.assert_array_equal(got, arrays["col.weight"][lo:hi])
        # The slice's bytes rounded out to 64 KiB blocks: 260,000 bytes, read 262,144 to
        # 327,680 (rank 3: rows 375:500 are bytes 780,000:1,040,000, blocks 11..15).
        read = sum(n for _, n in seen)
        assert reader.bytes_verified == read
        first, last = lo * COLS * 4 // block, (hi * COLS * 4 - 1) // block
        assert read == min((last + 1) * block, total) - first * block
        assert total / 8 <= read <= total / 8 + 2 * block
        if rank == 3:
            assert (first, last, read) == (11, 15, 5 * block)


def test_flipped_byte_caught_inside_the_range_only(tmp_path, monkeypatch):
    arrays = _big(tmp_path / "c", monkeypatch=monkeypatch)
    path = tmp_path / "c" / "rank_00000.safetensors"
    header = json.loads(path.read_bytes()[8:8 + int.from_bytes(path.read_bytes()[:8], "little")])
    start = 8 + int.from_bytes(path.read_bytes()[:8], "little")
    begin = header["col.weight"]["data_offsets"][0]
    tp8 = Layout(world_size=8, tp=8)
    # Flip a byte of row 900 (tp8 rank 7's rows 875:1000).
    data = bytearray(path.read_bytes())
    data[start + begin + 900 * COLS * 4 + 17] ^= 0x10
    path.write_bytes(bytes(data))
    reader = CheckpointReader(str(tmp_path / "c"))
    with pytest.raises(CheckpointIntegrityError, match=r"checksum mismatch in tensor 'col.weight' "
                                                       r"\(bytes \d+:\d+"):
        reader.read_piece("col.weight", piece_for("col.weight", (ROWS, COLS), _sh(0), tp8, 7))
    # Rank 0 (rows 0:125) never reads that block: it loads, and its values are right.
    reader = CheckpointReader(str(tmp_path / "c"))
    got = reader.read_piece("col.weight", piece_for("col.weight", (ROWS, COLS), _sh(0), tp8, 0))
    np.testing.assert_array_equal(got, arrays["col.weight"][:125])
    # inspect verifies every byte: it reports the file and the parameter.
    data = offline.inspect(str(tmp_path / "c"))
    assert not data["ok"] and any("rank_00000.safetensors: checksum mismatch" in p for p in data["problems"])


def test_dim1_split_reads_every_block_of_the_rows(tmp_path, monkeypatch):
    """A dim-1 split is a segment of every row: rows of 4,000 bytes are shorter than a
    64 KiB block, so every block of the stored tensor holds part of the slice."""
    arrays = _big(tmp_path / "c", monkeypatch=monkeypatch)
    seen = _spy(monkeypatch)
    reader = CheckpointReader(str(tmp_path / "c"))
    piece = piece_for("row.weight", (COLS, ROWS), _sh(1), Layout(world_size=8, tp=8), 2)
    got = reader.read_piece("row.weight", piece)
    np.testing.assert_array_equal(got, arrays["row.weight"][:, 250:375])
    assert sum(n for _, n in seen) == reader.bytes_verified == COLS * ROWS * 4


def test_format_1_checkpoint_is_still_read(tmp_path, monkeypatch):
    arrays = _big(tmp_path / "c", monkeypatch=monkeypatch)
    path = tmp_path / "c" / "manifest.json"
    data = json.loads(path.read_text())
    data["format_version"] = 1
    data.pop("layer_prefixes")
    for entry in data["parameters"].values():
        for key in ("layer", "position", "base"):
            entry.pop(key)
        for shard in entry["shards"]:
            shard.pop("block_bytes"), shard.pop("block_crc32")
    path.write_text(json.dumps(data))
    assert offline.inspect(str(tmp_path / "c"))["ok"]
    reader = CheckpointReader(str(tmp_path / "c"))
    got = reader.read_piece("col.weight", piece_for("col.weight", (ROWS, COLS), _sh(0),
                                                    Layout(world_size=8, tp=8), 1))
    np.testing.assert_array_equal(got, arrays["col.weight"][125:250])
    assert reader.bytes_verified == ROWS * COLS * 4  # no blocks: the whole tensor is verified
    offline.reshard(str(tmp_path / "c"), str(tmp_path / "tp2"), Layout(world_size=2, tp=2))
    assert json.loads((tmp_path / "tp2" / "manifest.json").read_text())["format_version"] == 2
    assert offline.inspect(str(tmp_path / "tp2"))["ok"]


def test_inspect_catches_edited_block_checksums(tmp_path, monkeypatch):
    _big(tmp_path / "c", monkeypatch=monkeypatch)
    path = tmp_path / "c" / "manifest.json"
    data = json.loads(path.read_text())
    crcs = data["parameters"]["row.weight"]["shards"][0]["block_crc32"]
    data["parameters"]["row.weight"]["shards"][0]["block_crc32"] = "00000000" + crcs[8:]
    path.write_text(json.dumps(data))
    report = offline.inspect(str(tmp_path / "c"))
    assert report["problems"] == ["parameter 'row.weight': the block checksums of "
                                  "rank_00000.safetensors in the manifest disagree with its data "
                                  "(load would refuse it)"]
    with pytest.raises(CheckpointIntegrityError, match="checksum mismatch in tensor 'row.weight'"):
        offline.merge(str(tmp_path / "c"), str(tmp_path / "m.safetensors"))


def _resident_bytes(path: str) -> int:
    """Bytes of ``path`` in the page cache (mincore over a fresh shared map)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                          ctypes.c_int, ctypes.c_long]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    size, page = os.path.getsize(path), mmap.PAGESIZE
    with open(path, "rb") as fh:
        addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fh.fileno(), 0)
    vec = ctypes.create_string_buffer(-(-size // page))
    try:
        assert libc.mincore(addr, size, vec) == 0
    finally:
        libc.munmap(addr, size)
    return sum(b & 1 for b in vec.raw) * page


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="mincore/fadvise: Linux")
def test_page_cache_holds_only_the_ranks_blocks_after_a_read(tmp_path):
    """Measured by the kernel, not by the reader: drop the file's pages from the cache,
    read tp8 rank 3's slice of a 16 MiB tp1 tensor (1 MiB blocks), count the pages now
    cached: the slice's 2 MiB and the header's pages, not the up to ``read_ahead_kb``
    (8 MiB on this machine's disk) the kernel reads around a fault of a plain file map
    (the reader asks for exactly its blocks with ``MADV_WILLNEED`` before touching them)."""
    arrays = {"w": np.random.default_rng(2).standard_normal((8192, 512)).astype(np.float32)}
    save_arrays(str(tmp_path / "c"), arrays, Layout(world_size=1), {"w": _sh(0)})
    path = str(tmp_path / "c" / "rank_00000.safetensors")
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    if _resident_bytes(path) > 64 << 10:
        pytest.skip("this file system keeps the pages cached (tmpfs?): nothing to measure")
    reader = CheckpointReader(str(tmp_path / "c"))
    got = np.array(reader.read_piece("w", piece_for("w", (8192, 512), _sh(0), Layout(world_size=8, tp=8), 3)))
    np.testing.assert_array_equal(got, arrays["w"][3072:4096])
    cached = _resident_bytes(path)
    assert reader.bytes_verified == 2 << 20
    assert 2 << 20 <= cached <= (2 << 20) + (256 << 10), cached


def _model(tmp_path, name, step=1, prefix="layers", layout=None):
    rng = np.random.default_rng(step)
    arrays = {"embed.weight": rng.standard_normal((8, 4)).astype(np.float32)}
    for i in range(4):
        arrays[f"{prefix}.{i}.w"] = rng.standard_normal((4, 4)).astype(np.float32)
    arrays["final_norm"] = rng.standard_normal(4).astype(np.float32)
    arrays["head.weight"] = rng.standard_normal((8, 4)).astype(np.float32)
    shardings = {n: _sh(0) for n in arrays if n.endswith(".w") or n == "embed.weight"}
    save_arrays(str(tmp_path / name), arrays, layout or Layout(world_size=1), shardings, step=step)
    return arrays


def test_crash_between_the_two_renames_is_recovered(tmp_path):
    """The fallback's in-between state, built on disk: no DIR, the previous checkpoint in
    DIR.old, the new complete one in DIR.partial. Readers use DIR.partial (with a note);
    the next save moves it into place first."""
    from mindscience.distributed.checkpoint.writer import prepare

    _model(tmp_path, "ckpt", step=1)
    new = _model(tmp_path, "new", step=2)
    os.rename(tmp_path / "ckpt", tmp_path / "ckpt.old")
    os.rename(tmp_path / "new", tmp_path / "ckpt.partial")
    ckpt = str(tmp_path / "ckpt")
    data = offline.inspect(ckpt)
    assert data["ok"] and data["step"] == 2 and data["source"] == ckpt + ".partial"
    assert "a save finished writing and was stopped while moving it into place" in data["notes"][0]
    merged = tmp_path / "m.safetensors"
    offline.merge(ckpt, str(merged))
    reader = CheckpointReader(ckpt)
    assert reader.manifest["step"] == 2 and reader.note
    np.testing.assert_array_equal(reader.read_box("head.weight", {}), new["head.weight"])
    proc = _cli("checkpoint", "inspect", ckpt)
    assert proc.returncode == 0 and "msdist: note:" in proc.stderr, proc.stderr
    # The next save (rank 0's prepare) finishes the interrupted replacement first.
    prepare(ckpt)
    assert CheckpointReader(ckpt).note is None and CheckpointReader(ckpt).manifest["step"] == 2
    assert os.path.isdir(ckpt + ".partial") and not os.listdir(ckpt + ".partial")


def test_incomplete_partial_with_old_is_explained(tmp_path):
    _model(tmp_path, "ckpt", step=1)
    os.rename(tmp_path / "ckpt", tmp_path / "ckpt.old")
    os.makedirs(tmp_path / "ckpt.partial")
    ckpt = str(tmp_path / "ckpt")
    with pytest.raises(CheckpointIntegrityError, match=r"ckpt.partial exists: a save that did not "
                                                       r"finish.*ckpt.old holds the previous complete"):
        CheckpointReader(ckpt)


@pytest.mark.parametrize("swap", [True, False])
def test_replacing_save_swaps_atomically_or_falls_back(tmp_path, monkeypatch, swap):
    from mindscience.distributed.checkpoint import writer

    calls = []
    real = writer.exchange

    def exchange(a, b):
        calls.append((a, b))
        return real(a, b) if swap else False

    monkeypatch.setattr(writer, "exchange", exchange)
    _model(tmp_path, "ckpt", step=1)
    assert calls == []  # nothing to replace
    _model(tmp_path, "ckpt", step=2)
    ckpt = str(tmp_path / "ckpt")
    assert calls == [(ckpt + ".partial", ckpt)]
    assert CheckpointReader(ckpt).manifest["step"] == 2
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]  # no .old, no .partial left


def test_exchange_swaps_two_directories(tmp_path):
    from mindscience.distributed.checkpoint.writer import exchange

    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "f").write_text("a")
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "f").write_text("b")
    if not exchange(str(tmp_path / "a"), str(tmp_path / "b")):
        pytest.skip("renameat2(RENAME_EXCHANGE) is not available here (the fallback is tested)")
    assert (tmp_path / "a" / "f").read_text() == "b" and (tmp_path / "b" / "f").read_text() == "a"


def _edit(path, fn):
    data = json.loads((path / "manifest.json").read_text())
    fn(data)
    (path / "manifest.json").write_text(json.dumps(data))


@pytest.mark.parametrize("edit, match", [
    (lambda m: m.pop("parameters"), '"parameters" is missing'),
    (lambda m: m["layout"].pop("tp"), "layout tp=None"),
    (lambda m: m["layout"].update(dp=3), "not a valid layout"),
    (lambda m: m["parameters"]["head.weight"].update(dtype="F99"), "'head.weight': dtype='F99'"),
    (lambda m: m["parameters"]["layers.1.w"]["shards"][0].update(dim=0, ranges=[[0, 9, 0]]),
     "'layers.1.w' shard 0: range"),
    (lambda m: m["parameters"]["head.weight"]["shards"][0].update(block_crc32="abc"), "block_bytes"),
    (lambda m: m["files"]["rank_00000.safetensors"].update(rank=7), "rank=7"),
])
def test_malformed_manifest_is_one_integrity_error(tmp_path, edit, match):
    _model(tmp_path, "c", layout=Layout(world_size=2, tp=2))
    _edit(tmp_path / "c", edit)
    with pytest.raises(CheckpointIntegrityError, match="corrupt manifest: .*" + match.replace("(", r"\(")):
        CheckpointReader(str(tmp_path / "c"))
    data = offline.inspect(str(tmp_path / "c"))
    assert not data["ok"] and "corrupt manifest" in data["problems"][0]
    proc = _cli("checkpoint", "merge", tmp_path / "c", tmp_path / "m.safetensors")
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("msdist: error:")]
    assert proc.returncode == 1 and len(lines) == 1 and "corrupt manifest" in lines[0], proc.stderr
    assert "Traceback" not in proc.stderr


def test_cli_exit_codes_for_bad_files_and_versions(tmp_path):
    arrays = _model(tmp_path, "c", layout=Layout(world_size=2, tp=2))
    # a rank file that is a directory: exit 1 naming it, in inspect and merge
    shutil.copytree(tmp_path / "c", tmp_path / "d")
    os.remove(tmp_path / "d" / "rank_00001.safetensors")
    os.mkdir(tmp_path / "d" / "rank_00001.safetensors")
    for args in (("inspect", tmp_path / "d"), ("merge", tmp_path / "d", tmp_path / "m1.safetensors")):
        proc = _cli("checkpoint", *args)
        assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
        assert "rank_00001.safetensors: cannot be read as a safetensors file (Is a directory)" in proc.stderr
    # a global shape edited to a wrong value: exit 1 naming the parameter (not 2, not "writer")
    shutil.copytree(tmp_path / "c", tmp_path / "e")
    _edit(tmp_path / "e", lambda m: m["parameters"]["embed.weight"].update(shape=[8, 2]))
    proc = _cli("checkpoint", "merge", tmp_path / "e", tmp_path / "m2.safetensors")
    assert proc.returncode == 1 and "'embed.weight'" in proc.stderr and "writer" not in proc.stderr
    assert "the file holds F32 [4, 4], the manifest says F32 [4, 2]" in proc.stderr, proc.stderr
    proc = _cli("checkpoint", "inspect", tmp_path / "e")
    assert proc.returncode == 1 and "'embed.weight'" in proc.stderr
    # an unknown format version: exit 1 naming it and the supported ones
    shutil.copytree(tmp_path / "c", tmp_path / "v")
    _edit(tmp_path / "v", lambda m: m.update(format_version=99))
    proc = _cli("checkpoint", "inspect", tmp_path / "v")
    assert proc.returncode == 1 and "unknown format_version 99" in proc.stderr
    assert "reads versions 1, 2" in proc.stderr
    with pytest.raises(CheckpointFormatError):
        CheckpointReader(str(tmp_path / "v"))
    # a regular file where the directory should be: bad input, exit 2
    (tmp_path / "file").write_text("x")
    proc = _cli("checkpoint", "inspect", tmp_path / "file")
    assert proc.returncode == 2 and "is a file, not a checkpoint directory" in proc.stderr
    # and the intact checkpoint still merges to the saved values
    offline.merge(str(tmp_path / "c"), str(tmp_path / "ok.safetensors"))
    from safetensors.numpy import load_file

    assert np.array_equal(load_file(str(tmp_path / "ok.safetensors"))["embed.weight"], arrays["embed.weight"])


def _cli(*args):
    proc = subprocess.run([sys.executable, "-m", "mscli.main", *map(str, args)], capture_output=True,
                          text=True, timeout=120)
    return proc


def test_reshard_places_custom_prefix_layers_and_non_layer_params(tmp_path):
    """pp1 -> pp2 with layers named ``blocks.<i>``: the recorded layer index places the
    layers, the saved order places the embedding (before the first layer) on stage 0
    and the final norm and head (after the last) on stage 1."""
    from mindscience.distributed.checkpoint.writer import finish, prepare, write_rank

    arrays = _model(tmp_path, "unused", prefix="blocks")
    names = list(arrays)  # the cell's order: embed, blocks.0-3, final_norm, head
    tmp = prepare(str(tmp_path / "c"))
    whole = {"dim": None}
    items = [(n, "F32", a.shape, _sh(), whole, a) for n, a in arrays.items()]
    meta = {n: {"layer": int(n.split(".")[1]) if n.startswith("blocks.") else None,
                "position": names.index(n), "base": None} for n in names}
    # optimizer state follows its parameter: a moment of the head, and a step counter
    items.append(("opt.m.head.weight", "F32", (8, 4), _sh(), whole, np.zeros((8, 4), np.float32)))
    meta["opt.m.head.weight"] = {"layer": None, "position": names.index("head.weight"), "base": "head.weight"}
    items.append(("opt.step", "I32", (), _sh(), whole, np.array(3, np.int32)))
    meta["opt.step"] = {"layer": None, "position": len(names), "base": None}
    write_rank(tmp, 0, 0, items, meta=meta)
    finish(str(tmp_path / "c"), 1, Layout(world_size=1).to_dict(), layer_prefixes=["blocks"])
    out = offline.reshard(str(tmp_path / "c"), str(tmp_path / "pp2"), Layout(world_size=2, pp=2))
    stage = {n: e["stage"] for n, e in out["parameters"].items()}
    assert stage == {"embed.weight": 0, "blocks.0.w": 0, "blocks.1.w": 0, "blocks.2.w": 1,
                     "blocks.3.w": 1, "final_norm": 1, "head.weight": 1, "opt.m.head.weight": 1,
                     "opt.step": 1}
    assert out["layer_prefixes"] == ["blocks"] and out["parameters"]["blocks.3.w"]["layer"] == 3
    # positions renumbered per new stage, as a pp2 save records them
    assert [out["parameters"][n]["position"] for n in ("blocks.2.w", "blocks.3.w", "final_norm")] == [0, 1, 2]
    # and back to pp4, then pp1: bit-exact, layers by index
    out4 = offline.reshard(str(tmp_path / "pp2"), str(tmp_path / "pp4"), Layout(world_size=4, pp=4))
    assert [out4["parameters"][f"blocks.{i}.w"]["stage"] for i in range(4)] == [0, 1, 2, 3]
    assert out4["parameters"]["embed.weight"]["stage"] == 0 and out4["parameters"]["head.weight"]["stage"] == 3
    offline.reshard(str(tmp_path / "pp4"), str(tmp_path / "pp1"), Layout(world_size=1))
    assert ((tmp_path / "pp1" / "rank_00000.safetensors").read_bytes()
            == (tmp_path / "c" / "rank_00000.safetensors").read_bytes())


def test_format_1_stage_rule_unchanged(tmp_path):
    from mindscience.distributed.checkpoint.plan import place_stages

    params = {"embed": {"stage": 0}, "layers.0.w": {"stage": 0}, "layers.1.w": {"stage": 1},
              "head": {"stage": 1}}
    assert place_stages(params, 2, 1) == {"embed": 0, "layers.0.w": 0, "layers.1.w": 0, "head": 0}
    assert place_stages(params, 2, 4) == {"embed": 0, "layers.0.w": 0, "layers.1.w": 2, "head": 3}


def test_reader_errors_stay_checkpoint_errors(tmp_path):
    with pytest.raises(CheckpointError):
        CheckpointReader(str(tmp_path / "nothing"))
