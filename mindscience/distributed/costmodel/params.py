"""Parameters of a GPT-style model, per layer, per pipeline stage and per ZeRO shard (pure).

The structure is the one ``GPTModel`` builds (contract C4 of the models), so
``config.num_parameters() == total_parameters(model)`` for every architecture option.
Weights are ``(out_features, in_features)`` as the library's linear layers hold them;
column-parallel layers split dim 0 over tp, row-parallel ones dim 1:

=======================  ===================================  =================================
parameter                local shape on a tp rank              present when
=======================  ===================================  =================================
input / post-attn norm   ``(h,)`` weight (+ ``(h,)`` bias)      always (bias with layernorm)
fused QKV (column)       ``((h + 2gd)/t, h)`` + bias           bias: ``model.bias``
attention out (row)      ``(h, h/t)`` + bias ``(h,)``           bias: ``model.bias``
MLP fc1 (column)         ``(F/t, h)`` + bias ``(F/t,)``         ``F = f`` (gelu), ``2f`` (swiglu)
MLP fc2 (row)            ``(h, f/t)`` + bias ``(h,)``           bias: ``model.bias``
word embedding           ``(V/t, h)`` (vocabulary-parallel)    first stage, ``V > 0``
learned positions        ``(s, h)``                            first stage, ``learned``
final norm               ``(h,)`` (+ ``(h,)``)                 last stage
output layer             ``(V/t, h)``                          last stage, untied; with
                                                               ``pp > 1`` a tied model's last
                                                               stage holds a copy of the word
                                                               embedding (summed over the
                                                               embedding group)
=======================  ===================================  =================================

ZeRO shards (contract C1): a parameter of local shape ``(r, *rest)`` sharded over ``d``
ranks keeps ``c = ceil(r / d)`` rows (zero-padded), so a rank holds
``sum(ceil(r / d) * prod(rest))`` elements (:func:`sharded_elements`).

Example, tiny-llama (h 64, 4 heads in 2 groups, f 128, V 256, rmsnorm, swiglu, rope, untied,
no bias): a layer is ``64 + 64*128 + 64*64 + 64 + 256*64 + 64*128 = 36,992`` parameters::

    >>> from mindscience.distributed.costmodel.spec import ModelSpec
    >>> m = ModelSpec(num_layers=4, hidden_size=64, num_attention_heads=4, num_query_groups=2,
    ...               ffn_hidden_size=128, seq_length=64, vocab_size=256, normalization="rmsnorm",
    ...               activation="swiglu", position_embedding="rope", tie_embeddings=False, bias=False)
    >>> sum(layer_parameters(m)), total_parameters(m)
    (36992, 180800)
"""

from __future__ import annotations

from functools import lru_cache
from math import prod

from .spec import ModelSpec, TrainingSpec


def norm_parameters(model: ModelSpec) -> int:
    """One normalization layer: ``2h`` (layernorm: weight and bias) or ``h`` (rmsnorm)."""
    return (2 if model.normalization == "layernorm" else 1) * model.hidden_size


def mlp_fc1_width(model: ModelSpec) -> int:
    """Output features of the first MLP matrix: ``f`` (gelu), ``2f`` (swiglu: gate and up fused)."""
    return (2 if model.activation == "swiglu" else 1) * model.ffn_hidden_size


def layer_shapes(model: ModelSpec, tp: int = 1, moe: bool = False) -> list[tuple[tuple, bool]]:
    """``[(local shape, split over tp)]`` of one layer's parameters on a tp rank (table above).

    ``moe``: a MoE layer's dense parameters: its MLP is the router ``(E, h)`` (replicated,
    no bias) and, with ``moe_shared_expert_intermediate_size``, the shared experts as a dense
    MLP of that width (split over tp like the MLP, no biases, as ``moe.SharedExperts``); the
    routed experts are :func:`expert_shapes` (split over etp x ep, not tp).
    """
    h, f, fc1 = model.hidden_size, model.ffn_hidden_size, mlp_fc1_width(model)
    if moe:
        f = model.moe_shared_expert_intermediate_size or 0
        fc1 = (2 if model.activation == "swiglu" else 1) * f
    qkv = h + 2 * model.num_query_groups * model.kv_channels
    norm = [((h,), False)] * (2 if model.normalization == "layernorm" else 1)
    shapes = list(norm)
    shapes.append(((qkv // tp, h), True))
    if model.bias:
        shapes.append(((qkv // tp,), True))
    shapes.append(((h, h // tp), True))
    if model.bias:
        shapes.append(((h,), False))
    shapes += norm
    bias = model.bias
    if moe:
        shapes.append(((model.num_moe_experts, h), False))  # the router
        if not f:
            return shapes
        bias = False  # the shared experts have no biases
    shapes.append(((fc1 // tp, h), True))
    if bias:
        shapes.append(((fc1 // tp,), True))
    shapes.append(((h, f // tp), True))
    if bias:
        shapes.append(((h,), False))
    return shapes


def expert_fc1_width(model: ModelSpec) -> int:
    """Output features of an expert's ``w1``: ``f_e`` (gelu) or ``2 f_e`` (swiglu), ``f_e = moe_ffn_hidden_size``."""
    return (2 if model.activation == "swiglu" else 1) * model.moe_ffn_hidden_size


def expert_shapes(model: ModelSpec, etp: int = 1, ep: int = 1) -> list[tuple[tuple, bool]]:
    """The routed experts of one MoE layer on one rank (contract D): ``w1 (E/ep, h, F_e/etp)``
    and ``w2 (E/ep, f_e/etp, h)``, no biases; empty for a dense model."""
    if not model.is_moe:
        return []
    local, h = model.num_moe_experts // ep, model.hidden_size
    return [((local, h, expert_fc1_width(model) // etp), True), ((local, model.moe_ffn_hidden_size // etp, h), True)]


def expert_parameters(model: ModelSpec) -> int:
    """Routed-expert parameters of one MoE layer, ``E * (h F_e + f_e h)`` (0 when dense)."""
    return sum(prod(shape) for shape, _ in expert_shapes(model))


def moe_layer_indices(model: ModelSpec, first: int, count: int) -> int:
    """MoE layers among the ``count`` layers starting at layer ``first``."""
    return sum(model.moe_layers[first:first + count])


def rank_moe_layers(model: ModelSpec, training: TrainingSpec | None, pp: int) -> list[int]:
    """MoE layers each pipeline rank holds (all its model chunks; all zero for a dense model)."""
    if not model.is_moe:
        return [0] * pp
    chunks = model_stage_layers(model, training, pp)
    starts = [sum(chunks[:k]) for k in range(len(chunks))]
    out = [0] * pp
    for k, (start, n) in enumerate(zip(starts, chunks)):
        out[k % pp] += moe_layer_indices(model, start, n)
    return out


def active_parameters(model: ModelSpec) -> int:
    """Parameters one token uses: :func:`total_parameters` with ``topk`` of the ``E`` routed
    experts per MoE layer (the "active" count model cards publish)."""
    if not model.is_moe:
        return total_parameters(model)
    unused = model.num_moe_layers * expert_parameters(model) * (model.num_moe_experts - model.moe_router_topk)
    return total_parameters(model) - unused // model.num_moe_experts


def layer_parameters(model: ModelSpec, moe: bool = False) -> tuple[int, int]:
    """One layer's parameters as ``(split over tp, replicated on every tp rank)``, whole-model counts.

    Split: QKV ``h (h + 2gd)``, output projection ``h^2``, MLP ``h F + f h`` and, with
    biases, ``h + 2gd + F``; replicated: two norms and, with biases, the two row-parallel
    biases ``2h``. With the GPT defaults (``g = a``, ``f = 4h``) the sum is Narayanan's
    ``12h^2 + 13h``.
    """
    shapes = layer_shapes(model, moe=moe)
    split = sum(prod(shape) for shape, is_split in shapes if is_split)
    return split, sum(prod(shape) for shape, is_split in shapes if not is_split)


def embedding_parameters(model: ModelSpec) -> tuple[int, int]:
    """First-stage embeddings as ``(split, replicated)``: words ``V h`` (vocabulary-parallel),
    learned positions ``s h`` (none with rope)."""
    positions = model.seq_length * model.hidden_size if model.position_embedding == "learned" else 0
    return model.vocab_size * model.hidden_size, positions


def output_parameters(model: ModelSpec) -> int:
    """The untied output layer ``V h`` (0 when tied to the embedding)."""
    return 0 if model.tie_embeddings else model.vocab_size * model.hidden_size


def total_parameters(model: ModelSpec) -> int:
    """All parameters: layers, embeddings, the final norm and an untied output layer.

    A MoE layer counts its dense part (:func:`layer_shapes` with ``moe``) and its routed
    experts (:func:`expert_parameters`).
    """
    words, positions = embedding_parameters(model)
    moe = model.num_moe_layers
    layers = (model.num_layers - moe) * sum(layer_parameters(model))
    if moe:
        layers += moe * (sum(layer_parameters(model, moe=True)) + expert_parameters(model))
    return layers + words + positions + norm_parameters(model) + output_parameters(model)


def _training(training: TrainingSpec | None) -> TrainingSpec:
    return training if training is not None else TrainingSpec()


def model_stage_layers(model: ModelSpec, training: TrainingSpec | None, pp: int) -> list[int]:
    """Layers of every model stage (``pp * v`` entries), cut by :func:`~..pipeline.split.stage_layers`
    with the training's unequal-stage options (ignored at ``pp = 1``).

    Raises:
        ModelConstraintError: the layers cannot be cut so (named ``num_layers % pp``).
    """
    training = _training(training)
    v = training.virtual_pipeline_stages if pp > 1 else 1
    if pp == 1:  # one stage holds everything: the cut options have nothing to cut
        return [model.num_layers]
    return list(_cut(model.num_layers, pp, v, training.first_stage_layers, training.last_stage_layers,
                     training.account_for_embedding_in_pipeline_split, training.account_for_loss_in_pipeline_split))


@lru_cache(maxsize=4096)
def _cut(num_layers, pp, v, first, last, embedding, loss) -> tuple:
    # suggest asks for the same cut of every size many times (memory, traffic, every order's step time).
    # Imported here: pipeline.split imports costmodel.errors, so either package may load first.
    from ..pipeline.split import stage_layers

    return tuple(stage_layers(num_layers, pp, v, first_stage_layers=first, last_stage_layers=last,
                              account_for_embedding_in_pipeline_split=embedding,
                              account_for_loss_in_pipeline_split=loss))


def rank_layers(model: ModelSpec, training: TrainingSpec | None, pp: int) -> list[int]:
    """Layers each pipeline rank holds (the sum of its ``v`` chunks; model stage ``c * pp + i``).

        >>> m = ModelSpec(num_layers=126, hidden_size=64, num_attention_heads=1, seq_length=8, vocab_size=0)
        >>> t = TrainingSpec(account_for_embedding_in_pipeline_split=True, account_for_loss_in_pipeline_split=True)
        >>> rank_layers(m, t, 16)
        [7, 8, 8, 8, 8, 8, 8, 8, 8, 8, 8, 8, 8, 8, 8, 7]
    """
    layers = model_stage_layers(model, training, pp)
    return [sum(layers[i::pp]) for i in range(pp)]


def stage_shapes(model: ModelSpec, tp: int, pp: int, stage: int,
                 training: TrainingSpec | None = None) -> list[tuple[tuple, bool, int]]:
    """``[(local shape, split over tp, how many)]`` of every parameter pipeline rank ``stage`` holds."""
    layers = rank_layers(model, training, pp)[stage]
    moe = rank_moe_layers(model, training, pp)[stage]
    out = [(shape, split, layers - moe) for shape, split in layer_shapes(model, tp)] if layers - moe else []
    out += [(shape, split, moe) for shape, split in layer_shapes(model, tp, moe=True)] if moe else []
    return out + _edge_shapes(model, tp, pp, stage)


def _edge_shapes(model: ModelSpec, tp: int, pp: int, stage: int) -> list:
    """The embeddings of the first stage, the final norm and output layer of the last."""
    h, vocab = model.hidden_size, model.vocab_size
    out = []
    words, positions = embedding_parameters(model)
    if stage == 0:
        if vocab:
            out.append(((vocab // tp, h), True, 1))
        if positions:
            out.append(((model.seq_length, h), False, 1))
    if stage == pp - 1:
        out += [((h,), False, 1)] * (2 if model.normalization == "layernorm" else 1)
        # The output matrix: untied, or the tied embedding's copy on a last stage of its own.
        if vocab and (not model.tie_embeddings or pp > 1):
            out.append(((vocab // tp, h), True, 1))
    return out


def stage_counts(model: ModelSpec, tp: int, pp: int, d: int,
                 training: TrainingSpec | None = None) -> list[tuple[int, int, int]]:
    """``(parameters, padded shard elements over d, tensors)`` of every pipeline rank.

    The same counts as :func:`stage_shapes` with :func:`sharded_elements`, one layer's
    shapes computed once (``suggest`` asks for every rank of thousands of sizes).
    """
    def counts(moe: bool) -> tuple:
        layer = [(shape, split, 1) for shape, split in layer_shapes(model, tp, moe)]
        return sum(prod(shape) for shape, _, _ in layer), sharded_elements(layer, d), len(layer)

    one = counts(False)
    moe_one = counts(True) if model.is_moe else (0, 0, 0)
    out = []
    for stage, (layers, moe) in enumerate(zip(rank_layers(model, training, pp), rank_moe_layers(model, training, pp))):
        edges = _edge_shapes(model, tp, pp, stage)
        dense = layers - moe
        out.append((dense * one[0] + moe * moe_one[0] + sum(prod(shape) for shape, _, _ in edges),
                    dense * one[1] + moe * moe_one[1] + sharded_elements(edges, d),
                    dense * one[2] + moe * moe_one[2] + len(edges)))
    return out


def stage_units(model: ModelSpec, tp: int, pp: int, d: int,
                training: TrainingSpec | None = None) -> list[tuple[list, tuple]]:
    """``fully_shard``'s units of every pipeline rank: ``(leaf units, root)``, each ``(parameters, padded shard
    elements, tensors)``.

    One leaf unit per layer (its parameters gathered in one bucket); the root holds the
    rest of the rank (the first stage's embeddings, the last stage's final norm and
    output layer; ``(0, 0, 0)`` on a middle stage). Leaves and root add up to the rank's
    :func:`stage_counts` row.

        >>> m = ModelSpec(num_layers=2, hidden_size=4, num_attention_heads=1, seq_length=2, vocab_size=0,
        ...               bias=False, normalization="rmsnorm", position_embedding="rope")
        >>> stage_units(m, 1, 1, 2)  # two layers of 6 tensors (200 values), the final norm
        [([(200, 100, 6), (200, 100, 6)], (4, 2, 1))]
    """
    def counts(moe: bool) -> tuple:
        layer = [(shape, split, 1) for shape, split in layer_shapes(model, tp, moe)]
        return sum(prod(shape) for shape, _, _ in layer), sharded_elements(layer, d), len(layer)

    dense_unit = counts(False)
    moe_unit = counts(True) if model.is_moe else None
    out = []
    for stage, (layers, moe) in enumerate(zip(rank_layers(model, training, pp), rank_moe_layers(model, training, pp))):
        edges = _edge_shapes(model, tp, pp, stage)
        root = (sum(prod(shape) for shape, _, _ in edges), sharded_elements(edges, d), len(edges)) if edges \
            else (0, 0, 0)
        out.append(([dense_unit] * (layers - moe) + [moe_unit] * moe, root))
    return out


def stage_expert_counts(model: ModelSpec, training: TrainingSpec | None, pp: int, etp: int, ep: int,
                        edp: int) -> list[tuple[int, int, int]]:
    """``(expert parameters, padded shard elements over edp, tensors)`` of every pipeline rank.

    The routed experts of the rank's MoE layers, ``E/ep`` experts of width ``f_e/etp``
    (:func:`expert_shapes`), their ZeRO shards cut on dim 0 (the local experts) over the
    expert data-parallel group ``edp`` as contract C1 cuts every parameter. All zero for a
    dense model.
    """
    shapes = [(shape, True, 1) for shape, _ in expert_shapes(model, etp, ep)]
    one = (sum(prod(shape) for shape, _, _ in shapes), sharded_elements(shapes, edp), len(shapes))
    return [(n * one[0], n * one[1], n * one[2]) for n in rank_moe_layers(model, training, pp)]


def stage_parameters(model: ModelSpec, tp: int, pp: int, stage: int,
                     training: TrainingSpec | None = None) -> tuple[int, int]:
    """Parameters pipeline rank ``stage`` holds on one tp rank, as ``(its tp shard, replicated)``.

    Layers per rank come from the training's stage cut (even by default). The first stage
    adds the embeddings, the last the final norm and the output layer (untied, or with
    ``pp > 1`` the tied embedding's copy, which :func:`total_parameters` counts once).
    """
    shard = whole = 0
    for shape, split, n in stage_shapes(model, tp, pp, stage, training):
        if split:
            shard += n * prod(shape)
        else:
            whole += n * prod(shape)
    return shard, whole


def sharded_elements(shapes, d: int) -> int:
    """Elements a rank holds when every parameter is cut on dim 0 over ``d`` ranks (C1 padding).

        >>> sharded_elements([((5, 3), True, 1), ((4,), False, 2)], 2)  # ceil(5/2)*3 + 2 * 4/2
        13
    """
    return sum(n * -(-shape[0] // d) * prod(shape[1:]) for shape, _, n in shapes)
