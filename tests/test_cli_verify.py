"""``msdist verify`` with the launcher patched: options, spec, command lines, report, exit codes."""

import json

import pytest
from typer.testing import CliRunner

import mindscience.distributed.harness as harness
from mindscience.distributed.harness import LaunchResult
from mscli import verify_report as vr
from mscli.main import app
from mindscience.distributed.topology import Layout

runner = CliRunner()


def rank_result(rank, *, bandwidth_time=100.0, passed=True, wrong=0):
    records = [
        {"check": "layout.groups", "group": "tp", "passed": True, "max_error": 0.0, "rank": rank},
        {"check": "mapping.copy_to_all", "group": "tp", "dtype": "float32", "passed": passed,
         "max_error": 0.0 if passed else 3.0, "rank": rank},
        {"check": "bandwidth", "op": "all_reduce", "group": "tp", "group_size": 2, "bytes": 1048576,
         "dtype": "float32", "time_us": bandwidth_time * (1 + rank), "wrong": wrong, "composed": False,
         "passed": wrong == 0, "max_error": 0.0, "rank": rank},
        {"check": "bandwidth", "op": "reduce_scatter", "group": "tp", "group_size": 2, "bytes": 1048576,
         "dtype": "float32", "time_us": bandwidth_time, "wrong": 0, "composed": True,
         "passed": True, "max_error": 0.0, "rank": rank},
    ]
    return {"rank": rank, "status": "done", "records": records}


class FakeLaunch:
    """Stands in for harness.launch / launch_local_multinode and remembers its calls."""

    def __init__(self, ranks=None, failures=(), world=4):
        self.calls = []
        self.ranks = ranks if ranks is not None else {r: rank_result(r) for r in range(world)}
        self.failures = list(failures)

    def __call__(self, spec, world_size, *args, **kwargs):
        self.calls.append({"spec": spec, "world_size": world_size, "args": args, **kwargs})
        if kwargs.get("on_progress"):
            kwargs["on_progress"]({"ranks": {0: {"status": "running", "current": "layout.init", "done": 0}}})
        return LaunchResult(ok=not self.failures, returncode=0 if not self.failures else 1, timed_out=False,
                            duration_s=1.5, ranks=self.ranks, failures=self.failures, log_dir="/tmp/x",
                            command=["msrun", "--worker_num=4"])


@pytest.fixture
def fake(monkeypatch):
    launcher = FakeLaunch()
    monkeypatch.setattr(harness, "launch", launcher)
    monkeypatch.setattr(harness, "launch_local_multinode", launcher)
    return launcher


def test_default_runs_four_cpu_ranks_with_all_checks(fake):
    result = runner.invoke(app, ["verify", "--format", "json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    call = fake.calls[0]
    assert call["world_size"] == 4
    assert call["env"]["MSDIST_DEVICE_TARGET"] == "CPU"
    names = [c["name"] for c in call["spec"]["checks"]]
    assert names == ["layout.init", "mappings.all", "mappings.all", "layers.dense_equivalence",
                     "layers.modes", "vocab.embedding", "vocab.cross_entropy", "vocab.errors",
                     "random.tracker", "attention.methods", "attention.methods", "attention.errors",
                     "compute.matmul", "bandwidth.sweep"]
    by_name = {c["name"]: c["params"] for c in call["spec"]["checks"]}
    assert by_name["vocab.embedding"]["modes"] == ["pynative", "jit"]
    assert [c["params"] for c in call["spec"]["checks"] if c["name"] == "attention.methods"] == [
        {"cases": "verify", "dtypes": ["float32"]},
        {"modes": ["jit"], "cases": "verify_compiled", "dtypes": ["float32"]}]
    even, uneven = call["spec"]["checks"][1]["params"], call["spec"]["checks"][2]["params"]
    assert even["groups"] == ["tp", "cp", "dp-cp"]
    assert even["modes"] == ["pynative", "jit"] and "split_sizes" not in even
    assert uneven["split_sizes"] == "auto" and uneven["modes"] == ["pynative", "jit"]
    assert call["spec"]["checks"][4]["params"]["modes"] == ["jit"]
    assert by_name["compute.matmul"] == {"dtype": "float32"}
    sweep = by_name["bandwidth.sweep"]
    assert sweep["sizes"] == [1024, 262144]
    assert sweep["groups"] == ["tp", "cp", "dp", "pp", "dp-cp", "world"]
    assert report["ok"] is True and report["ranks"] == 4
    assert report["layout"]["tp"] == 2
    # time is the slowest rank's (rank 3: 4 x 100 us); busbw factor 2(n-1)/n = 1 for n=2.
    ar = next(r for r in report["bandwidth"] if r["op"] == "all_reduce")
    assert ar["time_us"] == pytest.approx(400.0)
    assert ar["algbw_gbps"] == pytest.approx(1048576 / 400e-6 / 1e9)
    assert ar["busbw_gbps"] == pytest.approx(ar["algbw_gbps"])
    rs = next(r for r in report["bandwidth"] if r["op"] == "reduce_scatter")
    assert rs["busbw_gbps"] == pytest.approx(rs["algbw_gbps"] * 0.5) and rs["composed"] is True
    assert {"check": "mapping.copy_to_all", "group": "tp", "mode": "pynative"}.items() <= report["correctness"][1].items()
    assert report["failures"] == []


def _mode_record(rank, mode, passed=True):
    return {"check": "mapping.copy_to_all", "group": "tp", "dtype": "float32", "mode": mode,
            "split": "even", "passed": passed, "max_error": 0.0 if passed else 2.0, "rank": rank}


def test_mode_option_and_one_row_per_mode(monkeypatch):
    ranks = {r: {"rank": r, "status": "done",
                 "records": [_mode_record(r, "pynative"), _mode_record(r, "jit", passed=r != 1),
                             _mode_record(r, "graph")]} for r in range(4)}
    launcher = FakeLaunch(ranks=ranks)
    monkeypatch.setattr(harness, "launch", launcher)
    result = runner.invoke(app, ["verify", "--mode", "pynative,jit,graph", "--checks", "correctness",
                                 "--format", "json"])
    assert result.exit_code == 1, result.output
    spec = launcher.calls[0]["spec"]
    assert spec["checks"][1]["params"]["modes"] == ["pynative", "jit", "graph"]
    layer_modes = [c for c in spec["checks"] if c["name"] == "layers.modes"]
    assert len(layer_modes) == 1 and layer_modes[0]["params"]["modes"] == ["jit", "graph"]
    rows = {r["mode"]: r for r in json.loads(result.stdout)["correctness"]}
    assert set(rows) == {"pynative", "jit", "graph"}
    assert rows["jit"]["passed"] is False and rows["jit"]["failed_ranks"] == [1]
    assert rows["pynative"]["passed"] and rows["graph"]["passed"]
    rich = runner.invoke(app, ["verify", "--mode", "graph", "--checks", "correctness"])
    assert "mode" in rich.stdout and "graph" in rich.stdout
    pyn = [c for c in launcher.calls[-1]["spec"]["checks"] if c["name"] == "layers.modes"]
    assert pyn and pyn[0]["params"]["modes"] == ["graph"]


def test_pynative_only_runs_no_compiled_layer_check(fake):
    runner.invoke(app, ["verify", "--mode", "pynative", "--format", "json"])
    names = [c["name"] for c in fake.calls[-1]["spec"]["checks"]]
    assert "layers.modes" not in names
    assert all(c["params"]["modes"] == ["pynative"] for c in fake.calls[-1]["spec"]["checks"]
               if c["name"] == "mappings.all")


def test_rich_output_has_tables(fake):
    result = runner.invoke(app, ["verify"])
    assert result.exit_code == 0, result.output
    assert "correctness" in result.stdout and "bandwidth" in result.stdout
    assert "composed" in result.stdout and "OK" in result.stdout


def test_quick_and_sweep_options(fake):
    runner.invoke(app, ["verify", "--quick", "--checks", "bandwidth", "--dtype", "bfloat16", "--iters", "3",
                        "--warmup", "0", "--format", "json"])
    spec = fake.calls[-1]["spec"]
    assert [c["name"] for c in spec["checks"]] == ["layout.init", "compute.matmul", "bandwidth.sweep"]
    assert spec["checks"][1]["params"] == {"dtype": "bfloat16"}
    params = spec["checks"][2]["params"]
    assert params["sizes"] == [4096] and params["dtype"] == "bfloat16"
    assert (params["iters"], params["warmup"]) == (3, 0)
    runner.invoke(app, ["verify", "-b", "1K", "-e", "64K", "-f", "4", "--format", "json"])
    assert fake.calls[-1]["spec"]["checks"][-1]["params"]["sizes"] == [1024, 4096, 16384, 65536]


def test_wrong_values_exit_1(monkeypatch):
    launcher = FakeLaunch(ranks={r: rank_result(r, passed=r != 2) for r in range(4)})
    monkeypatch.setattr(harness, "launch", launcher)
    result = runner.invoke(app, ["verify", "--format", "json"])
    assert result.exit_code == 1
    report = json.loads(result.stdout)
    row = next(r for r in report["correctness"] if r["check"] == "mapping.copy_to_all")
    assert row["passed"] is False and row["max_error"] == 3.0 and row["failed_ranks"] == [2]


def test_bandwidth_wrong_exit_1(monkeypatch):
    launcher = FakeLaunch(ranks={r: rank_result(r, wrong=1 if r == 0 else 0) for r in range(4)})
    monkeypatch.setattr(harness, "launch", launcher)
    result = runner.invoke(app, ["verify", "--format", "json"])
    assert result.exit_code == 1
    assert next(r for r in json.loads(result.stdout)["bandwidth"] if r["op"] == "all_reduce")["wrong"] == 1


def test_failed_rank_reported_with_log_tail(monkeypatch):
    ranks = {r: rank_result(r) for r in range(4)}
    ranks[1] = {"rank": 1, "status": "error", "records": []}
    failure = {"rank": 1, "kind": "crash", "reason": "worker died with SIGSEGV", "log_tail": "Segmentation fault"}
    monkeypatch.setattr(harness, "launch", FakeLaunch(ranks=ranks, failures=[failure]))
    result = runner.invoke(app, ["verify"])
    assert result.exit_code == 1
    assert "rank 1 failed: crash: worker died with SIGSEGV" in result.stderr
    assert "Segmentation fault" in result.stderr


def test_min_busbw_threshold(fake):
    ok = runner.invoke(app, ["verify", "--min-busbw", "0.5", "--format", "json"])
    assert ok.exit_code == 0
    miss = runner.invoke(app, ["verify", "--min-busbw", "100", "--format", "json"])
    assert miss.exit_code == 1
    assert json.loads(miss.stdout)["busbw_misses"]


def test_output_file(fake, tmp_path):
    target = tmp_path / "report.json"
    result = runner.invoke(app, ["verify", "--output", str(target)])
    assert result.exit_code == 0
    assert json.loads(target.read_text())["ok"] is True


def test_cluster_node_and_dry_run(fake):
    result = runner.invoke(app, ["verify", "ascend-64", "--nodes", "8", "--node-rank", "0",
                                 "--master-addr", "10.0.0.1", "--master-port", "8118", "--dry-run"])
    assert result.exit_code == 0, result.output
    lines = [l for l in result.stdout.splitlines() if l.startswith(("msrun", "/"))]
    assert len(lines) == 8
    for node, line in enumerate(lines):
        assert "--worker_num=64" in line and "--local_worker_num=8" in line
        assert f"--node_rank={node}" in line and "--master_addr=10.0.0.1" in line
        assert "--master_port=8118" in line
    assert fake.calls == []  # nothing launched


def test_cluster_node_launch_arguments(monkeypatch):
    launcher = FakeLaunch(world=64, ranks={r: rank_result(r) for r in range(8, 16)})
    monkeypatch.setattr(harness, "launch", launcher)
    result = runner.invoke(app, ["verify", "ascend-64", "--nodes", "8", "--node-rank", "1",
                                 "--master-addr", "10.0.0.1", "--master-port", "8118"])
    assert result.exit_code == 0, result.output
    call = launcher.calls[0]
    assert call["world_size"] == 64 and call["local_worker_num"] == 8 and call["node_rank"] == 1
    assert call["master_addr"] == "10.0.0.1" and call["master_port"] == 8118
    assert call["spec"]["gather"] is True
    assert "node 0 prints the report" in result.stderr


def test_loopback_nodes(fake):
    result = runner.invoke(app, ["verify", "--loopback-nodes", "2", "--format", "json"])
    assert result.exit_code == 0, result.output
    assert fake.calls[0]["args"] == (2,)


@pytest.mark.parametrize(
    "args,fragment",
    [
        (["ascend-64"], "run msdist verify on every node"),
        (["ascend-65536", "--local"], "larger than this machine can run with --local"),
        (["--checks", "speed"], "--checks 'speed' is invalid"),
        (["--dtype", "int8"], "--dtype 'int8' is invalid"),
        (["--min-bytes", "2M", "--max-bytes", "1M"], "are invalid"),
        (["--min-bytes", "lots"], "size 'lots' is invalid"),
        (["--factor", "1"], "--factor 1 is invalid"),
        (["--iters", "0"], "--iters 0"),
        (["--timeout", "0"], "--timeout 0"),
        (["--format", "xml"], "--format 'xml'"),
        (["--nodes", "3"], "--nodes 3 is invalid"),
        (["--nodes", "2", "--node-rank", "2", "--master-addr", "h"], "--node-rank 2 is invalid"),
        (["--nodes", "2", "--node-rank", "0"], "needs --master-addr"),
        (["--nodes", "2", "--node-rank", "1", "--master-addr", "h"], "needs --master-port"),
        (["--loopback-nodes", "3"], "--loopback-nodes 3 is invalid"),
        (["--master-port", "70000"], "--master-port 70000"),
        (["no-such-layout"], "no such layout"),
        (["--output", "/no/such/dir/r.json"], "does not exist"),
        (["--inject-fault", "boom"], "--inject-fault 'boom'"),
        (["--mode", "eager"], "--mode 'eager' is invalid"),
        (["--mode", ""], "--mode '' is invalid"),
    ],
)
def test_bad_input_exit_2(fake, args, fragment):
    result = runner.invoke(app, ["verify", *args])
    assert result.exit_code == 2, result.output
    assert fragment in result.stderr
    assert "Traceback" not in result.stderr
    assert fake.calls == []


def test_port_in_use_is_bad_input(monkeypatch):
    def refuse(*args, **kwargs):
        raise harness.LaunchError("master port 8118 on 127.0.0.1 is already in use: pick another")

    monkeypatch.setattr(harness, "launch", refuse)
    result = runner.invoke(app, ["verify", "--master-port", "8118"])
    assert result.exit_code == 2
    assert "already in use" in result.stderr


def test_report_requires_every_rank_done():
    layout = Layout(world_size=4, tp=2, cp=2)
    ranks = {r: rank_result(r) for r in range(3)}
    assert vr.build_report(layout, ranks, [])["ok"] is False
    ranks[3] = rank_result(3)
    assert vr.build_report(layout, ranks, [])["ok"] is True
    ranks[3] = {**rank_result(3), "status": "running"}
    assert vr.build_report(layout, ranks, [])["ok"] is False


def test_bus_factors():
    assert vr.bus_factor("all_reduce", 4) == 1.5
    assert vr.bus_factor("all_gather", 4) == 0.75
    assert vr.bus_factor("reduce_scatter", 8) == 0.875
    assert vr.bus_factor("all_to_all", 2) == 0.5


# ------------------------------------------------------------------ expert layouts (ep/etp)
def _a2a_records(rank, mode, time_us):
    return [{"check": "bandwidth", "op": "all_to_all", "mode": mode, "group": "ep=etp-ep", "group_size": 4,
             "bytes": nbytes, "dtype": "float32", "time_us": time_us * nbytes / 1024 + rank, "wrong": 0,
             "composed": True, "passed": True, "max_error": 0.0, "rank": rank} for nbytes in (1024, 262144)]


def test_expert_layout_sweeps_all_to_all_on_ep_in_each_mode(monkeypatch):
    ranks = {r: {"rank": r, "status": "done", "records": rank_result(r)["records"] + _a2a_records(r, "pynative", 10.0)
                 + _a2a_records(r, "jit", 8.0)} for r in range(4)}
    launcher = FakeLaunch(ranks=ranks)
    monkeypatch.setattr(harness, "launch", launcher)
    result = runner.invoke(app, ["verify", "cpu-4-ep2", "--format", "json"])
    assert result.exit_code == 0, result.output
    call = launcher.calls[-1]
    assert call["spec"]["layout"]["ep"] == 2 and call["spec"]["layout"]["etp"] == 1
    sweep = next(c for c in call["spec"]["checks"] if c["name"] == "bandwidth.sweep")["params"]
    assert sweep["a2a_groups"] == ["ep", "etp-ep"] and sweep["a2a_modes"] == ["pynative", "jit"]
    rows = {(r["op"], r["mode"], r["bytes"]): r for r in json.loads(result.stdout)["bandwidth"]}
    for mode, per_kib in (("pynative", 10.0), ("jit", 8.0)):
        row = rows[("all_to_all", mode, 262144)]
        slowest_us = per_kib * 256 + 3  # rank 3 is the slowest
        assert row["time_us"] == pytest.approx(slowest_us)
        assert row["algbw_gbps"] == pytest.approx(262144 / (slowest_us * 1e-6) / 1e9)
        # nccl-tests' alltoall_perf: busbw = algbw * (n-1)/n, n = 4.
        assert row["busbw_gbps"] == pytest.approx(row["algbw_gbps"] * 3 / 4)
        assert row["latency_us"] == pytest.approx(per_kib + 3)
    assert rows[("all_reduce", "pynative", 1048576)]["mode"] == "pynative"
    text = runner.invoke(app, ["verify", "cpu-4-ep2"]).stdout
    assert "all_to_all (jit)" in text and "ep=etp-ep" in text and "ep=2 etp=1" in text
    # --mode pynative: the eager rows only; a dense layout gets no expert sweep at all.
    runner.invoke(app, ["verify", "cpu-4-ep2", "--mode", "pynative", "--format", "json"])
    sweep = next(c for c in launcher.calls[-1]["spec"]["checks"] if c["name"] == "bandwidth.sweep")["params"]
    assert sweep["a2a_modes"] == ["pynative"]
    runner.invoke(app, ["verify", "cpu-4", "--format", "json"])
    sweep = next(c for c in launcher.calls[-1]["spec"]["checks"] if c["name"] == "bandwidth.sweep")["params"]
    assert "a2a_groups" not in sweep


def test_calibration_reads_the_eager_rows_only():
    from mindscience.distributed.costmodel.calibrate import calibrate
    from mindscience.distributed.costmodel.spec import ClusterSpec

    eager = vr.bandwidth_rows({r: {"records": _a2a_records(r, "pynative", 10.0)} for r in range(4)})
    both = vr.bandwidth_rows({r: {"records": _a2a_records(r, "pynative", 10.0) + _a2a_records(r, "jit", 1.0)}
                              for r in range(4)})
    assert len(both) == 2 * len(eager)
    cluster = ClusterSpec(device="cpu")
    assert calibrate(cluster, {"bandwidth": both}, "r.json")[0] == calibrate(cluster, {"bandwidth": eager}, "r.json")[0]


def test_sweep_plan_of_expert_groups():
    from mindscience.distributed.harness.checks.bandwidth import OPS, _plan

    dense, a2a = ("tp", "cp", "dp", "pp", "dp-cp", "world"), ("ep", "etp-ep")
    assert _plan("ep=etp-ep", dense, a2a, OPS, ("pynative", "jit")) == [("all_to_all", "pynative"),
                                                                        ("all_to_all", "jit")]
    # An ep group that is also the tp group: every op once eagerly, plus the compiled all-to-all.
    assert _plan("tp=ep=etp-ep", dense, a2a, OPS, ("pynative", "jit")) == [(op, "pynative") for op in OPS] + [
        ("all_to_all", "jit")]
    assert _plan("cp=dp-cp", dense, a2a, OPS, ("pynative", "jit")) == [(op, "pynative") for op in OPS]
