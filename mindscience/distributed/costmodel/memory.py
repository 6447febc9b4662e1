"""Per-rank memory of one pipeline stage: parameters, weights, gradients, optimizer, activations.

Sources (the derivations are in docs/COST_MODEL.md):

* parameters: Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU
  Clusters Using Megatron-LM", eq. for GPT: ``12 l h^2 (1 + 13/(12h) + (V + s)/(12 l h))``,
  generalised to grouped-query attention and any MLP width;
* bytes per parameter: Megatron's theoretical memory report (``18`` for mixed-precision
  Adam, ``6 + 12/(dp*cp)`` with the distributed optimizer);
* activations: Korthikanti et al. 2022, "Reducing Activation Recomputation in Large
  Transformer Models", Table 2 and section 4.3, with 1F1B's micro-batches in flight.

Worked example (GPT-3 175B, tp=8, pp=8, sequence parallelism, selective recomputation):
one layer holds ``s*b*h*34/t = 2048*1*12288*34/8`` bytes of activations per micro-batch::

    >>> from mindscience.distributed.costmodel.spec import ModelSpec, TrainingSpec
    >>> gpt3 = ModelSpec(num_layers=96, hidden_size=12288, num_attention_heads=96,
    ...                  seq_length=2048, vocab_size=51200)
    >>> layer_activation_bytes(gpt3, TrainingSpec(recompute="selective"), tp=8, cp=1)
    106954752
    >>> total_parameters(gpt3)
    174615846912
"""

from __future__ import annotations

from dataclasses import replace

from .spec import ModelSpec, TrainingSpec

# precision -> bytes per parameter of (weights, gradients, optimizer state) and per
# activation element. Mixed precision keeps fp32 gradients and an fp32 master copy plus
# Adam's two moments (4 + 4 + 4); fp32 training needs no master copy.
BYTES = {
    "bf16": {"weights": 2, "gradients": 4, "optimizer": 12, "activation": 2},
    "fp16": {"weights": 2, "gradients": 4, "optimizer": 12, "activation": 2},
    "fp32": {"weights": 4, "gradients": 4, "optimizer": 8, "activation": 4},
}
TOKEN_ID_BYTES = 8  # int64 input ids
LOGIT_BYTES = 4  # the cross-entropy keeps fp32 logits


def layer_parameters(model: ModelSpec) -> tuple[int, int]:
    """One transformer layer's parameters as ``(split over tp, replicated on every tp rank)``.

    Split (column/row parallel): QKV weight ``h*(h + 2gd)`` and bias ``h + 2gd``, output
    projection ``h*h``, MLP ``2*h*f`` and first bias ``f``. Replicated: the output
    projection's and second MLP bias (``2h``) and two layernorms (``4h``). With
    ``g = a`` and ``f = 4h`` the sum is Narayanan's ``12h^2 + 13h``.
    """
    h, f = model.hidden_size, model.ffn_hidden_size
    kv = 2 * model.num_query_groups * model.kv_channels
    split = h * (h + kv) + (h + kv) + h * h + 2 * h * f + f
    return split, 6 * h


def embedding_parameters(model: ModelSpec) -> tuple[int, int]:
    """First-stage embeddings as ``(split, replicated)``: words ``v*h`` split over tp
    (vocabulary-parallel), learned positions ``s*h`` replicated."""
    return model.vocab_size * model.hidden_size, model.seq_length * model.hidden_size


def total_parameters(model: ModelSpec) -> int:
    """All parameters: layers, embeddings (the output layer is tied to them) and the final layernorm."""
    split, replicated = layer_parameters(model)
    words, positions = embedding_parameters(model)
    return model.num_layers * (split + replicated) + words + positions + 2 * model.hidden_size


def stage_parameters(model: ModelSpec, tp: int, pp: int, stage: int) -> tuple[int, int]:
    """Parameters one rank of ``stage`` holds, as ``(its shard of the split ones, replicated)``.

    The first stage adds the embeddings, the last the final layernorm. Summed over the
    tp ranks and stages, ``tp * shard + replicated`` gives :func:`total_parameters`.
    """
    split, replicated = layer_parameters(model)
    layers = model.num_layers // pp
    shard, whole = layers * split // tp, layers * replicated
    if stage == 0:
        words, positions = embedding_parameters(model)
        shard += words // tp
        whole += positions
    if stage == pp - 1:
        whole += 2 * model.hidden_size
    return shard, whole


def layer_activation_bytes(model: ModelSpec, training: TrainingSpec, tp: int, cp: int) -> int:
    """Activation bytes one layer keeps per micro-batch on one rank (Korthikanti Table 2).

    In bytes per ``s*b*h`` element at 16 bits: 10 not split by tp (layernorm and linear
    inputs, 2 dropout masks), 24 split by tp (Q, K, V, projection input, MLP), and
    ``5*a*s/h`` for the attention scores (softmax, its dropout mask and output):

    * no recomputation: ``10 + 24/t + 5as/(ht)``; with sequence parallelism
      ``34/t + 5as/(ht)``;
    * selective (attention core recomputed): ``10 + 24/t``, ``34/t`` with sequence parallelism;
    * full: ``2`` (the layer input), ``2/t`` with sequence parallelism.

    Generalisations (exact at ``g = a``, ``f = 4h``, 16 bits, ``cp = 1``): the split 24 is
    ``2*(2 + 2g/a + 2f/h)``; at 32 bits every non-mask term doubles; the sequence in the
    ``s*b*h`` factor is the rank's ``s/cp``, while Ulysses attention holds ``a/(t*cp)``
    heads over the full ``s`` (scores ``5*a*s^2*b/(t*cp)``).
    """
    h, a, b = model.hidden_size, model.num_attention_heads, training.micro_batch_size
    nbytes = BYTES[training.precision]["activation"]
    local = model.seq_length // cp
    sbh = local * b * h
    sp = training.sequence_parallel and tp > 1
    if training.recompute == "full":
        return nbytes * sbh // (tp if sp else 1)
    kv = 2 * model.num_query_groups * model.kv_channels
    replicated = (4 * nbytes + 2) * sbh  # 4 activations + 2 one-byte dropout masks
    split = nbytes * local * b * (2 * h + kv + 2 * model.ffn_hidden_size)
    total = (replicated + split) // tp if sp else replicated + split // tp
    if training.recompute == "none":
        total += (2 * nbytes + 1) * a * model.seq_length * local * b // tp
    return total


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


def edge_activation_bytes(model: ModelSpec, training: TrainingSpec, tp: int, cp: int) -> tuple[int, int]:
    """Per micro-batch extras of ``(the first stage, the last stage)`` (Korthikanti sec. 4.3).

    First: int64 token ids ``8sb`` and the embedding dropout mask ``sbh`` (``/t`` with
    sequence parallelism). Last: the final layernorm's and the output layer's inputs
    ``2 * 2sbh`` (``/t`` with sequence parallelism) and fp32 logits ``4sbv/t``: at 16 bits
    and with sequence parallelism, Korthikanti's ``4sbh/t * (1 + v/h)``.
    """
    b, h = training.micro_batch_size, model.hidden_size
    local = model.seq_length // cp
    nbytes = BYTES[training.precision]["activation"]
    shard = tp if training.sequence_parallel and tp > 1 else 1
    first = TOKEN_ID_BYTES * local * b + local * b * h // shard
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


def layers_in_flight(num_layers: int, pp: int, stage: int, microbatches: int, virtual_stages: int = 1) -> float:
    """Layer activations (layers x micro-batches) stage ``stage`` holds at its peak.

    1F1B: ``l/p`` layers of ``min(p - i, m)`` micro-batches. Interleaved with ``v`` chunks
    of ``l/(p v)`` layers: Megatron's warm-up runs ``2 (p - i - 1) + (v - 1) p`` chunk
    forwards before the first backward, so ``2 (p - i - 1) + (v - 1) p + 1`` chunks are in
    flight (at most ``v m``); on the first stage that is ``1 + (p - 1)/(p v)`` times
    1F1B's ``l`` layers, Megatron's interleaving memory penalty.

        >>> layers_in_flight(16, 4, 0, 8), layers_in_flight(16, 4, 0, 8, virtual_stages=2)
        (16, 22.0)
    """
    if virtual_stages <= 1 or pp <= 1:
        return num_layers // pp * in_flight(pp, stage, microbatches)
    chunks = min(2 * (pp - stage - 1) + (virtual_stages - 1) * pp + 1, virtual_stages * microbatches)
    return num_layers / (pp * virtual_stages) * chunks


def stage_rows(model: ModelSpec, training: TrainingSpec, tp: int, cp: int, pp: int, dp: int,
               communicator_bytes: int = 0) -> list[dict]:
    """One memory row per pipeline stage (the JSON ``memory.stages``), in bytes per rank."""
    per_param = BYTES[training.precision]
    optimizer = per_param["optimizer"]
    shards = dp * cp if training.distributed_optimizer else 1
    layer = layer_activation_bytes(model, training, tp, cp)
    first, last = edge_activation_bytes(model, training, tp, cp)
    working = working_set_bytes(model, training, tp, cp)
    m = num_microbatches(training, dp, tp * cp * pp * dp)
    rows = []
    for stage in range(pp):
        shard, whole = stage_parameters(model, tp, pp, stage)
        params = shard + whole
        flying = in_flight(pp, stage, m)
        layers = model.num_layers // pp
        held = layers_in_flight(model.num_layers, pp, stage, m, training.virtual_pipeline_stages)
        activations = round(held * layer) + working
        if stage == 0:
            activations += first * flying
        if stage == pp - 1:
            activations += last
        row = {
            "stage": stage,
            "layers": layers,
            "parameters": params,
            "weights_bytes": params * per_param["weights"],
            "gradients_bytes": params * per_param["gradients"],
            "optimizer_bytes": -(-params * optimizer // shards),
            "activations_bytes": activations,
            "communicator_bytes": communicator_bytes,
            "microbatches_in_flight": flying,
        }
        row["total_bytes"] = sum(row[k] for k in (
            "weights_bytes", "gradients_bytes", "optimizer_bytes", "activations_bytes", "communicator_bytes"))
        rows.append(row)
    return rows
