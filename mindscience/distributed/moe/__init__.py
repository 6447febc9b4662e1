"""Mixture-of-Experts with expert parallelism (issue 36, the layer).

    from mindscience.distributed.moe import MoEConfig, MoELayer
    layer = MoELayer(MoEConfig(hidden_size=64, num_experts=8, ffn_hidden_size=128, topk=2))
    out, aux_loss, stats = layer(x)          # x: (S, B, H)

See docs/guide/moe.md ("The MoE layer").
"""

from .config import MoEConfig, MoEConfigError, capacity, check_layout, dispatch_record
from .layer import MoELayer, expert_groups
from .router import TopKRouter, aux_loss_from_sums

__all__ = ["MoEConfig", "MoEConfigError", "MoELayer", "TopKRouter", "aux_loss_from_sums",
           "capacity", "check_layout", "dispatch_record", "expert_groups"]
