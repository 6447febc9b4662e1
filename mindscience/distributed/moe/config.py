"""The MoE layer's options (:class:`MoEConfig`) and their validation.

Pure Python (no MindSpore import): the checks run on every rank while the layer is
built, before any collective, so a bad option fails every rank with the same typed
error (:class:`MoEConfigError`) instead of a hang.

A :class:`MoEConfig` is built directly, or from a ``TransformerConfig`` / cost-model
``ModelSpec`` carrying the ``moe_*`` keys (:meth:`MoEConfig.from_model`).
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass, fields
from typing import Optional

__all__ = ["MoEConfig", "MoEConfigError", "capacity", "capacity_of", "check_layout", "dispatch_record"]

SCORE_FUNCTIONS = ("softmax", "sigmoid")
LOAD_BALANCING = ("aux_loss", "seq_aux_loss", "none")
DISPATCHERS = ("alltoall", "allgather")
DROP_POLICIES = ("probs", "position")
ACTIVATIONS = ("gelu", "swiglu")


class MoEConfigError(ValueError):
    """An MoE option (or an option against the layout) that cannot work; the message
    names the value, what was expected and how to fix it."""


def _int(name, value, minimum):
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < minimum:
        raise MoEConfigError(f"MoEConfig: {name}={value!r} is invalid: expected an integer "
                             f">= {minimum}.")
    return int(value)


def _choice(name, value, choices):
    if value not in choices:
        raise MoEConfigError(f"MoEConfig: {name}={value!r} is invalid: expected one of "
                             f"{', '.join(choices)}.")
    return value


def _number(name, value, minimum=None, strict=False):
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise MoEConfigError(f"MoEConfig: {name}={value!r} is invalid: expected a number.")
    if minimum is not None and (value <= minimum if strict else value < minimum):
        op = ">" if strict else ">="
        raise MoEConfigError(f"MoEConfig: {name}={value!r} is invalid: expected a number "
                             f"{op} {minimum}.")
    return float(value)


@dataclass(frozen=True)
class MoEConfig:
    """Options of :class:`~mindscience.distributed.moe.MoELayer` (Megatron's names without
    the ``moe_`` prefix).

    Attributes:
        hidden_size: Model width H.
        num_experts: Routed experts E.
        ffn_hidden_size: Width F of each routed expert.
        topk: Experts per token (<= E).
        score_function: ``softmax`` or ``sigmoid``.
        pre_softmax: softmax over all E logits before the top-k (True), or over the k
            selected logits (False, Megatron's default).
        topk_scaling_factor: Multiplies the routing weights (None: 1).
        num_groups, group_topk: Group-limited routing: the experts form ``num_groups``
            equal groups, only the ``group_topk`` best groups are eligible (a group's
            score is the sum of its ``topk // group_topk`` best scores).
        enable_expert_bias: Aux-loss-free balancing: a bias added to the scores for the
            selection only, moved by ``bias_update_rate`` towards balance by
            ``update_expert_bias``.
        load_balancing_type: ``aux_loss`` (``E * sum_i f_i * P_i`` over all tokens of the
            step), ``seq_aux_loss`` (the same per sequence, averaged) or ``none``.
        aux_loss_coeff, z_loss_coeff: Coefficients (0 disables).
        dispatcher: ``alltoall`` or ``allgather``.
        capacity_factor: None: dropless. Otherwise each expert takes at most
            ``ceil(capacity_factor * tokens * topk / E)`` of a rank's tokens.
        drop_policy: Which assignments an over-full expert keeps: the highest ``probs``
            or the first by ``position``.
        pad_to_capacity: Kept for Megatron's option: this layer always exchanges buffers
            padded to the static bound (capacity, or the token count when dropless).
        activation: ``gelu`` or ``swiglu`` (the fused ``w1`` is ``[gate | up]``).
        shared_expert_ffn_hidden_size: Width of the shared experts (None: none).
        sequence_parallel: The input is already split over tp along the sequence.
        init_std: Standard deviation of the normal initialisation of every weight.
    """

    hidden_size: int
    num_experts: int
    ffn_hidden_size: int
    topk: int = 2
    score_function: str = "softmax"
    pre_softmax: bool = False
    topk_scaling_factor: Optional[float] = None
    num_groups: Optional[int] = None
    group_topk: Optional[int] = None
    enable_expert_bias: bool = False
    bias_update_rate: float = 1e-3
    load_balancing_type: str = "aux_loss"
    aux_loss_coeff: float = 0.0
    z_loss_coeff: float = 0.0
    dispatcher: str = "alltoall"
    capacity_factor: Optional[float] = None
    drop_policy: str = "probs"
    pad_to_capacity: bool = False
    activation: str = "gelu"
    shared_expert_ffn_hidden_size: Optional[int] = None
    sequence_parallel: bool = False
    init_std: float = 0.02

    def __post_init__(self):
        _int("hidden_size", self.hidden_size, 1)
        E = _int("num_experts", self.num_experts, 1)
        _int("ffn_hidden_size", self.ffn_hidden_size, 1)
        k = _int("topk", self.topk, 1)
        if k > E:
            raise MoEConfigError(f"MoEConfig: topk={k} is invalid: a token cannot pick more "
                                 f"experts than the num_experts={E}; use topk <= {E}.")
        _choice("score_function", self.score_function, SCORE_FUNCTIONS)
        _choice("load_balancing_type", self.load_balancing_type, LOAD_BALANCING)
        _choice("dispatcher", self.dispatcher, DISPATCHERS)
        _choice("drop_policy", self.drop_policy, DROP_POLICIES)
        _choice("activation", self.activation, ACTIVATIONS)
        if self.topk_scaling_factor is not None:
            _number("topk_scaling_factor", self.topk_scaling_factor, 0.0, strict=True)
        if (self.num_groups is None) != (self.group_topk is None):
            raise MoEConfigError(
                f"MoEConfig: num_groups={self.num_groups!r} and group_topk={self.group_topk!r}: "
                "group-limited routing needs both (or neither).")
        if self.num_groups is not None:
            g = _int("num_groups", self.num_groups, 1)
            gk = _int("group_topk", self.group_topk, 1)
            if E % g:
                raise MoEConfigError(f"MoEConfig: num_groups={g} does not divide num_experts={E}: "
                                     "use a divisor of the expert count.")
            if gk > g:
                raise MoEConfigError(f"MoEConfig: group_topk={gk} is larger than num_groups={g}.")
            if k % gk:
                raise MoEConfigError(f"MoEConfig: group_topk={gk} does not divide topk={k}: each "
                                     "selected group contributes topk // group_topk experts; "
                                     "use a divisor of topk.")
            if (E // g) * gk < k:
                raise MoEConfigError(f"MoEConfig: group_topk={gk} groups of {E // g} experts hold "
                                     f"fewer than topk={k} experts; raise group_topk.")
        _number("bias_update_rate", self.bias_update_rate, 0.0)
        _number("aux_loss_coeff", self.aux_loss_coeff, 0.0)
        _number("z_loss_coeff", self.z_loss_coeff, 0.0)
        _number("init_std", self.init_std, 0.0, strict=True)
        if self.capacity_factor is not None:
            if (isinstance(self.capacity_factor, bool)
                    or not isinstance(self.capacity_factor, numbers.Real)
                    or self.capacity_factor <= 0):
                raise MoEConfigError(
                    f"MoEConfig: capacity_factor={self.capacity_factor!r} is invalid: expected a "
                    "number > 0 (e.g. 1.25), or None for dropless routing.")
        if self.shared_expert_ffn_hidden_size is not None:
            _int("shared_expert_ffn_hidden_size", self.shared_expert_ffn_hidden_size, 1)

    @property
    def fused_ffn(self) -> int:
        """Columns of ``w1``: F, or 2F for SwiGLU (``[gate | up]``)."""
        return 2 * self.ffn_hidden_size if self.activation == "swiglu" else self.ffn_hidden_size

    @classmethod
    def from_model(cls, model, **overrides) -> "MoEConfig":
        """The layer's config from a ``TransformerConfig`` or ``ModelSpec`` with ``moe_*``
        keys (issue 36's names); ``overrides`` win.

        Raises:
            MoEConfigError: the model has no experts (``num_moe_experts`` is None).
        """
        get = lambda key, default=None: getattr(model, key, default)  # noqa: E731
        experts = get("num_moe_experts")
        if experts is None and "num_experts" not in overrides:
            raise MoEConfigError("MoEConfig.from_model: the model has num_moe_experts=None (a "
                                 "dense model); set num_moe_experts to build MoE layers.")
        ffn = get("moe_ffn_hidden_size") or get("ffn_hidden_size") or 4 * get("hidden_size")
        values = dict(
            hidden_size=get("hidden_size"), num_experts=experts, ffn_hidden_size=ffn,
            topk=get("moe_router_topk", 2),
            score_function=get("moe_router_score_function", "softmax") or "softmax",
            pre_softmax=bool(get("moe_router_pre_softmax", False)),
            topk_scaling_factor=get("moe_router_topk_scaling_factor"),
            num_groups=get("moe_router_num_groups"), group_topk=get("moe_router_group_topk"),
            enable_expert_bias=bool(get("moe_router_enable_expert_bias", False)),
            bias_update_rate=get("moe_router_bias_update_rate", 1e-3),
            load_balancing_type=get("moe_router_load_balancing_type", "aux_loss") or "aux_loss",
            aux_loss_coeff=get("moe_aux_loss_coeff", 0.0) or 0.0,
            z_loss_coeff=get("moe_z_loss_coeff", 0.0) or 0.0,
            dispatcher=get("moe_token_dispatcher_type", "alltoall") or "alltoall",
            capacity_factor=get("moe_expert_capacity_factor"),
            drop_policy=get("moe_expert_drop_policy", "probs") or "probs",
            pad_to_capacity=bool(get("moe_pad_expert_input_to_capacity", False)),
            activation=get("activation", "gelu") if get("activation") in ACTIVATIONS else "gelu",
            shared_expert_ffn_hidden_size=get("moe_shared_expert_intermediate_size"),
            sequence_parallel=bool(get("sequence_parallel", False)),
        )
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(overrides) - names)
        if unknown:
            raise MoEConfigError(f"MoEConfig.from_model: unknown option(s) {unknown}; expected "
                                 f"some of {sorted(names)}.")
        values.update(overrides)
        return cls(**values)


def capacity(config: MoEConfig, tokens: int) -> int:
    """Slots per expert for ``tokens`` tokens of one rank: ``tokens`` when dropless (a
    token picks an expert at most once), else ``ceil(factor * tokens * topk / E)``
    (at least 1, at most ``tokens``).

    Example: 64 tokens, top-2 of 8 experts, factor 1.25 -> ``ceil(20.0) = 20``.
    """
    if config.capacity_factor is None:
        return int(tokens)
    return capacity_of(float(config.capacity_factor), int(tokens), config.topk, config.num_experts)


def capacity_of(factor: float, tokens: int, topk: int, num_experts: int) -> int:
    """:func:`capacity` from plain numbers (callable from compiled code)."""
    exact = factor * tokens * topk / num_experts - 1e-9
    c = int(exact)
    if c < exact:
        c = c + 1
    if c > tokens:
        c = tokens
    if c < 1:
        c = 1
    return c


def check_layout(config: MoEConfig, ep: int, etp: int) -> None:
    """The config against the expert group sizes (before any collective).

    Raises:
        MoEConfigError: ``ep`` does not divide the experts, or ``etp`` the expert width.
    """
    if config.num_experts % ep:
        raise MoEConfigError(
            f"MoELayer: num_experts={config.num_experts} is not divisible by ep={ep}: each "
            "expert-parallel rank holds num_experts/ep experts; choose ep among the divisors "
            f"{[d for d in range(1, config.num_experts + 1) if config.num_experts % d == 0]}.")
    if config.ffn_hidden_size % etp:
        raise MoEConfigError(
            f"MoELayer: ffn_hidden_size={config.ffn_hidden_size} is not divisible by etp={etp}: "
            "the expert width is split over the expert tensor-parallel ranks; use an etp that "
            "divides it.")


def dispatch_record(num_experts: int, topk: int, ep: int, etp: int, tokens: int, slot: int,
                    hidden: int, itemsize: int, capacity: bool = False) -> dict:
    """What the ``alltoall`` dispatcher moves on one rank for one layer call (pure arithmetic).

    The dispatch buffer holds ``num_experts * slot`` rows of ``hidden`` values. Each of the
    four all-to-alls over ep (dispatch and combine, and their backward twins of the same
    shape) sends the ``(ep - 1)/ep`` of it bound for the other ep ranks; with ``etp > 1`` each
    all-gather / reduce-scatter over etp sends ``(etp - 1)`` times the buffer (ring count).

    Returns:
        ``tokens``, ``slot``, ``rows`` (``num_experts * slot``), ``imbalance`` (``rows`` over
        ``tokens * topk``: the busiest expert's rows over the mean when the slot is sized from
        the counts), ``capacity`` (the slot is a capacity), ``all_to_all_bytes`` (one call),
        ``step_all_to_all_bytes`` (the four calls of a forward and backward), ``etp_bytes``
        (one etp all-gather or reduce-scatter) and ``static_all_to_all_bytes`` (one call with
        the compiled dropless slot, ``slot = tokens``).
    """
    row_bytes = hidden * itemsize
    local = num_experts // ep
    one = (ep - 1) * local * slot * row_bytes
    return {
        "tokens": tokens, "slot": slot, "rows": num_experts * slot,
        "imbalance": num_experts * slot / (tokens * topk) if tokens else 1.0,
        "capacity": bool(capacity),
        "all_to_all_bytes": one,
        "step_all_to_all_bytes": 4 * one,
        "etp_bytes": (etp - 1) * num_experts * slot * row_bytes,
        "static_all_to_all_bytes": (ep - 1) * local * tokens * row_bytes,
    }
