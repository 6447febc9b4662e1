"""``msdist verify`` on pipeline layouts without launching: the spec it runs, the sendrecv rows
(slowest pair, node crossing), the summary rows and the summary-first human view."""

from __future__ import annotations

from dataclasses import replace

from mindscience.distributed.topology import Layout, load_layout
from mscli import render
from mscli import verify_report as vr
from mscli.layouts import bundled_layouts


def _names(spec):
    return [c["name"] for c in spec["checks"]]


def test_pp_layout_adds_the_pipeline_checks_and_sendrecv():
    layout = load_layout(bundled_layouts()["cpu-8-pp2"])
    assert layout.pp == 2 and layout.world_size == 8
    spec = vr.build_spec(layout, modes=("pynative", "jit"))
    names = _names(spec)
    for name in ("p2p.ring", "p2p.pipeline", "pipeline.step", "bandwidth.sendrecv"):
        assert name in names
    ring = next(c for c in spec["checks"] if c["name"] == "p2p.ring")["params"]
    assert ring["dtypes"] == ["float32", "bfloat16"] and ring["modes"] == ["pynative", "jit"]
    assert ring["offsets"] == [1, -1]  # both directions
    step = next(c for c in spec["checks"] if c["name"] == "pipeline.step")["params"]
    assert step["schedules"] == ["1f1b"]
    # pp == 1: nothing of it
    plain = _names(vr.build_spec(Layout(world_size=4, tp=2, cp=2)))
    assert not {"p2p.ring", "p2p.pipeline", "pipeline.step", "bandwidth.sendrecv"} & set(plain)


def _sendrecv(group, time_us, nbytes=262144):
    return {"check": "bandwidth", "op": "sendrecv", "group": group, "group_size": 2, "bytes": nbytes,
            "dtype": "float32", "time_us": time_us, "wrong": 0, "composed": True}


def test_sendrecv_rows_name_the_slowest_pair_and_mark_node_crossing():
    layout = replace(Layout(world_size=8, tp=2, pp=2), devices_per_node=4)
    ranks = {r: {"status": "done", "records": []} for r in range(8)}
    ranks[0]["records"] = [_sendrecv("pp:0-4", 100.0), _sendrecv("pp:0-4", 10.0, 1024)]
    ranks[4]["records"] = [_sendrecv("pp:0-4", 120.0)]
    ranks[1]["records"] = [_sendrecv("pp:1-5", 400.0)]
    ranks[5]["records"] = [_sendrecv("pp:1-5", 380.0)]
    report = vr.build_report(layout, ranks, [])
    rows = {(r["group"], r["bytes"]): r for r in report["bandwidth"]}
    row = rows[("pp:0-4", 262144)]
    assert row["time_us"] == 120.0  # the slower end
    assert row["busbw_gbps"] == row["algbw_gbps"] == 262144 / 120e-6 / 1e9
    assert row["crosses_nodes"] is True  # ranks 0 and 4 sit on nodes 0 and 1
    assert row["latency_us"] == 10.0
    slow = report["sendrecv_slowest"]
    assert slow["group"] == "pp:1-5" and slow["time_us"] == 400.0 and slow["crosses_nodes"] is True
    one_node = vr.build_report(Layout(world_size=8, tp=2, pp=2), ranks, [])
    assert one_node["sendrecv_slowest"]["crosses_nodes"] is False


def test_summary_rows_and_the_human_view_lead_with_them(capsys):
    rows = [
        {"check": "mapping.copy_to_all", "group": "tp", "mode": "pynative", "passed": True, "max_error": 0.0},
        {"check": "mapping.gather_from_hidden", "group": "tp", "mode": "jit", "passed": True, "max_error": 0.5},
        {"check": "p2p.ring_shift", "group": "pp", "mode": "jit", "passed": False, "max_error": 3.0,
         "failed_ranks": [1]},
        {"check": "p2p.pipeline", "group": "pp", "mode": "pynative", "passed": True, "max_error": 0.0},
    ]
    summary = vr.summary_rows(rows)
    by = {(s["family"], s["mode"]): s for s in summary}
    assert by[("mapping", "jit")] == {"family": "mapping", "mode": "jit", "passed": 1, "failed": 0,
                                      "max_error": 0.5}
    assert by[("p2p", "jit")]["failed"] == 1 and by[("p2p", "pynative")]["passed"] == 1
    report = {"ok": False, "layout": Layout(world_size=4, tp=2, pp=2).to_dict(), "ranks": 4,
              "duration_s": 1.0, "correctness": rows, "summary": summary, "bandwidth": [],
              "failures": [], "compute": None,
              "sendrecv_slowest": {"group": "pp:0-2", "bytes": 1024, "busbw_gbps": 0.01,
                                   "time_us": 100.0, "crosses_nodes": True}}
    render.render_verify(report)
    out = capsys.readouterr().out
    assert out.index("correctness summary") < out.index("p2p.ring_shift")
    assert "mapping.copy_to_all" not in out  # passed rows only with --verbose
    assert "slowest pipeline neighbour pair: pp:0-2 (crosses nodes)" in out
    render.render_verify(report, verbose=True)
    assert "mapping.copy_to_all" in capsys.readouterr().out
