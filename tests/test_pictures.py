"""The pictures (mscli/pictures.py): device grid, memory per stage, step time, pipeline timeline and
verify's bandwidth curves, read back from the SVG (XML) they write: cells, colours, labels, axes."""

import json
import re
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
from typer.testing import CliRunner

pytest.importorskip("matplotlib")

from mindscience.distributed.topology import Layout  # noqa: E402
from mindscience.distributed.topology.plan import build_plan  # noqa: E402
from mscli import pictures  # noqa: E402
from mscli.layouts import load  # noqa: E402
from mscli.main import app  # noqa: E402

runner = CliRunner()
ROOT = Path(__file__).resolve().parent.parent
NS = "{http://www.w3.org/2000/svg}"


# ------------------------------------------------------------------ reading an SVG back
class Svg:
    def __init__(self, path):
        self.root = ET.parse(path).getroot()
        assert self.root.tag == NS + "svg"
        self.by_id = {g.get("id"): g for g in self.root.iter() if g.get("id")}

    def ids(self, prefix):
        return sorted(i for i in self.by_id if i.startswith(prefix))

    def style(self, gid, key):
        path = next(self.by_id[gid].iter(NS + "path"))
        return dict(part.strip().split(": ", 1) for part in path.get("style").split(";") if ":" in part).get(key)

    def fill(self, gid):
        return self.style(gid, "fill")

    def box(self, gid):
        """(x0, y0, x1, y1) in pixels of the first path under ``gid``."""
        path = next(self.by_id[gid].iter(NS + "path"))
        numbers = [float(v) for v in re.findall(r"-?\d+(?:\.\d+)?(?:e-?\d+)?", path.get("d"))]
        xs, ys = numbers[0::2], numbers[1::2]
        return min(xs), min(ys), max(xs), max(ys)

    def points(self, gid):
        path = next(self.by_id[gid].iter(NS + "path"))
        numbers = [float(v) for v in re.findall(r"-?\d+(?:\.\d+)?(?:e-?\d+)?", path.get("d"))]
        return list(zip(numbers[0::2], numbers[1::2]))

    def text(self, gid=None):
        node = self.root if gid is None else self.by_id[gid]
        return [t.text for t in node.iter(NS + "text") if t.text]

    def all_text(self):
        return "\n".join(self.text())

    def ticks(self, axes_gid, axis):
        """{label: pixel} of the labelled major ticks on the ``axis`` ("x" or "y") of the axes ``axes_gid``."""
        found = {}
        for group in self.by_id[axes_gid].iter(NS + "g"):
            if (group.get("id") or "").startswith(f"{axis}tick_"):
                label = "".join(t.text or "" for t in group.iter(NS + "text"))
                if label:
                    found[label] = float(next(group.iter(NS + "use")).get(axis))
        return found


def plan_of(name, **kwargs):
    spec, _ = load(name)
    return build_plan(spec, [], 200)


def draw_plan(tmp_path, plan, name="plan.svg", **kwargs):
    target = tmp_path / name
    pictures.save_plan(plan, [(str(target), "svg")], **kwargs)
    return Svg(target)


# ------------------------------------------------------------------ the device grid
def test_grid_cells_are_data():
    grid = pictures.grid_cells(plan_of("ascend-64"))
    assert grid["axis"] == "tp"  # order tp-cp-dp-pp, tp=4 > 1
    assert grid["nodes"] == list(range(8)) and grid["columns"] == list(range(8)) and grid["node_gap"] == -1
    assert grid["cells"][(0, 5)] == {"rank": 5, "group": 1, "stage": 0, "crosses": False}
    assert grid["cells"][(4, 0)] == {"rank": 32, "group": 8, "stage": 1, "crosses": False}
    by_pp = pictures.grid_cells(plan_of("ascend-64"), "pp")
    assert by_pp["cells"][(0, 5)] == {"rank": 5, "group": 5, "stage": 0, "crosses": True}  # [5, 37]


@pytest.mark.parametrize("sizes,order,expected", [
    ({"tp": 2, "cp": 2}, "tp-cp-dp-pp", "tp"),
    ({"cp": 2}, "tp-cp-dp-pp", "cp"),
    ({"tp": 2, "pp": 2}, "pp-dp-cp-tp", "pp"),
    ({}, "tp-cp-dp-pp", "dp"),
    ({"tp": 8}, "dp-pp-cp-tp", "tp"),
])
def test_default_colour_axis_is_innermost_above_one(sizes, order, expected):
    plan = build_plan(Layout(world_size=8, order=order, **sizes))
    assert pictures.color_axis(plan) == expected


def test_default_colour_axis_of_one_device():
    assert pictures.color_axis(build_plan(Layout(world_size=1))) == "tp"


def test_device_grid_svg_cells_labels_and_colours(tmp_path):
    plan = plan_of("ascend-64")
    svg = draw_plan(tmp_path, plan)
    assert svg.ids("cell-r") == sorted(f"cell-r{r}" for r in range(64))
    for r in range(64):
        assert svg.text(f"label-r{r}") == [str(r)]
    # One colour per tp group, and the 16 groups drawn all differ.
    colours = [{svg.fill(f"cell-r{r}") for r in members} for members in plan["groups"]["tp"]]
    assert all(len(c) == 1 for c in colours)
    assert len({c.pop() for c in colours}) == 16
    # Cells sit in their node's row, in local-rank order; rank 8 starts the second row.
    x0, y0, _, _ = svg.box("cell-r0")
    x1, _, _, _ = svg.box("cell-r1")
    x8, y8, _, _ = svg.box("cell-r8")
    assert x1 > x0 and x8 == pytest.approx(x0) and y8 > y0
    # Stage bands: nodes 0-3 hold stage 0, nodes 4-7 stage 1 (pp outermost), one band per node.
    bands = svg.ids("band-")
    assert len(bands) == 8
    assert {b for b in bands if b.endswith("-s1")} == {f"band-n{n}-x0-s1" for n in range(4, 8)}
    text = svg.all_text()
    assert "ascend-64: 64 devices = 8 node(s) x 8" in text and "coloured by tp group" in text
    assert "tp 0: 0,1,2,3" in text and "band = pipeline stage" in text
    assert "groups crossing nodes: dp, pp, dp-cp" in text
    assert "node 7" in text and "stage 1" in text
    # No tp group crosses a node: no outlined cell.
    assert {svg.style(f"cell-r{r}", "stroke") for r in range(64)} == {"#ffffff"}


def test_colour_by_pp_outlines_cross_node_groups(tmp_path):
    plan = plan_of("ascend-64")
    svg = draw_plan(tmp_path, plan, color_by="pp")
    assert "coloured by pp group" in svg.all_text() and "pp group crosses nodes" in svg.all_text()
    for members in plan["groups"]["pp"]:  # [r, r + 32]: same colour on node r//8 and node 4 + r//8
        assert svg.fill(f"cell-r{members[0]}") == svg.fill(f"cell-r{members[1]}")
        assert svg.style(f"cell-r{members[0]}", "stroke") == pictures.CROSS_EDGE
    cpu = draw_plan(tmp_path, plan_of("cpu-8-pp2"), "cpu.svg", color_by="pp")
    assert cpu.style("cell-r0", "stroke") == "#ffffff"  # one node: nothing crosses
    assert cpu.fill("cell-r0") == cpu.fill("cell-r4") != cpu.fill("cell-r1")


def test_tp_across_nodes_outlined_and_two_stages_per_row(tmp_path):
    plan = plan_of("ascend-64-tp-across-nodes")
    svg = draw_plan(tmp_path, plan, color_by="tp", highlight=9)
    assert all(svg.style(f"cell-r{r}", "stroke") == pictures.CROSS_EDGE for r in range(64) if r != 9)
    assert svg.style("cell-r9", "stroke") == "#000000" and "rank 9 outlined in black" in svg.all_text()
    # tp group 1 = [1, 17, 33, 49]: one colour down four nodes.
    assert len({svg.fill(f"cell-r{r}") for r in (1, 17, 33, 49)}) == 1
    # Order dp-pp-cp-tp puts pp second: every row holds stage 0 then stage 1.
    assert svg.ids("band-n0-") == ["band-n0-x0-s0", "band-n0-x4-s1"]
    # Default colour axis for this order is dp (innermost above 1).
    assert "coloured by dp group" in draw_plan(tmp_path, plan, "d.svg").all_text()


def test_large_world_draws_first_and_last_nodes(tmp_path):
    plan = json.loads(runner.invoke(app, ["plan", "ascend-65536", "--format", "json"]).stdout)
    svg = draw_plan(tmp_path, plan)
    ranks = sorted(int(i[6:]) for i in svg.ids("cell-r"))
    assert ranks == list(range(64)) + list(range(65536 - 64, 65536))
    text = svg.all_text()
    assert "4088 nodes not drawn (nodes 4-4091, 65408 devices)" in text
    assert "8 of 4096 nodes drawn (first and last 4)" in text
    assert "node 4095" in text and "node 4091" not in text
    # The drawn groups get distinct colours although the world has 8192 tp groups.
    assert len({svg.fill(f"cell-r{r}") for r in range(0, 64, 8)} | {svg.fill(f"cell-r{r}")
                                                                      for r in range(65472, 65536, 8)}) == 16
    assert "+8176 more tp groups" in text


def test_colour_by_cp_gives_each_of_32_groups_its_own_colour(tmp_path):
    plan = plan_of("ascend-64")
    svg = draw_plan(tmp_path, plan, color_by="cp")
    groups = plan["groups"]["cp"]  # [0, 4], [1, 5], ..., [59, 63]: 32 groups, all drawn
    colours = [{svg.fill(f"cell-r{r}") for r in members} for members in groups]
    assert len(groups) == 32 and all(len(c) == 1 for c in colours)
    assert len({c.pop() for c in colours}) == 32  # nodes 5-7 no longer repeat the colours of nodes 0-2
    assert "share one" not in svg.all_text()


def test_more_groups_than_colours_repeat_them_and_say_so(tmp_path):
    plan = build_plan(Layout(world_size=256, tp=2, devices_per_node=16))  # 128 tp groups, all drawn
    svg = draw_plan(tmp_path, plan)
    n = len(pictures.palette())
    fills = [svg.fill(f"cell-r{2 * g}") for g in range(128)]
    assert [svg.fill(f"cell-r{2 * g + 1}") for g in range(128)] == fills  # one colour per group
    assert n == 56 and len(set(fills[:n])) == n  # the first 56 groups all differ
    assert all(fills[g] == fills[g - n] for g in range(n, 128))  # then the colours repeat, 56 groups apart
    assert f"128 tp groups drawn with {n} colours: groups {n} apart share one" in svg.all_text()


def test_wide_node_elides_columns(tmp_path):
    plan = build_plan(Layout(world_size=256, tp=8, devices_per_node=128))
    grid = pictures.grid_cells(plan)
    assert grid["columns"] == list(range(16)) + list(range(112, 128)) and grid["column_gap"] == 16
    svg = draw_plan(tmp_path, plan)
    assert len(svg.ids("cell-r")) == 64 and "cell-r127" in svg.by_id and "cell-r64" not in svg.by_id
    assert "... 96 ..." in svg.all_text()


# ------------------------------------------------------------------ memory and step time
GIB = 1024**3


def memory_data(device_gib=64):
    def stage(i, weights, activations):
        return {"stage": i, "layers": 2, "parameters": 1, "weights_bytes": weights * GIB,
                "gradients_bytes": 2 * weights * GIB, "optimizer_bytes": 6 * weights * GIB,
                "activations_bytes": activations * GIB, "communicator_bytes": 1 * GIB, "microbatches_in_flight": 2,
                "total_bytes": (9 * weights + activations + 1) * GIB}
    return {"stages": [stage(0, 4, 10), stage(1, 8, 5)], "peak_bytes": 78 * GIB,
            "device_memory_bytes": device_gib * GIB, "fits": False}


def test_memory_chart_bars_device_line_and_over_marks(tmp_path):
    plan = {**build_plan(Layout(world_size=8, tp=4, pp=2)), "memory": memory_data()}
    svg = draw_plan(tmp_path, plan)
    parts = ("weights", "gradients", "optimizer", "activations", "communicators")
    for s in (0, 1):
        assert [f"mem-s{s}-{p}" for p in parts if f"mem-s{s}-{p}" in svg.by_id] == [f"mem-s{s}-{p}" for p in parts]
    height = {(s, p): svg.box(f"mem-s{s}-{p}")[3] - svg.box(f"mem-s{s}-{p}")[1] for s in (0, 1) for p in parts}
    unit = height[(0, "weights")] / 4  # pixels per GiB
    assert height[(0, "optimizer")] == pytest.approx(24 * unit, rel=1e-3)
    assert height[(1, "weights")] == pytest.approx(8 * unit, rel=1e-3)
    assert height[(1, "activations")] == pytest.approx(5 * unit, rel=1e-3)
    # Stacked: stage 0's gradients start where its weights end.
    assert svg.box("mem-s0-gradients")[3] == pytest.approx(svg.box("mem-s0-weights")[1], abs=0.01)
    # Stage 0 totals 47 GiB (under 64), stage 1 totals 78 GiB: only stage 1 is marked over.
    device_y = svg.points("mem-device")[0][1]
    assert svg.box("mem-s0-communicators")[1] > device_y > svg.box("mem-s1-communicators")[1]
    assert "mem-over-s1" in svg.by_id and "mem-over-s0" not in svg.by_id
    text = svg.all_text()
    assert "over by" in text and "14 GiB" in text and "device memory 64 GiB" in text
    assert "memory per stage: 1 of 2 over" in text and "GiB per device" in text
    assert not svg.ids("time-")  # no "time" data, no step-time bar


@pytest.mark.parametrize("device_gib", [64, 100])
def test_memory_chart_y_range_covers_the_device_line_and_the_tallest_bar(tmp_path, device_gib):
    plan = {**build_plan(Layout(world_size=8, tp=4, pp=2)), "memory": memory_data(device_gib)}
    svg = draw_plan(tmp_path, plan)
    _, top, _, bottom = svg.box("axes-memory")  # the chart's frame, in pixels (y grows downwards)
    ticks = {float(label): y for label, y in svg.ticks("axes-memory", "y").items()}
    assert min(ticks) == 0 and ticks[0] == pytest.approx(bottom, abs=0.01)  # the y axis starts at 0 GiB
    per_gib = (ticks[0] - ticks[max(ticks)]) / max(ticks)
    assert (bottom - top) / per_gib >= max(78, device_gib)  # the frame reaches above the line and the bars
    device_y, tallest_y = svg.points("mem-device")[0][1], svg.box("mem-s1-communicators")[1]  # stage 1: 78 GiB
    assert (bottom - device_y) / per_gib == pytest.approx(device_gib, rel=1e-3)
    assert (bottom - tallest_y) / per_gib == pytest.approx(78, rel=1e-3)
    assert top < min(device_y, tallest_y)
    assert svg.box("mem-s0-weights")[3] == pytest.approx(bottom, abs=0.01)  # bars stand on 0


def test_step_time_bar(tmp_path):
    time = {"step_time_s": 10.0, "tokens_per_s": 5000.0, "mfu": 0.41,
            "breakdown": {"compute_s": 6.0, "bubble_s": 1.0, "tp_s": 2.0, "cp_s": 0.0, "pp_s": 0.5, "dp_s": 0.5}}
    plan = {**build_plan(Layout(world_size=8, tp=4, pp=2)), "memory": memory_data(), "time": time}
    svg = draw_plan(tmp_path, plan)
    assert svg.ids("time-") == sorted(["time-compute", "time-bubble", "time-tp", "time-pp", "time-dp"])
    h = {k: svg.box(f"time-{k}")[3] - svg.box(f"time-{k}")[1] for k in ("compute", "bubble", "tp", "pp", "dp")}
    assert h["compute"] == pytest.approx(6 * h["bubble"], rel=1e-3) and h["tp"] == pytest.approx(4 * h["pp"], rel=1e-3)
    text = svg.all_text()
    assert "step 10 s" in text and "MFU 41%" in text and "compute 6 s" in text


# ------------------------------------------------------------------ pipeline timeline
def gpipe_schedule(p=2, m=3):
    # GPipe as data: all forwards (1 unit) then all backwards (2 units), stage s delayed by s.
    timeline = []
    for s in range(p):
        row = [{"kind": "F", "microbatch": j, "chunk": 0, "start": s + j, "end": s + j + 1} for j in range(m)]
        b0 = p + m - 1 + 2 * (p - 1 - s)
        row += [{"kind": "B", "microbatch": j, "chunk": 0, "start": b0 + 2 * j, "end": b0 + 2 * j + 2}
                for j in range(m)]
        timeline.append(row)
    makespan = timeline[0][-1]["end"]
    return {"schedule": "gpipe", "stages": p, "microbatches": m, "virtual_stages": 1,
            "actions": [[f"F{j}" for j in range(m)] + [f"B{j}" for j in range(m)] for _ in range(p)],
            "timeline": timeline, "makespan": makespan,
            "bubble_fraction": 1 - 3 * m / makespan, "peak_in_flight": [m] * p}


def test_schedule_timeline_blocks(tmp_path):
    schedule = gpipe_schedule()
    plan = {**build_plan(Layout(world_size=8, tp=4, pp=2)), "schedule": schedule}
    svg = draw_plan(tmp_path, plan)
    blocks = svg.ids("sched-")
    assert len(blocks) == 12 and "sched-s1-B2-c0" in blocks
    f0, b0 = svg.box("sched-s0-F0-c0"), svg.box("sched-s0-B0-c0")
    assert (b0[2] - b0[0]) == pytest.approx(2 * (f0[2] - f0[0]), rel=1e-3)  # a backward lasts 2 units
    # Stage 1 starts one unit later; its row is below stage 0's.
    f1 = svg.box("sched-s1-F0-c0")
    assert f1[0] == pytest.approx(f0[2], abs=0.01) and f1[1] > f0[1]
    assert svg.fill("sched-s0-F0-c0") != svg.fill("sched-s0-B0-c0")
    text = svg.all_text()
    assert "gpipe schedule: 2 stages x 3 microbatches, makespan 12" in text
    assert f"bubble {100 * schedule['bubble_fraction']:.1f}%" in text and "stage 1" in text


def test_schedule_numbers_every_block_or_none(tmp_path):
    short, long = tmp_path / "short.svg", tmp_path / "long.svg"
    for target, m in ((short, "4"), (long, "40")):
        result = runner.invoke(app, ["plan", "cpu-8-pp2", "--schedule", "1f1b", "--microbatches", m,
                                     "--svg", str(target)])
        assert result.exit_code == 0, result.output
    svg = Svg(short)
    blocks, labels = svg.ids("sched-"), svg.ids("schedlabel-")
    assert len(blocks) == 16 and {label.replace("schedlabel-", "sched-") for label in labels} == set(blocks)
    for label in labels:  # schedlabel-s1-F3-c0 reads 3
        assert svg.text(label) == [re.match(r"schedlabel-s\d+-[FB](\d+)-c\d+", label).group(1)]
    assert "forward (number = microbatch)" in svg.all_text()
    # 40 micro-batches: a forward block is too narrow for "39", so no block is numbered, backwards included.
    svg = Svg(long)
    assert len(svg.ids("sched-")) == 2 * 2 * 40 and svg.ids("schedlabel-") == []
    assert "blocks too narrow to number by microbatch" in svg.all_text()
    assert "forward (number = microbatch)" not in svg.all_text()


def test_schedule_numbering_rule_uses_the_narrowest_block():
    schedule = gpipe_schedule(p=2, m=12)  # forwards 1 unit, backwards 2, makespan 39
    timeline, makespan = schedule["timeline"], schedule["makespan"]
    # 8 in wide: (8 - 2.8) * 72 / 39 = 9.6 pt per unit; "11" at 6 pt needs 0.64 * 6 * 2 + 1 = 8.68 pt.
    assert pictures.schedule_numbered(timeline, makespan, 8.0)
    # 6 in: 5.9 pt per unit: a backward (11.8 pt) would hold "11", a forward not, so neither is numbered.
    assert not pictures.schedule_numbered(timeline, makespan, 6.0)


def test_plan_schedule_svg_draws_the_simulated_timeline(tmp_path):
    target = tmp_path / "s.svg"
    result = runner.invoke(app, ["plan", "cpu-8-pp2", "--schedule", "1f1b", "--microbatches", "4",
                                 "--format", "json", "--svg", str(target)])
    assert result.exit_code == 0, result.output
    schedule = json.loads(result.stdout)["schedule"]
    svg = Svg(target)
    expected = sorted(f"sched-s{s}-{b['kind']}{b['microbatch']}-c{b['chunk']}"
                      for s, row in enumerate(schedule["timeline"]) for b in row)
    assert svg.ids("sched-") == expected and len(expected) == 2 * 2 * 4
    # Block widths and starts follow the simulation's times (pixels per unit from stage 0's F0).
    f0 = svg.box("sched-s0-F0-c0")
    unit = f0[2] - f0[0]
    for s, row in enumerate(schedule["timeline"]):
        for b in row:
            x0, _, x1, _ = svg.box(f"sched-s{s}-{b['kind']}{b['microbatch']}-c{b['chunk']}")
            assert (x1 - x0) == pytest.approx((b["end"] - b["start"]) * unit, rel=1e-3)
            assert x0 - f0[0] == pytest.approx(b["start"] * unit, abs=0.05)
    assert f"1f1b schedule: 2 stages x 4 microbatches, makespan {schedule['makespan']:g}" in svg.all_text()


# ------------------------------------------------------------------ verify bandwidth
def bw_row(op, group, n, size, busbw, **extra):
    return {"op": op, "group": group, "group_size": n, "bytes": size, "dtype": "float32", "time_us": 1.0,
            "algbw_gbps": busbw, "busbw_gbps": busbw, "wrong": 0, "composed": False, **extra}


def report_data():
    rows = [bw_row("all_reduce", "tp", 2, s, b) for s, b in ((1024, 0.1), (4096, 0.3), (16384, 0.9))]
    rows += [bw_row("all_gather", "dp-cp", 4, s, b, crosses_nodes=True) for s, b in ((1024, 0.05), (16384, 0.4))]
    rows += [bw_row("all_reduce", "pp", 1, 1024, 0.0)]  # a group of one: no line
    return {"ok": True, "layout": {"name": "cpu-4", "backend": "cpu", "tp": 2, "cp": 2, "dp": 1, "pp": 1,
                                   "order": "tp-cp-dp-pp"}, "ranks": 4, "bandwidth": rows, "correctness": [],
            "failures": []}


def test_bandwidth_series_and_svg(tmp_path):
    report = report_data()
    series = pictures.bandwidth_series(report)
    assert [(s["op"], s["group"], s["dashed"]) for s in series] == [("all_reduce", "tp", False),
                                                                      ("all_gather", "dp-cp", True)]
    target = tmp_path / "bw.svg"
    pictures.save_bandwidth(report, str(target))
    svg = Svg(target)
    assert svg.ids("bw-") == ["bw-all_gather-dp-cp", "bw-all_reduce-tp"]
    tp = svg.points("bw-all_reduce-tp")
    assert len(tp) == 3
    # log-2 x axis: 1K -> 4K -> 16K are equal steps; y is linear from 0.
    assert tp[1][0] - tp[0][0] == pytest.approx(tp[2][0] - tp[1][0], rel=1e-3)
    assert (tp[0][1] - tp[1][1]) / (tp[1][1] - tp[2][1]) == pytest.approx(0.2 / 0.6, rel=1e-2)
    dp = svg.points("bw-all_gather-dp-cp")
    assert dp[0][0] == pytest.approx(tp[0][0]) and dp[1][0] == pytest.approx(tp[2][0])
    assert svg.style("bw-all_gather-dp-cp", "stroke-dasharray") is not None
    assert svg.style("bw-all_reduce-tp", "stroke-dasharray") is None
    text = svg.all_text()
    for label in ("1K", "4K", "16K", "bus bandwidth (GB/s)", "message size (bytes, log2)",
                  "all_reduce tp (n=2)", "all_gather dp-cp (n=4) inter-node", "msdist verify cpu-4"):
        assert label in text, label
    assert "all_reduce pp" not in text


def test_bandwidth_axes_cover_every_size_and_start_at_zero(tmp_path):
    target = tmp_path / "bw.svg"
    pictures.save_bandwidth(report_data(), str(target))
    svg = Svg(target)
    left, top, right, bottom = svg.box("axes-bandwidth")
    xs = svg.ticks("axes-bandwidth", "x")
    assert list(xs) == ["1K", "4K", "16K"]  # a labelled tick at every size, the smallest and the largest
    assert left < xs["1K"] < xs["4K"] < xs["16K"] < right  # all inside the frame
    assert xs["16K"] - xs["1K"] == pytest.approx(2 * (xs["4K"] - xs["1K"]), rel=1e-3)  # log 2: 4 doublings vs 2
    tp = svg.points("bw-all_reduce-tp")
    assert tp[0][0] == pytest.approx(xs["1K"], abs=0.01) and tp[-1][0] == pytest.approx(xs["16K"], abs=0.01)
    ys = {float(label): y for label, y in svg.ticks("axes-bandwidth", "y").items()}
    assert min(ys) == 0 and ys[0] == pytest.approx(bottom, abs=0.01)  # y starts at 0 at the frame's bottom
    per_gbps = (ys[0] - ys[max(ys)]) / max(ys)
    assert (bottom - top) / per_gbps >= 0.9  # and reaches the fastest point, 0.9 GB/s
    assert tp[-1][1] == pytest.approx(bottom - 0.9 * per_gbps, abs=0.01)


def test_png_is_written(tmp_path):
    target = tmp_path / "bw.png"
    pictures.save_bandwidth(report_data(), str(target))
    assert target.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# ------------------------------------------------------------------ the commands
def test_plan_svg_and_png_from_the_command(tmp_path):
    svg_path, png_path = tmp_path / "g.svg", tmp_path / "g.png"
    result = runner.invoke(app, ["plan", "ascend-64", "--format", "json", "--svg", str(svg_path),
                                 "--png", str(png_path), "--color-by", "dp"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)  # stdout stays JSON
    svg = Svg(svg_path)
    assert len(svg.ids("cell-r")) == 64 and "coloured by dp group" in svg.all_text()
    for members in data["groups"]["dp"]:
        assert len({svg.fill(f"cell-r{r}") for r in members}) == 1
    assert png_path.read_bytes()[:4] == b"\x89PNG"


def test_plan_rank_svg_draws_the_world_with_the_rank_outlined(tmp_path):
    target = tmp_path / "r.svg"
    result = runner.invoke(app, ["plan", "cpu-8-pp2", "--rank", "5", "--svg", str(target)])
    assert result.exit_code == 0, result.output
    svg = Svg(target)
    assert len(svg.ids("cell-r")) == 8 and svg.style("cell-r5", "stroke") == "#000000"


def test_plan_model_svg_matches_the_estimate(tmp_path):
    target = tmp_path / "m.svg"
    result = runner.invoke(app, ["plan", "ascend-64", "--model", "gpt3-175b", "--format", "json",
                                 "--svg", str(target)])
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    svg = Svg(target)
    stages = data["memory"]["stages"]
    assert {i for i in svg.ids("mem-s") if i.endswith("-weights")} == {f"mem-s{s['stage']}-weights" for s in stages}
    device = data["memory"]["device_memory_bytes"]
    over = {f"mem-over-s{s['stage']}" for s in stages if s["total_bytes"] > device}
    assert set(svg.ids("mem-over-")) == over and over  # gpt3-175b on 64 devices does not fit
    assert bool(svg.ids("time-")) == ("time" in data)


def test_verify_plot_from_a_saved_report(tmp_path):
    saved, target = tmp_path / "report.json", tmp_path / "bw.svg"
    saved.write_text(json.dumps(report_data()))
    result = runner.invoke(app, ["verify", "--from-report", str(saved), "--plot", str(target), "--format", "json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout) == report_data()  # the report unchanged
    assert Svg(target).ids("bw-") == ["bw-all_gather-dp-cp", "bw-all_reduce-tp"]


def test_verify_plot_after_a_launch(tmp_path, monkeypatch):
    import mindscience.distributed.harness as harness
    from mindscience.distributed.harness import LaunchResult

    def record(rank, size, us):
        return {"check": "bandwidth", "op": "all_reduce", "group": "tp", "group_size": 2, "bytes": size,
                "dtype": "float32", "time_us": us, "wrong": 0, "composed": False, "passed": True, "rank": rank}

    ranks = {r: {"rank": r, "status": "done", "records": [record(r, 1024, 50.0), record(r, 4096, 80.0 + r)]}
             for r in range(4)}

    def fake_launch(spec, world_size, *args, **kwargs):
        return LaunchResult(ok=True, returncode=0, timed_out=False, duration_s=1.0, ranks=ranks, failures=[],
                            log_dir="/tmp/x", command=["msrun"])

    monkeypatch.setattr(harness, "launch", fake_launch)
    plain = runner.invoke(app, ["verify", "--format", "json", "--checks", "bandwidth"])
    target = tmp_path / "bw.svg"
    plotted = runner.invoke(app, ["verify", "--format", "json", "--checks", "bandwidth", "--plot", str(target)])
    assert plotted.exit_code == 0, plotted.output
    assert json.loads(plotted.stdout) == json.loads(plain.stdout)  # the report is unchanged by --plot
    svg = Svg(target)
    (x0, y0), (x1, y1) = svg.points("bw-all_reduce-tp")
    assert x1 > x0 and y1 < y0  # 4 KiB in 83 us beats 1 KiB in 50 us (slowest rank)
    assert "note-one-size" not in svg.by_id
    # A --quick report has one size: the picture says how to get curves.
    quick = report_data()
    quick["bandwidth"] = [r for r in quick["bandwidth"] if r["bytes"] == 1024]
    pictures.save_bandwidth(quick, str(tmp_path / "q.svg"))
    assert "note-one-size" in Svg(tmp_path / "q.svg").by_id


def one_line_error(result, *fragments):
    assert result.exit_code == 2, result.output
    assert result.stdout == ""
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("msdist: error: ") and "Traceback" not in result.stderr
    for fragment in fragments:
        assert fragment in lines[0], lines[0]


@pytest.mark.parametrize("args,fragments", [
    (["plan", "--color-by", "xp", "--svg", "x.svg"], ["--color-by 'xp' is invalid", "tp, cp, dp, pp"]),
    (["plan", "--color-by", "tp"], ["add --svg FILE or --png FILE"]),
    (["verify", "--plot", "bw.pdf"], ["ending in .svg or .png"]),
    (["verify", "--plot", "/no/such/dir/bw.svg"], ["does not exist"]),
    (["verify", "--from-report", "/no/such/report.json"], ["cannot read it as JSON"]),
])
def test_picture_option_errors_are_one_line(args, fragments, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    one_line_error(runner.invoke(app, args), *fragments)


def test_not_a_report(tmp_path):
    bad = tmp_path / "r.json"
    bad.write_text("[1, 2]")
    one_line_error(runner.invoke(app, ["verify", "--from-report", str(bad)]), "not a msdist verify report")


@pytest.mark.parametrize("args", [["plan", "--svg", "p.svg"], ["plan", "--png", "p.png"],
                                  ["verify", "--plot", "bw.svg"]])
def test_without_matplotlib_the_flag_says_how_to_get_it(args, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    result = runner.invoke(app, args)
    one_line_error(result, 'pip install -e ".[plots]"', "matplotlib")
    assert not list(tmp_path.iterdir())


def test_plain_plan_imports_neither_matplotlib_nor_mindspore(tmp_path):
    code = ("import sys\nfrom mscli.main import app\n"
            "try:\n    app(['plan', 'ascend-64', '--model', 'gqa-7b'])\nexcept SystemExit as e:\n    assert not e.code\n"
            "print(sorted({m.split('.')[0] for m in sys.modules} & {'matplotlib', 'mindspore'}))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "[]"
    picture = ("import sys\nfrom mscli.main import app\n"
               "try:\n    app(['plan', 'cpu-8-pp2', '--svg', sys.argv[1]])\nexcept SystemExit as e:\n"
               "    assert not e.code\nprint('mindspore' in sys.modules, 'matplotlib' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", picture, str(tmp_path / "p.svg")], capture_output=True, text=True,
                         timeout=60, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "False True"
