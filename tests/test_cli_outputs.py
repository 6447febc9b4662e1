"""Output files and saved reports of the CLI: pictures and tables that cannot be written, names whose
suffix does not match the format, and `verify --from-report` files missing what the views read. Every
case is one stderr line and exit 2, checked before any work (and before verify launches a rank)."""

import json

import pytest
from typer.testing import CliRunner

pytest.importorskip("matplotlib")

from mscli.main import app  # noqa: E402
from test_pictures import one_line_error, report_data  # noqa: E402

runner = CliRunner()


@pytest.mark.parametrize("args,fragment", [
    (["plan", "ascend-64", "--svg", "/proc/x.svg"], "--svg /proc/x.svg: cannot write there"),
    (["plan", "ascend-64", "--png", "/proc/x.png"], "--png /proc/x.png: cannot write there"),
    (["plan", "ascend-64", "--svg-table", "/proc/t.svg"], "--svg-table /proc/t.svg: cannot write there"),
    (["plan", "ascend-64", "--svg", "{tmp}"], "--svg {tmp}: is a folder: expected a file name, e.g. {tmp}/picture.svg"),
    (["plan", "ascend-64", "--svg", "{tmp}/folder.svg"], "--svg {tmp}/folder.svg: is a folder"),
    (["plan", "ascend-64", "--svg-table", "{tmp}/folder.svg"], "--svg-table {tmp}/folder.svg: is a folder"),
    (["plan", "ascend-64", "--svg", "a.pdf"], "--svg a.pdf: expected a file name ending in .svg"),
    (["plan", "ascend-64", "--svg", "a.txt"], "--svg a.txt: expected a file name ending in .svg"),
    (["plan", "ascend-64", "--png", "c.svg"], "--png c.svg: expected a file name ending in .png"),
    (["plan", "ascend-64", "--svg-table", "t.png"], "--svg-table t.png: expected a file name ending in .svg"),
    (["verify", "--from-report", "{report}", "--plot", "/proc/bw.svg"], "--plot /proc/bw.svg: cannot write there"),
    (["verify", "--from-report", "{report}", "--plot", "{tmp}/folder.svg"], "--plot {tmp}/folder.svg: is a folder"),
    (["suggest", "-m", "gqa-7b", "-w", "64", "--write", "/proc/best.yaml"], "--write /proc/best.yaml: cannot write"),
    (["suggest", "-m", "gqa-7b", "-w", "64", "--write", "{tmp}"], "--write {tmp}: is a folder"),
])
def test_unwritable_or_mismatched_outputs_are_one_line(args, fragment, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "folder.svg").mkdir()
    (tmp_path / "r.json").write_text(json.dumps(report_data()))

    def fill(text):
        return text.replace("{tmp}", str(tmp_path)).replace("{report}", str(tmp_path / "r.json"))

    one_line_error(runner.invoke(app, [fill(a) for a in args]), fill(fragment))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["folder.svg", "r.json"]  # nothing written, no probe left


def test_a_writable_path_is_probed_without_leaving_a_file(tmp_path):
    target = tmp_path / "g.svg"
    result = runner.invoke(app, ["plan", "cpu-4", "--svg", str(target), "--color-by", "xp"])  # fails after the probe
    one_line_error(result, "--color-by 'xp' is invalid")
    assert not target.exists()
    target.write_text("old")  # an existing file is left as it was when the command fails
    one_line_error(runner.invoke(app, ["plan", "cpu-4", "--svg", str(target), "--color-by", "xp"]), "--color-by")
    assert target.read_text() == "old"


def test_verify_checks_the_plot_path_before_launching(tmp_path, monkeypatch):
    import mindscience.distributed.harness as harness

    launched = []
    monkeypatch.setattr(harness, "launch", lambda *args, **kwargs: launched.append(args))
    (tmp_path / "folder.svg").mkdir()
    for target, fragment in (("/proc/bw.svg", "cannot write there"), (str(tmp_path / "folder.svg"), "is a folder"),
                             (str(tmp_path / "bw.pdf"), "ending in .svg or .png")):
        result = runner.invoke(app, ["verify", "--checks", "bandwidth", "--plot", target])
        one_line_error(result, f"--plot {target}", fragment)
    assert launched == []


@pytest.mark.parametrize("change,fragment", [
    (lambda r: r.pop("failures"), "key 'failures' is missing: expected a list"),
    (lambda r: r["layout"].pop("tp"), "key 'layout.tp' is missing: expected an integer"),
    (lambda r: r["bandwidth"][0].pop("busbw_gbps"), "key 'bandwidth[0].busbw_gbps' is missing"),
    (lambda r: r.update(ranks="four"), "key 'ranks' is 'four': expected an integer"),
    (lambda r: r.update(ok="yes"), "key 'ok' is 'yes': expected true or false"),
    (lambda r: r.update(failures=[{"rank": 1}]), "key 'failures[0].reason' is missing"),
    (lambda r: r.update(correctness=[{"check": "mapping.copy", "group": "tp"}]), "key 'correctness[0].passed'"),
    (lambda r: r.update(compute={"dtype": "float32", "shape": [8, 8, 8]}), "key 'compute.tflops' is missing"),
])
def test_from_report_names_the_missing_key(change, fragment, tmp_path):
    report = report_data()
    change(report)
    path = tmp_path / "r.json"
    path.write_text(json.dumps(report))
    for fmt in ("rich", "json"):
        result = runner.invoke(app, ["verify", "--from-report", str(path), "--format", fmt])
        one_line_error(result, f"--from-report {path}: {fragment}")


def test_from_report_of_a_complete_report_shows_it(tmp_path):
    path = tmp_path / "r.json"
    report = report_data()
    report["compute"] = {"tflops": 0.15, "dtype": "float32", "shape": [1024, 1024, 1024]}
    path.write_text(json.dumps(report))
    result = runner.invoke(app, ["verify", "--from-report", str(path)])
    assert result.exit_code == 0, result.output
    assert "all_reduce" in result.stdout and "0.15 TFLOP/s" in result.stdout and "OK" in result.stdout
