"""The mixture-of-experts keys of a model (contract C of issue 36): which layers are MoE, and their checks.

Pure: :class:`~.spec.ModelSpec` calls :func:`check_moe` from its validation; the keys and their
meaning are listed in :mod:`.spec` and docs/COST_MODEL.md ("Mixture of experts").
"""

from __future__ import annotations

from functools import lru_cache

from .errors import ModelError
from .values import _choice, _positive_int, is_finite_number

SCORE_FUNCTIONS = ("softmax", "sigmoid")
LOAD_BALANCING = ("aux_loss", "seq_aux_loss", "none")
DISPATCHERS = ("alltoall", "allgather")
DROP_POLICIES = ("probs", "position")


@lru_cache(maxsize=256)
def moe_layer_pattern(num_layers: int, freq) -> tuple:
    """Which layers are MoE layers: ``freq`` an int N (layer ``i`` when ``i % N == 0``, Megatron's
    ``moe_layer_freq``) or a 0/1 sequence of one entry per layer.

        >>> moe_layer_pattern(6, 2), moe_layer_pattern(4, (0, 0, 1, 1))
        ((True, False, True, False, True, False), (False, False, True, True))
    """
    if isinstance(freq, int):
        return tuple(i % freq == 0 for i in range(num_layers))
    return tuple(bool(x) for x in freq)


def _optional_positive(name: str, value, minimum: int = 1) -> None:
    if value is not None:
        _positive_int(name, value, minimum)


def check_moe(m) -> None:
    """The mixture-of-experts keys of a :class:`ModelSpec` (contract C of issue 36)."""
    freq = m.moe_layer_freq
    if isinstance(freq, list):
        freq = tuple(freq)
        object.__setattr__(m, "moe_layer_freq", freq)
    for name in ("moe_router_pre_softmax", "moe_router_enable_expert_bias", "moe_pad_expert_input_to_capacity"):
        if not isinstance(getattr(m, name), bool):
            raise ModelError(f"{name}={getattr(m, name)!r} is invalid: expected true or false.")
    _choice("moe_router_score_function", m.moe_router_score_function, SCORE_FUNCTIONS)
    _choice("moe_router_load_balancing_type", m.moe_router_load_balancing_type, LOAD_BALANCING)
    _choice("moe_token_dispatcher_type", m.moe_token_dispatcher_type, DISPATCHERS)
    _choice("moe_expert_drop_policy", m.moe_expert_drop_policy, DROP_POLICIES)
    for name in ("moe_aux_loss_coeff", "moe_z_loss_coeff", "moe_router_bias_update_rate"):
        value = getattr(m, name)
        if not is_finite_number(value) or value < 0:
            raise ModelError(f"{name}={value!r} is invalid: expected a finite number >= 0 (0 turns it off).")
    for name in ("moe_expert_capacity_factor", "moe_router_topk_scaling_factor"):
        value = getattr(m, name)
        if value is not None and (not is_finite_number(value) or not value > 0):
            what = ("the tokens an expert takes, as a multiple of its even share, e.g. 1.25; leave it out "
                    "for dropless routing" if name == "moe_expert_capacity_factor" else
                    "the factor the routing weights are scaled by, e.g. 2.5; leave it out for 1")
            raise ModelError(f"{name}={value!r} is invalid: expected a number > 0, {what}.")
    _optional_positive("num_moe_experts", m.num_moe_experts)
    _positive_int("moe_router_topk", m.moe_router_topk)
    _optional_positive("moe_ffn_hidden_size", m.moe_ffn_hidden_size)
    _optional_positive("moe_shared_expert_intermediate_size", m.moe_shared_expert_intermediate_size)
    _optional_positive("moe_router_num_groups", m.moe_router_num_groups)
    _optional_positive("moe_router_group_topk", m.moe_router_group_topk)
    if isinstance(freq, tuple):
        if len(freq) != m.num_layers or any(isinstance(x, bool) or x not in (0, 1) for x in freq):
            raise ModelError(
                f"moe_layer_freq={list(freq)!r} is invalid: expected one 0 (dense) or 1 (MoE) per layer, "
                f"{m.num_layers} entries, e.g. [0, 0, 0] + [1] * {max(m.num_layers - 3, 0)} for the first 3 dense.")
    else:
        _positive_int("moe_layer_freq", freq)
    experts = m.num_moe_experts
    if experts is None:
        moe_only = [k for k in ("moe_ffn_hidden_size", "moe_shared_expert_intermediate_size", "moe_router_num_groups",
                                "moe_router_group_topk", "moe_expert_capacity_factor") if getattr(m, k) is not None]
        if moe_only:
            raise ModelError(f"{moe_only[0]}={getattr(m, moe_only[0])!r} needs a mixture-of-experts model: set "
                             "num_moe_experts (routed experts per MoE layer), or remove the key.")
        return
    if m.moe_ffn_hidden_size is None:
        object.__setattr__(m, "moe_ffn_hidden_size", m.ffn_hidden_size)
    if m.moe_router_topk > experts:
        raise ModelError(f"moe_router_topk={m.moe_router_topk} is invalid: a token cannot use more experts than "
                         f"num_moe_experts={experts}. Use a top-k of at most {experts}.")
    if not any(m.moe_layers):
        raise ModelError(f"moe_layer_freq={list(freq) if isinstance(freq, tuple) else freq!r} makes no layer a MoE "
                         f"layer although num_moe_experts={experts}: mark at least one layer with 1, or drop "
                         "num_moe_experts for a dense model.")
    groups, group_topk = m.moe_router_num_groups, m.moe_router_group_topk
    if (groups is None) != (group_topk is None):
        given = "moe_router_num_groups" if groups is not None else "moe_router_group_topk"
        raise ModelError(f"{given} is set without {'moe_router_group_topk' if groups is not None else 'moe_router_num_groups'}: "
                         "group-limited routing needs both (e.g. 8 groups, top-4 groups as DeepSeek-V3).")
    if groups is not None:
        if experts % groups:
            raise ModelError(f"moe_router_num_groups={groups} does not divide num_moe_experts={experts}: every group "
                             f"holds the same number of experts. Use a divisor of {experts}.")
        if group_topk > groups:
            raise ModelError(f"moe_router_group_topk={group_topk} is invalid: a token cannot use more than the "
                             f"moe_router_num_groups={groups} groups. Use at most {groups}.")
        if m.moe_router_topk > group_topk * (experts // groups):
            raise ModelError(f"moe_router_topk={m.moe_router_topk} exceeds the experts of the "
                             f"moe_router_group_topk={group_topk} groups a token may use ({group_topk} x "
                             f"{experts // groups} = {group_topk * (experts // groups)}). Raise the group top-k or "
                             "lower the top-k.")
    if m.moe_pad_expert_input_to_capacity and m.moe_expert_capacity_factor is None:
        raise ModelError("moe_pad_expert_input_to_capacity=true needs moe_expert_capacity_factor: padding fills "
                         "every expert to its capacity. Set a capacity factor (e.g. 1.25) or drop the padding.")


def dispatch_imbalance(model, training) -> float:
    """The rows a rank's dispatch moves and its experts run per MoE layer, over ``tokens * topk``.

    ``training.moe_imbalance`` (the busiest rank's rows over the mean), except for the dropless
    ``alltoall`` dispatcher run compiled (``training.moe_static_slots``): its static slots hold
    all of a rank's tokens for every expert, ``num_experts / topk`` whatever the routing.

        >>> from types import SimpleNamespace as N
        >>> m = N(num_moe_experts=8, moe_router_topk=2, moe_expert_capacity_factor=None,
        ...       moe_token_dispatcher_type="alltoall")
        >>> [dispatch_imbalance(m, N(moe_imbalance=1.25, moe_static_slots=s)) for s in (False, True)]
        [1.25, 4.0]
    """
    if (getattr(training, "moe_static_slots", False) and model.moe_expert_capacity_factor is None
            and model.moe_token_dispatcher_type == "alltoall"):
        return model.num_moe_experts / model.moe_router_topk
    return training.moe_imbalance


def dispatch_notes(model, training) -> list:
    """What the cost model assumed about the MoE dispatch, when compiled mode runs it otherwise.

    The dropless ``alltoall`` dispatcher sizes its expert slots from the real per-expert counts
    in PyNative, and uses static slots of all of a rank's tokens per expert when compiled
    (``ms.jit``, GRAPH_MODE). Priced dynamic (``moe_static_slots: false``), the estimate holds for
    PyNative only, so say so; ``msdist train --mode jit`` prices the static slots itself.

        >>> from types import SimpleNamespace as N
        >>> m = N(is_moe=True, num_moe_experts=8, moe_router_topk=2, moe_expert_capacity_factor=None,
        ...       moe_token_dispatcher_type="alltoall")
        >>> len(dispatch_notes(m, N(moe_static_slots=False))), dispatch_notes(m, N(moe_static_slots=True))
        (1, [])
    """
    if (not getattr(model, "is_moe", False) or getattr(training, "moe_static_slots", False)
            or model.moe_expert_capacity_factor is not None or model.moe_token_dispatcher_type != "alltoall"):
        return []
    ratio = model.num_moe_experts / model.moe_router_topk
    return [f"MoE dispatch: priced as PyNative runs it (expert slots sized from the real token counts); "
            f"compiled (ms.jit, GRAPH_MODE) the dropless all-to-all uses static slots of every local token "
            f"per expert, {ratio:g}x the rows (num_experts / topk): set training.moe_static_slots: true to "
            "price that (msdist train --mode jit does), or a capacity factor."]
