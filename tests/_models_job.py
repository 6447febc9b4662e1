"""The ONE 4-rank msrun job of test_models.py (a launch costs 15-25 s before any check).

The checks live next to the tests (tests/_models_checks.py), imported by the workers
through ``spec["modules"]`` with tests/ on their PYTHONPATH. Cases are grouped by layout
so the parallel groups are re-created only when it changes. Every feature meets
PyNative, and each of ring attention, grouped-query attention with RoPE and SwiGLU,
1F1B and the unequal stages also meets ``mode="jit"`` once (compiling costs seconds per
graph on 2 cores). tp2 x pp2 x dp2 runs at 8 ranks (SPEC_8), in the session's 8-rank
launch with tests/test_mappings.py's checks when both files run (``_jobs.py``).
"""

from __future__ import annotations

import os

import _jobs

WORLD_SIZE = 4
# Measured 2026-12-05 on the shared 2-core machine under a load average of 20-30 (other
# engineers' jobs): 447 s launch to finish (pytest 472 s); the jit cases dominate (ring
# 117 s, 1F1B 98 s, unequal 61 s a case, mostly compiling), PyNative cases 19-37 s with
# the dense reference. Earlier under load 50-70: ~330 s for the pipeline groups alone.
TIMEOUT_S = 1500
HERE = os.path.dirname(os.path.abspath(__file__))

GPT, LLAMA = "tiny-gpt", "tiny-llama"


def _case(name, preset, mode="pynative", microbatches=1, schedule=None, **config):
    return {"name": name, "preset": preset, "mode": mode, "microbatches": microbatches,
            "schedule": schedule, "config": config}


def _parity(layout, *cases):
    return {"name": "models.parity", "params": {"layout": layout, "cases": list(cases)}}


SPEC = {
    "modules": ["_models_checks"],
    "layout": {"world_size": WORLD_SIZE},
    "checks": [
        # tp2 x cp2, sequence parallel: every context-parallel method
        _parity({"tp": 2, "cp": 2},
                _case("ring", GPT, "jit", microbatches=2, context_parallel_method="ring"),
                _case("ulysses", GPT, context_parallel_method="ulysses"),
                _case("allgather_kv", LLAMA, context_parallel_method="allgather_kv",
                      recompute="selective"),
                _case("ring_gqa_rope", LLAMA, context_parallel_method="ring")),
        {"name": "models.errors", "params": {"layout": {"tp": 2, "cp": 2}}},
        # tp2 x pp2: 1F1B, untied head (SwiGLU, RMSNorm, RoPE, GQA)
        _parity({"tp": 2, "pp": 2},
                _case("1f1b_tp", LLAMA, "jit", microbatches=2, num_layers=4)),
        # pp2 x dp2: interleaved (v = 2) with the tied embedding and selective recompute
        # (the attention cores recomputed inside kept stage forwards); 5 layers cut 2 + 3
        _parity({"tp": 1, "pp": 2},
                _case("interleaved", GPT, microbatches=2, num_layers=4, virtual_pipeline_stages=2,
                      recompute="selective"),
                _case("unequal", GPT, "jit", microbatches=2, num_layers=5, first_stage_layers=2)),
        # tp2 x dp2, sequence parallel, full recompute
        _parity({"tp": 2},
                _case("sequence_parallel", GPT, microbatches=2, recompute="full")),
        # tp2 x dp2, dropout: the tracker's streams, full recompute replays the masks
        {"name": "models.dropout", "params": {"layout": {"tp": 2}}},
    ],
}


# tp2 x pp2 (1F1B) x dp2, the tied embedding (its gradient summed over the embedding group,
# then averaged over dp): PyNative (ms.jit meets the pipeline in the 4-rank 1f1b_tp case),
# full recompute (each layer recomputed inside the kept stage forwards).
WORLD_SIZE_8 = 8
TIMEOUT_8_S = 300
SPEC_8 = {
    "modules": ["_models_checks"],
    "layout": {"world_size": WORLD_SIZE_8},
    "checks": [_parity({"tp": 2, "pp": 2},
                       _case("1f1b_tp_dp", GPT, microbatches=2, schedule="1f1b",
                             recompute="full"))],
}

_jobs.register("models", SPEC, world_size=WORLD_SIZE, timeout=TIMEOUT_S,
               test_files=("test_models.py",), paths=(HERE,))
_jobs.register("models8", SPEC_8, world_size=WORLD_SIZE_8, timeout=TIMEOUT_8_S,
               test_files=("test_models.py",), paths=(HERE,))


def run_job():
    """This family's part of the session's shared launch (``_jobs.py``), a LaunchResult."""
    return _jobs.run("models")


def run_job8():
    """The 8-rank case's part of the session's shared 8-rank launch, a LaunchResult."""
    return _jobs.run("models8")


def describe_failures(result) -> str:
    return _jobs.describe_failures(result, tail=25)


def records_of(result, check: str) -> list:
    """Every rank's records of ``check``."""
    return _jobs.records_of(result, check)
