"""``ContextParallelAttention``: tp-parallel projections around context-parallel attention.

    x (S/cp, B, H), this cp rank's rows, the same on every tp rank
      -> ColumnParallelLinear qkv (gather_output=False)    (S/cp, B, (N + 2 N_kv) hd / tp)
      -> context_parallel_attention over cp               (S/cp, B, N/tp, hd)
      -> RowParallelLinear out (input_is_parallel=True)   (S/cp, B, H)  (all-reduce over tp)

The fused qkv features are laid out per query group (Megatron's GQA layout): for each of
the ``N_kv`` key/value heads, its ``g = N / N_kv`` query heads, then its key head, then
its value head. A column split over tp therefore hands every tp rank whole query groups
(``N_kv`` must be divisible by tp).
"""

from __future__ import annotations

import numbers
from typing import Optional

from mindspore import nn

from ..linear import ColumnParallelLinear, RowParallelLinear, _tp_group
from .core import METHODS
from .methods import context_parallel_attention


def _cp_group(group):
    from ... import manager
    from ...collectives import resolve_group
    from ...group import ParallelGroup

    if group is not None:
        return resolve_group(group)
    if manager.is_initialized():
        return manager.get_context_parallel_group()
    return ParallelGroup.trivial("cp")


class ContextParallelAttention(nn.Cell):
    """Multi-head (or grouped-query) self-attention, heads over tp, sequence over cp.

    Args:
        hidden_size: Model width H; ``H % num_heads == 0``.
        num_heads: Query heads N; ``N % num_query_groups == 0``.
        num_query_groups: Key/value heads N_kv (default N: plain multi-head); must be
            divisible by tp.
        method: ``"ring"``, ``"ulysses"`` or ``"allgather_kv"`` (see
            :func:`context_parallel_attention`; ulysses needs ``N/tp`` and ``N_kv/tp``
            divisible by cp).
        causal: Causal self-attention.
        load_balance: Zigzag layout of the causal ring (x then holds this rank's zigzag rows).
        compute_dtype: Dtype of the projections' matmuls (None: the input's).
        recompute: Selective activation recompute (Korthikanti et al. 2022): the
            attention core's scores and probabilities are computed again in the backward
            instead of being kept (see :func:`context_parallel_attention`). Default
            False. The gradients are identical either way (in PyNative, ``ms.jit`` and
            GRAPH_MODE, every method).
        tp_group: Override the tp group (default: the manager's, or size 1).
        cp_group: Override the cp group (default: the manager's, or size 1).

    Inputs:
        x: ``(S_local, B, H)``. split_sizes: the rows of every cp rank (uneven sequence).

    Outputs:
        ``(S_local, B, H)``.
    """

    def __init__(self, hidden_size: int, num_heads: int, *, num_query_groups: Optional[int] = None,
                 method: str = "ring", causal: bool = False, load_balance: bool = False,
                 compute_dtype=None, recompute: bool = False, tp_group=None, cp_group=None):
        super().__init__()
        cls = type(self).__name__
        n_kv = num_heads if num_query_groups is None else num_query_groups
        for key, value in (("hidden_size", hidden_size), ("num_heads", num_heads),
                           ("num_query_groups", n_kv)):
            if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value <= 0:
                raise ValueError(f"{cls}: {key}={value!r} must be a positive integer.")
        if method not in METHODS:
            raise ValueError(f"{cls}: method={method!r} is invalid: expected one of {METHODS}.")
        if not isinstance(recompute, bool):
            raise ValueError(f"{cls}: recompute={recompute!r} must be True or False (True: "
                             "the attention core is recomputed in the backward).")
        if load_balance and not (causal and method == "ring"):
            # The zigzag layout only evens out the causal ring's triangle; say so when the
            # layer is built, not at its first call.
            raise ValueError(f"{cls}: load_balance=True needs method='ring' and causal=True "
                             f"(got method={method!r}, causal={causal}); drop load_balance or use "
                             "a causal ring.")
        if hidden_size % num_heads:
            raise ValueError(f"{cls}: hidden_size={hidden_size} is not divisible by "
                             f"num_heads={num_heads}.")
        if num_heads % n_kv:
            raise ValueError(f"{cls}: num_heads={num_heads} is not a multiple of "
                             f"num_query_groups={n_kv}.")
        self.tp = _tp_group(tp_group)
        self.cp = _cp_group(cp_group)
        if n_kv % self.tp.size:
            raise ValueError(f"{cls}: num_query_groups={n_kv} is not divisible by the tensor-"
                             f"parallel size {self.tp.size}: each tp rank holds whole query "
                             "groups. Choose a multiple of tp, or another tp size.")
        self.head_dim = hidden_size // num_heads
        self.g = num_heads // n_kv
        self.local_groups = n_kv // self.tp.size
        if method == "ulysses" and (self.local_groups % self.cp.size):
            raise ValueError(
                f"{cls}: method='ulysses' needs the key/value heads per tp rank "
                f"({n_kv}/{self.tp.size} = {self.local_groups}) divisible by cp={self.cp.size}; "
                "use method='ring' or 'allgather_kv'.")
        self.method, self.causal, self.load_balance = method, bool(causal), bool(load_balance)
        self.recompute_core = recompute
        self.num_heads, self.num_query_groups = num_heads, n_kv
        f = dict(compute_dtype=compute_dtype, group=self.tp)
        self.qkv = ColumnParallelLinear(hidden_size, (num_heads + 2 * n_kv) * self.head_dim,
                                        gather_output=False, **f)
        self.out = RowParallelLinear(num_heads * self.head_dim, hidden_size,
                                     input_is_parallel=True, **f)

    def construct(self, x, split_sizes=None):
        s, b, _ = x.shape
        hd, g, groups = self.head_dim, self.g, self.local_groups
        t = self.qkv(x).reshape(s, b, groups, g + 2, hd)
        q = t[:, :, :, :g].reshape(s, b, groups * g, hd)
        k = t[:, :, :, g]
        v = t[:, :, :, g + 1]
        # The group by keyword: next to keyword arguments, a positional group is packed
        # with the tensors into one tuple, which ms.jit's autodiff cannot zero (see
        # methods._AllGatherKV).
        o = context_parallel_attention(q, k, v, group=self.cp, method=self.method,
                                       causal=self.causal, split_sizes=split_sizes,
                                       load_balance=self.load_balance,
                                       recompute=self.recompute_core)
        return self.out(o.reshape(s, b, groups * g * hd))
