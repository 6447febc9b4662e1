"""Checkpoints of MoE models: expert parameters stored per expert, resharded over ep/etp.

Offline (no ranks): checkpoints built with ``writer.save_arrays`` as an ep4 run would have
written them, resharded to ep2 x etp2 and to one rank, merged, inspected. In process:
``checkpoint.save`` of expert Parameters on 2 "ranks" (threads, ep2) loaded on one rank,
and the expert-count error. The multi-process runs (GPTModel ep4 -> reshard -> ep2 x etp2
-> resume) are in tests/test_moe_model.py.
"""

import numpy as np
import pytest

from mindscience.distributed.checkpoint import CheckpointError, offline
from mindscience.distributed.checkpoint.manifest import CheckpointReader
from mindscience.distributed.checkpoint.plan import expert_name, piece_for, writes
from mindscience.distributed.checkpoint.writer import save_arrays
from mindscience.distributed.topology.layout import Layout

E, H, F = 8, 4, 6  # experts, hidden, ffn per expert


def _sh(dim, stride=1, k=None):
    out = {"axis": "etp" if dim is not None else None, "partition_dim": dim,
           "partition_stride": stride if dim is not None else 1, "sequence_parallel": False}
    if k is not None:
        out["expert"] = {"index": k, "count": E}
    return out


def _experts(seed=0):
    """Per-expert entries of one MoE layer (SwiGLU w1 [gate; up] split over etp with stride 2,
    w2 split on its ffn rows), a dense router and a replicated norm."""
    rng = np.random.default_rng(seed)
    arrays, shardings = {}, {}
    w1 = rng.standard_normal((E, H, 2 * F)).astype(np.float32)
    w2 = rng.standard_normal((E, F, H)).astype(np.float32)
    for k in range(E):
        arrays[expert_name("layers.1.mlp.experts.w1", k)] = w1[k]
        shardings[expert_name("layers.1.mlp.experts.w1", k)] = _sh(1, 2, k)
        arrays[expert_name("layers.1.mlp.experts.w2", k)] = w2[k]
        shardings[expert_name("layers.1.mlp.experts.w2", k)] = _sh(0, 1, k)
    arrays["layers.1.mlp.router.weight"] = rng.standard_normal((E, H)).astype(np.float32)
    arrays["layers.1.input_norm.weight"] = rng.standard_normal(H).astype(np.float32)
    return arrays, shardings, w1, w2


def test_expert_names_and_writers():
    assert expert_name("0.layers.1.mlp.experts.w1", 3) == "0.layers.1.mlp.experts.3.w1"
    # ep2 x etp2 on 4 ranks (dense dp4): expert 5 lives on ep rank 1 (experts 4-7), which is
    # ranks 2 and 3 (etp 0 and 1), each writing its etp half.
    layout = Layout(world_size=4, dp=4, ep=2, etp=2)
    sharding = _sh(1, 2, 5)
    assert [r for r in range(4) if writes(layout, r, "etp", sharding["expert"])] == [2, 3]
    assert piece_for("w1.5", [H, 2 * F], sharding, layout, 3)["ranges"] == [[3, 6, 0], [9, 12, 3]]
    # ep4 with edp 2 on 8 ranks: only edp rank 0 of each expert's ep rank writes it.
    layout = Layout(world_size=8, dp=8, ep=4, etp=1)
    writers = [r for r in range(8) if writes(layout, r, "etp", {"index": 5, "count": E})]
    assert writers == [2]  # order tp-cp-ep-dp-pp: ep rank 2 at edp 0 is rank 2
    with pytest.raises(CheckpointError, match=r"8 experts are not divisible by ep=3"):
        writes(Layout(world_size=3, dp=3, ep=3), 0, "etp", {"index": 0, "count": E})


def test_reshard_ep4_to_ep2_etp2_and_one_rank(tmp_path):
    arrays, shardings, w1, w2 = _experts()
    src = tmp_path / "ep4"
    save_arrays(str(src), arrays, Layout(world_size=4, dp=4, ep=4), shardings, step=2)
    files = {p["name"]: p for p in offline.inspect(str(src))["parameters"]}
    assert files[expert_name("layers.1.mlp.experts.w1", 7)]["sharding"]["expert"] == {"index": 7, "count": 8}
    # ep4: each rank's file holds its 2 experts' entries, the dense ones on rank 0 only
    reader = CheckpointReader(str(src))
    by_file = {}
    for name, entry in reader.params.items():
        for shard in entry["shards"]:
            by_file.setdefault(shard["file"], set()).add(name)
    assert len(by_file) == 4
    assert {n for f, ns in by_file.items() for n in ns if ".experts.6." in n} == {
        "layers.1.mlp.experts.6.w1", "layers.1.mlp.experts.6.w2"}
    folded = tmp_path / "ep2_etp2"
    target = Layout(world_size=4, dp=4, ep=2, etp=2)
    offline.reshard(str(src), str(folded), target)
    info = offline.inspect(str(folded))
    assert info["ok"], info["problems"]
    assert info["layout"]["ep"] == 2 and info["layout"]["etp"] == 2
    reader = CheckpointReader(str(folded))
    w1_entry = reader.params[expert_name("layers.1.mlp.experts.w1", 6)]
    # expert 6 is on ep rank 1 = ranks 2 (etp 0) and 3 (etp 1): two shards, gate/up interleaved
    assert sorted(s["file"] for s in w1_entry["shards"]) == ["rank_00002.safetensors",
                                                             "rank_00003.safetensors"]
    got = reader.read_piece(expert_name("layers.1.mlp.experts.w1", 6),
                            piece_for("w", [H, 2 * F], _sh(1, 2, 6), target, 3))
    np.testing.assert_array_equal(got, np.concatenate([w1[6][:, 3:6], w1[6][:, 9:12]], axis=1))
    one = tmp_path / "one"
    offline.reshard(str(folded), str(one), Layout(world_size=1))
    merged = tmp_path / "m.safetensors"
    offline.merge(str(one), str(merged))
    from safetensors.numpy import load_file

    dense = load_file(str(merged))
    np.testing.assert_array_equal(np.stack([dense[expert_name("layers.1.mlp.experts.w1", k)]
                                            for k in range(E)]), w1)
    np.testing.assert_array_equal(np.stack([dense[expert_name("layers.1.mlp.experts.w2", k)]
                                            for k in range(E)]), w2)
    np.testing.assert_array_equal(dense["layers.1.mlp.router.weight"], arrays["layers.1.mlp.router.weight"])
    with pytest.raises(CheckpointError, match=r"not divisible by ep=3"):
        offline.reshard(str(src), str(tmp_path / "bad"), Layout(world_size=3, dp=3, ep=3))


def test_cli_reshard_to_an_expert_layout_and_inspect(tmp_path):
    import json

    from typer.testing import CliRunner

    from mscli.main import app

    arrays, shardings, w1, _ = _experts(seed=1)
    src = tmp_path / "ep4"
    save_arrays(str(src), arrays, Layout(world_size=4, dp=4, ep=4), shardings, step=1)
    to = tmp_path / "ep2etp2.yaml"
    to.write_text("world_size: 4\ntp: 2\nep: 2\netp: 2\nbackend: cpu\n")
    runner = CliRunner()
    out = tmp_path / "out"
    done = runner.invoke(app, ["checkpoint", "reshard", str(src), str(out), "--to", str(to)])
    assert done.exit_code == 0, done.output
    assert "experts ep2 x etp2" in " ".join(done.output.split())
    info = json.loads(runner.invoke(app, ["checkpoint", "inspect", str(out), "--format", "json"]).stdout)
    assert info["ok"] and (info["layout"]["ep"], info["layout"]["etp"]) == (2, 2)
    shards = {p["name"]: p["shards"] for p in info["parameters"]}
    assert shards[expert_name("layers.1.mlp.experts.w1", 0)] == 2  # etp halves
    assert shards["layers.1.mlp.router.weight"] == 1
    # a layout whose ep does not divide the 8 experts: exit 2, one line naming both
    bad = tmp_path / "ep3.yaml"
    bad.write_text("world_size: 3\nep: 3\nbackend: cpu\n")
    refused = runner.invoke(app, ["checkpoint", "reshard", str(src), str(tmp_path / "no"), "--to", str(bad)])
    assert refused.exit_code == 2 and "not divisible by ep=3" in refused.stderr
