"""``msdist verify`` for real: msrun ranks on this CPU, as a user runs it (a separate process)."""

import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.multiprocess

MSDIST = shutil.which("msdist") or str(Path(sys.executable).parent / "msdist")


def run_verify(tmp_path, *args, timeout=240):
    """Run ``msdist verify`` with its own log folder; return (exit code, report, stderr, seconds)."""
    log_dir = tmp_path / "logs"
    report_path = tmp_path / "report.json"
    start = time.monotonic()
    proc = subprocess.run(
        [MSDIST, "verify", *args, "--log-dir", str(log_dir), "--output", str(report_path), "--format", "json"],
        capture_output=True, text=True, timeout=timeout,
    )
    seconds = time.monotonic() - start
    report = json.loads(report_path.read_text()) if report_path.exists() else None
    if report is not None:
        assert json.loads(proc.stdout) == report  # stdout holds only the JSON
    return proc.returncode, report, proc.stderr, seconds, log_dir


def leftovers(log_dir) -> list:
    """Processes whose command line mentions this run's log folder (workers, msrun, scheduler)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as fh:
                cmdline = fh.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if str(log_dir) in cmdline:
            found.append((int(entry), cmdline))
    return found


def test_default_layout_passes(tmp_path):
    code, report, stderr, _, log_dir = run_verify(tmp_path)
    assert code == 0, stderr
    assert report["ok"] is True and report["ranks"] == 4 and report["failures"] == []
    assert report["layout"]["tp"] == 2 and report["layout"]["cp"] == 2
    rows = {(r["check"], r["group"], r["mode"], r.get("split")): r for r in report["correctness"]}
    for key in ("tp", "cp", "dp", "pp", "dp-cp"):
        assert rows[("layout.groups", key, "pynative", None)]["passed"]
    # The expert groups too (ep 1, etp = tp here: the dense groups under their expert names).
    for key in ("ep", "etp", "edp", "etp-ep"):
        assert rows[("layout.groups", key, "pynative", None)]["passed"]
    mappings = {c for c, *_ in rows if c.startswith("mapping.")}
    assert len(mappings) >= 9
    # Default modes: every mapping in PyNative and under ms.jit, exact on small integers.
    for check in mappings:
        for mode in ("pynative", "jit"):
            for group in ("tp", "cp=dp-cp"):
                row = rows[(check, group, mode, "even")]
                assert row["passed"] and row["max_error"] == 0.0, row
    # Each sequence mapping once more on an uneven sequence, in both modes.
    uneven = {(c, m) for c, g, m, split in rows if split == "uneven" and c.startswith("mapping.")}
    assert len(uneven) == 6 * 2
    assert {mode for check, _, mode, _split in rows if check.startswith("layers.")} >= {"pynative", "jit"}
    # The three context-parallel attentions (causal GQA uneven) in both modes, the zigzag ring eagerly.
    for mode in ("pynative", "jit"):
        assert rows[("attention.methods", "cp", mode, "uneven")]["passed"]
    assert rows[("attention.methods", "cp", "pynative", "zigzag")]["passed"]
    assert all(r["passed"] for r in report["correctness"])
    bandwidth = report["bandwidth"]
    assert {r["op"] for r in bandwidth} == {"all_reduce", "all_gather", "reduce_scatter", "all_to_all"}
    assert {r["group"] for r in bandwidth} == {"tp", "cp=dp-cp", "world"}
    assert {r["mode"] for r in bandwidth} == {"pynative"}  # compiled rows: the expert all-to-all only
    for row in bandwidth:
        assert row["wrong"] == 0 and row["time_us"] > 0 and row["busbw_gbps"] > 0
        assert row["composed"] == (row["op"] in ("reduce_scatter", "all_to_all"))
        assert row["group_size"] == (4 if row["group"] == "world" else 2)
        assert row["crosses_nodes"] is False  # one machine
        smallest = min((r for r in bandwidth if (r["op"], r["group"]) == (row["op"], row["group"])),
                       key=lambda r: r["bytes"])
        assert row["latency_us"] == smallest["time_us"]
    # The compute probe: a correctness row (the product is exact) and the slowest rank's rate.
    assert rows[("compute.matmul", "world", "pynative", None)]["passed"]
    compute = report["compute"]
    assert compute["tflops"] == min(compute["tflops_per_rank"].values()) > 0
    assert compute["dtype"] == "float32" and compute["shape"] == [1024, 1024, 1024]
    # The report calibrates the cost model: plan --calibrate takes its rate and bandwidths.
    proc = subprocess.run([MSDIST, "plan", "cpu-4", "--model", "sci-transformer-s", "--calibrate",
                           str(tmp_path / "report.json"), "--format", "json"], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    cluster = json.loads(proc.stdout)["model"]["cluster"]
    assert cluster["peak_tflops"] * cluster["compute_efficiency"] == pytest.approx(compute["tflops"])
    # Alpha-beta: per (op, group), the bus bandwidth of the bytes beyond the smallest size,
    # factor * (B - b) / (T - t) with factor = busbw * T / B of the largest size; the median
    # of those that grew with the size (the largest sizes' median busbw when none did).
    sweeps = {}
    for row in bandwidth:
        sweeps.setdefault((row["op"], row["group"]), []).append(row)
    slopes, largest_busbw = [], []
    for rows_of in sweeps.values():
        small, large = min(rows_of, key=lambda r: r["bytes"]), max(rows_of, key=lambda r: r["bytes"])
        largest_busbw.append(large["busbw_gbps"])
        grown_us = large["time_us"] - small["time_us"]
        if grown_us > 0:
            factor = large["busbw_gbps"] * large["time_us"] / large["bytes"]
            slopes.append(factor * (large["bytes"] - small["bytes"]) / grown_us)
    assert len(sweeps) == 12
    expected = statistics.median(slopes) if slopes else statistics.median(largest_busbw)
    assert cluster["intra_node_gbps"] == pytest.approx(expected, rel=1e-6)
    # Its latency: the median over the sweeps of the smallest size's time (not the fastest
    # time: under load a larger size can come back faster).
    assert cluster["intra_node_latency_us"] == pytest.approx(statistics.median(
        min(rows_of, key=lambda r: r["bytes"])["time_us"] for rows_of in sweeps.values()), rel=1e-6)
    assert leftovers(log_dir) == []


def test_crashing_rank_is_named_and_nothing_is_left(tmp_path):
    code, report, stderr, seconds, log_dir = run_verify(
        tmp_path, "--checks", "correctness", "--inject-fault", "crash:1:segfault", "--timeout", "120")
    assert code == 1
    assert report["ok"] is False
    crashed = [f for f in report["failures"] if f["rank"] == 1]
    assert crashed and "crash" in crashed[0]["reason"]
    assert crashed[0]["log_tail"]
    assert seconds < 120
    assert leftovers(log_dir) == []


def test_hanging_rank_is_stopped_within_timeout(tmp_path):
    code, report, stderr, seconds, log_dir = run_verify(
        tmp_path, "--checks", "correctness", "--inject-fault", "hang:2", "--timeout", "25")
    assert code == 1
    assert report["ok"] is False
    assert 2 in {f["rank"] for f in report["failures"]}
    # The timeout counts from the launch; stopping and reporting take a few seconds more.
    assert seconds < 25 + 30
    assert leftovers(log_dir) == []


def test_two_nodes_on_loopback(tmp_path):
    # PyNative only: the compiled modes are covered by test_default_layout_passes.
    plot = tmp_path / "bw.svg"
    code, report, stderr, _, log_dir = run_verify(
        tmp_path, "--loopback-nodes", "2", "--checks", "correctness,bandwidth", "--quick", "--mode", "pynative",
        "--plot", str(plot))
    assert code == 0, stderr
    assert report["ok"] is True and report["ranks"] == 4
    assert all(r["passed"] for r in report["correctness"])
    # Two nodes of 2 ranks: tp stays inside a node, cp and the world span both.
    crossing = {r["group"]: r["crosses_nodes"] for r in report["bandwidth"]}
    assert crossing == {"tp": False, "cp=dp-cp": True, "world": True}
    # --plot drew one line per (op, group), the node-crossing ones dashed (tests/test_pictures.py for more).
    import xml.etree.ElementTree as ET

    lines = {g.get("id"): next(g.iter("{http://www.w3.org/2000/svg}path")).get("style")
             for g in ET.parse(plot).getroot().iter() if (g.get("id") or "").startswith("bw-")}
    assert set(lines) == {f"bw-{r['op']}-{r['group']}" for r in report["bandwidth"]}
    assert all(("dasharray" in style) == crossing[key.split("-", 2)[2]] for key, style in lines.items())
    assert report["compute"]["tflops"] > 0
    assert leftovers(log_dir) == []
