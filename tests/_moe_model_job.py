"""The MoE GPTModel family of the session's shared 4-rank launch (``_jobs.py``).

GPTModel with MoE layers (tiny-moe, small) against the dense model built in each rank:
ep4, ep2, ep2 x tp2 with etp 1 and 2, ep2 x pp2, ep2 x cp2 (one step: losses, aux losses,
every gradient gathered); dropless with the aux and z losses, and with a capacity factor
(drops on both sides); PyNative, and jit once. Training 5 steps with DistributedOptimizer
at ZeRO stages 0-3 spread over the layouts (against the one-rank run in the test
process); a checkpoint saved at ep4 (stage 1), resharded offline to ep2 x etp2 and
resumed there; experts that ep does not divide.
"""

from __future__ import annotations

import os
import tempfile

import _jobs

WORLD_SIZE = 4
TIMEOUT_S = 900
HERE = os.path.dirname(os.path.abspath(__file__))

AUX = {"moe_aux_loss_coeff": 0.01, "moe_z_loss_coeff": 0.001}
# The aux loss is the step's micro-batch over every dp-cp rank: cases that cut the batch in
# micro-batches of the same rows on both sides turn it off.
NO_AUX = {"moe_aux_loss_coeff": 0.0}


def _case(name, mode="pynative", microbatches=1, same_microbatches=False, **config):
    return {"name": name, "mode": mode, "microbatches": microbatches,
            "same_microbatches": same_microbatches, "config": config}


def _parity(layout, *cases):
    return {"name": "moe_model.parity", "params": {"layout": layout, "cases": list(cases)}}


def _train(layout, zero_stage):
    return {"name": "moe_model.train", "params": {"layout": layout, "zero_stage": zero_stage}}


def spec() -> dict:
    folder = tempfile.mkdtemp(prefix="msdist_moe_ckpt_")
    return {
        "modules": ["_moe_model_checks"],
        "layout": {"world_size": WORLD_SIZE},
        "checks": [
            {"name": "moe_model.errors", "params": {"layout": {"ep": 4}}},
            _parity({"ep": 4},
                    _case("dropless_aux", **AUX),
                    _case("dropless_aux_jit", "jit", **AUX),
                    # capacity 1.0 of top-2 over 4 experts drops assignments; no aux loss,
                    # the dense model in micro-batches of the same rows
                    _case("capacity", same_microbatches=True, **NO_AUX,
                          moe_expert_capacity_factor=1.0)),
            _parity({"ep": 2}, _case("shared_experts", moe_shared_expert_intermediate_size=16, **AUX)),
            _parity({"tp": 2, "ep": 2, "etp": 1}, _case("tp2_etp1", **AUX)),
            _parity({"tp": 2, "ep": 2, "etp": 2}, _case("tp2_etp2", **AUX)),
            # 1F1B over 2 micro-batches (the recomputing stage runs each forward twice)
            _parity({"pp": 2, "ep": 2},
                    _case("pp2_capacity", microbatches=2, same_microbatches=True, **NO_AUX,
                          moe_expert_capacity_factor=1.0)),
            _parity({"cp": 2, "ep": 2}, _case("cp2", **AUX)),
            _train({"ep": 4}, 0),
            _train({"tp": 2, "ep": 2, "etp": 2}, 1),
            _train({"pp": 2, "ep": 2}, 2),
            _train({"ep": 2}, 3),
            {"name": "moe_model.checkpoint",
             "params": {"folder": folder, "first": {"ep": 4}, "then": {"tp": 2, "ep": 2, "etp": 2},
                        "zero_stage": 1}},
        ],
    }


_jobs.register("moe_model", spec, world_size=WORLD_SIZE, timeout=TIMEOUT_S,
               test_files=("test_moe_model.py",), paths=(HERE,))


def run_job():
    """This family's part of the session's shared 4-rank launch, a LaunchResult."""
    return _jobs.run("moe_model")


def records_of(result, check: str) -> list:
    return _jobs.records_of(result, check, with_rank=True)


def describe_failures(result) -> str:
    return _jobs.describe_failures(result)


if __name__ == "__main__":  # time the family alone: python tests/_moe_model_job.py
    import json
    import sys

    sys.path.insert(0, HERE)
    result = run_job()
    print(describe_failures(result))
    for name in ("moe_model.parity", "moe_model.train", "moe_model.checkpoint", "moe_model.errors"):
        for r in records_of(result, name):
            print(json.dumps({k: r.get(k) for k in ("check", "rank", "layout", "case", "passed",
                                                      "max_grad_rel_err", "loss_rel_err", "aux_rel_err",
                                                      "seconds", "steps", "message", "zero_stage")})[:600])
