"""Pipeline schedules as data (pure, no MindSpore): counts, memory bound, bubble, errors,
and ``msdist plan --schedule``."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from typer.testing import CliRunner

from mindscience.distributed.pipeline import schedules as S
from mindscience.distributed.pipeline.plan import embedding_groups, embedding_ranks
from mindscience.distributed.topology import Layout
from mscli.main import app

runner = CliRunner()


def _computes(sched, r):
    return [a for step in sched.steps[r] for a in step if a.kind in ("F", "B")]


@pytest.mark.parametrize("p,m", [(2, 4), (4, 8), (4, 4), (4, 2), (3, 5), (1, 3)])
def test_1f1b_warmup_memory_and_makespan(p, m):
    sched = S.build("1f1b", p, m)
    for i in range(p):
        comp = _computes(sched, i)
        first_b = next(k for k, a in enumerate(comp) if a.kind == "B")
        # warm-up p-i-1 forwards, then the first steady forward, then the first backward
        assert first_b == min(p - i, m)
        assert sum(a.kind == "F" for a in comp) == m and sum(a.kind == "B" for a in comp) == m
        assert sched.peak_in_flight[i] == min(p - i, m)
    # 1F1B's makespan: (m + p - 1) forward+backward slots of 3 units each
    assert sched.makespan == 3 * (m + p - 1)
    assert sched.bubble_ratio == pytest.approx(S.theoretical_bubble(p, m))


@pytest.mark.parametrize("p,m", [(2, 4), (4, 8)])
def test_gpipe_holds_every_microbatch(p, m):
    sched = S.build("gpipe", p, m)
    assert sched.peak_in_flight == [m] * p
    for i in range(p):
        kinds = "".join(a.kind for a in _computes(sched, i))
        assert kinds == "F" * m + "B" * m
    assert sched.makespan == 3 * (m + p - 1)


@pytest.mark.parametrize("m", [8, 16])
def test_interleaved_bubble_matches_narayanan(m):
    p, v = 4, 2
    sched = S.build("interleaved", p, m, v)
    assert sched.bubble_ratio == pytest.approx((p - 1) / (v * m))
    one = S.build("1f1b", p, m)
    assert sched.bubble_fraction < one.bubble_fraction
    for i in range(p):
        comp = _computes(sched, i)
        assert sorted((a.kind, a.microbatch, a.chunk) for a in comp) == sorted(
            (k, j, c) for k in "FB" for j in range(m) for c in range(v))
    # rank 0 warms up 2(p-1) + (v-1)p virtual micro-batches, then one more forward
    assert sched.peak_in_flight[0] == 2 * (p - 1) + (v - 1) * p + 1


def test_every_send_has_its_receive_and_exchanges_pair_up():
    sched = S.build("1f1b", 4, 8)
    sends = sorted((r, a.peer, a.kind[-1], a.microbatch) for r, rank in enumerate(sched.steps)
                   for step in rank for a in step if a.kind.startswith("SEND"))
    recvs = sorted((a.peer, r, a.kind[-1], a.microbatch) for r, rank in enumerate(sched.steps)
                   for step in rank for a in step if a.kind.startswith("RECV"))
    assert sends == recvs and len(sends) == 2 * 8 * 3  # activations and gradients, 3 pairs
    exchanges = [step for rank in sched.steps for step in rank if len(step) == 2]
    assert exchanges  # the steady state's send_forward_recv_backward
    assert all({a.kind[:4] for a in step} == {"SEND", "RECV"} for step in exchanges)


def test_actions_print_and_parse():
    sched = S.build("interleaved", 2, 4, 2)
    acts = sched.actions()
    assert acts[0][0] == "F0"
    assert any(s.startswith("F") and s.endswith(".1") for s in acts[0])
    for rank in acts:
        for step in rank:
            for text in step.split("+"):
                a = S.parse_action(text)
                assert str(a) == text
    with pytest.raises(S.ScheduleError, match="X1"):
        S.parse_action("X1")


def test_a_reordered_list_is_caught_as_a_deadlock():
    sched = S.build("gpipe", 2, 2)
    steps = [list(r) for r in sched.steps]
    # Stage 0 waits for gradient 0 before sending activation 1, which stage 1 needs first.
    i, j = (next(k for k, s in enumerate(steps[0]) if str(s[0]) == name)
            for name in ("SEND_F1", "RECV_B0"))
    steps[0][i], steps[0][j] = steps[0][j], steps[0][i]
    bad = S.Schedule("gpipe", 2, 2, 1, steps)
    with pytest.raises(S.ScheduleError, match="wait|before"):
        S.validate(bad)


def test_missing_compute_is_caught():
    sched = S.build("gpipe", 2, 2)
    steps = [list(r) for r in sched.steps]
    steps[0] = [s for s in steps[0] if str(s[0]) != "B1"]
    with pytest.raises(S.ScheduleError, match="exactly once"):
        S.validate(S.Schedule("gpipe", 2, 2, 1, steps))


@pytest.mark.parametrize("args,match", [
    (("interleaved", 4, 6, 2), "m=6 is not divisible by p=4; use m=8"),
    (("1f1b", 4, 8, 2), "need the interleaved schedule"),
    (("zigzag", 4, 8), "unknown"),
    (("1f1b", 0, 8), "pipeline stages=0"),
    (("gpipe", 2, 0), "microbatches=0"),
])
def test_bad_arguments(args, match):
    with pytest.raises(S.ScheduleError, match=match):
        S.build(*args)


def test_timeline_text_and_dict_contract():
    sched = S.build("1f1b", 2, 4)
    lines = S.format_timeline(sched)
    assert lines[0].startswith("stage 0 | F0 F1 .")
    d = sched.to_dict()
    assert set(d) >= {"schedule", "stages", "microbatches", "virtual_stages", "actions",
                      "timeline", "makespan", "bubble_fraction", "peak_in_flight"}
    assert d["timeline"][1][0] == {"kind": "F", "microbatch": 0, "chunk": 0, "start": 1, "end": 2}
    assert d["bubble_fraction"] == pytest.approx(3 / 15)


def test_embedding_groups_are_first_and_last_stage():
    lay = Layout(world_size=16, tp=2, pp=4)
    groups = embedding_groups(lay)
    assert groups == [[g[0], g[-1]] for g in lay.groups("pp")]
    assert groups[0] == [0, 12]
    assert embedding_groups(Layout(world_size=4, tp=2)) == []
    assert embedding_ranks((3, 7, 11)) == (3, 11) and embedding_ranks((5,)) == (5,)


def test_plan_schedule_cli_json_and_text():
    res = runner.invoke(app, ["plan", "cpu-8-pp2", "--schedule", "1f1b", "--microbatches", "8",
                              "--format", "json"])
    assert res.exit_code == 0, res.output
    data = json.loads(res.stdout)
    assert data["schedule"]["schedule"] == "1f1b" and data["schedule"]["peak_in_flight"] == [2, 1]
    assert data["embedding_groups"] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    text = runner.invoke(app, ["plan", "cpu-8-pp2", "--schedule", "gpipe", "--microbatches", "4"])
    assert text.exit_code == 0
    assert "stage 0 | F0 F1 F2 F3" in text.stdout and "embedding groups" in text.stdout
    bad = runner.invoke(app, ["plan", "cpu-8-pp2", "--schedule", "interleaved", "--microbatches", "3",
                              "--virtual-stages", "2"])
    assert bad.exit_code == 2 and "m=3 is not divisible by p=2" in bad.output


def test_schedules_import_no_mindspore():
    code = ("import sys; from mindscience.distributed.pipeline import build; build('interleaved', 4, 8, 2);"
            "import mindscience.distributed.pipeline.plan;"
            "print(any(m.split('.')[0] == 'mindspore' for m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
