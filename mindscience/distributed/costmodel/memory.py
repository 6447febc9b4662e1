"""Per-rank memory of one pipeline stage: parameters, weights, gradients, optimizer, activations.

Sources (the derivations are in docs/COST_MODEL.md):

* parameters: :mod:`.params` (the structure ``GPTModel`` builds; Narayanan et al. 2021's
  ``12 l h^2 (1 + 13/(12h) + (V + s)/(12 l h))`` for the GPT defaults);
* bytes per parameter: contract C2, what ``DistributedOptimizer`` allocates at ZeRO stages
  0-3 (``18`` for mixed-precision Adam at stage 0, ``6 + 12/d`` at stage 1, Megatron's
  theoretical memory report and Rajbhandari et al. 2020);
* activations: Korthikanti et al. 2022, "Reducing Activation Recomputation in Large
  Transformer Models", Table 2 and section 4.3, with 1F1B's micro-batches in flight.

Worked example (GPT-3 175B with dropout, tp=8, pp=8, sequence parallelism, selective
recomputation): one layer holds ``s*b*h*34/t = 2048*1*12288*34/8`` bytes of activations
per micro-batch::

    >>> from mindscience.distributed.costmodel.spec import ModelSpec, TrainingSpec
    >>> gpt3 = ModelSpec(num_layers=96, hidden_size=12288, num_attention_heads=96,
    ...                  seq_length=2048, vocab_size=51200, dropout=0.1)
    >>> layer_activation_bytes(gpt3, TrainingSpec(recompute="selective"), tp=8, cp=1)
    106954752
    >>> total_parameters(gpt3)
    174615846912
"""

from __future__ import annotations

from dataclasses import replace

from .params import (embedding_parameters, expert_fc1_width, layer_parameters, mlp_fc1_width, model_stage_layers,
                     rank_layers, rank_moe_layers, stage_counts, stage_expert_counts, stage_parameters,
                     stage_units, total_parameters)
from .moe_spec import dispatch_imbalance
from .runtime import main_weight_bytes
from .spec import ModelSpec, TrainingSpec

__all__ = ["embedding_parameters", "layer_parameters", "stage_parameters", "total_parameters",
           "bytes_per_parameter", "layer_activation_bytes", "stage_rows"]

# precision -> bytes of one model parameter (weights) and of one activation element.
BYTES = {
    "bf16": {"weights": 2, "activation": 2},
    "fp16": {"weights": 2, "activation": 2},
    "fp32": {"weights": 4, "activation": 4},
}
GRADIENT_BYTES = 4  # the fp32 reduced gradient (contract C2)
MAIN_WEIGHT_BYTES = 4  # fp32 main weights
ADAM_MOMENT_BYTES = 8  # exp_avg + exp_avg_sq in fp32
TOKEN_ID_BYTES = 8  # int64 input ids
LOGIT_BYTES = 4  # the cross-entropy keeps fp32 logits
MASK_BYTES = 1  # a dropout mask element
ROUTER_BYTES = 4  # the router's logits and probabilities are kept in fp32


def bytes_per_parameter(precision: str, zero_stage: int, d: int) -> dict:
    """Bytes per local parameter element a rank holds (contract C2), ``d`` = optimizer group size.

    Weights ``w`` (stage 3: ``w/d``); fp32 gradients 4 (stages 2-3: ``4/d``); Adam's
    moments 8 plus the fp32 main weights the optimizer keeps
    (:func:`~.runtime.main_weight_bytes`: 4 for 16-bit weights; for fp32 weights 0 at
    stage 0, and at stages 1-3 0 where the optimizer uses its own shard as the main
    weights, else 4), all ``/d`` at stages 1-3. Exact for parameters whose dim 0 divides
    by ``d``; :func:`stage_rows` counts the padded shards instead.

        >>> [sum(bytes_per_parameter("bf16", z, 8).values()) for z in range(4)]
        [18, 7.5, 4.0, 2.25]
    """
    w = BYTES[precision]["weights"]
    main = main_weight_bytes(w, zero_stage)
    optimizer = ADAM_MOMENT_BYTES + main
    return {
        "weights": w / d if zero_stage >= 3 else w,
        "gradients": GRADIENT_BYTES / d if zero_stage >= 2 else GRADIENT_BYTES,
        "optimizer": optimizer / d if zero_stage >= 1 else optimizer,
    }


def layer_activation_bytes(model: ModelSpec, training: TrainingSpec, tp: int, cp: int) -> int:
    """Activation bytes one layer keeps per micro-batch on one rank (Korthikanti Table 2).

    In bytes per ``s*b*h`` element at 16 bits with dropout: 10 not split by tp (norm and
    linear inputs, 2 dropout masks), 24 split by tp (Q, K, V, projection input, MLP), and
    ``4*a*s/h`` for the attention scores and probabilities the dense core keeps
    (Korthikanti's ``5as/h`` less the attention-dropout mask and copy, which the library
    does not have; 0 for the ring attention at ``cp > 1``, which recomputes them):

    * no recomputation: ``10 + 24/t + 4as/(ht)``; with sequence parallelism
      ``34/t + 4as/(ht)``;
    * selective (attention core recomputed): ``10 + 24/t``, ``34/t`` with sequence parallelism;
    * full: ``2`` (the layer input), ``2/t`` with sequence parallelism.

    Generalisations (exact at ``g = a``, ``f = 4h``, gelu, 16 bits, ``cp = 1``, dropout):
    the split 24 is ``2*(2 + 2g/a + 2f/h)``, SwiGLU keeps its fused ``2f`` input and ``f``
    output (``2*(2 + 2g/a + 3f/h)``); without dropout (``model.dropout == 0``, the default)
    the two masks are gone (``8 + 24/t``); at 32 bits every
    non-mask term doubles; the sequence in the ``s*b*h`` factor is the rank's ``s/cp``,
    while Ulysses attention holds ``a/(t*cp)`` heads over the full ``s``.
    """
    h, a, b = model.hidden_size, model.num_attention_heads, training.micro_batch_size
    nbytes = BYTES[training.precision]["activation"]
    masks = MASK_BYTES if model.dropout > 0 else 0
    local = model.seq_length // cp
    sbh = local * b * h
    sp = training.sequence_parallel and tp > 1
    if training.recompute == "full":
        return nbytes * sbh // (tp if sp else 1)
    kv = 2 * model.num_query_groups * model.kv_channels
    replicated = (4 * nbytes + 2 * masks) * sbh  # 4 activations + 2 dropout masks
    mlp = mlp_fc1_width(model) + model.ffn_hidden_size  # fc1 output (activation input) + fc2 input
    split = nbytes * local * b * (2 * h + kv + mlp)
    total = (replicated + split) // tp if sp else replicated + split // tp
    if training.recompute == "none" and not ring_attention(training, cp):
        # The dense core keeps its scores and probabilities, a/t heads x s/cp queries x s keys
        # (the library has no attention dropout, so Korthikanti's mask and dropped copy are not there).
        total += 2 * nbytes * a * model.seq_length * local * b // tp
    return total


def dispatched_tokens(model: ModelSpec, training: TrainingSpec, tp: int, cp: int, etp: int) -> float:
    """(token, expert) rows one rank's experts process per MoE layer and micro-batch, on the busiest rank.

    A rank routes its ``s/cp * b / tp`` tokens (sequence parallelism shards them over tp) to
    ``topk`` experts each; balanced over the ``ep`` ranks it receives as many as it sent,
    and the etp all-gather brings the etp ranks' together: ``s/cp * b / tp * topk * etp``,
    times ``training.moe_imbalance`` (>= 1: the busiest rank's load over the mean), or
    ``num_experts/topk`` with ``moe_static_slots`` (:func:`~.moe_spec.dispatch_imbalance`).
    """
    tokens = model.seq_length // cp * training.micro_batch_size / tp
    return tokens * model.moe_router_topk * etp * dispatch_imbalance(model, training)


def moe_layer_activation_bytes(model: ModelSpec, training: TrainingSpec, tp: int, cp: int,
                               etp: int | None = None) -> int:
    """Activation bytes a MoE layer keeps per micro-batch on one rank.

    The dense layer's (:func:`layer_activation_bytes`) with its MLP term replaced by
    the shared experts' (the same formula at width ``moe_shared_expert_intermediate_size``,
    nothing without them), plus the routed experts' on their ``R`` dispatched rows
    (:func:`dispatched_tokens`): the permuted input and the expert output ``2 h``, ``w1``'s
    output ``F_e / etp`` and ``w2``'s input ``f_e / etp`` per row, ``R (2h + (F_e + f_e)/etp)``
    values, and the router's fp32 logits and probabilities ``2 * 4 * E`` bytes per local
    token. Full recomputation keeps only the layer input, as for a dense layer.
    """
    etp = tp if etp is None else etp
    dense = layer_activation_bytes(model, training, tp, cp)
    if training.recompute == "full":
        return dense
    nbytes = BYTES[training.precision]["activation"]
    local = model.seq_length // cp * training.micro_batch_size
    shared = model.moe_shared_expert_intermediate_size or 0
    shared_mlp = (2 if model.activation == "swiglu" else 1) * shared + shared
    mlp_delta = nbytes * local * (mlp_fc1_width(model) + model.ffn_hidden_size - shared_mlp)
    rows = dispatched_tokens(model, training, tp, cp, etp)
    experts = nbytes * rows * (2 * model.hidden_size + (expert_fc1_width(model) + model.moe_ffn_hidden_size) / etp)
    router = 2 * ROUTER_BYTES * local / tp * model.num_moe_experts
    return round(dense - mlp_delta / tp + experts + router)


def ring_attention(training: TrainingSpec, cp: int) -> bool:
    """The ring runs (``cp > 1``): it keeps no scores and recomputes them in its backward."""
    return cp > 1 and training.context_parallel_method == "ring"


def working_set_bytes(model: ModelSpec, training: TrainingSpec, tp: int, cp: int) -> int:
    """Recomputed activations of the one layer whose backward runs (not in Table 2).

    Full recomputation rebuilds a whole layer, selective its attention scores; without
    recomputation nothing is rebuilt.
    """
    if training.recompute == "none":
        return 0
    everything = layer_activation_bytes(model, replace(training, recompute="none"), tp, cp)
    if training.recompute == "full":
        return everything
    return everything - layer_activation_bytes(model, training, tp, cp)


def gathered_bytes(model: ModelSpec, training: TrainingSpec, tp: int, params: int,
                   units: tuple | None = None, units_alive: int | None = None) -> int:
    """ZeRO-3's gathered weights alive at once on one rank, in bytes; 0 below stage 3.

    ``units_alive`` None (``fully_shard`` keeping what it gathers, ``reshard_after_forward=False``):
    a stage's full (tp-local) weights, ``w * params``: each unit is gathered for a
    micro-batch's forward and autodiff keeps the gathered tensors until that backward
    (micro-batches run forward-to-backward one at a time on a single stage). Otherwise
    (per-unit gathers, each leaf unit freed after its forward and gathered again for its
    backward; ``fsdp.rules``): the root unit's weights (embeddings, head: alive throughout)
    and the ``units_alive`` largest leaf units, of ``units`` = ``(leaves, root)`` from
    :func:`~.params.stage_units`, ``w`` bytes per parameter.

        >>> m = ModelSpec(num_layers=2, hidden_size=4, num_attention_heads=1, seq_length=2, vocab_size=0)
        >>> z3 = TrainingSpec(zero_stage=3, precision="fp32")
        >>> leaves, root = [(240, 0, 0), (240, 0, 0), (240, 0, 0)], (20, 0, 0)
        >>> gathered_bytes(m, z3, 1, 740), gathered_bytes(m, z3, 1, 740, (leaves, root), 2)
        (2960, 2000)
    """
    if training.zero_stage < 3:
        return 0
    w = BYTES[training.precision]["weights"]
    if units_alive is None or units is None:
        return w * params
    leaves, root = units
    return w * (root[0] + sum(sorted((u[0] for u in leaves), reverse=True)[:units_alive]))


def edge_activation_bytes(model: ModelSpec, training: TrainingSpec, tp: int, cp: int) -> tuple[int, int]:
    """Per micro-batch extras of ``(the first stage, the last stage)`` (Korthikanti sec. 4.3).

    First: int64 token ids ``8sb`` and, with dropout, the embedding dropout mask ``sbh``
    (``/t`` with sequence parallelism). Last: the final norm's and the output layer's
    inputs ``2 * 2sbh`` (``/t`` with sequence parallelism) and fp32 logits ``4sbv/t``: at
    16 bits and with sequence parallelism, Korthikanti's ``4sbh/t * (1 + v/h)``.
    """
    b, h = training.micro_batch_size, model.hidden_size
    local = model.seq_length // cp
    nbytes = BYTES[training.precision]["activation"]
    shard = tp if training.sequence_parallel and tp > 1 else 1
    mask = MASK_BYTES * local * b * h // shard if model.dropout > 0 else 0
    first = TOKEN_ID_BYTES * local * b + mask
    last = 2 * nbytes * local * b * h // shard + LOGIT_BYTES * local * b * model.vocab_size // tp
    return first, last


def num_microbatches(training: TrainingSpec, dp: int, world_size: int) -> int:
    """Micro-batches per step and data-parallel rank, ``gbs / (b * dp)``.

    Without a global batch it is ``b * world_size`` (one micro-batch per device), so every
    layout of a world trains the same samples per step and their step times compare.
    """
    gbs = training.global_batch_size or training.micro_batch_size * world_size
    return max(1, gbs // (training.micro_batch_size * dp))


def pipeline_bubble(pp: int, microbatches: int, virtual_stages: int = 1) -> float:
    """Idle time relative to the compute: 1F1B ``(pp - 1) / m``, interleaved ``(pp - 1) / (v m)``
    (Narayanan et al. 2021, sec. 2.2)."""
    return (pp - 1) / (virtual_stages * microbatches)


def in_flight(pp: int, stage: int, microbatches: int) -> int:
    """Micro-batches whose activations stage ``stage`` holds at once under 1F1B: ``min(pp - stage, m)``."""
    return min(pp - stage, microbatches)


def layers_in_flight(layers: int, pp: int, stage: int, microbatches: int, virtual_stages: int = 1) -> float:
    """Layer activations (layers x micro-batches) pipeline rank ``stage`` holds at its peak.

    ``layers``: the rank's layers (all its chunks). 1F1B: ``layers`` of ``min(p - i, m)``
    micro-batches. Interleaved with ``v`` chunks (``layers / v`` each on average):
    Megatron's warm-up runs ``2 (p - i - 1) + (v - 1) p`` chunk forwards before the first
    backward, so ``2 (p - i - 1) + (v - 1) p + 1`` chunks are in flight (at most ``v m``);
    on the first stage that is ``1 + (p - 1)/(p v)`` times 1F1B's, Megatron's interleaving
    memory penalty.

        >>> layers_in_flight(4, 4, 0, 8), layers_in_flight(4, 4, 0, 8, virtual_stages=2)
        (16, 22.0)
    """
    if virtual_stages <= 1 or pp <= 1:
        return layers * in_flight(pp, stage, microbatches)
    chunks = min(2 * (pp - stage - 1) + (virtual_stages - 1) * pp + 1, virtual_stages * microbatches)
    return layers / virtual_stages * chunks


def stage_input_bytes(model: ModelSpec, training: TrainingSpec, tp: int, cp: int) -> int:
    """One micro-batch's stage input, ``s/cp * b * h`` values (``/t`` with sequence parallelism)."""
    sp = training.sequence_parallel and tp > 1
    local = model.seq_length // cp * training.micro_batch_size * model.hidden_size
    return BYTES[training.precision]["activation"] * local // (tp if sp else 1)


def stage_rows(model: ModelSpec, training: TrainingSpec, tp: int, cp: int, pp: int, dp: int,
               communicator_bytes: int = 0, runtime=None, ep: int = 1, etp: int | None = None) -> list[dict]:
    """One memory row per pipeline rank (the JSON ``memory.stages``), in bytes per rank.

    Weights, gradients and optimizer state follow :func:`bytes_per_parameter` (contract
    C2) with the ZeRO shards counted per parameter, padding included (contract C1):
    ``sharded`` = :func:`~.params.sharded_elements` over ``d = dp * cp``. Layers per rank
    follow the training's stage cut, so an unequal first or last stage shows here.

    ``runtime`` (:class:`~.runtime.Runtime`, from :func:`~.runtime.what_runs`): with
    ``stage_recompute`` the pipeline runtime keeps one stage input per chunk in flight
    (token ids on the first stage) and the activations of one micro-batch of its largest
    chunk while that chunk's re-run forward and backward run; without it, Korthikanti's
    layers x micro-batches in flight.

    Mixture of experts (``ep``, ``etp``; etp None = tp): the routed experts of a rank's
    MoE layers (:func:`~.params.stage_expert_counts`, ``E/ep`` experts of width
    ``f_e/etp``) add their weights, gradients and optimizer state, the state sharded at
    ZeRO stages >= 1 and the gradients at >= 2 over the expert data-parallel group
    ``edp = world / (etp * ep * pp)`` (not dp-cp);
    ``expert_parameters``/``expert_bytes`` say how much of the row they are. At stage 3
    the experts are priced as at stage 2 (weights whole): ``DistributedOptimizer`` keeps them
    in a second optimizer over edp and ``fully_shard`` leaves them whole. A MoE layer's
    activations are :func:`moe_layer_activation_bytes` (the stage's layers in flight are
    priced at the mean of its dense and MoE layers).
    """
    w = BYTES[training.precision]["weights"]
    stage_z, d = training.zero_stage, dp * cp
    etp = tp if etp is None else etp
    world = tp * cp * pp * dp
    edp = max(1, world // (etp * ep * pp))
    experts = stage_expert_counts(model, training, pp, etp, ep, edp)
    moe_per_rank = rank_moe_layers(model, training, pp)
    moe_layer = moe_layer_activation_bytes(model, training, tp, cp, etp) if model.is_moe else 0
    main = main_weight_bytes(w, stage_z)
    dense_layer = layer_activation_bytes(model, training, tp, cp)
    first, last = edge_activation_bytes(model, training, tp, cp)
    ids = TOKEN_ID_BYTES * model.seq_length // cp * training.micro_batch_size
    working = working_set_bytes(model, training, tp, cp)
    m = num_microbatches(training, dp, tp * cp * pp * dp)
    v = training.virtual_pipeline_stages if pp > 1 else 1
    per_rank = rank_layers(model, training, pp)
    chunk_layers = model_stage_layers(model, training, pp)
    recomputing = runtime is not None and runtime.stage_recompute and pp > 1
    rows = []
    counts = stage_counts(model, tp, pp, d, training)
    fsdp_units = stage_z >= 3 and d > 1 and runtime is not None and runtime.fsdp_units
    units = stage_units(model, tp, pp, d, training) if fsdp_units else None
    for stage in range(pp):
        params, sharded, _ = counts[stage]
        flying = in_flight(pp, stage, m)
        mine = per_rank[stage]
        moe = moe_per_rank[stage]
        # The stage's layers priced at the mean of its dense and MoE layers.
        layer = dense_layer if not moe else (dense_layer * (mine - moe) + moe_layer * moe) / mine
        if recomputing:
            chunks = layers_in_flight(v, pp, stage, m, v)  # chunk inputs held
            inputs = flying * ids + (chunks - flying) * stage_input_bytes(model, training, tp, cp) \
                if stage == 0 else chunks * stage_input_bytes(model, training, tp, cp)
            largest = max(chunk_layers[stage::pp])
            activations = round(inputs + largest * layer) + (working if largest else 0)
            activations += first - ids if stage == 0 else 0  # the embedding's own, one micro-batch
        else:
            held = layers_in_flight(mine, pp, stage, m, v)
            activations = round(held * layer) + (working if mine else 0)
            activations += first * flying if stage == 0 else 0
        if stage == pp - 1:
            activations += last
        e_params, e_sharded, _ = experts[stage]
        # DistributedOptimizer keeps the experts in a second optimizer over edp that shards their state
        # (stage >= 1) and gradients (>= 2); stage 3 runs them as stage 2: fully_shard leaves them whole.
        expert_bytes = (w * e_params
                        + GRADIENT_BYTES * (e_sharded if stage_z >= 2 else e_params)
                        + (ADAM_MOMENT_BYTES + main) * (e_sharded if stage_z >= 1 else e_params))
        row = {
            "stage": stage,
            "layers": mine,
            "parameters": params + e_params,
            "zero_stage": stage_z,
            "weights_bytes": w * (sharded if stage_z >= 3 else params) + w * e_params,
            "gradients_bytes": GRADIENT_BYTES * ((sharded + e_sharded) if stage_z >= 2 else (params + e_params)),
            "optimizer_bytes": (ADAM_MOMENT_BYTES + main) * ((sharded + e_sharded) if stage_z >= 1
                                                             else (params + e_params)),
            "activations_bytes": activations,
            "gathered_bytes": gathered_bytes(model, training, tp, params, units[stage] if units else None,
                                             runtime.fsdp_units_alive if runtime is not None else None),
            "communicator_bytes": communicator_bytes,
            "microbatches_in_flight": flying,
        }
        if model.is_moe:
            row.update({"moe_layers": moe, "expert_parameters": e_params, "expert_bytes": expert_bytes})
        row["total_bytes"] = sum(row[k] for k in (
            "weights_bytes", "gradients_bytes", "optimizer_bytes", "activations_bytes", "gathered_bytes",
            "communicator_bytes"))
        rows.append(row)
    return rows
