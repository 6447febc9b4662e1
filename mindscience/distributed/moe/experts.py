"""Routed experts as one batched matmul over this rank's local experts, and the shared
experts (a tensor-parallel MLP like the dense one)."""

from __future__ import annotations

import mindspore as ms
from mindspore import Parameter, nn, ops
from mindspore import dtype as mstype
from mindspore.common.initializer import Normal, initializer

from ..sharding import mark_sharding
from .config import MoEConfig

__all__ = ["GroupedExperts", "SharedExperts"]


class GroupedExperts(nn.Cell):
    """``L = num_experts / ep`` experts of width ``F / etp``, one batched matmul each way.

    Parameters: ``w1`` (L, H, F/etp) or (L, H, 2F/etp) for SwiGLU (``[gate | up]``, each
    half split over etp: ``partition_stride=2``), ``w2`` (L, F/etp, H). Both carry
    ``expert_parallel = True``; with etp > 1 their ffn dim is marked ``axis="etp"``.

    Inputs:
        x: (L, T, H) tokens per local expert (zero rows for empty slots give zero rows
            out and add nothing to the weight gradients).

    Outputs:
        (L, T, H), a partial sum over etp when etp > 1.
    """

    def __init__(self, config: MoEConfig, local_experts: int, etp: int = 1):
        super().__init__()
        H, F = config.hidden_size, config.ffn_hidden_size
        f = F // etp
        self.swiglu = config.activation == "swiglu"
        self.local_experts = local_experts
        cols = 2 * f if self.swiglu else f
        self.w1 = Parameter(initializer(Normal(config.init_std), (local_experts, H, cols),
                                        mstype.float32), name="w1")
        self.w2 = Parameter(initializer(Normal(config.init_std), (local_experts, f, H),
                                        mstype.float32), name="w2")
        for p in (self.w1, self.w2):
            p.expert_parallel = True
        if etp > 1:
            mark_sharding(self.w1, axis="etp", partition_dim=2,
                          partition_stride=2 if self.swiglu else 1)
            mark_sharding(self.w2, axis="etp", partition_dim=1)
        self.f = f

    def construct(self, x):
        h = ops.bmm(x, ops.cast(self.w1, x.dtype))
        if self.swiglu:
            gate = h[:, :, : self.f]
            up = h[:, :, self.f:]
            h = ops.silu(gate) * up
        else:
            h = ops.gelu(h)
        return ops.bmm(h, ops.cast(self.w2, x.dtype))


class SharedExperts(nn.Cell):
    """Experts every token goes through, split over tp like the dense MLP: a column-
    parallel ``fc1`` (H -> F or 2F) and a row-parallel ``fc2`` (F -> H), no bias."""

    def __init__(self, config: MoEConfig, tp_group, compute_dtype=ms.float32):
        super().__init__()
        from ..modules import ColumnParallelLinear, RowParallelLinear

        F = config.shared_expert_ffn_hidden_size
        self.swiglu = config.activation == "swiglu"
        sp = bool(config.sequence_parallel)
        tp = tp_group.size
        self.fc1 = ColumnParallelLinear(config.hidden_size, 2 * F if self.swiglu else F, bias=False,
                                        gather_output=False, use_sequence_parallel=sp,
                                        compute_dtype=compute_dtype, group=tp_group)
        if self.swiglu and tp > 1:
            # [gate | up] fused: each tp rank holds its gate and up halves.
            mark_sharding(self.fc1.weight, axis="tp", partition_dim=0, partition_stride=2)
        self.fc2 = RowParallelLinear(F, config.hidden_size, bias=False, input_is_parallel=True,
                                     use_sequence_parallel=sp, compute_dtype=compute_dtype,
                                     group=tp_group)
        self.f = F // tp

    def construct(self, x):
        h = self.fc1(x)
        if self.swiglu:
            h = ops.silu(h[..., : self.f]) * h[..., self.f:]
        else:
            h = ops.gelu(h)
        return self.fc2(h)
