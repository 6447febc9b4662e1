"""What the cost model needs to know besides the layout: the model, the training and the cluster.

Each is a frozen dataclass validated at construction, so a training script can build one
by hand; :func:`workload_from_mapping` reads the ``model:``, ``training:`` and ``cluster:``
sections of a YAML mapping (a layout file or a model file) with one-line errors naming the
file and the dotted key::

    model:
      num_layers: 96
      hidden_size: 12288
      num_attention_heads: 96
      num_query_groups: 96        # default = heads (grouped-query attention when smaller)
      ffn_hidden_size: 49152      # default 4 * hidden_size
      seq_length: 2048
      vocab_size: 51200           # 0: no token embedding / output logits (e.g. patches)
      normalization: layernorm    # layernorm | rmsnorm              (these are the defaults)
      activation: gelu            # gelu | swiglu (gate and up projections fused)
      position_embedding: learned # learned (a seq_length x h table) | rope (no parameters)
      tie_embeddings: true        # false: a separate V x h output layer
      bias: true                  # biases of the linear layers (norms keep theirs)
      dropout: 0.0
      # Mixture of experts (all optional; without num_moe_experts the model is dense):
      num_moe_experts: null       # routed experts per MoE layer
      moe_router_topk: 2          # experts each token is routed to
      moe_ffn_hidden_size: null   # width of one expert (default ffn_hidden_size)
      moe_layer_freq: 1           # 1: every layer MoE; N: every N-th (layer i when i % N == 0);
                                  # or a 0/1 list per layer, e.g. DeepSeek-V3's [0, 0, 0, 1, ...]
      moe_shared_expert_intermediate_size: null   # shared experts' width (a dense MLP every token uses)
      moe_router_score_function: softmax          # softmax | sigmoid
      moe_router_num_groups: null # group-limited routing: experts in groups ...
      moe_router_group_topk: null # ... of which each token may use this many
      moe_expert_capacity_factor: null            # null: dropless
      # also: moe_router_pre_softmax, moe_router_topk_scaling_factor, moe_router_load_balancing_type
      # (aux_loss | seq_aux_loss | none), moe_aux_loss_coeff, moe_z_loss_coeff,
      # moe_router_enable_expert_bias, moe_router_bias_update_rate, moe_token_dispatcher_type
      # (alltoall | allgather), moe_expert_drop_policy (probs | position),
      # moe_pad_expert_input_to_capacity
    training:                     # these are the defaults
      micro_batch_size: 1
      global_batch_size: 1536     # default micro_batch_size * world_size
      precision: bf16             # bf16 | fp16 | fp32
      zero_stage: 0               # 0-3: what the dp-cp group shards (1 optimizer state, 2 + gradients,
                                  # 3 + weights); `distributed_optimizer: true` means 1
      recompute: none             # none | selective | full
      sequence_parallel: true
      virtual_pipeline_stages: 1  # > 1: the interleaved 1F1B schedule with v model chunks per rank
      overlap_grad_reduce: true   # the dp-cp gradient reduction overlaps the last backward
      overlap_param_gather: false # ZeRO 1-2: the updated weights' all-gather overlaps the next forward
      reshard_after_forward: true # ZeRO 3: free a unit's gathered weights after its forward, gather again
      fsdp_prefetch: true         # ZeRO 3: gather the next unit while the current one computes
      context_parallel_method: ring   # ulysses | allgather_kv | ring
      first_stage_layers: null    # unequal pipeline stages (pipeline.split.stage_layers)
      last_stage_layers: null
      account_for_embedding_in_pipeline_split: false
      account_for_loss_in_pipeline_split: false
      moe_imbalance: 1.0          # MoE: the busiest rank's routed tokens over the mean (>= 1)
      moe_static_slots: false     # MoE: compiled dropless dispatch (a slot of all N tokens per expert)
    cluster:                      # these are the defaults (without a device preset)
      device: null                # a preset filling the keys below: ascend-910b, a100-80gb, ...
      device_memory_gb: 64        # GiB (2**30 bytes) per device
      intra_node_gbps: 90         # per-device bandwidth inside a node, GB/s (1e9 bytes/s)
      inter_node_gbps: 25         # per-device bandwidth between nodes, GB/s
      intra_node_latency_us: 10   # one small collective call inside a node
      inter_node_latency_us: 20   # ... across nodes
      peak_tflops: 300            # dense bf16/fp16 TFLOP/s per device
      compute_efficiency: 0.5     # the fraction of peak a transformer layer's matmuls reach
      devices_per_node: 8         # only used by `msdist suggest` (default 8)
      cores_per_node: null        # CPU cores a node's ranks share (null: a device each; the cpu
                                  # preset: this machine's, $MSDIST_CPU_CORES or the CPUs it may use)
      op_overhead_us: 0           # framework time of one operator launch on a core of its own

Example:
    >>> m = ModelSpec(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=32,
    ...               vocab_size=100, num_query_groups=2)
    >>> (m.ffn_hidden_size, m.kv_channels)
    (256, 16)
"""

from __future__ import annotations

import math
import os
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path

from ..topology.layout_file import LAYOUT_KEYS, SECTIONS, read_yaml_mapping
from .devices import DEVICE_PRESETS, PRESET_KEYS, device_names, local_cores
from .errors import ModelError, ModelFileError
from .moe_spec import check_moe, moe_layer_pattern
from .values import _choice, _positive_int, is_finite_number

PRECISIONS = ("bf16", "fp16", "fp32")
RECOMPUTE = ("none", "selective", "full")
NORMALIZATIONS = ("layernorm", "rmsnorm")
ACTIVATIONS = ("gelu", "swiglu")
POSITION_EMBEDDINGS = ("learned", "rope")
CP_METHODS = ("ulysses", "allgather_kv", "ring")
ZERO_STAGES = (0, 1, 2, 3)
DEFAULT_DEVICES_PER_NODE = 8
GIB = 1024**3


# What each number means and a typical value, for the error of a bad one.
NUMBER_HINTS = {
    "device_memory_gb": "GiB of memory per device, e.g. 64",
    "intra_node_gbps": "GB/s per device between devices of one node, e.g. 90",
    "inter_node_gbps": "GB/s per device between nodes, e.g. 25",
    "intra_node_latency_us": "microseconds of one small collective inside a node, e.g. 10",
    "inter_node_latency_us": "microseconds of one small collective across nodes, e.g. 20",
    "peak_tflops": "dense bf16/fp16 TFLOP/s per device, e.g. 300",
    "compute_efficiency": "a fraction of the peak in (0, 1], e.g. 0.5",
}


def _positive_number(name: str, value) -> None:
    # Finite: YAML's `.inf` / `.nan` are floats, and an infinite peak or bandwidth would
    # price every layout at zero seconds.
    if not is_finite_number(value) or not value > 0:
        hint = NUMBER_HINTS.get(name, "a positive number")
        raise ModelError(f"{name}={value!r} is invalid: expected a finite number > 0. Set {name} to {hint}.")


@dataclass(frozen=True)
class ModelSpec:
    """A GPT-style transformer (Narayanan et al. 2021): its shape decides parameters and activations.

    Args:
        num_layers: Transformer layers (``l``).
        hidden_size: Hidden size (``h``).
        num_attention_heads: Attention heads (``a``); must divide ``hidden_size``.
        seq_length: Tokens per sample (``s``).
        vocab_size: Vocabulary (``v``); 0 for a model without token embedding and logits.
        num_query_groups: Key/value heads (``g``), default ``a``; grouped-query attention
            when smaller, must divide ``a``.
        ffn_hidden_size: MLP width (``f``), default ``4 * h``.
        name: Optional label.
        normalization: ``layernorm`` (weight and bias, ``2h``) or ``rmsnorm`` (weight, ``h``).
        activation: ``gelu`` (fc1 ``h x f``) or ``swiglu`` (gate and up fused, ``h x 2f``).
        position_embedding: ``learned`` (an ``s x h`` table) or ``rope`` (no parameters).
        tie_embeddings: The output layer reuses the embedding; False adds a ``V x h`` matrix.
        bias: Biases of the linear layers (the norms keep theirs either way).
        dropout: Dropout probability in ``[0, 1)``; priced as a 1-byte mask per dropped
            element (Korthikanti et al. 2022) when above 0.
        num_moe_experts: Routed experts of a MoE layer; None (the default) for a dense model.
            The other ``moe_*`` keys (contract C of issue 36, Megatron-core's names; see the
            module docstring) only matter with it: ``moe_router_topk`` (<= experts),
            ``moe_ffn_hidden_size`` (default ``ffn_hidden_size``), ``moe_layer_freq`` (an
            int N or a 0/1 tuple per layer, :attr:`moe_layers`),
            ``moe_shared_expert_intermediate_size``, the router's score function, groups
            (``moe_router_num_groups`` must divide the experts), capacity factor (> 0) ...

    Raises:
        ModelError: a value out of range, with the fix.
    """

    num_layers: int
    hidden_size: int
    num_attention_heads: int
    seq_length: int
    vocab_size: int
    num_query_groups: int | None = None
    ffn_hidden_size: int | None = None
    name: str | None = None
    normalization: str = "layernorm"
    activation: str = "gelu"
    position_embedding: str = "learned"
    tie_embeddings: bool = True
    bias: bool = True
    dropout: float = 0.0
    num_moe_experts: int | None = None
    moe_router_topk: int = 2
    moe_ffn_hidden_size: int | None = None
    moe_layer_freq: int | tuple = 1
    moe_shared_expert_intermediate_size: int | None = None
    moe_router_score_function: str = "softmax"
    moe_router_pre_softmax: bool = False
    moe_aux_loss_coeff: float = 0.0
    moe_z_loss_coeff: float = 0.0
    moe_token_dispatcher_type: str = "alltoall"
    moe_expert_capacity_factor: float | None = None
    moe_router_enable_expert_bias: bool = False
    moe_router_load_balancing_type: str = "aux_loss"
    moe_router_topk_scaling_factor: float | None = None
    moe_router_num_groups: int | None = None
    moe_router_group_topk: int | None = None
    moe_router_bias_update_rate: float = 1e-3
    moe_expert_drop_policy: str = "probs"
    moe_pad_expert_input_to_capacity: bool = False

    def __post_init__(self):
        _choice("normalization", self.normalization, NORMALIZATIONS)
        _choice("activation", self.activation, ACTIVATIONS)
        _choice("position_embedding", self.position_embedding, POSITION_EMBEDDINGS)
        for name in ("tie_embeddings", "bias"):
            if not isinstance(getattr(self, name), bool):
                raise ModelError(f"{name}={getattr(self, name)!r} is invalid: expected true or false.")
        if not is_finite_number(self.dropout) or not 0 <= self.dropout < 1:
            raise ModelError(
                f"dropout={self.dropout!r} is invalid: expected a probability in [0, 1), e.g. 0.1 "
                "(0 disables dropout).")
        for name in ("num_layers", "hidden_size", "num_attention_heads", "seq_length"):
            _positive_int(name, getattr(self, name))
        _positive_int("vocab_size", self.vocab_size, minimum=0)
        if self.num_query_groups is None:
            object.__setattr__(self, "num_query_groups", self.num_attention_heads)
        if self.ffn_hidden_size is None and isinstance(self.hidden_size, int):
            object.__setattr__(self, "ffn_hidden_size", 4 * self.hidden_size)
        _positive_int("num_query_groups", self.num_query_groups)
        _positive_int("ffn_hidden_size", self.ffn_hidden_size)
        heads, groups = self.num_attention_heads, self.num_query_groups
        if self.hidden_size % heads:
            raise ModelError(
                f"hidden_size={self.hidden_size} is not divisible by num_attention_heads={heads}: "
                "every head has hidden_size / heads channels. Use a head count that divides "
                "hidden_size."
            )
        if groups > heads or heads % groups:
            raise ModelError(
                f"num_query_groups={groups} does not divide num_attention_heads={heads}: each "
                "key/value group serves the same number of query heads. Use a divisor of "
                f"{heads} (= {heads} without grouped-query attention)."
            )
        check_moe(self)

    @property
    def is_moe(self) -> bool:
        """The model has routed experts (``num_moe_experts`` is set)."""
        return self.num_moe_experts is not None

    @property
    def moe_layers(self) -> tuple:
        """One bool per layer: True where the layer's MLP is a MoE layer (all False when dense)."""
        return moe_layer_pattern(self.num_layers, self.moe_layer_freq) if self.is_moe else \
            (False,) * self.num_layers

    def is_moe_layer(self, index: int) -> bool:
        """Whether layer ``index`` (0-based) is a MoE layer."""
        return self.moe_layers[index]

    @property
    def num_moe_layers(self) -> int:
        return sum(self.moe_layers)

    @property
    def kv_channels(self) -> int:
        """Channels per head, ``h / a``."""
        return self.hidden_size // self.num_attention_heads


@dataclass(frozen=True)
class TrainingSpec:
    """How the model is trained: batch, precision, optimizer sharding, recomputation.

    Args:
        micro_batch_size: Samples per micro-batch (``b``).
        global_batch_size: Samples per step, ``micro_batch_size * dp`` times the number
            of micro-batches. None: ``micro_batch_size * world_size`` (one micro-batch
            per device, the same samples per step for every layout of a world).
        precision: ``bf16``/``fp16`` (mixed precision, fp32 master weights) or ``fp32``.
        distributed_optimizer: Shard the optimizer state over the dp-cp group (Megatron's
            distributed optimizer / ZeRO-1): the same as ``zero_stage=1`` when ``zero_stage``
            is not given.
        recompute: ``none``, ``selective`` (the attention core) or ``full`` (each layer).
        sequence_parallel: Shard the non-tensor-parallel activations over tp.
        virtual_pipeline_stages: Model chunks per pipeline rank (``v``); above 1 the
            interleaved 1F1B schedule (Narayanan et al. 2021, sec. 2.2.2), which needs
            ``num_layers % (pp * v) == 0`` and micro-batches divisible by pp.
        overlap_grad_reduce: The dp-cp gradient reduction runs during the backward of the
            last micro-batch (Megatron's ``--overlap-grad-reduce``); only what exceeds
            that backward is exposed. False: all of it follows the backward.
            ``plan``/``suggest`` price the overlap only where the library runs it
            (``optimizer.overlap_rules.grad_reduce_overlap``) and say so in a note where
            it does not (:func:`~.runtime.what_runs`).
        overlap_param_gather: ZeRO stages 1-2: the all-gather of the updated weights
            overlaps the next step's forward (Megatron's ``--overlap-param-gather``); only
            what exceeds that forward is exposed. False (the default): it follows the
            optimizer step. Priced where the library runs it
            (``optimizer.overlap_rules.param_gather_overlap``).
        reshard_after_forward: ZeRO stage 3 (``fully_shard``): free each unit's gathered
            weights after its forward and gather them again for its backward (FSDP2's
            default, True): two all-gathers per unit and micro-batch, at most a few units'
            gathered weights alive. False: one gather, kept from the forward to the
            backward (a whole stage's weights alive).
        fsdp_prefetch: ZeRO stage 3: gather the next unit's weights while the current one
            computes (True, the default), so only the first unit's gather is exposed.
            Priced where the library runs it (``fsdp.rules.fsdp_runtime``).
        zero_stage: What the dp-cp group shards (Rajbhandari et al. 2020): 0 nothing,
            1 the optimizer state (with the fp32 main weights), 2 also the gradients,
            3 also the weights (``fully_shard``). None: 1 with ``distributed_optimizer``,
            else 0. After construction it is always an int, it wins over
            ``distributed_optimizer``, which becomes ``zero_stage >= 1``.
        context_parallel_method: ``ulysses``, ``allgather_kv`` or ``ring`` (the default).
        first_stage_layers: Layers of the first model stage (unequal stages), None: even.
        last_stage_layers: Layers of the last model stage, None: even.
        account_for_embedding_in_pipeline_split: The embedding counts as a layer of the
            first stage when the layers are cut (Megatron's option of the same name).
        account_for_loss_in_pipeline_split: The loss counts as a layer of the last stage.
        moe_imbalance: Mixture of experts: the busiest rank's routed (token, expert) rows
            over the mean, >= 1 (default 1.0, perfectly balanced). It multiplies that
            rank's expert FLOPs, dispatched activations and all-to-all bytes.
        moe_static_slots: Mixture of experts: the dropless ``alltoall`` dispatch runs
            compiled (ms.jit / GRAPH_MODE), whose static shapes give each expert a slot of
            all of a rank's tokens: every rank dispatches and computes ``num_experts/topk``
            times ``tokens * topk`` rows, whatever the routing. False (the default): the
            PyNative dispatch, whose slots are sized from the real counts
            (``moe_imbalance``).

    Raises:
        ModelError: a value out of range or an unknown choice.
    """

    micro_batch_size: int = 1
    global_batch_size: int | None = None
    precision: str = "bf16"
    distributed_optimizer: bool = False
    recompute: str = "none"
    sequence_parallel: bool = True
    virtual_pipeline_stages: int = 1
    overlap_grad_reduce: bool = True
    overlap_param_gather: bool = False
    reshard_after_forward: bool = True
    fsdp_prefetch: bool = True
    zero_stage: int | None = None
    context_parallel_method: str = "ring"
    first_stage_layers: int | None = None
    last_stage_layers: int | None = None
    account_for_embedding_in_pipeline_split: bool = False
    account_for_loss_in_pipeline_split: bool = False
    moe_imbalance: float = 1.0
    moe_static_slots: bool = False

    def __post_init__(self):
        _positive_int("micro_batch_size", self.micro_batch_size)
        if not is_finite_number(self.moe_imbalance) or self.moe_imbalance < 1:
            raise ModelError(
                f"moe_imbalance={self.moe_imbalance!r} is invalid: expected a number >= 1, the busiest rank's "
                "routed tokens over the mean (1.0: perfectly balanced experts, e.g. 1.2 for 20 % more).")
        if self.zero_stage is None:
            object.__setattr__(self, "zero_stage", 1 if self.distributed_optimizer is True else 0)
        if isinstance(self.zero_stage, bool) or self.zero_stage not in ZERO_STAGES:
            raise ModelError(
                f"zero_stage={self.zero_stage!r} is invalid: expected 0, 1, 2 or 3 (0 replicates "
                "everything, 1 shards the optimizer state, 2 also the gradients, 3 also the weights).")
        if isinstance(self.distributed_optimizer, bool):
            # zero_stage wins: `replace(training, zero_stage=0)` must not keep a stale flag.
            object.__setattr__(self, "distributed_optimizer", self.zero_stage >= 1)
        _choice("context_parallel_method", self.context_parallel_method, CP_METHODS)
        for name in ("first_stage_layers", "last_stage_layers"):
            if getattr(self, name) is not None:
                _positive_int(name, getattr(self, name))
        for name in ("account_for_embedding_in_pipeline_split", "account_for_loss_in_pipeline_split"):
            if not isinstance(getattr(self, name), bool):
                raise ModelError(f"{name}={getattr(self, name)!r} is invalid: expected true or false.")
        explicit = self.first_stage_layers is not None or self.last_stage_layers is not None
        if explicit and (self.account_for_embedding_in_pipeline_split
                         or self.account_for_loss_in_pipeline_split):
            raise ModelError(
                "first_stage_layers/last_stage_layers and account_for_*_in_pipeline_split cannot be "
                "combined: choose one way to cut the layers.")
        if self.global_batch_size is not None:
            _positive_int("global_batch_size", self.global_batch_size)
        _positive_int("virtual_pipeline_stages", self.virtual_pipeline_stages)
        _choice("precision", self.precision, PRECISIONS)
        _choice("recompute", self.recompute, RECOMPUTE)
        for name in ("distributed_optimizer", "sequence_parallel", "overlap_grad_reduce", "overlap_param_gather",
                     "reshard_after_forward", "fsdp_prefetch", "moe_static_slots"):
            if not isinstance(getattr(self, name), bool):
                raise ModelError(f"{name}={getattr(self, name)!r} is invalid: expected true or false.")


LATENCY_OPS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "send_recv")


def _latency_table(entries) -> tuple:
    """``collective_latency_us`` as a sorted tuple of ``(op, group_size, us)`` triples, checked."""
    hint = ("expected a list of [op, group_size, microseconds] entries, op one of "
            f"{', '.join(LATENCY_OPS)}, group_size an integer >= 2, microseconds a finite number > 0 "
            "(what --calibrate takes from a verify report)")
    if not isinstance(entries, (list, tuple)):
        raise ModelError(f"collective_latency_us={entries!r} is invalid: {hint}.")
    table = {}
    for entry in entries:
        ok = isinstance(entry, (list, tuple)) and len(entry) == 3
        op, n, us = entry if ok else (None, None, None)
        if not (ok and op in LATENCY_OPS and isinstance(n, int) and not isinstance(n, bool) and n >= 2
                and is_finite_number(us) and us > 0):
            raise ModelError(f"collective_latency_us={entries!r} is invalid: entry {entry!r}: {hint}.")
        if (op, n) in table:
            raise ModelError(f"collective_latency_us={entries!r} is invalid: ({op}, {n}) is listed twice; "
                             "keep one latency per op and group size.")
        table[(op, n)] = float(us)
    return tuple((op, n, us) for (op, n), us in sorted(table.items()))


# Without a device preset: the cost model's generic accelerator.
CLUSTER_DEFAULTS = {
    "device_memory_gb": 64, "intra_node_gbps": 90, "inter_node_gbps": 25,
    "intra_node_latency_us": 10, "inter_node_latency_us": 20, "peak_tflops": 300,
}
DEFAULT_COMPUTE_EFFICIENCY = 0.5


@dataclass(frozen=True)
class ClusterSpec:
    """The devices: memory, compute and per-device links (achievable bus bandwidth, latency).

    Every value left None comes from the ``device`` preset
    (:data:`~mindscience.distributed.costmodel.devices.DEVICE_PRESETS`), else from
    :data:`CLUSTER_DEFAULTS`; values given explicitly override the preset.

    Args:
        device: A preset name (``ascend-910b``, ``a100-80gb``, ``h100-80gb``, ``h200``,
            ``cpu``) or None.
        device_memory_gb: Memory per device in GiB.
        intra_node_gbps: Per-device bandwidth between devices of one node, GB/s.
        inter_node_gbps: Per-device bandwidth between nodes, GB/s.
        devices_per_node: Devices per node for ``msdist suggest`` (a layout brings its own).
        peak_tflops: Dense bf16/fp16 TFLOP/s per device (the MFU denominator).
        compute_efficiency: Fraction of the peak a transformer layer's matmuls reach,
            in (0, 1]; 0.5 by default (Megatron reaches 0.42-0.56 of an A100's peak on
            GPT models of 22B-1T parameters, Korthikanti et al. 2022).
        intra_node_latency_us: Time of one small collective inside a node, microseconds.
        inter_node_latency_us: The same across nodes.
        cores_per_node: CPU cores the ranks of one node share (the ``cpu`` preset: this
            machine's, :func:`~.devices.local_cores`); None (accelerators): every rank has a
            device of its own. With more ranks than cores on a node, each rank runs
            ``ranks / cores`` times slower (:meth:`oversubscription`): its compute, its
            operator launches and its collectives, which wait for ranks that are not running.
        op_overhead_us: Framework time of one operator launch on a core of its own
            (microseconds, >= 0): the step model adds it per operator of a layer pass and
            of the optimizer step (:func:`~.steptime.step_operators`). 0 (accelerators):
            launches overlap the device's work.
        collective_latency_us: Optional, measured per collective inside a node: a tuple of
            ``(op, group_size, microseconds)`` (``op`` as the traffic rows name it:
            ``all_reduce``, ``all_gather``, ``reduce_scatter``, ``all_to_all``,
            ``send_recv``), what ``--calibrate`` takes from a verify sweep. A call of
            ``op`` on ``n`` ranks costs the listed latency of ``n``, interpolated linearly
            in ``log2(n)`` between listed sizes and the nearest listed size outside them;
            an op that is not listed costs ``intra_node_latency_us``
            (:meth:`collective_latency_s`).

    Raises:
        ModelError: an unknown device or a value that is not positive.

    Example:
        >>> c = ClusterSpec(device="a100-80gb", inter_node_gbps=12.5)
        >>> (c.peak_tflops, c.device_memory_gb, c.inter_node_gbps, c.compute_efficiency)
        (312.0, 80, 12.5, 0.5)
    """

    device_memory_gb: float | None = None
    intra_node_gbps: float | None = None
    inter_node_gbps: float | None = None
    devices_per_node: int | None = None
    device: str | None = None
    peak_tflops: float | None = None
    compute_efficiency: float | None = None
    intra_node_latency_us: float | None = None
    inter_node_latency_us: float | None = None
    collective_latency_us: tuple | None = None
    cores_per_node: int | None = None
    op_overhead_us: float | None = None

    def __post_init__(self):
        preset = {}
        if self.device is not None:
            if self.device not in DEVICE_PRESETS:
                raise ModelError(
                    f"device={self.device!r} is invalid: expected one of {', '.join(device_names())}, "
                    "or leave it out and set peak_tflops and the bandwidths yourself.")
            preset = DEVICE_PRESETS[self.device]
        for name in PRESET_KEYS:
            if getattr(self, name) is None:
                object.__setattr__(self, name, preset.get(name, CLUSTER_DEFAULTS[name]))
        if self.compute_efficiency is None:
            object.__setattr__(self, "compute_efficiency", DEFAULT_COMPUTE_EFFICIENCY)
        for name in PRESET_KEYS:
            _positive_number(name, getattr(self, name))
        _positive_number("compute_efficiency", self.compute_efficiency)
        if self.compute_efficiency > 1:
            raise ModelError(
                f"compute_efficiency={self.compute_efficiency!r} is invalid: expected a fraction of the "
                "peak in (0, 1], e.g. 0.5. To model a faster device raise peak_tflops instead.")
        if self.devices_per_node is not None:
            _positive_int("devices_per_node", self.devices_per_node)
        if self.collective_latency_us is not None:
            object.__setattr__(self, "collective_latency_us", _latency_table(self.collective_latency_us))
        if self.cores_per_node is None and preset.get("cores_per_node") == "local":
            object.__setattr__(self, "cores_per_node", local_cores())
        if self.cores_per_node is not None:
            _positive_int("cores_per_node", self.cores_per_node)
        if self.op_overhead_us is None:
            object.__setattr__(self, "op_overhead_us", preset.get("op_overhead_us", 0.0))
        if not is_finite_number(self.op_overhead_us) or self.op_overhead_us < 0:
            raise ModelError(
                f"op_overhead_us={self.op_overhead_us!r} is invalid: expected a finite number >= 0, the "
                "microseconds of one operator launch (0 on accelerators, whose launches overlap their work).")

    def oversubscription(self, ranks_on_node: int) -> float:
        """How many times slower a rank runs when ``ranks_on_node`` ranks share the node's cores.

        ``ranks / cores_per_node`` when above 1 (the cores are time-shared: a rank computes,
        launches operators and answers its collectives a ``cores/ranks`` share of the time),
        else 1; always 1 without ``cores_per_node`` (a device per rank).

            >>> c = ClusterSpec(device="cpu", cores_per_node=2)
            >>> c.oversubscription(8), c.oversubscription(2), c.oversubscription(1)
            (4.0, 1.0, 1.0)
        """
        if not self.cores_per_node:
            return 1.0
        return max(1.0, ranks_on_node / self.cores_per_node)

    def collective_latency_s(self, op: str, group_size: int, crosses: bool = False) -> float:
        """Seconds of one small call of ``op`` on ``group_size`` ranks.

        Across nodes: ``inter_node_latency_us``. Inside a node: the ``collective_latency_us``
        entries of ``op``, linear in ``log2(group_size)`` between the two listed sizes
        around it (the nearest listed size outside them); ``intra_node_latency_us`` when
        ``op`` is not listed.

            >>> c = ClusterSpec(collective_latency_us=(("all_reduce", 2, 100.0), ("all_reduce", 8, 400.0)))
            >>> [round(c.collective_latency_s("all_reduce", n) * 1e6, 6) for n in (2, 4, 8, 16)]
            [100.0, 250.0, 400.0, 400.0]
            >>> c.collective_latency_s("send_recv", 2) * 1e6  # not listed: intra_node_latency_us
            10.0
        """
        if crosses:
            return self.inter_node_latency_us * 1e-6
        points = sorted((n, us) for o, n, us in self.collective_latency_us or () if o == op)
        if not points:
            return self.intra_node_latency_us * 1e-6
        x = math.log2(group_size)
        if x <= math.log2(points[0][0]):
            return points[0][1] * 1e-6
        for (n0, t0), (n1, t1) in zip(points, points[1:]):
            x0, x1 = math.log2(n0), math.log2(n1)
            if x <= x1:
                return (t0 + (t1 - t0) * (x - x0) / (x1 - x0)) * 1e-6
        return points[-1][1] * 1e-6

    @property
    def device_memory_bytes(self) -> int:
        return int(self.device_memory_gb * GIB)

    @property
    def effective_flops(self) -> float:
        """FLOP/s a layer's matmuls reach on one device: ``peak_tflops * compute_efficiency``."""
        return self.peak_tflops * self.compute_efficiency * 1e12


@dataclass(frozen=True)
class Workload:
    """A model with its training and cluster: everything the estimates read besides the layout.

    ``model`` is None for a layout file without a ``model:`` section. ``cluster_keys``
    names the cluster values a file set explicitly (the rest came from the device preset
    or the defaults; see :func:`~.calibrate.cluster_sources`).
    """

    model: ModelSpec | None = None
    training: TrainingSpec = field(default_factory=TrainingSpec)
    cluster: ClusterSpec = field(default_factory=ClusterSpec)
    source: str | None = None
    cluster_keys: tuple = ()


# section -> (dataclass, {key: (accepted types, human type)})
_INT, _NUM, _BOOL, _STR = ((int,), "an integer"), ((int, float), "a number"), ((bool,), "true or false"), ((str,), "a string")
_MODEL_TYPES = {
    "name": _STR, "normalization": ((str,), "one of layernorm, rmsnorm"),
    "activation": ((str,), "one of gelu, swiglu"), "position_embedding": ((str,), "one of learned, rope"),
    "tie_embeddings": _BOOL, "bias": _BOOL, "dropout": _NUM,
    "moe_layer_freq": ((int, list), "an integer N (every N-th layer) or a list of 0/1 per layer"),
    "moe_router_score_function": ((str,), "one of softmax, sigmoid"),
    "moe_router_load_balancing_type": ((str,), "one of aux_loss, seq_aux_loss, none"),
    "moe_token_dispatcher_type": ((str,), "one of alltoall, allgather"),
    "moe_expert_drop_policy": ((str,), "one of probs, position"),
    "moe_router_pre_softmax": _BOOL, "moe_router_enable_expert_bias": _BOOL,
    "moe_pad_expert_input_to_capacity": _BOOL,
    "moe_aux_loss_coeff": _NUM, "moe_z_loss_coeff": _NUM, "moe_expert_capacity_factor": _NUM,
    "moe_router_topk_scaling_factor": _NUM, "moe_router_bias_update_rate": _NUM,
}
MOE_KEYS = tuple(f.name for f in fields(ModelSpec) if f.name.startswith(("moe_", "num_moe_")))
_SCHEMAS = {
    "model": (ModelSpec, {f.name: _MODEL_TYPES.get(f.name, _INT) for f in fields(ModelSpec)}),
    "training": (TrainingSpec, {
        "micro_batch_size": _INT, "global_batch_size": _INT, "precision": ((str,), "one of bf16, fp16, fp32"),
        "distributed_optimizer": _BOOL, "recompute": ((str,), "one of none, selective, full"),
        "sequence_parallel": _BOOL, "virtual_pipeline_stages": _INT, "overlap_grad_reduce": _BOOL,
        "overlap_param_gather": _BOOL, "reshard_after_forward": _BOOL, "fsdp_prefetch": _BOOL,
        "zero_stage": ((int,), "one of 0, 1, 2, 3"),
        "context_parallel_method": ((str,), "one of ulysses, allgather_kv, ring"),
        "first_stage_layers": _INT, "last_stage_layers": _INT,
        "account_for_embedding_in_pipeline_split": _BOOL, "account_for_loss_in_pipeline_split": _BOOL,
        "moe_imbalance": _NUM, "moe_static_slots": _BOOL,
    }),
    "cluster": (ClusterSpec, {
        "device": ((str,), f"a device preset ({', '.join(device_names())})"),
        "device_memory_gb": _NUM, "intra_node_gbps": _NUM, "inter_node_gbps": _NUM, "devices_per_node": _INT,
        "peak_tflops": _NUM, "compute_efficiency": _NUM, "intra_node_latency_us": _NUM,
        "inter_node_latency_us": _NUM,
        "collective_latency_us": ((list, tuple), "a list of [op, group_size, microseconds] entries"),
        "cores_per_node": _INT, "op_overhead_us": _NUM,
    }),
}
_OPTIONAL = {"num_query_groups", "ffn_hidden_size", "name", "global_batch_size", "devices_per_node", "device",
             "cores_per_node", "op_overhead_us",
             *PRESET_KEYS, "compute_efficiency", "zero_stage", "first_stage_layers", "last_stage_layers",
             "normalization", "activation", "position_embedding", "tie_embeddings", "bias", "dropout", *MOE_KEYS}
_LOWERED = {"precision", "recompute", "context_parallel_method", "normalization", "activation",
            "position_embedding", "moe_router_score_function", "moe_router_load_balancing_type",
            "moe_token_dispatcher_type", "moe_expert_drop_policy"}


def section_from_mapping(section: str, data, source: str):
    """Build the spec of one section (``"model"``, ``"training"`` or ``"cluster"``).

    Raises:
        ModelFileError: not a mapping, an unknown key, a wrong type, or an invalid value;
            the message names ``source`` and the dotted key.
    """
    cls, schema = _SCHEMAS[section]
    if not isinstance(data, dict):
        raise ModelFileError(
            f"{source}: section {section!r} is {type(data).__name__}: expected a mapping of "
            f"{', '.join(schema)}.", source, section)
    for key, value in data.items():
        dotted = f"{section}.{key}"
        if key not in schema:
            raise ModelFileError(
                f"{source}: unknown key {dotted!r}: expected one of {', '.join(schema)}. Remove it "
                "or fix its spelling.", source, dotted)
        types, expected = schema[key]
        if value is None and key in _OPTIONAL:
            continue
        if (isinstance(value, bool) and bool not in types) or not isinstance(value, types):
            raise ModelFileError(
                f"{source}: key {dotted!r} has value {value!r} ({type(value).__name__}): expected "
                f"{expected}.", source, dotted)
    kwargs = {k: v for k, v in data.items() if v is not None}
    if section == "model":
        missing = [f.name for f in fields(ModelSpec) if f.name not in kwargs and f.name not in _OPTIONAL]
        if missing:
            raise ModelFileError(
                f"{source}: key 'model.{missing[0]}' is missing: expected the model's "
                f"{missing[0]} (required: {', '.join(missing)}).", source, f"model.{missing[0]}")
    kwargs = {k: v.lower() if k in _LOWERED else v for k, v in kwargs.items()}
    if section == "training" and kwargs.get("distributed_optimizer") is True and kwargs.get("zero_stage") == 0:
        raise ModelFileError(
            f"{source}: training.zero_stage=0 contradicts training.distributed_optimizer=true (which "
            "shards the optimizer state, stage 1): drop one of them.", source, "training.zero_stage")
    try:
        return cls(**kwargs)
    except ModelError as err:
        key = str(err).split("=", 1)[0]
        raise ModelFileError(f"{source}: {section}.{err}", source, f"{section}.{key}") from None


def workload_from_mapping(data, source: str = "<model>", base: Workload | None = None) -> Workload:
    """The workload described by the sections of ``data``; absent sections come from ``base``.

    ``data`` is a parsed layout file or model file: besides the three sections it may hold
    the layout keys (ignored here). Without a model name the file's stem is used.

    Raises:
        ModelFileError: an unknown top-level key or a bad section.
    """
    if not isinstance(data, dict):
        raise ModelFileError(
            f"{source}: expected a mapping with a 'model' section, got {type(data).__name__}.", source)
    for key in data:
        if key not in SECTIONS and key not in LAYOUT_KEYS:
            raise ModelFileError(
                f"{source}: unknown key {key!r}: expected the sections {', '.join(SECTIONS)} (and "
                "optionally layout keys). Remove it or fix its spelling.", source, str(key))
    base = base or Workload()
    specs = {s: section_from_mapping(s, data[s], source) for s in SECTIONS if s in data}
    model = specs.get("model", base.model)
    if "model" in specs and model.name is None:
        model = replace(model, name=str(data.get("name") or Path(source).stem))
    section = data.get("cluster")
    return Workload(
        model=model,
        training=specs.get("training", base.training),
        cluster=specs.get("cluster", base.cluster),
        source=source if "model" in specs else base.source,
        cluster_keys=tuple(k for k, v in section.items() if v is not None) if "cluster" in specs
        else base.cluster_keys,
    )


def workload_sections(workload: Workload) -> dict:
    """The workload as the ``model``/``training``/``cluster`` mappings a YAML file holds
    (what :func:`workload_from_mapping` reads back)."""
    sections = {}
    for key in SECTIONS:
        spec = getattr(workload, key)
        if spec is not None:
            # Tuples (a calibrated collective_latency_us) as lists: what YAML writes and reads back.
            # (and moe_layer_freq's tuple of 0/1 as a list of ints).
            sections[key] = {k: [list(e) if isinstance(e, tuple) else e for e in v] if isinstance(v, tuple) else v
                             for k, v in asdict(spec).items() if v is not None}
    return sections


def load_workload(path: str | os.PathLike, base: Workload | None = None) -> Workload:
    """Read a model file (a YAML with a ``model:`` section, optionally ``training:``/``cluster:``).

    Raises:
        ModelFileError: missing file, bad YAML, no ``model`` section, or a bad value.
    """
    path = os.fspath(path)
    try:
        data = read_yaml_mapping(path, what="model")
    except ModelFileError:
        raise
    except ValueError as err:
        raise ModelFileError(str(err), path) from None
    if not isinstance(data, dict) or "model" not in data:
        raise ModelFileError(
            f"{path}: no 'model' section: a model file holds 'model:' (num_layers, hidden_size, "
            "num_attention_heads, seq_length, vocab_size) and optionally 'training:' and 'cluster:'.",
            path, "model")
    return workload_from_mapping(data, path, base)
