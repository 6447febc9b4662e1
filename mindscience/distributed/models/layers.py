"""The blocks of GPTModel: norms, rotary embedding, self-attention, MLP, transformer layer.

Activations are ``(S, B, H)`` with the sequence first, as in the parallel layers. With
sequence parallelism (tp > 1) the residual stream of a layer is this rank's
``S_cp / tp`` rows (``S_cp`` = this context-parallel rank's rows); the qkv and fc1
projections all-gather them over tp and the output projections reduce-scatter back:

    x (S_cp/tp, B, H) -> norm -> qkv ColumnParallel (S_cp, B, (N + 2 N_kv) d / tp)
      -> RoPE (this cp rank's global positions) -> context_parallel_attention over cp
      -> proj RowParallel (S_cp/tp, B, H) -> + x -> norm -> fc1 ColumnParallel
      -> GeLU | SwiGLU -> fc2 RowParallel (S_cp/tp, B, H) -> + residual

Each parameter is created from its GLOBAL tensor (:mod:`.weights`, keyed by the global
name) and this rank's slice of it, so the layers at any layout re-assemble to the dense
model.
"""

from __future__ import annotations

import importlib

import numpy as np

import mindspore as ms
from mindspore import nn, ops
from mindspore.ops import operations as P
from mindspore.ops.primitive import constexpr

from ..modules import ColumnParallelLinear, RowParallelLinear, context_parallel_attention
from ..random import get_rng_tracker
from ..sharding import mark_sharding
from .weights import draw, tp_slice

__all__ = ["Norm", "SelfAttention", "MLP", "MoEBlock", "TransformerLayer", "rope_tables", "Init",
           "Dropout"]

# What ops.dropout draws its seeds with (private MindSpore functions, used in one place).
_SEED = importlib.import_module("mindspore.common.seed")
_RANDOM_FUNC = importlib.import_module("mindspore.ops.function.random_func")
_FORBID_REUSE = importlib.import_module("mindspore.graph.api")._function_forbid_reuse


class Init:
    """What a block needs to draw its parameters: seed, dtype, groups, the global name prefix."""

    def __init__(self, config, seed: int, dtype, tp, cp, sequence_parallel: bool, experts=None):
        self.config, self.seed, self.dtype = config, int(seed), dtype
        self.tp, self.cp = tp, cp
        # The groups of MoE layers ({"ep", "etp", "dp-cp", "etp-ep"}), None: all of size 1.
        self.experts = experts
        self.sequence_parallel = bool(sequence_parallel) and tp.size > 1

    def full(self, name: str, shape, kind: str) -> np.ndarray:
        return draw(self.seed, name, shape, kind, self.config.num_layers)

    def tensor(self, array: np.ndarray) -> ms.Tensor:
        return ms.Tensor(np.ascontiguousarray(array), ms.float32).astype(self.dtype)

    def parameter(self, name: str, shape, kind: str, local_name: str) -> ms.Parameter:
        """A replicated parameter (the same on every tp rank)."""
        return ms.Parameter(self.tensor(self.full(name, shape, kind)), name=local_name)

    def linear(self, cls, prefix: str, in_f: int, out_f: int, *, bias: bool, stride: int = 1,
               out_kind: str = "normal", **kwargs):
        """A Column/RowParallelLinear whose global weight is drawn by name and sliced here."""
        w = self.full(prefix + ".weight", (out_f, in_f), out_kind)
        b = self.full(prefix + ".bias", (out_f,), "zeros") if bias else None
        column = cls is ColumnParallelLinear
        if column and stride > 1:
            # Reorder the rows so that the layer's contiguous row split hands rank r the
            # r-th piece of every block (SwiGLU: [gate_r; up_r]).
            w = np.concatenate([tp_slice(w, 0, r, self.tp.size, stride)
                                for r in range(self.tp.size)])
            if b is not None:
                b = np.concatenate([tp_slice(b, 0, r, self.tp.size, stride)
                                    for r in range(self.tp.size)])
        layer = cls(in_f, out_f, bias=bias, weight_init=self.tensor(w),
                    bias_init=None if b is None else self.tensor(b), param_init_dtype=self.dtype,
                    compute_dtype=None, use_sequence_parallel=self.sequence_parallel,
                    group=self.tp, **kwargs)
        if column and stride > 1:
            mark_sharding(layer.weight, axis="tp", partition_dim=0, partition_stride=stride)
            if layer.bias is not None:
                mark_sharding(layer.bias, axis="tp", partition_dim=0, partition_stride=stride)
        return layer


@constexpr(reuse_result=False)
def _dropout_seeds(parallel):
    """The ``(seed0, seed1)`` of the next dropout, drawn as ``ops.dropout`` draws them, from
    the tracker's model-parallel stream (``parallel``) or the default one.

    A constexpr: eagerly it runs at every call (each call a new mask, replayed by
    ``random.recompute``); in compiled code once per call site at trace time, the kernel
    then advancing its own state at every run. No ``with`` statement reaches the graph.
    """
    if parallel:
        with get_rng_tracker().fork():
            return _SEED._get_graph_seed(None, "dropout")
    return _SEED._get_graph_seed(None, "dropout")


@_FORBID_REUSE
def _dropout(x, keep_prob, parallel):
    # ops.dropout's body with the seeds from the chosen stream; forbid_reuse (as
    # ops.dropout) gives every call site of a graph its own seeds.
    seed0, seed1 = _dropout_seeds(parallel)
    op = P.Dropout(keep_prob=keep_prob, Seed0=seed0, Seed1=seed1)
    op = _RANDOM_FUNC._set_prim_op_user_data(op, "random_cache", False)
    out, _ = op(x)
    return out


class Dropout(nn.Cell):
    """Dropout on the random stream its activations need (Megatron's rule).

    Activations split over tp (sequence parallelism: each tp rank holds other rows) draw
    from the model-parallel stream (``random.get_rng_tracker().fork()``), so the tp
    ranks drop independently; activations every tp rank holds alike draw from the
    default stream, the same mask on every tp rank (the copies stay equal). Active
    while ``self.training``; under ``random.recompute`` the recomputed forward draws the
    same masks in PyNative, and compiled recompute re-runs the traced kernels.

    Args:
        p: Drop probability in ``[0, 1)``.
        parallel: The activations are split over tp (draw from the model-parallel stream).
    """

    def __init__(self, p: float, parallel: bool):
        super().__init__()
        self.keep_prob = 1.0 - float(p)
        self.active = float(p) > 0.0
        self.parallel = bool(parallel)

    def construct(self, x):
        if self.active and self.training:
            return _dropout(x, self.keep_prob, self.parallel)
        return x


class Norm(nn.Cell):
    """LayerNorm (weight and bias) or RMSNorm (weight) over the last dim, in float32.

    (``mint.nn.LayerNorm`` has no CPU kernel in MindSpore 2.10.) Under sequence
    parallelism each tp rank normalizes its own rows, so the gradients of these
    replicated parameters are partial sums over tp: they carry ``sequence_parallel``
    and the gradient finalizer sums them over tp.
    """

    def __init__(self, init: Init, prefix: str, eps: float = 1e-5):
        super().__init__()
        h = init.config.hidden_size
        self.rms = init.config.normalization == "rmsnorm"
        self.eps = eps
        self.weight = init.parameter(prefix + ".weight", (h,), "ones", "weight")
        self.bias = None if self.rms else init.parameter(prefix + ".bias", (h,), "zeros", "bias")
        for p in (self.weight, self.bias):
            if p is not None:
                mark_sharding(p, axis=None, sequence_parallel=init.sequence_parallel)

    def construct(self, x):
        dtype = x.dtype
        x = ops.cast(x, ms.float32)
        if self.rms:
            y = x * ops.rsqrt((x * x).mean(-1, keep_dims=True) + self.eps)
            y = y * ops.cast(self.weight, ms.float32)
        else:
            mean = x.mean(-1, keep_dims=True)
            c = x - mean
            y = c * ops.rsqrt((c * c).mean(-1, keep_dims=True) + self.eps)
            y = y * ops.cast(self.weight, ms.float32) + ops.cast(self.bias, ms.float32)
        return ops.cast(y, dtype)


def rope_tables(positions: np.ndarray, head_dim: int, base: float = 10000.0):
    """``(cos, sin)`` of shape ``(len(positions), 1, 1, head_dim)`` (float32, numpy) for the
    rotate-half RoPE at the given GLOBAL positions (a cp rank passes its own rows')."""
    inv = 1.0 / (base ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim))
    angles = np.outer(np.asarray(positions, np.float64), inv)
    angles = np.concatenate([angles, angles], axis=-1)
    shape = (len(positions), 1, 1, head_dim)
    return (np.cos(angles).reshape(shape).astype(np.float32),
            np.sin(angles).reshape(shape).astype(np.float32))


class _AttentionCore(nn.Cell):
    """RoPE on q and k, then causal attention over the cp group (the part selective
    recompute re-runs: its scores are the largest activations of a layer)."""

    def __init__(self, init: Init, positions: np.ndarray, load_balance: bool):
        super().__init__()
        cfg = init.config
        self.cp, self.method, self.load_balance = init.cp, cfg.context_parallel_method, load_balance
        self.rope = cfg.position_embedding == "rope"
        if self.rope:
            cos, sin = rope_tables(positions, cfg.head_dim)
            self.cos, self.sin = ms.Tensor(cos), ms.Tensor(sin)
        self.half = cfg.head_dim // 2

    def _rotate(self, x):
        dtype = x.dtype
        x = ops.cast(x, ms.float32)
        rot = ops.cat((-x[..., self.half:], x[..., :self.half]), -1)
        return ops.cast(x * self.cos + rot * self.sin, dtype)

    def construct(self, q, k, v):
        if self.rope:
            q, k = self._rotate(q), self._rotate(k)
        # The group by keyword: with keyword arguments a positional group is packed with
        # q, k, v into one tuple, whose zeros_like ms.jit's autodiff cannot build once
        # the call is not inlined (measured: tiny-gpt's 4 layers failed to compile).
        return context_parallel_attention(q, k, v, group=self.cp, method=self.method, causal=True,
                                          load_balance=self.load_balance)


class SelfAttention(nn.Cell):
    """Causal (grouped-query) self-attention: heads over tp, sequence over cp.

    The fused qkv rows are laid out per query group (for each key/value head, its
    ``N/N_kv`` query heads, then its key, then its value head), so the column split hands
    every tp rank whole groups.
    """

    def __init__(self, init: Init, prefix: str, positions: np.ndarray, load_balance: bool):
        super().__init__()
        cfg = init.config
        h, d = cfg.hidden_size, cfg.head_dim
        self.head_dim = d
        self.g = cfg.num_attention_heads // cfg.num_query_groups
        self.groups = cfg.num_query_groups // init.tp.size
        self.qkv = init.linear(ColumnParallelLinear, prefix + ".qkv", h, cfg.qkv_size,
                               bias=cfg.bias, gather_output=False)
        self.core = _AttentionCore(init, positions, load_balance)
        self.proj = init.linear(RowParallelLinear, prefix + ".proj", h, h, bias=cfg.bias,
                                out_kind="output", input_is_parallel=True)

    def construct(self, x):
        t = self.qkv(x)
        s, b = t.shape[0], t.shape[1]
        t = t.reshape(s, b, self.groups, self.g + 2, self.head_dim)
        q = t[:, :, :, :self.g].reshape(s, b, self.groups * self.g, self.head_dim)
        k = t[:, :, :, self.g]
        v = t[:, :, :, self.g + 1]
        o = self.core(q, k, v)
        return self.proj(o.reshape(s, b, self.groups * self.g * self.head_dim))


class MLP(nn.Cell):
    """fc1 (column parallel) -> GeLU, or SwiGLU on the fused ``[gate; up]`` -> fc2 (row parallel)."""

    def __init__(self, init: Init, prefix: str):
        super().__init__()
        cfg = init.config
        self.swiglu = cfg.activation == "swiglu"
        self.fc1 = init.linear(ColumnParallelLinear, prefix + ".fc1", cfg.hidden_size, cfg.fc1_size,
                               bias=cfg.bias, stride=2 if self.swiglu else 1, gather_output=False)
        self.fc2 = init.linear(RowParallelLinear, prefix + ".fc2", cfg.ffn_hidden_size,
                               cfg.hidden_size, bias=cfg.bias, out_kind="output",
                               input_is_parallel=True)

    def construct(self, x):
        y = self.fc1(x)
        if self.swiglu:
            gate, up = ops.chunk(y, 2, -1)
            y = gate * ops.sigmoid(gate) * up
        else:
            y = ops.gelu(y)
        return self.fc2(y)


class _AttachAux(nn.Cell):
    """``x`` unchanged; in the backward the MoE aux loss gets the gradient ``scale``.

    So the aux loss joins the training objective without travelling with the
    activations (through pipeline stages, whose transfers carry one tensor): its
    gradient is what the loss's would be, ``scale`` = the loss's weight of this
    micro-batch (``1/m``). Megatron's ``MoEAuxLossAutoScaler``.
    """

    def construct(self, x, aux, scale):
        return x

    def bprop(self, x, aux, scale, out, dout):
        return dout, ops.ones_like(aux) * ops.cast(scale, aux.dtype), ops.zeros_like(scale)


def _buffer(value, name: str) -> ms.Parameter:
    """A non-trainable float32 buffer that checkpoints leave out (``checkpoint = False``)."""
    p = ms.Parameter(ms.Tensor(np.asarray(value, np.float32)), name=name, requires_grad=False)
    p.checkpoint = False
    p.unsharded_buffer = True  # fully_shard leaves it whole
    return p


def _init_kind(name: str, value: np.ndarray) -> str:
    """How GPTModel draws a MoE layer's parameter: as the layer initialized it when that is
    all zeros or ones (biases, norms), else normal; ``output`` for the output projections."""
    if value.size and not value.any():
        return "zeros"
    if value.size and (value == 1).all():
        return "ones"
    parts = name.split(".")
    return "output" if any(p in ("w2", "fc2", "linear_fc2", "down_proj") for p in parts) else "normal"


class MoEBlock(nn.Cell):
    """The MLP of a MoE layer: :class:`~mindscience.distributed.moe.MoELayer` with the
    model's global weights, its aux loss joined to the objective (:class:`_AttachAux`), and
    the step's statistics kept in buffers for ``GPTModel.moe_metrics``.

    Buffers (not trainable, not checkpointed), summed over the forward calls of a step
    (``GPTModel.forward_backward`` resets them): ``aux_sum`` (the aux loss), ``tokens``
    (tokens this rank routed to each expert, then the dropped assignments) and ``calls``
    (forwards run: a pipeline stage that recomputes runs two per micro-batch, so the
    per-micro-batch values are ``sum / calls``).
    """

    def __init__(self, init: Init, prefix: str):
        super().__init__()
        from ..moe import MoEConfig, MoELayer

        groups = init.experts or {}
        self.config = MoEConfig.from_model(init.config, sequence_parallel=init.sequence_parallel)
        self.moe = MoELayer(self.config, **_moe_groups(init, groups))
        self.num_experts = self.config.num_experts
        _mark_expert_width(self.moe, self.config)
        _draw_moe(self.moe, init, prefix, groups)
        self.aux_sum = _buffer(0.0, "aux_sum")
        self.tokens = _buffer(np.zeros(self.num_experts + 1), "tokens")
        self.calls = _buffer(0.0, "calls")
        self.aux_scale = _buffer(1.0, "aux_scale")
        self.attach = _AttachAux()

    def buffers(self) -> tuple:
        """``(aux_sum, tokens, calls)``."""
        return self.aux_sum, self.tokens, self.calls

    def construct(self, x):
        y, aux, stats = self.moe(x)
        aux = aux.astype(ms.float32)
        ops.assign_add(self.aux_sum, ops.stop_gradient(aux))
        ops.assign_add(self.tokens, ops.stop_gradient(stats.astype(ms.float32)))
        ops.assign_add(self.calls, ops.ones((), ms.float32))
        return self.attach(y, aux, self.aux_scale)


def _mark_expert_width(moe, config) -> None:
    """Mark the experts' ffn dim ``etp`` at etp 1 too (the layer marks it when etp > 1), so a
    checkpoint saved at etp 1 records the split dim an offline reshard to etp > 1 needs."""
    from ..sharding import get_sharding

    experts = getattr(moe, "experts", None)
    for name, dim, stride in (("w1", 2, 2 if config.activation == "swiglu" else 1), ("w2", 1, 1)):
        param = getattr(experts, name, None)
        if param is not None and get_sharding(param)["axis"] is None:
            mark_sharding(param, axis="etp", partition_dim=dim, partition_stride=stride)


def _moe_groups(init: Init, groups: dict) -> dict:
    """MoELayer's group arguments: the model's tp and cp groups and the expert ones
    (``groups``: ep, etp, dp-cp, etp-ep), trivial when the model is built dense."""
    from ..group import ParallelGroup

    def get(key):
        return groups.get(key) or ParallelGroup.trivial(key)

    return {"ep_group": get("ep"), "etp_group": get("etp"), "tp_group": init.tp,
            "dp_cp_group": get("dp-cp"), "cp_group": init.cp, "dispatch_group": get("etp-ep")}


def _draw_moe(moe, init: Init, prefix: str, groups: dict) -> None:
    """Set every trainable parameter of ``moe`` to this rank's slice of its global tensor
    drawn by global name (``<prefix>.<path>``, :mod:`.weights`): expert parameters
    (``expert_parallel``) hold experts ``[ep_rank * L, (ep_rank + 1) * L)`` on dim 0, and a
    dim marked ``etp`` or ``tp`` is split as :func:`.weights.tp_slice` splits it."""
    from ..sharding import get_sharding

    sizes = {"tp": init.tp, "etp": groups.get("etp"), "ep": groups.get("ep")}
    for path, param in moe.parameters_and_names():
        if not param.requires_grad:
            # Buffers (the expert bias) keep the layer's values; every rank updates them
            # alike (update_expert_bias with the step's global counts): fully_shard
            # leaves them whole.
            param.unsharded_buffer = True
            continue
        local = param.astype(ms.float32).asnumpy()
        shape = list(local.shape)
        sh = get_sharding(param)
        ep = sizes["ep"]
        expert = bool(getattr(param, "expert_parallel", False)) and ep is not None
        if expert:
            shape[0] *= ep.size
        group = sizes.get(sh["axis"]) if sh["axis"] else None
        if group is not None:
            shape[sh["partition_dim"]] *= group.size
        full = init.full(f"{prefix}.{path}", shape, _init_kind(path, local))
        if expert:
            n = local.shape[0]
            full = full[ep.rank * n:(ep.rank + 1) * n]
        if group is not None:
            full = tp_slice(full, sh["partition_dim"], group.rank, group.size, sh["partition_stride"])
        param.set_data(init.tensor(full))


class TransformerLayer(nn.Cell):
    """Pre-norm layer: ``x + attention(norm(x))``, then ``+ mlp(norm(.))`` (and hidden dropout).

    The mlp is a :class:`MoEBlock` in the layers ``config.is_moe_layer(index)`` names.
    """

    def __init__(self, init: Init, index: int, positions: np.ndarray, load_balance: bool):
        super().__init__()
        prefix = f"layers.{index}"
        self.input_norm = Norm(init, prefix + ".input_norm")
        self.attention = SelfAttention(init, prefix + ".attention", positions, load_balance)
        self.post_attention_norm = Norm(init, prefix + ".post_attention_norm")
        moe = getattr(init.config, "num_moe_experts", None) and init.config.is_moe_layer(index)
        self.mlp = MoEBlock(init, prefix + ".mlp") if moe else MLP(init, prefix + ".mlp")
        # The outputs of the row-parallel projections: this rank's rows under sequence
        # parallelism (the tp stream), else the same on every tp rank (the default one).
        self.attention_dropout = Dropout(init.config.dropout, init.sequence_parallel)
        self.mlp_dropout = Dropout(init.config.dropout, init.sequence_parallel)
        if init.config.recompute == "selective":
            self.attention.core.recompute()

    def construct(self, x):
        x = x + self.attention_dropout(self.attention(self.input_norm(x)))
        return x + self.mlp_dropout(self.mlp(self.post_attention_norm(x)))
