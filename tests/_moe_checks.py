"""Test-only MoE checks run inside the ranks of tests/_moe_job.py (the shipped ones are
``moe.layer`` and ``moe.dispatch`` in mindscience/distributed/harness/checks/moe.py).

``moe.errors``: each bad option raises ``MoEConfigError`` on every rank, before any
collective (the collective counter does not move).
"""

from __future__ import annotations

from mindscience.distributed.harness.checks.moe import with_layout
from mindscience.distributed.harness.registry import CheckContext, check

BAD = (
    ("experts_not_divisible_by_ep", dict(num_experts=6)),
    ("topk_above_experts", dict(num_experts=4, topk=5)),
    ("groups_not_dividing_experts", dict(num_experts=4, num_groups=3, group_topk=1)),
    ("group_topk_not_dividing_topk", dict(num_experts=4, topk=3, num_groups=2, group_topk=2)),
    ("capacity_zero", dict(capacity_factor=0.0)),
    ("capacity_negative", dict(capacity_factor=-1.0)),
)


@check("moe.errors")
def errors(ctx: CheckContext, layout=None) -> list:
    def body(manager):
        from mindscience.distributed import counters
        from mindscience.distributed.moe import MoEConfig, MoEConfigError, MoELayer

        records = []
        for name, opts in BAD:
            before = counters.call_count()
            kind, message = None, ""
            try:
                MoELayer(MoEConfig(**{"hidden_size": 8, "ffn_hidden_size": 6, "num_experts": 4,
                                      "topk": 2, **opts}))
            except MoEConfigError as err:
                kind, message = type(err).__name__, str(err)
            except Exception as err:  # noqa: BLE001 - recorded: the test says which type
                kind, message = type(err).__name__, str(err)
            records.append({"check": "moe.errors", "case": name, "error": kind,
                            "message": message, "collectives": counters.call_count() - before,
                            "passed": kind == "MoEConfigError"})
        return records

    return with_layout(ctx, layout, body)
