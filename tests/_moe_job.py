"""The MoE family of the session's shared 4-rank launch (``_jobs.py``).

The layer at ep2, ep4, ep2 x tp2 (etp 1 and 2) and ep2 x cp2 against the one-rank layer
(outputs, aux loss, every gradient after GradientFinalizer), dropless and with a capacity
factor, both dispatchers, a rank whose experts receive no token, PyNative and jit (each
graph compiled once); the uneven all-to-all and the dispatch round trip; the error cases;
DistributedOptimizer stages with and without max_grad_norm; the dispatch's bytes against
the cost model.
"""

from __future__ import annotations

import os

import _jobs

WORLD_SIZE = 4
TIMEOUT_S = 900
HERE = os.path.dirname(os.path.abspath(__file__))

AUX = {"aux_loss_coeff": 0.01, "z_loss_coeff": 0.001}


def _layer(layout, *cases, modes=("pynative",)):
    return {"name": "moe.layer", "params": {"layout": layout, "cases": list(cases),
                                            "modes": list(modes)}}


SPEC = {
    "modules": ["_moe_checks"],
    "layout": {"world_size": WORLD_SIZE},
    "checks": [
        {"name": "moe.dispatch", "params": {"layout": {"ep": 4}, "modes": ["pynative", "jit"]}},
        {"name": "moe.errors", "params": {"layout": {"ep": 4}}},
        # ep2 x dp4 (edp 2)
        _layer({"ep": 2},
               {"name": "dropless_shared", "shared_expert_ffn_hidden_size": 4, **AUX},
               {"name": "capacity_probs_swiglu", "capacity_factor": 1.0, "activation": "swiglu"},
               {"name": "allgather", "dispatcher": "allgather", **AUX}),
        # ep4 (one expert per rank, edp 1)
        _layer({"ep": 4},
               {"name": "dropless", **AUX},
               {"name": "capacity_position", "capacity_factor": 0.75, "drop_policy": "position",
                "modes": ["pynative", "jit"]},
               {"name": "no_tokens", "no_tokens": True, "enable_expert_bias": True, **AUX}),
        # tp2 x dp2, ep2 with etp 1: the tp ranks route halves of the sequence
        _layer({"tp": 2, "ep": 2, "etp": 1},
               {"name": "seq_aux_shared", "load_balancing_type": "seq_aux_loss",
                "shared_expert_ffn_hidden_size": 4, **AUX},
               {"name": "capacity", "capacity_factor": 1.0, "score_function": "sigmoid"}),
        # tp2 x dp2, ep2 x etp2 (edp 1)
        _layer({"tp": 2, "ep": 2, "etp": 2},
               {"name": "swiglu_groups", "activation": "swiglu", "num_groups": 2,
                "group_topk": 1, **AUX, "modes": ["pynative", "jit"]},
               {"name": "allgather_capacity", "dispatcher": "allgather", "capacity_factor": 1.0}),
        # DistributedOptimizer stages 0-3 (stage 3 after fully_shard), 5 steps, tp2 x dp2 x ep2
        {"name": "moe.train", "params": {"layout": {"tp": 2, "ep": 2, "etp": 1}}},
        # max_grad_norm: one global norm over dense and expert weights, both clipped alike
        {"name": "moe.clip", "params": {"layout": {"tp": 2, "ep": 2, "etp": 1}}},
        {"name": "moe.clip", "params": {"layout": {"tp": 2, "ep": 2, "etp": 2}, "stages": [1]}},
        # bytes the dropless dispatch moved vs the cost model's figure
        {"name": "moe.bytes", "params": {"layout": {"ep": 4}}},
        {"name": "moe.bytes", "params": {"layout": {"tp": 2, "ep": 2, "etp": 2}}},
        # cp2 x dp2, ep2: the layer sees cp chunks of the sequence
        _layer({"cp": 2, "ep": 2},
               {"name": "aux", "pre_softmax": True, "topk_scaling_factor": 2.0, **AUX},
               {"name": "seq_aux", "load_balancing_type": "seq_aux_loss", **AUX}),
    ],
}

_jobs.register("moe", SPEC, world_size=WORLD_SIZE, timeout=TIMEOUT_S,
               test_files=("test_moe.py",), paths=(HERE,))


def run_job():
    """This family's part of the session's shared 4-rank launch, a LaunchResult."""
    return _jobs.run("moe")


def records_of(result, check: str) -> list:
    return _jobs.records_of(result, check, with_rank=False)


def describe_failures(result) -> str:
    return _jobs.describe_failures(result)
