"""The top-k router: scores, selection, routing weights and the auxiliary losses' local sums.

``TopKRouter.construct(x)`` works on this rank's tokens ``(N, H)`` and returns local
quantities only; :class:`~mindscience.distributed.moe.MoELayer` sums them over the ranks
that share a loss (so the losses are those of all tokens of the step) and turns them into
the aux / z losses with :func:`aux_loss_from_sums`.

Selection (for one token, logits ``z = x W^T``, ``E`` experts):

======================  ==============================================================
``softmax``             ``pre_softmax``: ``s = softmax(z)``, top-k of ``s``, weights the
                        selected ``s``. Otherwise (Megatron's default) top-k of ``z``,
                        weights ``softmax`` over the k selected logits.
``sigmoid``             ``s = sigmoid(z)``, top-k of ``s``, weights the selected ``s``
                        divided by their sum (when k > 1).
group-limited           only experts of the ``group_topk`` best groups are eligible.
expert bias             added to the scores for the top-k only; weights stay unbiased.
``topk_scaling_factor`` multiplies the weights.
======================  ==============================================================
"""

from __future__ import annotations

import numpy as np
import mindspore as ms
from mindspore import Parameter, Tensor, nn, ops
from mindspore import dtype as mstype
from mindspore.common.initializer import Normal, initializer

from .config import MoEConfig

__all__ = ["TopKRouter", "aux_loss_from_sums"]

_NEG = -1e30


class TopKRouter(nn.Cell):
    """Top-k gating (see the module docstring) with Parameter ``weight`` (E, H).

    Args:
        config: The layer's :class:`MoEConfig`, or a model config with the ``moe_*`` keys
            (``TransformerConfig``); None to build one from ``options``.
        **options: :class:`MoEConfig` fields when ``config`` is None, e.g.
            ``TopKRouter(hidden_size=64, num_experts=8, topk=2, score_function="sigmoid")``.

    Inputs:
        x: ``(N, H)`` tokens (N may be 0 only in PyNative).
        num_seqs: Sequences the ``N = S_local * num_seqs`` tokens form (the tokens are
            sequence-major, ``(S, B)`` flattened), used by ``seq_aux_loss``.

    Outputs:
        ``(indices, weights, routed, sums)``: ``indices`` (N, k) int32 experts,
        ``weights`` (N, k) float32 routing weights (differentiable), ``routed`` (N, E)
        float32 0/1 map of the selection, ``sums`` float32: the loss sums of these tokens,
        ``(E,)`` probability sums + ``(1,)`` sum of squared logsumexp, or for
        ``seq_aux_loss`` ``(B, E)`` per-sequence probability sums flattened + the
        ``(1,)`` z sum.
    """

    def __init__(self, config=None, **options):
        super().__init__()
        if config is None:  # TopKRouter(hidden_size=64, num_experts=8, topk=2, ...)
            # the router has no experts' width: any valid one will do for its config
            config = MoEConfig(**{"ffn_hidden_size": options.get("hidden_size"), **options})
        elif options:
            raise TypeError(f"TopKRouter: pass either a config or keyword options, not both "
                            f"(got a config and {sorted(options)}).")
        elif not isinstance(config, MoEConfig):  # a TransformerConfig / ModelSpec with moe_* keys
            config = MoEConfig.from_model(config)
        self.config = config
        self.num_experts = config.num_experts
        self.topk = config.topk
        self.weight = Parameter(initializer(Normal(config.init_std), (config.num_experts,
                                                                      config.hidden_size),
                                            mstype.float32), name="weight")
        # Not trained by the optimizer: moved by update_expert_bias.
        self.expert_bias = Parameter(Tensor(np.zeros(config.num_experts, np.float32)),
                                     name="expert_bias", requires_grad=False)
        self.expert_bias.unsharded_buffer = True  # fully_shard leaves it whole
        self.softmax = config.score_function == "softmax"
        self.pre_softmax = bool(config.pre_softmax)
        self.scale = float(config.topk_scaling_factor or 1.0)
        self.use_bias = bool(config.enable_expert_bias)
        self.num_groups = config.num_groups or 0
        self.group_topk = config.group_topk or 0
        self.seq_aux = config.load_balancing_type == "seq_aux_loss"

    # ------------------------------------------------------------------ helpers
    def _group_mask(self, sel):
        """``sel`` with the experts outside the ``group_topk`` best groups set to -1e30."""
        n = sel.shape[0]
        g = self.num_groups
        per = self.num_experts // g
        grouped = sel.reshape((n, g, per))
        best, _ = ops.topk(grouped, self.topk // self.group_topk)
        group_scores = best.sum(-1)  # (N, g)
        _, top_groups = ops.topk(group_scores, self.group_topk)
        keep = ops.zeros((n, g), mstype.float32)
        keep = ops.tensor_scatter_elements(keep, top_groups, ops.ones(top_groups.shape,
                                                                      mstype.float32), 1)
        keep = ops.broadcast_to(keep.reshape((n, g, 1)), (n, g, per)).reshape((n, self.num_experts))
        return ops.where(keep > 0.5, sel, ops.full_like(sel, _NEG))

    def construct(self, x, num_seqs=1):
        logits = ops.matmul(ops.cast(x, mstype.float32), self.weight.T)  # (N, E)
        n = logits.shape[0]
        if self.softmax:
            scores = ops.softmax(logits, -1)
            # Selection on the logits when pre_softmax is False: same order as softmax.
            sel = scores if self.pre_softmax else logits
        else:
            scores = ops.sigmoid(logits)
            sel = scores
        sel = ops.stop_gradient(sel)
        if self.use_bias:
            sel = sel + self.expert_bias
        if self.num_groups:
            sel = self._group_mask(sel)
        _, indices = ops.topk(sel, self.topk)
        indices = ops.cast(indices, mstype.int32)
        if self.softmax and not self.pre_softmax:
            weights = ops.softmax(ops.gather_elements(logits, 1, indices), -1)
        else:
            weights = ops.gather_elements(scores, 1, indices)
            if not self.softmax and self.topk > 1:
                weights = weights / (weights.sum(-1, keepdims=True) + 1e-20)
        if self.scale != 1.0:
            weights = weights * self.scale
        routed = ops.one_hot(indices, self.num_experts, ops.ones((), mstype.float32),
                             ops.zeros((), mstype.float32)).sum(1)
        # Probabilities of the balancing loss: softmax over all experts, or the sigmoid
        # scores normalised per token.
        if self.softmax:
            aux_probs = scores
        else:
            aux_probs = scores / (scores.sum(-1, keepdims=True) + 1e-20)
        lse = ops.logsumexp(logits, -1)
        zsum = (lse * lse).sum().reshape((1,))
        if self.seq_aux:
            per_seq = aux_probs.reshape((n // num_seqs, num_seqs, self.num_experts)).sum(0)
            sums = ops.cat((per_seq.reshape((-1,)), zsum), 0)
        else:
            sums = ops.cat((aux_probs.sum(0), zsum), 0)
        return indices, weights, routed, sums

    def update_expert_bias(self, tokens_per_expert):
        """Aux-loss-free balancing step: ``bias += rate * sign(mean - tokens_per_expert)``.

        Args:
            tokens_per_expert: (E,) tokens routed to each expert this step, summed over
                the data-parallel ranks (numpy array, list or Tensor).

        Returns:
            The new bias as a numpy array (unchanged unless ``enable_expert_bias``).
        """
        counts = np.asarray(tokens_per_expert.asnumpy() if isinstance(tokens_per_expert, Tensor)
                            else tokens_per_expert, np.float32).reshape(-1)
        if counts.shape[0] != self.num_experts:
            raise ValueError(f"update_expert_bias: got {counts.shape[0]} counts for "
                             f"{self.num_experts} experts; pass one count per expert.")
        bias = self.expert_bias.asnumpy()
        if self.use_bias:
            bias = bias + float(self.config.bias_update_rate) * np.sign(counts.mean() - counts)
            self.expert_bias.set_data(Tensor(bias.astype(np.float32)))
        return bias


def aux_loss_from_sums(num_experts: int, topk: int, aux_coeff: float, z_coeff: float,
                       seq_aux: bool, counts, sums, num_seqs: int):
    """The layer's aux + z loss from the GLOBAL sums (every rank sharing the loss added).

    Args:
        num_experts: E, the routed experts.
        topk: k, the experts each token is sent to.
        aux_coeff: ``aux_loss_coeff`` (0 when the balancing type is ``none``).
        z_coeff: ``z_loss_coeff``.
        seq_aux: ``seq_aux_loss`` (per-sequence sums) rather than ``aux_loss``.
        counts: (E,) or (B*E,) float32 assignments per expert (no gradient).
        sums: The router's ``sums`` added over the ranks (see :class:`TopKRouter`).
        num_seqs: B, the sequences of this replica (``seq_aux``).

    Returns:
        A float32 scalar: ``aux_coeff * aux + z_coeff * z`` where, over the N tokens of the
        step, ``aux = E / (k N^2) * sum_i counts_i * probsum_i`` (Switch's
        ``E * sum_i f_i P_i`` with ``f_i = counts_i / (k N)``, ``P_i = probsum_i / N``),
        per sequence and averaged for ``seq_aux``, and ``z = sum(logsumexp^2) / N``.
    """
    E = num_experts
    k = topk
    zsum = sums[-1]
    if seq_aux:
        c = counts.reshape((num_seqs, E))
        p = sums[:-1].reshape((num_seqs, E))
        n_seq = c.sum(-1) / k
        aux = ((c * p).sum(-1) * E / (k * n_seq * n_seq)).mean()
        tokens = n_seq.sum()
    else:
        tokens = counts.sum() / k
        aux = (counts * sums[:-1]).sum() * E / (k * tokens * tokens)
    total = zsum * 0.0
    if aux_coeff > 0:
        total = total + aux * aux_coeff
    if z_coeff > 0:
        total = total + zsum / tokens * z_coeff
    return total
