"""The examples in examples/: single-process runs, the shared 4-rank job, and one msrun
launch of a script exactly as its docstring says to run it."""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
import uuid

import numpy as np
import pytest

import _layers_job
from _examples_checks import examples_dir
from mindscience.distributed.group import ParallelGroup
from mindscience.distributed.harness import find_free_port, find_msrun, stop_job

EXAMPLES = ("tp_mlp", "attention_tp", "attention_ulysses", "attention_cp_allgather")


def _load(name):
    folder = examples_dir()
    if folder not in sys.path:
        sys.path.insert(0, folder)
    return importlib.import_module(name)


# --------------------------------------------------------------------------- one process
@pytest.mark.parametrize("name", EXAMPLES)
def test_example_runs_in_a_plain_process(name, capsys):
    assert "MS_ROLE" not in os.environ
    assert _load(name).main([]) == 0
    assert "PASSED on all ranks" in capsys.readouterr().out


def test_sequence_parallel_mlp_in_a_plain_process():
    record = _load("tp_mlp").run(sequence_parallel=True, steps=3)
    assert record["passed"], record
    assert record["parallel_losses"] == record["dense_losses"]


@pytest.mark.parametrize("name", ["attention_ulysses", "attention_cp_allgather"])
def test_cp_example_command_line_takes_seq_len(name, capsys):
    assert _load(name).main(["--seq-len", "13", "--batch", "1"]) == 0
    assert "PASSED on all ranks" in capsys.readouterr().out
    with pytest.raises(SystemExit) as info:
        _load(name).main(["--seq-len", "0"])
    assert info.value.code == 2
    assert "--seq-len 0 is invalid" in capsys.readouterr().err


@pytest.mark.parametrize("name,argv", [
    ("train_transformer", ["--steps", "2", "--mode", "pynative"]),
    ("train_pipeline", ["--steps", "2", "--mode", "pynative", "--schedules", "1f1b"]),
])
def test_gpt_example_command_line_in_a_plain_process(name, argv, capsys):
    """The GPTModel examples' command line in one process (the dense model against itself;
    their layouts run in tests/test_mappings.py's 8-rank job)."""
    assert _load(name).main(argv) == 0
    out = capsys.readouterr().out
    assert f"examples.{name}: PASSED on all ranks" in out and "tp1 x cp1 x dp1 x pp1" in out


def test_uneven_sequence_shards_partition_the_sequence():
    common = _load("_common")
    seq = np.arange(1003)
    shards = []
    for rank in range(4):
        group = ParallelGroup(key="cp", ranks=(0, 1, 2, 3), rank=rank, backend_name="unused")
        sizes = common.sequence_split(1003, group)
        assert sizes == [251, 251, 251, 250]
        shards.append(common.rows(seq, group, sizes))
        assert common.sequence_split(1004, group) is None  # divisible: the even path
    assert [len(s) for s in shards] == [251, 251, 251, 250]
    np.testing.assert_array_equal(np.concatenate(shards), seq)


def test_report_exit_code_on_mismatch(capsys):
    common = _load("_common")
    record = common.result("examples.fake", {"output": 1.0, "grad x": 0.0})
    assert not record["passed"]
    assert common.report(record) == 1
    out = capsys.readouterr().out
    assert "MISMATCH" in out and "FAILED" in out


# --------------------------------------------------------------------------- 4 ranks
@pytest.fixture(scope="module")
def job():
    result = _layers_job.run_job()
    assert result.ok, _layers_job.describe_failures(result)
    return result


@pytest.mark.multiprocess
@pytest.mark.parametrize("name,runs", [("tp_mlp", 2), ("attention_tp", 1), ("attention_ulysses", 2),
                                       ("attention_cp_allgather", 2)])
def test_example_on_4_ranks_matches_dense(job, name, runs):
    records = _layers_job.records_of(job, f"examples.{name}")
    assert len(records) == runs * _layers_job.WORLD_SIZE
    failed = [r for r in records if not r["passed"]]
    assert not failed, failed
    assert max(r["max_error"] for r in records) <= 1e-4


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", ["attention_ulysses", "attention_cp_allgather"])
def test_attention_on_an_uneven_sequence_matches_dense(job, name):
    """S = 1,003 over cp = 4: shards [251, 251, 251, 250] (split_sizes= to the mappings;
    the all-gather-KV causal mask at the uneven offsets), forward and backward equal to
    dense attention on every rank."""
    records = [r for r in _layers_job.records_of(job, f"examples.{name}") if r.get("split_sizes")]
    assert sorted(r["rank"] for r in records) == list(range(_layers_job.WORLD_SIZE))
    for r in records:
        assert r["passed"], r
        assert r["cp"] == 4 and r["seq_len"] == _layers_job.UNEVEN_SEQ_LEN == 1003
        assert r["split_sizes"] == [251, 251, 251, 250]
        assert "seq_len=1003" in r["case"]
        assert {"output", "grad x", "grad qkv.weight", "grad qkv.bias", "grad proj.weight",
                "grad proj.bias"} <= set(r["errors"])
        assert max(r["errors"].values()) == r["max_error"] <= 1e-4
    # the even runs (tp=2 x cp=2, S = 8) carry no split
    even = [r for r in _layers_job.records_of(job, f"examples.{name}") if not r.get("split_sizes")]
    assert len(even) == _layers_job.WORLD_SIZE and all(r["cp"] == 2 for r in even)


@pytest.mark.multiprocess
def test_mlp_loss_curves_equal_on_4_ranks(job):
    for record in _layers_job.records_of(job, "examples.tp_mlp"):
        assert record["tp"] == 2
        dense, par = record["dense_losses"], record["parallel_losses"]
        assert len(dense) == 5 and dense[-1] < dense[0]
        assert max(abs(p - d) / d for p, d in zip(par, dense)) <= 1e-5


@pytest.mark.multiprocess
def test_example_script_under_msrun(tmp_path):
    """``msrun ... examples/tp_mlp.py --sequence-parallel`` on 2 ranks: exit 0, verdict printed."""
    port = find_free_port()
    job_id = uuid.uuid4().hex
    log_dir = tmp_path / "logs"
    cmd = [find_msrun(), "--worker_num=2", "--local_worker_num=2", f"--master_port={port}",
           f"--log_dir={log_dir}", "--join=True",
           os.path.join(examples_dir(), "tp_mlp.py"), "--sequence-parallel"]
    env = dict(os.environ, MSDIST_HARNESS_JOB=job_id,
               PATH=os.pathsep.join([os.path.dirname(sys.executable), os.environ.get("PATH", "")]))
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            stdin=subprocess.DEVNULL)
    try:
        code = proc.wait(timeout=150)
    finally:
        stop_job(job_id, [proc])  # msrun's workers run in their own sessions
    log = (log_dir / "worker_0.log").read_text(errors="replace")
    assert code == 0, log[-3000:]
    assert "examples.tp_mlp: PASSED on all ranks" in log
    assert "sequence_parallel: True" in log and "tp: 2" in log
