"""The ONE msrun job shared by test_layers.py and test_examples.py.

A launch costs ~20-25 s on a 2-core machine before any check runs, so the layer checks
and the examples run as one battery of named harness checks on 4 ranks, under two
layouts: tp=4 (the world group) and tp=2 x cp=2 (subgroups). The result is cached for
the whole pytest session.
"""

from __future__ import annotations

import functools

WORLD_SIZE = 4
TIMEOUT_S = 240

_TP4 = {"tp": 4}
_TP2_CP2 = {"tp": 2, "cp": 2}
SPEC = {
    "checks": [
        {"name": "layers.init_exact", "params": _TP4},
        {"name": "layers.errors", "params": _TP4},
        {"name": "layers.matrix", "params": _TP4},
        {"name": "layers.column", "params": {**_TP4, "sequence_parallel": True, "compute_dtype": "bfloat16"}},
        {"name": "layers.row", "params": {**_TP4, "sequence_parallel": True, "compute_dtype": "bfloat16"}},
        # compiled: ms.jit of the grad function, construct = ms.jit(construct), GRAPH_MODE
        {"name": "layers.modes", "params": _TP2_CP2},
        {"name": "layers.init_exact", "params": _TP2_CP2},
        {"name": "layers.errors", "params": _TP2_CP2},
        {"name": "layers.matrix", "params": {**_TP2_CP2, "skip_bias_add": False}},
        {"name": "examples.tp_mlp", "params": _TP2_CP2},
        {"name": "examples.tp_mlp", "params": {**_TP2_CP2, "sequence_parallel": True}},
        {"name": "examples.attention_tp", "params": _TP2_CP2},
        {"name": "examples.attention_ulysses", "params": _TP2_CP2},
        {"name": "examples.attention_cp_allgather", "params": _TP2_CP2},
    ]
}


@functools.lru_cache(maxsize=None)
def run_job():
    """Launch the battery once per session; returns the harness LaunchResult."""
    from mindscience.distributed.harness import launch

    return launch(SPEC, WORLD_SIZE, timeout=TIMEOUT_S)


def describe_failures(result) -> str:
    lines = [f"launch ok={result.ok} timed_out={result.timed_out} logs: {result.log_dir}"]
    for failure in result.failures:
        lines.append(f"rank {failure['rank']} {failure['kind']}: {failure['reason']}")
        lines.extend("    " + line for line in (failure.get("log_tail") or "").splitlines()[-15:])
    return "\n".join(lines)


def records_of(result, check_prefix: str) -> list:
    """Every rank's records of the checks whose name starts with ``check_prefix``."""
    out = []
    for rank, state in sorted(result.ranks.items()):
        for record in (state or {}).get("records", []):
            if record.get("check", "").startswith(check_prefix):
                out.append(record)
    return out
