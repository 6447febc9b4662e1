"""Constraints a layout must meet for a model (Megatron's and Ulysses' divisibility rules).

:func:`violations` lists every broken constraint of a (tp, cp, pp, dp) choice, each with a
message that names the constraint, the values and the fix; :func:`check` raises the first.
Both work on plain integers, so ``msdist suggest`` can screen thousands of sizes cheaply.

Example:
    >>> from mindscience.distributed.costmodel.spec import ModelSpec, TrainingSpec
    >>> m = ModelSpec(num_layers=96, hidden_size=12288, num_attention_heads=96,
    ...               seq_length=2048, vocab_size=51200)
    >>> [name for name, _ in violations(m, TrainingSpec(), tp=5, cp=1, pp=7, dp=1)]
    ['num_attention_heads % tp', 'ffn_hidden_size % tp', 'num_layers % pp', 'seq_length % (tp*cp)']
"""

from __future__ import annotations

from functools import lru_cache

from .errors import ModelConstraintError
from .params import model_stage_layers
from .spec import ModelSpec, TrainingSpec


@lru_cache(maxsize=1024)
def _divisors(n: int, limit: int = 8) -> str:
    found = [d for d in range(1, n + 1) if n % d == 0]
    shown = ", ".join(map(str, found[:limit]))
    return shown + (", ..." if len(found) > limit else "")


def expert_violations(model: ModelSpec, tp: int, cp: int, pp: int, dp: int, ep: int = 1,
                      etp: int | None = None) -> list[tuple[str, str]]:
    """The expert-parallel constraints of ``ep`` and ``etp`` (None: tp), as :func:`violations`.

    * ``num_moe_experts % ep``: every expert-parallel rank holds whole experts (and a dense
      model has no experts to split: ep must be 1);
    * ``moe_ffn_hidden_size % etp``: expert tensor parallelism splits each expert's width;
    * ``moe_shared_expert_intermediate_size % tp``: the shared experts split like the MLP;
    * ``world % (etp*ep*pp)``: the expert layers fold over the same ranks as ``etp x ep x edp x pp``.
    """
    etp = tp if etp is None else etp
    found = []

    def add(name: str, message: str) -> None:
        found.append((name, f"{name} fails: {message}"))

    experts = model.num_moe_experts
    if experts is None:
        if ep > 1 or etp != tp:
            add("num_moe_experts % ep", f"ep={ep}, etp={etp} split experts, but the model is dense (no "
                "num_moe_experts): use ep=1 and leave etp out, or set model.num_moe_experts.")
        return found
    if experts % ep:
        add("num_moe_experts % ep", f"num_moe_experts={experts} is not divisible by ep={ep}: every expert-parallel "
            f"rank holds the same number of whole experts. Use an ep that divides {experts} ({_divisors(experts)}).")
    if model.moe_ffn_hidden_size % etp:
        add("moe_ffn_hidden_size % etp", f"moe_ffn_hidden_size={model.moe_ffn_hidden_size} is not divisible by "
            f"etp={etp}: expert tensor parallelism splits each expert's width. Use an etp that divides "
            f"{model.moe_ffn_hidden_size} ({_divisors(model.moe_ffn_hidden_size)}).")
    shared = model.moe_shared_expert_intermediate_size
    if shared and shared % tp:
        add("moe_shared_expert_intermediate_size % tp", f"moe_shared_expert_intermediate_size={shared} is not "
            f"divisible by tp={tp}: the shared experts are split over tp like the MLP. Use a tp that divides "
            f"{shared} ({_divisors(shared)}).")
    world = tp * cp * pp * dp
    if world % (etp * ep * pp):
        add("world % (etp*ep*pp)", f"etp*ep*pp = {etp}*{ep}*{pp} = {etp * ep * pp} does not divide the world of "
            f"{world} ranks: the expert layers fold over the same ranks as etp x ep x edp x pp. Use an ep and "
            f"etp whose product divides {world // pp}.")
    return found


def violations(model: ModelSpec, training: TrainingSpec, tp: int, cp: int, pp: int, dp: int,
               ep: int = 1, etp: int | None = None) -> list[tuple[str, str]]:
    """Every constraint the sizes break, as ``(name, message)`` pairs (empty: all hold).

    The constraints (each message says why it exists and how to fix it):

    * ``num_attention_heads % tp``, ``num_query_groups % tp``: tensor parallelism gives
      each rank whole query heads and whole key/value groups;
    * ``(num_attention_heads / tp) % cp``, ``(num_query_groups / tp) % cp``: Ulysses
      context parallelism splits each tp rank's heads again over cp (the ring and
      all-gather KV keep every head);
    * ``ffn_hidden_size % tp``, ``vocab_size % tp``: column-parallel MLP and the
      vocabulary-parallel embedding split these over tp;
    * ``num_layers % pp``: the layers cut into pp stages, evenly or with the training's
      unequal-stage options (:func:`~..pipeline.split.stage_layers`);
    * ``seq_length % (tp*cp)`` with sequence parallelism (else ``seq_length % cp``);
    * ``global_batch_size % (micro_batch_size*dp)`` when the global batch is given;
    * with ``virtual_pipeline_stages`` v > 1 and pp > 1 (interleaved 1F1B):
      ``num_layers % (pp*virtual_pipeline_stages)`` and ``microbatches % pp (interleaved)``;
    * the expert axes ``ep``, ``etp`` of a MoE model (:func:`expert_violations`).
    """
    found = dense_violations(model, training, tp, cp, pp, dp)
    if model.is_moe or ep > 1 or (etp is not None and etp != tp):
        found += expert_violations(model, tp, cp, pp, dp, ep, etp)
    return found


def dense_violations(model: ModelSpec, training: TrainingSpec, tp: int, cp: int, pp: int,
                     dp: int) -> list[tuple[str, str]]:
    """The constraints of :func:`violations` that do not involve the expert axes."""
    a, g = model.num_attention_heads, model.num_query_groups
    ulysses = training.context_parallel_method == "ulysses"
    found = []

    def add(name: str, message: str) -> None:
        found.append((name, f"{name} fails: {message}"))

    if a % tp:
        add("num_attention_heads % tp", f"num_attention_heads={a} is not divisible by tp={tp}: tensor "
            f"parallelism gives each rank whole heads. Use a tp that divides {a} ({_divisors(a)}).")
    elif ulysses and (a // tp) % cp:
        add("(num_attention_heads / tp) % cp", f"heads per tp rank {a}/{tp} = {a // tp} is not divisible "
            f"by cp={cp}: Ulysses context parallelism splits each rank's heads over cp. Use a cp that "
            f"divides {a // tp} ({_divisors(a // tp)}) or a smaller tp.")
    if g != a and g % tp:  # grouped-query attention: the key/value groups split too
        add("num_query_groups % tp", f"num_query_groups={g} is not divisible by tp={tp}: each tensor-"
            f"parallel rank holds whole key/value groups. Use a tp that divides {g} ({_divisors(g)}).")
    elif ulysses and g != a and (g // tp) % cp:
        add("(num_query_groups / tp) % cp", f"key/value groups per tp rank {g}/{tp} = {g // tp} is not "
            f"divisible by cp={cp}: Ulysses context parallelism splits the key/value heads over cp too. "
            f"Use a cp that divides {g // tp} ({_divisors(g // tp)}) or a smaller tp.")
    if model.ffn_hidden_size % tp:
        add("ffn_hidden_size % tp", f"ffn_hidden_size={model.ffn_hidden_size} is not divisible by tp={tp}: "
            "the column-parallel MLP splits it over tp. Use a tp that divides "
            f"{model.ffn_hidden_size} ({_divisors(model.ffn_hidden_size)}).")
    if model.vocab_size % tp:
        add("vocab_size % tp", f"vocab_size={model.vocab_size} is not divisible by tp={tp}: the embedding "
            f"and the output layer split the vocabulary over tp. Pad vocab_size to a multiple of {tp} "
            f"(Megatron pads to a multiple of 128*tp = {128 * tp}).")
    v = training.virtual_pipeline_stages
    uneven = (training.first_stage_layers, training.last_stage_layers) != (None, None) or \
        training.account_for_embedding_in_pipeline_split or training.account_for_loss_in_pipeline_split
    try:
        model_stage_layers(model, training, pp)
    except ModelConstraintError as err:
        if uneven:  # the cut options were given: stage_layers' own message names them
            add("num_layers % pp", str(err))
        elif model.num_layers % pp:
            add("num_layers % pp", f"num_layers={model.num_layers} is not divisible by pp={pp}: every "
                f"pipeline stage holds the same number of layers. Use a pp that divides {model.num_layers} "
                f"({_divisors(model.num_layers)}), or cut unequal stages with training.first_stage_layers/"
                "last_stage_layers or account_for_embedding/loss_in_pipeline_split.")
        else:
            add("num_layers % (pp*virtual_pipeline_stages)", f"num_layers={model.num_layers} is not divisible "
                f"by pp*virtual_pipeline_stages = {pp}*{v} = {pp * v}: the interleaved schedule gives every "
                f"rank {v} equal model chunks. Use a pp and virtual_pipeline_stages whose product divides "
                f"{model.num_layers}.")
    s = model.seq_length
    if training.sequence_parallel and s % (tp * cp):
        add("seq_length % (tp*cp)", f"seq_length={s} is not divisible by tp*cp = {tp}*{cp} = {tp * cp}: "
            "sequence parallelism shards the sequence over the tp and cp ranks. Use tp and cp whose "
            "product divides the sequence, or set training.sequence_parallel: false.")
    elif not training.sequence_parallel and s % cp:
        add("seq_length % cp", f"seq_length={s} is not divisible by cp={cp}: context parallelism shards "
            f"the sequence over cp. Use a cp that divides {s} ({_divisors(s)}).")
    gbs, mbs = training.global_batch_size, training.micro_batch_size
    if gbs is not None and gbs % (mbs * dp):
        add("global_batch_size % (micro_batch_size*dp)", f"global_batch_size={gbs} is not divisible by "
            f"micro_batch_size*dp = {mbs}*{dp} = {mbs * dp}: every data-parallel rank runs the same "
            f"number of micro-batches. Use a global_batch_size that is a multiple of {mbs * dp}, or "
            "another dp.")
    if v > 1 and pp > 1:
        m = (gbs or mbs * tp * cp * pp * dp) // (mbs * dp)
        if m % pp:
            add("microbatches % pp (interleaved)", f"{m} micro-batches per step are not divisible by pp={pp}: "
                "the interleaved schedule runs micro-batches in groups of pp. Use a global_batch_size that "
                f"gives a multiple of {pp} micro-batches per dp rank, or virtual_pipeline_stages: 1.")
    return found


def check(model: ModelSpec, training: TrainingSpec, layout, source: str | None = None) -> None:
    """Raise for the first constraint ``layout`` breaks.

    Raises:
        ModelConstraintError: with the constraint's name and a message prefixed by
            ``source`` (the model or layout file) when given.
    """
    # ep/etp: the layout's expert axes (issue 36's topology; a layout without them is ep 1, etp tp).
    broken = violations(model, training, layout.tp, layout.cp, layout.pp, layout.dp,
                        getattr(layout, "ep", 1), getattr(layout, "etp", None))
    if broken:
        name, message = broken[0]
        where = f"{source}: " if source else ""
        subject = f"model {model.name}" if model.name else "the model"
        on = f" on layout {layout.name}" if getattr(layout, "name", None) else ""
        raise ModelConstraintError(f"{where}{subject}{on}: {message}", name)
