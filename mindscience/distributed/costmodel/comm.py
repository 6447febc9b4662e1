"""Bytes each rank sends per training step, per group, and the time they take.

Per step one rank sends, for each group of the layout (``count`` calls of ``message``
bytes, ring algorithms as nccl-tests count them):

============  =======================================  ===========================================
group         op (per layer and micro-batch)            message (one call)
============  =======================================  ===========================================
tp            all_reduce x 4 (2 fwd, 2 bwd)             ``s/cp * b * h`` activations
tp with SP    all_gather x 6, reduce_scatter x 4        the same (the backward all-gathers the
                                                        column-linear inputs again, Korthikanti 4.2.2)
cp            by context_parallel_method (:func:`cp_rows`): Ulysses all_to_all x 8 (q, k, v, out;
              fwd+bwd), all-gather KV, ring shifts of the K/V block
pp            send_recv x 2 per micro-batch (x v)       ``s/cp * b * h`` (``/tp`` with SP)
dp-cp ZeRO-0  all_reduce x 1 per step                   the rank's fp32 gradients
dp-cp ZeRO-1,2 reduce_scatter + all_gather per step     fp32 gradients, then the updated weights
dp-cp ZeRO-3  all_gather x 2 + reduce_scatter per       every parameter (forward, backward), its
              parameter and micro-batch                  gradient in the model dtype
============  =======================================  ===========================================

ZeRO messages are the padded shards times ``d`` (contract C1). Stage 3 sends ``3 w P (d-1)/d``
per micro-batch against stage 0's ``2 * 4 P (d-1)/d`` per step: at ``w = 4`` and one
micro-batch, 1.5x the all-reduce (Rajbhandari et al. 2020, sec. 7.2.2).

Full recomputation, and the pipeline runtime's re-run of a stage's forward
(:mod:`.runtime`), run each layer's forward again (+2 tp collectives of each kind, the
forward's cp collectives again). Bytes sent per call are ``message * factor``: ``2(n-1)/n`` for all-reduce,
``(n-1)/n`` for all-gather, reduce-scatter and all-to-all, 1 for point-to-point: the
nccl-tests bus factors, so the time is ``bytes / bandwidth`` with the cluster's per-device
(bus) bandwidth, inter-node when any group of the key spans nodes
(:meth:`~mindscience.distributed.topology.Layout.crossing_group_count`). The step total
adds the groups up (no overlap), an upper bound.

Example: tp=2 without sequence parallelism, one 1-layer stage, one micro-batch per step
of ``s*b*h = 4`` bf16 values: 4 all-reduces of 8 bytes, each sending ``8 * 2*(2-1)/2 = 8``::

    >>> from mindscience.distributed.costmodel.spec import ModelSpec, TrainingSpec
    >>> m = ModelSpec(num_layers=1, hidden_size=2, num_attention_heads=2, seq_length=2, vocab_size=0)
    >>> one = TrainingSpec(sequence_parallel=False, global_batch_size=1)
    >>> row = traffic(m, one, tp=2, cp=1, pp=1, dp=1)[0]
    >>> (row["group"], row["op"], row["count"], row["bytes"])
    ('tp', 'all_reduce', 4, 32)
"""

from __future__ import annotations

from .memory import BYTES, GRADIENT_BYTES, num_microbatches
from .moe_spec import dispatch_imbalance
from .params import model_stage_layers, rank_layers, stage_counts, stage_units
from .spec import ClusterSpec, ModelSpec, TrainingSpec

GROUPS = ("tp", "cp", "pp", "dp-cp")
EXPERT_GROUPS = ("ep", "etp", "edp")  # keys of the topology's expert groups (issue 36)


def send_factor(op: str, n: int) -> float:
    """Bytes one rank sends per byte of the message in a ring of ``n`` (nccl-tests' bus factor)."""
    if n <= 1:
        return 0.0
    if op == "send_recv":
        return 1.0
    return 2.0 * (n - 1) / n if op == "all_reduce" else (n - 1) / n


def _row(group: str, op: str, size: int, count: int, total: int) -> dict:
    # `total`: the bytes of all `count` messages; message_bytes is their mean.
    return {
        "group": group,
        "op": op,
        "group_size": size,
        "count": count,
        "message_bytes": total // count,
        "bytes": round(total * send_factor(op, size)),
    }


def recompute_passes(model: ModelSpec, training: TrainingSpec, pp: int, stage: int, runtime=None,
                     chunks: list | None = None) -> float:
    """Extra forwards per micro-batch of rank ``stage``'s layers, as a fraction of its layers.

    ``recompute: full`` re-runs every layer (1); the pipeline runtime's stage re-run
    (:class:`~.runtime.Runtime`) adds the layers of every chunk but the last model stage's.
    ``chunks``: :func:`~.params.model_stage_layers`, when the caller has it.
    """
    again = 1.0 if training.recompute == "full" else 0.0
    if runtime is not None and runtime.stage_recompute and pp > 1:
        chunks = model_stage_layers(model, training, pp) if chunks is None else chunks
        mine = chunks[stage::pp]
        total = sum(mine)
        last = chunks[-1] if stage == pp - 1 else 0
        again += (total - last) / total if total else 0.0
    return again


def busiest_stage(model: ModelSpec, training: TrainingSpec, pp: int) -> int:
    """The pipeline rank with the most layers (the later one on a tie: it adds the logits)."""
    layers = rank_layers(model, training, pp)
    return max(range(pp), key=lambda i: (layers[i], i))


def cp_rows(model: ModelSpec, training: TrainingSpec, tp: int, cp: int, passes: float, again: float) -> list[dict]:
    """The context-parallel rows of ``passes`` layer passes (x micro-batches) and ``again`` re-runs.

    One pass moves, per layer, with ``q`` = ``h/t`` and ``kv`` = ``g d/t`` channels of the
    rank's ``s/cp`` tokens:

    * ulysses: 4 all-to-alls forward (q, k, v, out) and 4 backward; re-runs add 4;
    * allgather_kv: K and V all-gathered (2 calls of the gathered ``cp`` blocks) forward,
      their gradients reduce-scattered backward; re-runs add 2 all-gathers;
    * ring: ``cp - 1`` shifts of the K/V block forward; backward ``cp - 1`` shifts of
      K/V with their gradient accumulators (twice the bytes) and one shift bringing the
      accumulators home (:mod:`mindscience.distributed.modules.attention.ring`).
    """
    if cp <= 1:
        return []
    b, h = training.micro_batch_size, model.hidden_size
    nbytes = BYTES[training.precision]["activation"]
    tokens = model.seq_length // cp * b
    q, kv = h // tp, model.num_query_groups * model.kv_channels // tp
    method = training.context_parallel_method
    if method == "ulysses":
        one_pass = 2 * (q + kv) * tokens * nbytes
        count = round(4 * (2 + again) * passes)
        return [_row("cp", "all_to_all", cp, count, round((2 + again) * passes * one_pass))]
    block = 2 * kv * tokens * nbytes  # this rank's K and V
    if method == "allgather_kv":
        gathers = round(2 * (1 + again) * passes)
        return [_row("cp", "all_gather", cp, gathers, round((1 + again) * passes * cp * block)),
                _row("cp", "reduce_scatter", cp, round(2 * passes), round(passes * cp * block))]
    shifts = round(((1 + again) * (cp - 1) + cp) * passes)
    sent = ((1 + again) * (cp - 1) * block + (2 * (cp - 1) + 1) * block) * passes
    return [_row("cp", "send_recv", cp, shifts, round(sent))]


def moe_rows(model: ModelSpec, training: TrainingSpec, tp: int, cp: int, ep: int, etp: int, passes: float,
             again: float) -> list[dict]:
    """The token dispatch of ``passes`` MoE-layer passes (x micro-batches) and ``again`` re-runs.

    Per MoE layer and micro-batch a rank sends its ``s/cp * b / tp`` tokens to ``topk``
    experts each (``x moe_imbalance`` on the busiest rank): the alltoall dispatcher's four
    all-to-alls over ep (dispatch and combine, forward and backward) of ``tokens * topk * h``
    values (sent: ``(ep - 1)/ep`` of them), and with ``etp > 1`` an all-gather after the
    dispatch and a reduce-scatter before the combine (and their backward twins) over etp
    of the ``etp`` times larger gathered rows. A re-run forward adds one dispatch and one
    combine of each. With ``moe_static_slots`` (the compiled dropless dispatch) the rows are
    ``num_experts / topk`` times the tokens' (:func:`~.moe_spec.dispatch_imbalance`).
    """
    if not model.is_moe or passes == 0:
        return []
    nbytes = BYTES[training.precision]["activation"]
    rows_sent = model.seq_length // cp * training.micro_batch_size / tp * model.moe_router_topk
    message = rows_sent * model.hidden_size * nbytes * dispatch_imbalance(model, training)
    out = []
    if ep > 1:
        count = round((4 + 2 * again) * passes)
        out.append(_row("ep", "all_to_all", ep, count, round(count * message)))
    if etp > 1:
        for op in ("all_gather", "reduce_scatter"):
            count = round((2 + again) * passes)
            out.append(_row("etp", op, etp, count, round(count * message * etp)))
    return out


def traffic(model: ModelSpec, training: TrainingSpec, tp: int, cp: int, pp: int, dp: int,
            runtime=None, stage: int | None = None, ep: int = 1, etp: int | None = None) -> list[dict]:
    """Rows ``{group, op, group_size, count, message_bytes, bytes}`` for the busiest rank.

    Layout-order independent: where ranks sit (and so which link carries them) is added
    by :func:`timed`. ``runtime`` (:func:`~.runtime.what_runs`) adds the pipeline
    runtime's re-run forwards. ``stage``: the pipeline rank whose tp/cp traffic is
    counted (default: the one with the most layers; ``step_time`` passes the rank with
    the most compute, :func:`~.steptime.stage_slot_flops`). ``ep``, ``etp`` (None: tp):
    the expert axes of a MoE model, which add the ``ep``/``etp`` dispatch rows
    (:func:`moe_rows`) and the ``edp`` rows of the expert gradients (:func:`zero_traffic`
    over the expert data-parallel group).
    """
    etp = tp if etp is None else etp
    h, b = model.hidden_size, training.micro_batch_size
    nbytes = BYTES[training.precision]
    local = model.seq_length // cp
    microbatches = num_microbatches(training, dp, tp * cp * pp * dp)
    stage = busiest_stage(model, training, pp) if stage is None else stage
    passes = rank_layers(model, training, pp)[stage] * microbatches  # layer passes per step
    again = recompute_passes(model, training, pp, stage, runtime)
    sp = training.sequence_parallel and tp > 1
    activation = local * b * h * nbytes["activation"]
    rows = []
    if tp > 1:
        for op, per_layer in (("all_gather", 6), ("reduce_scatter", 4)) if sp else (("all_reduce", 4),):
            count = round((per_layer + 2 * again) * passes)
            rows.append(_row("tp", op, tp, count, count * activation))
    rows += cp_rows(model, training, tp, cp, passes, again)
    if model.is_moe:
        from .params import rank_moe_layers

        rows += moe_rows(model, training, tp, cp, ep, etp,
                         rank_moe_layers(model, training, pp)[stage] * microbatches, again)
    if pp > 1:
        # A middle stage sends both ways; with v model chunks per rank every chunk boundary sends.
        sends = microbatches * (2 if pp > 2 else 1) * training.virtual_pipeline_stages
        rows.append(_row("pp", "send_recv", pp, sends, sends * (activation // (tp if sp else 1))))
    regather = runtime is not None and runtime.stage_recompute and pp > 1
    rows += zero_traffic(model, training, tp, pp, dp * cp, microbatches, regather, runtime=runtime)
    if model.is_moe:
        edp = tp * cp * pp * dp // (etp * ep * pp)
        rows += zero_traffic(model, training, tp, pp, edp, microbatches, regather, experts=(etp, ep))
    return rows


def fsdp_gathers(runtime, regather: bool = False) -> int:
    """All-gathers of a stage-3 unit (or parameter) per micro-batch.

    ``runtime.fsdp_gathers_per_unit`` (2 when the unit reshards after its forward and
    gathers again for its backward), at least 2 when the pipeline re-runs the forward
    (``regather``: the re-run forward's gather then serves the backward too).
    """
    gathers = runtime.fsdp_gathers_per_unit if runtime is not None and runtime.fsdp_units else 1
    return max(gathers, 2) if regather else gathers


def zero_traffic(model: ModelSpec, training: TrainingSpec, tp: int, pp: int, d: int, microbatches: int,
                 regather: bool = False, experts: tuple | None = None, runtime=None) -> list[dict]:
    """The dp-cp rows of the pipeline rank with the most parameters, at the training's ZeRO stage.

    Stage 0 all-reduces the fp32 gradients once per step (bucketed: one call); stages 1-2
    reduce-scatter them and all-gather the updated weights (the same bytes as the
    all-reduce); stage 3 all-gathers the weights before each forward (``regather``:
    also before the pipeline runtime's re-run forward) and reduce-scatters their gradients,
    per micro-batch: with ``runtime.fsdp_units`` (:mod:`.runtime`) one bucket per unit
    (:func:`~.params.stage_units`) and :func:`fsdp_gathers` gathers of it, else one call
    per parameter (``fully_shard`` before units).
    ``experts`` (``(etp, ep)``): the routed experts' rows over ``d`` = edp, at stage 3 as at
    stage 2 (``DistributedOptimizer``'s expert optimizer; ``fully_shard`` leaves them whole).

        >>> m = ModelSpec(num_layers=1, hidden_size=4, num_attention_heads=1, seq_length=2, vocab_size=0,
        ...               bias=False, normalization="rmsnorm", position_embedding="rope")
        >>> rows = zero_traffic(m, TrainingSpec(zero_stage=3, precision="fp32"), 1, 1, 2, 1, regather=True)
        >>> [(r["op"], r["count"], r["bytes"]) for r in rows]  # 7 tensors, 204 fp32 values, x 1/2
        [('all_gather', 14, 816), ('reduce_scatter', 7, 408)]
    """
    if d <= 1:
        return []
    group, stage = "dp-cp", training.zero_stage
    if experts is not None:  # (etp, ep): the routed experts over their data-parallel group edp
        from .params import stage_expert_counts

        # DistributedOptimizer's expert optimizer runs stage 3 as stage 2 (fully_shard leaves experts whole).
        group, stage = "edp", min(stage, 2)
        params, shard, tensors = max(stage_expert_counts(model, training, pp, *experts, d))
        if not params:
            return []
    else:
        params, shard, tensors = max(stage_counts(model, tp, pp, d, training))
    padded = d * shard  # the all-gathered / reduce-scattered buffer
    w = BYTES[training.precision]["weights"]
    if stage == 0:
        return [_row(group, "all_reduce", d, 1, params * GRADIENT_BYTES)]
    if stage < 3:
        return [_row(group, "reduce_scatter", d, 1, padded * GRADIENT_BYTES),
                _row(group, "all_gather", d, 1, padded * w)]
    gathers = fsdp_gathers(runtime, regather)
    if experts is None and runtime is not None and runtime.fsdp_units:
        # One bucket per unit; the root (embeddings, head) keeps its weights to the backward: one gather.
        counts = stage_counts(model, tp, pp, d, training)
        leaves, root = stage_units(model, tp, pp, d, training)[counts.index(max(counts))]
        calls = len(leaves) + (1 if root[0] else 0)
        root_padded = d * root[1]
        gathered = microbatches * (gathers * (padded - root_padded) + root_padded) * w
        return [_row(group, "all_gather", d, microbatches * (gathers * len(leaves) + (1 if root[0] else 0)),
                     gathered),
                _row(group, "reduce_scatter", d, calls * microbatches, microbatches * padded * w)]
    return [_row(group, "all_gather", d, gathers * tensors * microbatches, gathers * microbatches * padded * w),
            _row(group, "reduce_scatter", d, tensors * microbatches, microbatches * padded * w)]


def timed(rows: list[dict], crossing: dict, cluster: ClusterSpec) -> dict:
    """Add ``crosses_nodes`` and ``est_time_s`` to each row and sum them up.

    Args:
        rows: From :func:`traffic`.
        crossing: ``{group key: True when any of its groups spans nodes}``.
        cluster: The bandwidths.

    Returns:
        ``{"per_step": rows, "est_time_s": total, "bottleneck": slowest group or None}``.
    """
    per_step, by_group = [], {}
    for row in rows:
        crosses = bool(crossing.get(row["group"]))
        gbps = cluster.inter_node_gbps if crosses else cluster.intra_node_gbps
        seconds = row["bytes"] / (gbps * 1e9)
        per_step.append({**row, "crosses_nodes": crosses, "est_time_s": seconds})
        by_group[row["group"]] = by_group.get(row["group"], 0.0) + seconds
    bottleneck = max(by_group, key=by_group.get) if by_group else None
    return {"per_step": per_step, "est_time_s": sum(by_group.values(), 0.0), "bottleneck": bottleneck}


def crossing_flags(layout, experts: bool = False, dense: dict | None = None) -> dict:
    """``{group key: any group spans nodes}`` for the keys that carry traffic (from the topology).

    ``experts``: also the expert keys ``ep``, ``etp`` and ``edp`` (a MoE model), read from
    the layout's expert groups (an all-to-all over an ep group that spans nodes is priced on
    the inter-node bandwidth); a size-1 expert axis never crosses. ``dense``: the dense keys'
    flags when the caller has them (they do not depend on the expert axes).
    """
    flags = dict(dense) if dense is not None else {key: layout.crossing_group_count(key) > 0 for key in GROUPS}
    if experts:
        sizes = {"ep": layout.ep, "etp": layout.etp, "edp": layout.edp}
        flags.update({key: sizes[key] > 1 and layout.crossing_group_count(key) > 0 for key in EXPERT_GROUPS})
    return flags
