"""Upstream-style user code on 4 msrun ranks: tensor-parallel, Ulysses and all-gather-KV
attention against a dense reference.

``tests/upstream_style/attention_upstream.py`` is written the way upstream mindscience's
own distributed tests are (their import lines, ``Name.apply(x, group)``, the manager
getters, 2-D ``(S*B, H)`` activations). It is launched ONCE, exactly as a user would,
with msrun; each rank writes ``rank_<r>.json``, and every variant is checked here on
every rank. The msrun command, the job's process tracking and the cleanup are the
harness's (``build_msrun_command``, ``MSDIST_HARNESS_JOB``, ``stop_job``).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
import uuid
from types import SimpleNamespace

import pytest

from mindscience.distributed.harness import build_msrun_command, find_free_port, find_msrun, stop_job
from mindscience.distributed.harness.launcher import JOB_ENV
from mindscience.distributed.manager import CommGroupCreator

WORLD_SIZE = 4
TIMEOUT_S = 420  # ~80 s alone on 2 cores; other jobs share the machine
ATOL = 1e-4
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(REPO, "tests", "upstream_style", "attention_upstream.py")

# layout -> (tp, cp); what the script must report for each
LAYOUTS = {"tp4": (4, 1), "tp2": (2, 1), "cp4": (1, 4), "tp2cp2": (2, 2)}
ATTENTION = [("tp_attention", "tp4"), ("tp_attention", "tp2"), ("ulysses", "cp4"),
             ("allgather_kv", "cp4"), ("ulysses", "tp2cp2"), ("allgather_kv", "tp2cp2")]
ATTENTION_VARIANTS = [f"{kind}.{layout}.{mask}" for kind, layout in ATTENTION for mask in ("full", "causal")]
GROUP_VARIANTS = [f"groups.{layout}" for layout in LAYOUTS]
ALL_VARIANTS = GROUP_VARIANTS + ["seed_init.tp4"] + ATTENTION_VARIANTS
ATTENTION_ERRORS = {"output", "grad x", "grad w_qkv.weight", "grad w_qkv.bias", "grad w_o.weight",
                    "grad w_o.bias", "dense output vs numpy"}


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    """Run the script once under msrun on 4 ranks; its exit code, logs and rank results."""
    run_dir = tmp_path_factory.mktemp("upstream_style")
    out_dir, log_dir = run_dir / "results", run_dir / "logs"
    port = find_free_port()
    job_id = uuid.uuid4().hex
    cmd = build_msrun_command(WORLD_SIZE, spec_path=os.devnull, out_dir=str(out_dir), log_dir=str(log_dir),
                              master_port=port, msrun=find_msrun(), script=SCRIPT)
    env = dict(os.environ)
    env.update({
        JOB_ENV: job_id,  # how stop_job finds msrun's workers (each in its own session)
        "PATH": os.pathsep.join([os.path.dirname(sys.executable), env.get("PATH", "")]),
        "PYTHONPATH": os.pathsep.join([REPO, env.get("PYTHONPATH", "")]),
        "PYTHONUNBUFFERED": "1",
    })
    started = time.monotonic()
    with open(run_dir / "msrun.log", "w", encoding="utf-8") as msrun_log:
        proc = subprocess.Popen(cmd, env=env, stdout=msrun_log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)
        try:
            code = proc.wait(timeout=TIMEOUT_S)
        except subprocess.TimeoutExpired:
            code = None
        finally:
            left = stop_job(job_id, [proc])
    wall_s = time.monotonic() - started
    ranks = {}
    for rank in range(WORLD_SIZE):
        path = out_dir / f"rank_{rank}.json"
        ranks[rank] = json.loads(path.read_text()) if path.exists() else None
    return SimpleNamespace(code=code, wall_s=wall_s, ranks=ranks, log_dir=log_dir, left=left,
                           job_id=job_id, master_port=port)


def _log_tail(job, rank=0, chars=3000):
    path = job.log_dir / f"worker_{rank}.log"
    return path.read_text(errors="replace")[-chars:] if path.exists() else f"(no {path})"


def _records(job, variant):
    """{rank: the rank's record of ``variant``} for every rank that wrote one."""
    found = {}
    for rank, state in job.ranks.items():
        for rec in (state or {}).get("records", []):
            if rec["variant"] == variant:
                found[rank] = rec
    return found


@pytest.mark.multiprocess
def test_script_exits_zero_on_every_rank(job, assert_no_leftovers):
    print(f"msrun wall time {job.wall_s:.1f} s")
    assert job.code is not None, f"msrun ran past {TIMEOUT_S} s; rank 0 log:\n{_log_tail(job)}"
    assert job.code == 0, f"msrun exit {job.code}; rank 0 log:\n{_log_tail(job)}"
    for rank, state in job.ranks.items():
        assert state is not None, f"rank {rank} wrote no results:\n{_log_tail(job, rank)}"
        assert state["error"] is None, state["error"]
        assert state["finished"] and state["rank"] == rank and state["world_size"] == WORLD_SIZE
        variants = [r["variant"] for r in state["records"]]
        assert sorted(variants) == sorted(ALL_VARIANTS), variants  # each exactly once
    assert not job.left
    assert_no_leftovers(job)


@pytest.mark.multiprocess
@pytest.mark.parametrize("variant", ATTENTION_VARIANTS)
def test_attention_matches_dense_on_every_rank(job, variant):
    kind, layout, mask = variant.split(".")
    tp, cp = LAYOUTS[layout]
    records = _records(job, variant)
    assert sorted(records) == list(range(WORLD_SIZE)), f"{variant} missing on ranks; log:\n{_log_tail(job)}"
    for rank, rec in records.items():
        errors = rec["errors"]
        assert set(errors) == ATTENTION_ERRORS, (rank, errors)
        assert all(isinstance(e, float) and math.isfinite(e) and e >= 0.0 for e in errors.values()), (rank, errors)
        assert max(errors.values()) <= ATOL, (rank, errors)
        assert rec["passed"] and rec["max_error"] == max(errors.values())
        assert (rec["kind"], rec["tp"], rec["cp"], rec["causal"]) == (kind, tp, cp, mask == "causal")
        # every rank works on its own rows of the (S*B, H) = (16, 32) activations
        assert rec["output_shape"] == [16 // cp, 32]


@pytest.mark.multiprocess
def test_seed_init_gives_the_dense_weights_sliced(job):
    records = _records(job, "seed_init.tp4")
    assert sorted(records) == list(range(WORLD_SIZE))
    for rank, rec in records.items():
        assert len(rec["errors"]) == 4 and max(rec["errors"].values()) == 0.0, (rank, rec["errors"])


@pytest.mark.multiprocess
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_groups_match_comm_group_creator(job, layout):
    tp, cp = LAYOUTS[layout]
    dp = WORLD_SIZE // (tp * cp)
    creator = CommGroupCreator(tp, cp, dp, 1, "tp-cp-dp-pp")
    records = _records(job, f"groups.{layout}")
    assert sorted(records) == list(range(WORLD_SIZE))
    for rank, rec in records.items():
        assert rec["passed"] and rec["problems"] == [], (rank, rec["problems"])
        assert (rec["tp"], rec["cp"], rec["dp"]) == (tp, cp, dp)
        for key in ("tp", "cp", "dp", "dp-cp"):
            (planned,) = [ids for ids in creator.get_group_rank_ids(key) if rank in ids]
            assert rec["members"][key] == planned, (rank, key)
