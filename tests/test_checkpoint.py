"""Sharded checkpoints offline (no ranks): format, reshard round trips, integrity faults, CLI.

Checkpoints are built from full numpy tensors with ``writer.save_arrays`` (what each
rank of the layout would have written), so every expectation is a numpy slice.
"""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from mindscience.distributed.checkpoint import CheckpointError, CheckpointIntegrityError, offline
from mindscience.distributed.checkpoint.manifest import CheckpointReader
from mindscience.distributed.checkpoint.plan import piece_for, rename_layers, writes
from mindscience.distributed.checkpoint.writer import save_arrays
from mindscience.distributed.topology.layout import Layout


def _sh(dim=None, stride=1, axis="tp"):
    if dim is None:
        return {"axis": None, "partition_dim": None, "partition_stride": 1, "sequence_parallel": False}
    return {"axis": axis, "partition_dim": dim, "partition_stride": stride, "sequence_parallel": False}


def _model(seed=0):
    """A small 'transformer' state: fused qkv (stride 3), column/row weights, a bf16
    replicated norm (uint16 bits), an int step counter, layers on two stages."""
    rng = np.random.default_rng(seed)
    arrays, shardings, stages, dtypes = {}, {}, {}, {}
    for i in range(4):
        p = f"layers.{i}."
        arrays[p + "qkv.weight"] = rng.standard_normal((24, 8)).astype(np.float32)
        shardings[p + "qkv.weight"] = _sh(0, 3)
        arrays[p + "fc2.weight"] = rng.standard_normal((8, 16)).astype(np.float32)
        shardings[p + "fc2.weight"] = _sh(1)
        arrays[p + "fc1.bias"] = rng.standard_normal((16,)).astype(np.float16)
        shardings[p + "fc1.bias"] = _sh(0)
        arrays[p + "norm"] = rng.integers(0, 2 ** 16, 8, dtype=np.uint16)
        dtypes[p + "norm"] = "BF16"
        for n in (p + "qkv.weight", p + "fc2.weight", p + "fc1.bias", p + "norm"):
            stages[n] = i // 2
    arrays["embed.weight"] = rng.standard_normal((16, 8)).astype(np.float32)
    shardings["embed.weight"] = _sh(0)
    arrays["global_step"] = np.array(7, np.int32)
    return arrays, shardings, stages, dtypes


def _save(path, layout, seed=0):
    arrays, shardings, stages, dtypes = _model(seed)
    if layout.pp == 1:
        stages = {}
    save_arrays(str(path), arrays, layout, shardings, stages, step=3, extra={"lr": 0.1}, dtypes=dtypes)
    return arrays


def load_file(path):
    """Every tensor of a safetensors file, read by the safetensors package (whose numpy
    backend has no bfloat16: BF16 tensors are read as their uint16 bits by our reader)."""
    from safetensors import safe_open

    from mindscience.distributed.checkpoint.files import read_header, tensor_view

    header, start, _ = read_header(str(path))
    out = {}
    with safe_open(str(path), framework="np") as fh:
        for key in fh.keys():
            if header[key]["dtype"] == "BF16":
                out[key] = np.array(tensor_view(str(path), header, start, key))
            else:
                out[key] = fh.get_tensor(key)
    return out


def _merged(ckpt, tmp_path, name="m.safetensors"):
    out = tmp_path / name
    offline.merge(str(ckpt), str(out))
    return load_file(str(out))


def _rank_tensors(ckpt):
    return {f: load_file(os.path.join(ckpt, f)) for f in sorted(os.listdir(ckpt))
            if f.endswith(".safetensors")}


def test_writer_slices_and_owners():
    lay = Layout(world_size=4, tp=2)  # tp2 x dp2
    assert [writes(lay, r, "tp") for r in range(4)] == [True, True, False, False]
    assert [writes(lay, r, None) for r in range(4)] == [True, False, False, False]
    assert piece_for("w", (24, 8), _sh(0, 3), lay, 1) == {"dim": 0, "ranges": [[4, 8, 0], [12, 16, 4], [20, 24, 8]]}
    assert rename_layers("0.layers.1.w", 4) == "0.layers.5.w"
    assert rename_layers("adam_m.layers.12.x", -2) == "adam_m.layers.10.x"


def test_saved_files_hold_exactly_each_ranks_slices(tmp_path):
    arrays = _save(tmp_path / "a", Layout(world_size=4, tp=2))
    files = _rank_tensors(str(tmp_path / "a"))
    # dp rank 1 (ranks 2, 3) writes nothing; replicated tensors only on rank 0.
    assert sorted(files) == ["rank_00000.safetensors", "rank_00001.safetensors"]
    qkv = arrays["layers.0.qkv.weight"]
    np.testing.assert_array_equal(files["rank_00001.safetensors"]["layers.0.qkv.weight"],
                                  np.concatenate([qkv[4:8], qkv[12:16], qkv[20:24]]))
    np.testing.assert_array_equal(files["rank_00001.safetensors"]["layers.0.fc2.weight"],
                                  arrays["layers.0.fc2.weight"][:, 8:])
    assert "global_step" in files["rank_00000.safetensors"]
    assert "global_step" not in files["rank_00001.safetensors"]
    manifest = json.loads((tmp_path / "a" / "manifest.json").read_text())
    assert manifest["format_version"] == 2 and manifest["step"] == 3
    assert manifest["layout"]["tp"] == 2 and manifest["layout"]["dp"] == 2
    assert manifest["parameters"]["layers.0.norm"]["dtype"] == "BF16"
    assert manifest["parameters"]["layers.0.qkv.weight"]["shape"] == [24, 8]


@pytest.mark.parametrize("start", [dict(world_size=4, tp=2), dict(world_size=4, tp=2, pp=2)])
def test_reshard_round_trip_is_bit_exact(tmp_path, start):
    arrays = _save(tmp_path / "tp2", Layout(**start))
    offline.reshard(str(tmp_path / "tp2"), str(tmp_path / "tp4"), Layout(world_size=4, tp=4))
    offline.reshard(str(tmp_path / "tp4"), str(tmp_path / "tp1"), Layout(world_size=1))
    for ckpt in ("tp2", "tp4", "tp1"):
        assert offline.inspect(str(tmp_path / ckpt))["ok"], ckpt
        merged = _merged(tmp_path / ckpt, tmp_path, f"{ckpt}.safetensors")
        assert sorted(merged) == sorted(arrays)
        for name, want in arrays.items():
            assert merged[name].dtype == want.dtype and np.array_equal(merged[name], want), (ckpt, name)
    # tp4 files are what a tp4 save would write: rank 3's stride-3 qkv blocks.
    files = _rank_tensors(str(tmp_path / "tp4"))
    qkv = arrays["layers.1.qkv.weight"]
    np.testing.assert_array_equal(files["rank_00003.safetensors"]["layers.1.qkv.weight"],
                                  np.concatenate([qkv[6:8], qkv[14:16], qkv[22:24]]))
    # tp1 is byte-identical to a tp1 save of the same tensors.
    _save(tmp_path / "direct", Layout(world_size=1))
    assert ((tmp_path / "tp1" / "rank_00000.safetensors").read_bytes()
            == (tmp_path / "direct" / "rank_00000.safetensors").read_bytes())


def test_reshard_to_more_stages_places_layers_by_global_index(tmp_path):
    _save(tmp_path / "a", Layout(world_size=4, tp=2, pp=2))
    manifest = offline.reshard(str(tmp_path / "a"), str(tmp_path / "b"), Layout(world_size=4, pp=4))
    assert manifest["parameters"]["layers.3.qkv.weight"]["stage"] == 3
    assert manifest["parameters"]["layers.1.fc2.weight"]["shards"][0]["file"] == "rank_00001.safetensors"
    assert offline.inspect(str(tmp_path / "b"))["ok"]


def test_reader_touches_only_the_requested_slice(tmp_path):
    arrays = _save(tmp_path / "a", Layout(world_size=2, tp=2))
    reader = CheckpointReader(str(tmp_path / "a"), verify=False)
    got = reader.read_box("layers.2.fc2.weight", {1: (6, 10)})  # straddles both tp shards
    np.testing.assert_array_equal(got, arrays["layers.2.fc2.weight"][:, 6:10])
    assert isinstance(reader.view(reader.params["layers.2.fc2.weight"]["shards"][0]), np.memmap)


def test_reshard_refuses_a_layout_that_cannot_split(tmp_path):
    _save(tmp_path / "a", Layout(world_size=2, tp=2))
    with pytest.raises(CheckpointError, match=r"'layers.0.qkv.weight': dim 0 .* 24, not divisible by "
                                              r"tp=16 x partition_stride 3"):
        offline.reshard(str(tmp_path / "a"), str(tmp_path / "b"), Layout(world_size=16, tp=16))
    assert not (tmp_path / "b").exists() and not (tmp_path / "b.partial").exists()


def _corrupt(path, how):
    ckpt = str(path)
    target = os.path.join(ckpt, "rank_00001.safetensors")
    if how == "deleted":
        os.remove(target)
    elif how == "flipped":
        data = bytearray(open(target, "rb").read())
        data[-5] ^= 0x40
        open(target, "wb").write(bytes(data))
    elif how == "truncated":
        os.truncate(target, os.path.getsize(target) - 16)
    elif how == "manifest":
        os.remove(os.path.join(ckpt, "manifest.json"))
    return target


@pytest.mark.parametrize("how, match", [
    ("deleted", "rank_00001.safetensors: missing rank file"),
    ("flipped", "rank_00001.safetensors: checksum mismatch"),
    ("truncated", "rank_00001.safetensors: truncated"),
    ("manifest", "incomplete: no manifest.json"),
])
def test_inspect_catches_each_fault(tmp_path, how, match):
    _save(tmp_path / "a", Layout(world_size=4, tp=2))
    assert offline.inspect(str(tmp_path / "a"))["ok"]
    _corrupt(tmp_path / "a", how)
    data = offline.inspect(str(tmp_path / "a"))
    assert not data["ok"] and any(match in p for p in data["problems"]), data["problems"]
    assert data["complete"] == (how != "manifest")
    # The readers refuse it too, naming the same thing, and write nothing.
    with pytest.raises(CheckpointIntegrityError, match=match.split(":")[-1].strip()):
        offline.reshard(str(tmp_path / "a"), str(tmp_path / "b"), Layout(world_size=1))
    assert not (tmp_path / "b").exists()


def test_inspect_without_checksums_misses_only_flipped_data(tmp_path):
    _save(tmp_path / "a", Layout(world_size=2, tp=2))
    _corrupt(tmp_path / "a", "flipped")
    assert offline.inspect(str(tmp_path / "a"), checksums=False)["ok"]
    _corrupt(tmp_path / "a", "truncated")
    assert not offline.inspect(str(tmp_path / "a"), checksums=False)["ok"]


def test_unknown_format_version_is_refused(tmp_path):
    _save(tmp_path / "a", Layout(world_size=1))
    path = tmp_path / "a" / "manifest.json"
    manifest = json.loads(path.read_text())
    manifest["format_version"] = 99
    path.write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match="unknown format_version 99"):
        offline.inspect(str(tmp_path / "a"))


def test_merge_is_readable_by_mindspore(tmp_path):
    arrays = _save(tmp_path / "a", Layout(world_size=4, tp=2, pp=2))
    offline.merge(str(tmp_path / "a"), str(tmp_path / "m.safetensors"))
    import mindspore as ms

    loaded = ms.load_checkpoint(str(tmp_path / "m.safetensors"), format="safetensors")
    for name in ("layers.3.qkv.weight", "embed.weight", "layers.0.fc1.bias"):
        np.testing.assert_array_equal(loaded[name].asnumpy(), arrays[name])
    bits = (loaded["layers.1.norm"].astype(ms.float32).asnumpy().view(np.uint32) >> 16).astype(np.uint16)
    np.testing.assert_array_equal(bits, arrays["layers.1.norm"])


def _cli(*args):
    code = ("import sys; from mscli.main import app\n"
            "try:\n    app(sys.argv[1:])\nexcept SystemExit as e:\n"
            "    code = e.code or 0\n"
            "    sys.stderr.write('MS=%s\\n' % any(m.split('.')[0] == 'mindspore' for m in sys.modules))\n"
            "    sys.exit(code)\n")
    proc = subprocess.run([sys.executable, "-c", code, *map(str, args)], capture_output=True, text=True,
                          timeout=120)
    assert "MS=False" in proc.stderr, proc.stderr  # never imports MindSpore
    return proc


def test_cli_inspect_reshard_merge(tmp_path):
    arrays = _save(tmp_path / "a", Layout(world_size=4, tp=2))
    proc = _cli("checkpoint", "inspect", tmp_path / "a", "--format", "json")
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    assert data["ok"] and data["layout"]["tp"] == 2
    row = {p["name"]: p for p in data["parameters"]}["layers.0.qkv.weight"]
    assert row["shape"] == [24, 8] and row["bytes"] == 24 * 8 * 4 and row["sharding"]["partition_stride"] == 3
    (tmp_path / "tp4.yaml").write_text("world_size: 4\ntp: 4\n")
    proc = _cli("checkpoint", "reshard", tmp_path / "a", tmp_path / "b", "--to", tmp_path / "tp4.yaml",
                "--workers", "3")
    assert proc.returncode == 0, proc.stderr
    assert json.loads((tmp_path / "b" / "manifest.json").read_text())["layout"]["tp"] == 4
    proc = _cli("checkpoint", "merge", tmp_path / "b", tmp_path / "m.safetensors")
    assert proc.returncode == 0, proc.stderr
    merged = load_file(str(tmp_path / "m.safetensors"))
    assert all(np.array_equal(merged[k], v) for k, v in arrays.items())
    proc = _cli("checkpoint", "inspect", tmp_path / "a")
    assert proc.returncode == 0 and "OK" in proc.stdout


@pytest.mark.parametrize("how", ["deleted", "flipped", "truncated", "manifest"])
def test_cli_inspect_exit_1_names_the_fault(tmp_path, how):
    _save(tmp_path / "a", Layout(world_size=2, tp=2))
    _corrupt(tmp_path / "a", how)
    proc = _cli("checkpoint", "inspect", tmp_path / "a")
    assert proc.returncode == 1
    assert ("manifest.json" if how == "manifest" else "rank_00001.safetensors") in proc.stderr


def test_cli_bad_input_exits_2_in_one_line(tmp_path):
    _save(tmp_path / "a", Layout(world_size=2, tp=2))
    (tmp_path / "tp16.yaml").write_text("world_size: 16\ntp: 16\n")
    proc = _cli("checkpoint", "reshard", tmp_path / "a", tmp_path / "b", "--to", tmp_path / "tp16.yaml")
    assert proc.returncode == 2
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("msdist: error:")]
    assert len(lines) == 1 and "not divisible by tp=16" in lines[0]
    (tmp_path / "tp1.yaml").write_text("world_size: 1\n")
    proc = _cli("checkpoint", "reshard", tmp_path / "a", tmp_path / "c", "--to", tmp_path / "tp1.yaml",
                "--workers", "0")
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("msdist: error:")]
    assert proc.returncode == 2 and len(lines) == 1 and "workers=0" in lines[0], proc.stderr
    assert not (tmp_path / "c").exists()
    proc = _cli("checkpoint", "inspect", tmp_path / "missing")
    assert proc.returncode == 2 and "does not exist" in proc.stderr
    proc = _cli("checkpoint", "merge", tmp_path / "a", tmp_path / "a" / "manifest.json")
    assert proc.returncode == 2 and "exists" in proc.stderr


@pytest.mark.parametrize("same", [True, False])
def test_inspect_checks_that_replicated_copies_agree(tmp_path, same):
    """Two pipeline stages both hold the optimizer's step counter: one shard, one copy."""
    from mindscience.distributed.checkpoint.writer import finish, prepare, write_rank

    lay = Layout(world_size=2, pp=2)
    tmp = prepare(str(tmp_path / "a"))
    whole = {"dim": None}
    for rank in range(2):
        value = np.array(5 if (same or rank == 0) else 6, np.int32)
        write_rank(tmp, rank, rank, [("global_step", "I32", (), _sh(), whole, value),
                                     (f"layers.{rank}.w", "F32", (2,), _sh(), whole, np.ones(2, np.float32))])
    manifest = finish(str(tmp_path / "a"), 2, lay.to_dict())
    assert len(manifest["parameters"]["global_step"]["copies"]) == 1
    data = offline.inspect(str(tmp_path / "a"))
    assert data["ok"] == same
    if not same:
        assert data["problems"] == ["parameter 'global_step': the copy in rank_00001.safetensors "
                                    "disagrees with the shard it replicates"]


def test_checksums_are_zlib_crc32_across_chunk_edges(tmp_path):
    import zlib

    from mindscience.distributed.checkpoint import blocks, files

    data = np.random.default_rng(1).integers(0, 256, 50_000, dtype=np.uint8).tobytes()
    assert files.crc32(data) == zlib.crc32(data)
    assert files.crc32(data[7:], files.crc32(data[:7])) == zlib.crc32(data)
    path = tmp_path / "blob"
    path.write_bytes(data)
    with open(path, "rb") as fh:
        for start, length in [(0, 50_000), (4095, 9_000), (12_345, 1), (49_999, 1), (3, 0)]:
            seen = []
            # Maps of 4 blocks of 250 bytes: many maps, none starting on a page.
            crcs = blocks.block_crcs(fh, start, length, 250, 1000, seen.append)
            got = blocks.combine_blocks(crcs, length, 250)
            assert got == zlib.crc32(data[start:start + length]), (start, length)
            assert sum(seen) == length


@pytest.mark.parametrize("workers", [1, 3])
def test_reshard_streams_slabs_in_parallel_files_bit_exact(tmp_path, monkeypatch, workers):
    # Slabs of 40 bytes: every tensor takes several, each assembled in the reused scratch.
    monkeypatch.setattr(offline, "RESHARD_SLAB_BYTES", 40)
    arrays = _save(tmp_path / "tp2", Layout(world_size=4, tp=2))
    seen = []
    offline.reshard(str(tmp_path / "tp2"), str(tmp_path / "tp4"), Layout(world_size=4, tp=4),
                    progress=seen.append, workers=workers)
    total = sum(a.nbytes for n, a in arrays.items())
    # every byte is reported once, the scalar step counter too
    assert sum(seen) == offline.inspect(str(tmp_path / "tp4"))["total_bytes"] == total
    assert offline.inspect(str(tmp_path / "tp4"))["ok"]
    merged = _merged(tmp_path / "tp4", tmp_path)
    for name, want in arrays.items():
        assert np.array_equal(merged[name], want), name
    _save(tmp_path / "direct", Layout(world_size=4, tp=4))
    for rank in range(4):
        f = f"rank_{rank:05d}.safetensors"
        assert (tmp_path / "tp4" / f).read_bytes() == (tmp_path / "direct" / f).read_bytes(), f


@pytest.mark.parametrize("workers", [0, -1, 1.5, True, "2"])
def test_reshard_refuses_bad_workers(tmp_path, workers):
    _save(tmp_path / "a", Layout(world_size=2, tp=2))
    with pytest.raises(CheckpointError, match=r"workers=.*expected a positive integer"):
        offline.reshard(str(tmp_path / "a"), str(tmp_path / "b"), Layout(world_size=1), workers=workers)
    assert not (tmp_path / "b").exists() and not (tmp_path / "b.partial").exists()


def test_rich_inspect_shows_the_optimizer_record(capsys):
    from mscli import render_checkpoint

    data = {"directory": "ckpt/step_4", "ok": True, "complete": True, "checksums": True, "problems": [],
            "notes": [], "parameters": [], "files": [], "layout": {"world_size": 4, "tp": 2}, "step": 4,
            "total_bytes": 0,
            "optimizers": [{"class": "DistributedOptimizer", "kind": "adamw", "state": ["exp_avg", "exp_avg_sq"],
                            "zero_stage": 1, "group_size": 2}]}
    render_checkpoint.render_inspect(data, "rich")
    out = capsys.readouterr().out
    assert "optimizer" in out and "adamw (exp_avg, exp_avg_sq), ZeRO stage 1 over 2 ranks" in out
