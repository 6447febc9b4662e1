"""``msdist plan`` and ``msdist layouts`` through typer's CliRunner, and the layout files."""

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from mindscience.distributed.topology import Layout, LayoutFileError, load_layout
from mscli.layouts import bundled_layouts
from mscli.main import app

runner = CliRunner()
ROOT = Path(__file__).resolve().parent.parent


def invoke(*args):
    return runner.invoke(app, list(args))


def write(tmp_path, text, name="layout.yaml"):
    path = tmp_path / name
    path.write_text(text)
    return str(path)


# ------------------------------------------------------------------ bundled layouts
def test_bundled_layouts_cover_the_required_shapes():
    layouts = {name: load_layout(path) for name, path in bundled_layouts().items()}
    default = layouts["cpu-4"]
    assert (default.world_size, default.backend) == (4, "cpu")
    assert any(l.world_size == 8 and l.num_nodes == 1 for l in layouts.values())
    big = layouts["ascend-64"]
    assert (big.world_size, big.num_nodes, big.backend) == (64, 8, "ascend")
    assert min(big.tp, big.cp, big.dp, big.pp) > 1
    assert any(l.world_size == 65536 for l in layouts.values())


def test_default_plan_table():
    result = invoke("plan")
    assert result.exit_code == 0, result.output
    out = result.stdout
    assert "cpu-4" in out and "tp=2  cp=2  dp=1  pp=1" in out
    assert "tp-cp-dp-pp" in out
    # The groups section lists the real members.
    assert "[0, 1]" in out and "[2, 3]" in out and "[0, 2]" in out and "[1, 3]" in out
    assert "2 per rank (tp, cp)" in out
    assert "800 MB per rank" in out


def test_plan_json_schema_and_values():
    result = invoke("plan", "ascend-64", "--format", "json")
    assert result.exit_code == 0, result.stderr
    data = json.loads(result.stdout)
    assert data["world_size"] == 64
    assert data["order"] == "tp-cp-dp-pp"
    assert data["sizes"] == {"tp": 4, "cp": 2, "dp": 4, "pp": 2}
    assert data["devices_per_node"] == 8
    assert set(data["groups"]) >= {"tp", "cp", "dp", "pp", "dp-cp"}
    layout = Layout(world_size=64, tp=4, cp=2, pp=2, devices_per_node=8)
    for key, groups in data["groups"].items():
        assert groups == layout.groups(key)
    assert data["groups"]["tp"][0] == [0, 1, 2, 3]
    assert data["groups"]["cp"][0] == [0, 4]
    assert data["groups"]["dp"][0] == [0, 8, 16, 24]
    assert data["groups"]["pp"][0] == [0, 32]
    assert len(data["ranks"]) == 64
    assert data["ranks"][37] == {"rank": 37, "node": 4, "local_rank": 5, "tp": 1, "cp": 1, "dp": 0, "pp": 1,
                                 "ep": 0, "etp": 1, "edp": 1}
    # Five distinct communicators at 400 MB each.
    assert data["communicators"]["per_rank"] == 5
    assert data["communicators"]["buffer_mb_per_rank"] == 2000
    assert data["warnings"] == []


def test_plan_json_extra_groups():
    result = invoke("plan", "cpu-4", "--format", "json", "--groups", "tp-cp,tp-dp-cp")
    data = json.loads(result.stdout)
    assert data["groups"]["tp-cp"] == [[0, 1, 2, 3]]
    assert data["groups"]["tp-dp-cp"] == [[0, 1, 2, 3]]


def test_plan_rank_view():
    result = invoke("plan", "cpu-8-pp2", "--rank", "5")
    assert result.exit_code == 0
    out = result.stdout
    assert "rank 5" in out and "tp=1" in out and "pp=1" in out
    assert "[4, 5]" in out and "[5, 7]" in out and "[1, 5]" in out

    data = json.loads(invoke("plan", "cpu-8-pp2", "--rank", "5", "--format", "json").stdout)
    assert data["coords"] == {"tp": 1, "cp": 0, "dp": 0, "pp": 1}
    assert data["groups"]["pp"] == {"index": 1, "group_rank": 1, "size": 2, "ranks": [1, 5], "cross_node": False}
    assert data["groups"]["dp"]["ranks"] == [5, 7]


def test_cross_node_marks_and_warnings():
    result = invoke("plan", "ascend-64-tp-across-nodes")
    assert result.exit_code == 0
    assert "crosses nodes" in result.stdout
    assert "tp groups cross node boundaries" in result.stderr
    assert "cp groups cross node boundaries" in result.stderr
    data = json.loads(invoke("plan", "ascend-64-tp-across-nodes", "--format", "json").stdout)
    assert len(data["cross_node"]["tp"]) == 16
    assert any("tp groups cross" in w for w in data["warnings"])


def test_large_world_is_summarized_unless_all():
    result = invoke("plan", "ascend-65536")
    assert result.exit_code == 0
    assert "65520 more ranks not shown (use --all)" in result.stdout
    assert "65535" in result.stdout  # the last row is shown
    small = invoke("plan", "ascend-64")
    assert "more ranks" in small.stdout
    full = invoke("plan", "ascend-64", "--all")
    assert "more ranks" not in full.stdout and "more groups" not in full.stdout
    assert "[60, 61, 62, 63]" in full.stdout


def test_svg_table_export(tmp_path):
    # The terminal tables as SVG moved from --svg (now the device grid, tests/test_pictures.py).
    target = tmp_path / "plan.svg"
    result = invoke("plan", "--svg-table", str(target))
    assert result.exit_code == 0
    svg = target.read_text()
    assert svg.startswith("<svg") and "msdist" in svg and "cpu-4" in svg
    target2 = tmp_path / "rank.svg"
    result = invoke("plan", "--rank", "2", "--format", "json", "--svg-table", str(target2))
    assert result.exit_code == 0
    assert json.loads(result.stdout)["rank"] == 2  # stdout stays pure JSON
    assert target2.read_text().startswith("<svg")


def test_layouts_command_lists_bundled():
    result = invoke("layouts", "--format", "json")
    rows = json.loads(result.stdout)
    assert {"cpu-4", "ascend-64", "ascend-65536"} <= {r["name"] for r in rows}


def test_layout_path_and_explicit_file(tmp_path):
    path = write(tmp_path, "world_size: 8\ntp: 2\npp: 2\n")
    data = json.loads(invoke("plan", path, "--format", "json").stdout)
    assert data["sizes"] == {"tp": 2, "cp": 1, "dp": 2, "pp": 2}
    assert data["devices_per_node"] == 8 and data["order"] == "tp-cp-dp-pp"


# ------------------------------------------------------------------ error paths
def assert_bad_input(result, *fragments):
    assert result.exit_code == 2, result.output
    assert result.stdout == ""
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("msdist: error: ")
    assert "Traceback" not in result.stderr
    for fragment in fragments:
        assert fragment in lines[0], lines[0]


@pytest.mark.parametrize(
    "text,fragments",
    [
        ("world_size: 8\ntp: 2\nfoo: 1\n", ["unknown key 'foo'"]),
        ("world_size: 8\ntp: two\n", ["key 'tp'", "expected an integer"]),
        ("world_size: 8\ntp: 2.5\n", ["key 'tp'"]),
        ("world_size: 8\norder: [tp, cp]\n", ["key 'order'"]),
        ("world_size: 8\ntp: [1\n", ["malformed YAML", "line"]),
        ("- 1\n- 2\n", ["expected a mapping"]),
        ("", ["empty"]),
        ("tp: 2\n", ["'world_size' is missing"]),
        ("world_size: 8\ntp: 3\n", ["does not divide world_size=8"]),
        ("world_size: 8\ntp: 2\ndp: 3\n", ["dp=3 disagrees"]),
        ("world_size: 8\norder: tp-cp-dp\n", ["missing axis 'pp'"]),
        ("world_size: 8\norder: tp-cp-dp-xp\n", ["unknown axis 'xp'"]),
        ("world_size: 8\ndevices_per_node: 3\n", ["devices_per_node=3"]),
        ("world_size: 8\nbackend: tpu\n", ["backend='tpu'"]),
        ("world_size: 0\n", ["world_size=0"]),
        ("world_size: 8\nep: 3\n", ["ep=3 does not fit", "does not divide world_size=8"]),
        ("world_size: 8\nep: two\n", ["key 'ep'", "expected an integer"]),
        ("world_size: 8\netp: true\n", ["key 'etp'"]),
        ("world_size: 8\nep: 0\n", ["ep=0 is invalid"]),
        ("world_size: 16\ncp: 2\npp: 2\nep: 4\norder: tp-cp-ep-pp-dp\n", ["ep=4", "edp must equal dp"]),
        ("world_size: 16\ntp: 2\npp: 2\nep: 2\netp: 1\norder: tp-pp-cp-ep-dp\n",
         ["ep=2", "other pipeline groups"]),
        ("world_size: 8\norder: tp-cp-ep-ep-dp-pp\n", ["repeats axis 'ep'"]),
    ],
)
def test_layout_file_errors_name_file_and_key(tmp_path, text, fragments):
    path = write(tmp_path, text)
    assert_bad_input(invoke("plan", path), path, *fragments)
    assert_bad_input(invoke("plan", path, "--format", "json"), path, *fragments)
    with pytest.raises(LayoutFileError):
        load_layout(path)


def test_layout_error_names_the_key_attribute(tmp_path):
    with pytest.raises(LayoutFileError) as info:
        load_layout(write(tmp_path, "world_size: 8\nep: 3\n"))
    assert info.value.key == "ep"


def test_missing_file():
    assert_bad_input(invoke("plan", "no/such/layout.yaml"), "no/such/layout.yaml", "cpu-4")


@pytest.mark.parametrize(
    "args,fragment",
    [
        (["--rank", "4"], "rank 4 is outside the world"),
        (["--rank", "-1"], "rank -1 is outside the world"),
        (["--groups", "tp-xp"], "unknown axis 'xp'"),
        (["--groups", "tp-tp"], "repeats an axis"),
        (["--groups", "tp-ep"], "mixes dense axis 'tp' with expert axis 'ep'"),
        (["--format", "yaml"], "--format 'yaml' is invalid"),
        (["--hccl-buffsize", "0"], "--hccl-buffsize 0"),
        (["--svg", "/no/such/dir/x.svg"], "does not exist"),
        (["--svg-table", "/no/such/dir/x.svg"], "does not exist"),
        (["--png", "/no/such/dir/x.png"], "does not exist"),
    ],
)
def test_option_errors(args, fragment):
    assert_bad_input(invoke("plan", *args), fragment)


def test_bad_hccl_buffsize_env():
    result = runner.invoke(app, ["plan"], env={"HCCL_BUFFSIZE": "lots"})
    assert_bad_input(result, "HCCL_BUFFSIZE='lots'")


def test_hccl_buffsize_env_changes_estimate():
    result = runner.invoke(app, ["plan", "--format", "json"], env={"HCCL_BUFFSIZE": "100"})
    assert json.loads(result.stdout)["communicators"]["buffer_mb_per_rank"] == 400


# ------------------------------------------------------------------ expert axes
def test_expert_layout_plan_json():
    """ascend-64-ep8: dense tp2 x dp16 x pp2, experts etp1 x ep8 x edp4 folded over the same ranks."""
    result = invoke("plan", "ascend-64-ep8", "--format", "json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    layout = load_layout(ROOT / "layouts" / "ascend-64-ep8.yaml")
    assert data["order"] == "tp-cp-ep-dp-pp"
    assert data["sizes"] == {"tp": 2, "cp": 1, "dp": 16, "pp": 2}
    assert data["expert_sizes"] == {"etp": 1, "ep": 8, "edp": 4}
    assert {"ep", "etp", "edp", "etp-ep"} <= set(data["groups"])
    for key, groups in data["groups"].items():
        assert groups == layout.groups(key), key
    assert data["groups"]["ep"][0] == list(range(8)) and data["groups"]["ep"][7] == list(range(56, 64))
    assert data["groups"]["etp-ep"] == data["groups"]["ep"]
    assert data["groups"]["edp"][0] == [0, 8, 16, 24] and data["groups"]["edp"][8] == [32, 40, 48, 56]
    assert data["groups"]["etp"] == [[r] for r in range(64)]
    # The experts' pipeline groups are the dense ones: [r, r + 32].
    assert data["groups"]["pp"][5] == [5, 37]
    assert data["cross_node"]["ep"] == [] and data["cross_node"]["edp"] == list(range(16))
    assert data["ranks"][45] == {"rank": 45, "node": 5, "local_rank": 5, "tp": 1, "cp": 0, "dp": 6, "pp": 1,
                                 "ep": 5, "etp": 0, "edp": 1}
    # tp, dp (= dp-cp), pp, ep (= etp-ep), edp.
    assert data["communicators"]["per_rank"] == 5
    assert data["communicators"]["groups"] == ["tp", "dp", "pp", "ep", "edp"]


def test_expert_layout_plan_table_and_rank_view():
    out = invoke("plan", "ascend-64-ep8").stdout
    assert "etp=1  ep=8  edp=4  pp=2" in out
    assert "ep: 8 x 8" in out and "edp: 16 x 4" in out and "etp-ep: 8 x 8" in out
    assert "[0, 8, 16, 24]" in out and "[56, 57, 58, 59, 60, 61, 62, 63]" in out
    header = next(line for line in out.splitlines() if line.startswith("rank "))
    assert [c.strip() for c in header.split("\u2503")][-5:] == ["#tp", "#dp", "#pp", "#ep", "#edp"]
    view = json.loads(invoke("plan", "ascend-64-ep8", "--rank", "45", "--format", "json").stdout)
    assert view["expert_coords"] == {"etp": 0, "ep": 5, "edp": 1}
    assert view["groups"]["ep"] == {"index": 5, "group_rank": 5, "size": 8, "ranks": list(range(40, 48)),
                                    "cross_node": False}
    assert view["groups"]["edp"]["ranks"] == [37, 45, 53, 61]
    text = invoke("plan", "ascend-64-ep8", "--rank", "45").stdout
    assert "ep=5  etp=0  edp=1" in text


def test_dense_layout_lists_no_repeated_expert_groups_for_people():
    # cpu-4 has ep 1 and etp = tp: its expert groups are its dense ones, listed in JSON only.
    out = invoke("plan").stdout
    assert "etp=2  ep=1  edp=2  pp=1" in out and "expert layers = dense" in out
    assert "etp-ep" not in out and "edp " not in out
    data = json.loads(invoke("plan", "--format", "json").stdout)
    assert data["groups"]["etp"] == data["groups"]["tp"] == [[0, 1], [2, 3]]
    assert data["groups"]["edp"] == data["groups"]["dp-cp"] == [[0, 2], [1, 3]]
    assert data["groups"]["ep"] == [[0], [1], [2], [3]]
    assert data["communicators"]["per_rank"] == 2


def test_cpu_expert_layout_and_layouts_listing():
    data = json.loads(invoke("plan", "cpu-4-ep2", "--format", "json").stdout)
    assert data["expert_sizes"] == {"etp": 1, "ep": 2, "edp": 2}
    assert data["groups"]["ep"] == [[0, 1], [2, 3]] and data["groups"]["edp"] == [[0, 2], [1, 3]]
    rows = {r["name"]: r for r in json.loads(invoke("layouts", "--format", "json").stdout)}
    assert (rows["cpu-4-ep2"]["ep"], rows["cpu-4-ep2"]["etp"]) == (2, 1)
    assert (rows["cpu-4"]["ep"], rows["cpu-4"]["etp"]) == (1, 2)


def test_picture_grid_colours_by_expert_groups(tmp_path):
    from mscli import pictures

    # tp = cp = 1: ep is the innermost axis larger than 1, so the grid is coloured by it.
    data = json.loads(invoke("plan", write(tmp_path, "world_size: 8\npp: 2\nep: 4\n"), "--format", "json").stdout)
    assert data["order"] == "tp-cp-ep-dp-pp" and pictures.color_axis(data) == "ep"
    grid = pictures.grid_cells(data, "edp")
    assert grid["axis"] == "edp"
    # edp = 8 / (1*4*2) = 1: every rank its own expert-data group.
    assert [grid["cells"][(0, r)]["group"] for r in range(8)] == list(range(8))
    ep = pictures.grid_cells(data)
    assert [ep["cells"][(0, r)]["group"] for r in range(8)] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert [ep["cells"][(0, r)]["stage"] for r in range(8)] == [0, 0, 0, 0, 1, 1, 1, 1]
