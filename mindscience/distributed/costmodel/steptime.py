"""How long one training step takes: compute, pipeline bubble and exposed communication.

For the busiest pipeline stage of a layout (sources and derivations in docs/COST_MODEL.md,
"Step time"):

* **compute**: the stage's matmul FLOPs per micro-batch (:func:`layer_forward_flops`,
  the logits on the last stage), x3 for forward and backward, plus the recomputed
  forward (``recompute: full``) or attention core (``selective``), split over ``tp * cp``
  ranks; seconds = FLOPs / (``peak_tflops * compute_efficiency``). ``compute_s`` is
  ``m`` such slots.
* **bubble**: 1F1B idles ``(p - 1)`` slots, the interleaved schedule with ``v`` chunks
  ``(p - 1) / v`` (Narayanan et al. 2021, sec. 2.2): ``bubble_s = compute_s * (p - 1) / (v * m)``.
* **tp, cp**: every collective of the stage is on the critical path: ``calls * latency +
  bytes / bandwidth`` (alpha-beta, the bandwidth and latency of the link the group uses).
* **pp**: each of the ``m + p - 1`` slots of 1F1B sends one activation forward and one
  gradient backward on the critical path; the interleaved schedule moves every micro-batch
  across ``v`` times as many stage boundaries, so ``v`` times the transfers (Narayanan et
  al. 2021, sec. 2.2): ``2 * v * (m + p - 1)`` transfers (:func:`pipeline_transfers`).
* **dp**: the dp-cp traffic of the ZeRO stage (:func:`~.comm.zero_traffic`); with
  ``overlap_grad_reduce`` (stages 0-2) only what exceeds the backward of the last
  micro-batch is exposed, with ``overlap_param_gather`` (stages 1-2) the weights' gather
  beyond the first forward; at stage 3 with prefetching, the gathers and reduce-scatters
  beyond the compute of their neighbouring units. ``plan``/``suggest`` price overlap only
  where the library runs it (:mod:`.runtime`).
* **launches and shared cores**: ``cluster.op_overhead_us`` per operator a rank launches
  (:func:`step_operators`) joins the compute; where ``ranks_per_node`` ranks share
  ``cluster.cores_per_node`` cores (the ``cpu`` preset), every term is
  :meth:`~.spec.ClusterSpec.oversubscription` times longer.

``step_time_s`` is the sum of the six exposed terms, so the breakdown adds up.
``mfu`` is the model's FLOPs per second (no recomputation) over ``world * peak``.

Example: a two-layer toy model on one device of 1 TFLOP/s at full efficiency. One layer
forward is ``24 s h^2 + 4 s^2 h = 24*8*4^2 + 4*8^2*4 = 4096`` FLOPs, the step three times
both layers: 24,576 FLOPs, 24.576 ns::

    >>> from mindscience.distributed.costmodel.spec import ClusterSpec, ModelSpec, TrainingSpec
    >>> toy = ModelSpec(num_layers=2, hidden_size=4, num_attention_heads=1, seq_length=8, vocab_size=0)
    >>> one = TrainingSpec(global_batch_size=1)
    >>> fast = ClusterSpec(peak_tflops=1, compute_efficiency=1)
    >>> t = step_time(toy, one, fast, tp=1, cp=1, pp=1, dp=1)
    >>> round(t["step_time_s"] * 1e9, 3), round(t["mfu"], 9)
    (24.576, 1.0)
"""

from __future__ import annotations

from .comm import fsdp_gathers, recompute_passes, traffic
from .memory import BYTES, num_microbatches, pipeline_bubble, ring_attention
from .moe_spec import dispatch_imbalance
from .params import expert_fc1_width, mlp_fc1_width, model_stage_layers, rank_moe_layers, stage_counts, stage_units
from .spec import ClusterSpec, ModelSpec, TrainingSpec

TERMS = ("compute_s", "bubble_s", "tp_s", "cp_s", "pp_s", "dp_s")
MOE_TERM = "ep_s"  # a MoE model's breakdown adds the token dispatch (ep all-to-alls, etp gathers)


def moe_layer_forward_flops(model: ModelSpec, tokens: int, context: int, imbalance: float = 1.0) -> dict:
    """Forward FLOPs of one MoE layer: :func:`layer_forward_flops` with the MLP replaced.

    The router ``2*tokens*h*E``, the shared experts as a dense MLP of their width, and the
    routed experts ``topk * imbalance`` times an expert MLP per token
    (``2*tokens*h*(F_e + f_e)`` each: routed experts count top-k, shared experts always).

        >>> m = ModelSpec(num_layers=1, hidden_size=4, num_attention_heads=2, seq_length=8, vocab_size=0,
        ...               num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=8)
        >>> moe_layer_forward_flops(m, 8, 8)  # qkv 2*8*4*(4+8), out 2*8*4*4, router 2*8*4*4, 2 x 2*8*4*(8+8)
        {'linear': 3328, 'attention': 1024}
    """
    h = model.hidden_size
    dense = layer_forward_flops(model, tokens, context)
    mlp = 2 * tokens * h * (mlp_fc1_width(model) + model.ffn_hidden_size)
    shared = model.moe_shared_expert_intermediate_size or 0
    shared_mlp = 2 * tokens * h * ((2 if model.activation == "swiglu" else 1) * shared + shared)
    experts = 2 * tokens * h * (expert_fc1_width(model) + model.moe_ffn_hidden_size) * model.moe_router_topk
    router = 2 * tokens * h * model.num_moe_experts
    linear = dense["linear"] - mlp + router + shared_mlp + experts * imbalance
    return {"linear": round(linear), "attention": dense["attention"]}


def layer_forward_flops(model: ModelSpec, tokens: int, context: int) -> dict:
    """Forward matmul FLOPs of one layer for ``tokens`` queries attending to ``context`` keys.

    ``{"linear": ..., "attention": ...}``: the projections and the MLP
    (``2*tokens*h*(h + 2*g*k)`` for q, k, v, ``2*tokens*h^2`` for the output projection,
    ``4*tokens*h*f`` for a GeLU MLP, ``6*tokens*h*f`` for SwiGLU's three matrices) and the
    two attention-score matmuls
    (``4*tokens*context*h``: ``Q K^T`` and ``P V``). With ``g = a``, ``f = 4h`` and
    ``tokens = context = s`` the sum is Narayanan's ``24 s h^2 + 4 s^2 h``.

        >>> m = ModelSpec(num_layers=1, hidden_size=4, num_attention_heads=2, seq_length=8, vocab_size=0)
        >>> layer_forward_flops(m, 8, 8)
        {'linear': 3072, 'attention': 1024}
    """
    h, f = model.hidden_size, model.ffn_hidden_size
    kv = 2 * model.num_query_groups * model.kv_channels
    linear = 2 * tokens * h * (h + kv) + 2 * tokens * h * h + 2 * tokens * h * (mlp_fc1_width(model) + f)
    return {"linear": linear, "attention": 4 * tokens * context * h}


def logits_forward_flops(model: ModelSpec, tokens: int) -> int:
    """The output layer's forward, ``2 * tokens * h * v`` (0 without a vocabulary)."""
    return 2 * tokens * model.hidden_size * model.vocab_size


def model_flops_per_sample(model: ModelSpec) -> int:
    """Model FLOPs of one sample's forward and backward, without recomputation (for MFU).

    ``3 * (l * (24 s h^2 + 4 s^2 h) + 2 s h v)`` for a GPT model, i.e. Korthikanti et al.'s
    ``72 s l h^2 (1 + s/(6h) + v/(12 l h))``.
    """
    s = model.seq_length
    layer = layer_forward_flops(model, s, s)
    moe = model.num_moe_layers
    flops = (model.num_layers - moe) * (layer["linear"] + layer["attention"])
    if moe:  # the active experts (top-k), balanced: what the model computes, not a rank's load
        moe_layer = moe_layer_forward_flops(model, s, s)
        flops += moe * (moe_layer["linear"] + moe_layer["attention"])
    return 3 * (flops + logits_forward_flops(model, s))


def stage_slot_flops(model: ModelSpec, training: TrainingSpec, tp: int, cp: int, pp: int,
                     runtime=None) -> dict:
    """FLOPs one rank of the busiest stage runs per micro-batch: ``{"forward", "backward", "total", "stage"}``.

    The backward is twice the forward, plus what is recomputed before it: the layers'
    forward (``full``, and the pipeline runtime's re-run of every chunk but the last
    model stage, :func:`~.comm.recompute_passes`) or their attention-score matmuls
    (``selective``, and always for the ring attention at ``cp > 1``, whose backward
    rebuilds every block's probabilities). A rank's layers follow the training's stage
    cut (all its chunks); the last stage adds the logits. ``stage`` is the busiest
    pipeline rank (the later one on a tie).
    """
    b, s = training.micro_batch_size, model.seq_length
    layer = layer_forward_flops(model, b * s // cp, s)
    logits = logits_forward_flops(model, b * s // cp) / tp
    scores_again = training.recompute == "selective" or ring_attention(training, cp)
    best = None
    chunks = model_stage_layers(model, training, pp)
    moe_layers = rank_moe_layers(model, training, pp)
    # A MoE layer on the busiest expert rank: its routed rows are moe_imbalance x the mean.
    # moe_static_slots: the compiled dropless dispatch runs num_experts/topk x (dispatch_imbalance).
    moe_layer = (moe_layer_forward_flops(model, b * s // cp, s, dispatch_imbalance(model, training))
                 if model.is_moe else layer)
    for stage in range(pp):
        layers = sum(chunks[stage::pp])
        moe = moe_layers[stage]
        forward = ((layers - moe) * (layer["linear"] + layer["attention"])
                   + moe * (moe_layer["linear"] + moe_layer["attention"])) / tp
        recomputed = recompute_passes(model, training, pp, stage, runtime, chunks) * forward
        if scores_again and training.recompute != "full":
            recomputed += layers * layer["attention"] / tp
        forward += logits if stage == pp - 1 else 0
        backward = 2 * forward + recomputed
        if best is None or forward + backward >= best["total"]:
            best = {"forward": forward, "backward": backward, "total": forward + backward, "stage": stage}
    return best


# Operator launches (a nominal count of the library's kernels; op_overhead_us prices each):
# one layer's forward launches its two norms, four linear layers and their biases, the
# heads' reshapes and transposes, the attention core (scores, scale, mask, softmax, P V),
# the activation and two residual adds; the embedding stage and the head stage (final
# norm, logits, loss) a few more. A backward launches about two per forward operator,
# AdamW about twelve per parameter tensor (moments, bias corrections, update, copies).
LAYER_FORWARD_OPS = 24
EDGE_FORWARD_OPS = 8
BACKWARD_OPS_PER_FORWARD = 2
OPTIMIZER_OPS_PER_TENSOR = 12
# The causal ring (context_parallel_method "ring", cp > 1) runs its attention block by
# block: the zigzag layout gives each rank two query chunks and cp K/V blocks arrive in
# turn, so the busiest rank computes 2 * cp blocks a layer, each about thirty operators
# (slices of the block, scores, mask, online-softmax merge) forward and as many backward
# (modules/attention/ring.py).
RING_BLOCK_OPS = 30


def ring_block_operators(training: TrainingSpec, cp: int) -> int:
    """Operators one layer's ring attention launches per direction on the busiest rank.

        >>> ring_block_operators(TrainingSpec(context_parallel_method="ring"), 4)
        240
        >>> ring_block_operators(TrainingSpec(context_parallel_method="ulysses"), 4)
        0
    """
    if cp <= 1 or training.context_parallel_method != "ring":
        return 0
    return RING_BLOCK_OPS * 2 * cp


def step_operators(model: ModelSpec, training: TrainingSpec, tp: int, cp: int, pp: int, dp: int,
                   stage: int, runtime=None) -> dict:
    """Operators rank ``stage`` launches: ``{"forward", "backward"}`` per micro-batch, ``"optimizer"`` per step.

    A layer's forward launches :data:`LAYER_FORWARD_OPS` (plus, under the causal ring,
    :func:`ring_block_operators`), the first and the last stage :data:`EDGE_FORWARD_OPS`
    more each; the backward :data:`BACKWARD_OPS_PER_FORWARD` per forward operator (the
    ring's blocks once more) plus the re-run forwards (:func:`~.comm.recompute_passes`); the
    optimizer step :data:`OPTIMIZER_OPS_PER_TENSOR` per parameter tensor of the rank.

        >>> toy = ModelSpec(num_layers=2, hidden_size=4, num_attention_heads=1, seq_length=8, vocab_size=0)
        >>> step_operators(toy, TrainingSpec(), 1, 1, 1, 1, 0)  # 2 x 24 + 2 x 8; 2 x 12 + 3 tensors
        {'forward': 64, 'backward': 128, 'optimizer': 324}
    """
    chunks = model_stage_layers(model, training, pp)
    layers = sum(chunks[stage::pp])
    edges = (stage == 0) + (stage == pp - 1)
    ring = ring_block_operators(training, cp)
    forward = layers * (LAYER_FORWARD_OPS + ring) + edges * EDGE_FORWARD_OPS
    again = recompute_passes(model, training, pp, stage, runtime, chunks) * layers * (LAYER_FORWARD_OPS + ring)
    tensors = stage_counts(model, tp, pp, dp * cp, training)[stage][2]
    backward = BACKWARD_OPS_PER_FORWARD * (forward - layers * ring) + layers * ring + again
    return {"forward": forward, "backward": round(backward),
            "optimizer": OPTIMIZER_OPS_PER_TENSOR * tensors}


def hidden_behind(comm_s: float, compute_s: float, pieces: int = 1) -> float:
    """Exposed seconds of ``comm_s`` of collectives overlapped with ``compute_s`` of compute.

    What exceeds the compute, and at least the first of ``pieces`` equal buckets (it
    starts before any compute can hide it, or finishes after the last):
    ``max(comm / pieces, comm - compute)``, never more than ``comm``.

        >>> hidden_behind(3.0, 10.0, 3), hidden_behind(3.0, 1.0), hidden_behind(3.0, 10.0)
        (1.0, 2.0, 0.0)
    """
    if comm_s <= 0:
        return 0.0
    floor = comm_s / pieces if pieces > 1 else 0.0
    return min(comm_s, max(floor, comm_s - compute_s))


def _link(cluster: ClusterSpec, crosses: bool) -> tuple[float, float]:
    """(bytes per second, seconds per call) of a group's link."""
    if crosses:
        return cluster.inter_node_gbps * 1e9, cluster.inter_node_latency_us * 1e-6
    return cluster.intra_node_gbps * 1e9, cluster.intra_node_latency_us * 1e-6


COMPOSED_DEVICES = ("cpu",)  # devices whose collectives the library composes (collectives.get_backend)


def backend_calls(row: dict, cluster: ClusterSpec) -> int:
    """Backend calls, one after the other, of each call a traffic row counts.

    A point-to-point transfer is a pair's (2 ranks). On a device whose collectives the
    library composes (the ``cpu`` preset: no send/recv kernel, :mod:`mindscience.distributed.p2p`),
    a ring shift over ``n > 2`` ranks is two such transfers in turn, one to each neighbour
    over its own 2-rank communicator; native send/recv run both at once. Everything else
    is one call.

        >>> ring = {"group": "cp", "op": "send_recv", "group_size": 4}
        >>> backend_calls(ring, ClusterSpec(device="cpu")), backend_calls(ring, ClusterSpec(device="h100-80gb"))
        (2, 1)
    """
    composed = cluster.device in COMPOSED_DEVICES
    return 2 if composed and row["op"] == "send_recv" and row["group"] != "pp" and row["group_size"] > 2 else 1


def ring_steps(row: dict, cluster: ClusterSpec) -> int:
    """Hops of one call on a host whose ranks share cores: each waits for its peer to run.

    On such a host (``cluster.cores_per_node``, no measured ``collective_latency_us``) a
    ring all-reduce over ``n`` ranks is ``2 (n - 1)`` hops, an all-gather, reduce-scatter
    or all-to-all ``n - 1``, a transfer one; each hop costs the link's latency. Elsewhere 1
    (the latency is the whole call's, as nccl-tests measure it).

        >>> host = ClusterSpec(device="cpu", cores_per_node=2)
        >>> [ring_steps({"op": op, "group_size": 4}, host) for op in ("all_reduce", "all_gather", "send_recv")]
        [6, 3, 1]
    """
    if not cluster.cores_per_node or cluster.collective_latency_us:
        return 1
    n = row["group_size"]
    if row["op"] == "send_recv" or n <= 1:
        return 1
    return 2 * (n - 1) if row["op"] == "all_reduce" else n - 1


def collective_seconds(rows: list[dict], group: str, cluster: ClusterSpec, crosses: bool,
                       ops: tuple | None = None) -> float:
    """Alpha-beta time of a group's rows from :func:`~.comm.traffic`: ``calls * latency + bytes / bandwidth``.

    The latency of a row is its op's on its group size (:meth:`~.spec.ClusterSpec.collective_latency_s`:
    a calibrated ``collective_latency_us``, else the link's one latency; a transfer's group
    is its pair), times :func:`backend_calls`. ``ops``: only the rows of these ops.
    """
    bandwidth, _ = _link(cluster, crosses)

    def latency(r):
        n = 2 if r["op"] == "send_recv" else r["group_size"]
        return backend_calls(r, cluster) * cluster.collective_latency_s(r["op"], n, crosses) * ring_steps(r, cluster)

    # Start at 0.0: a group without rows (size 1) is 0.0 s, a float like every other term.
    return sum((r["count"] * latency(r) + r["bytes"] / bandwidth for r in rows
                if r["group"] == group and (ops is None or r["op"] in ops)), 0.0)


def pipeline_transfers(pp: int, microbatches: int, virtual_stages: int = 1) -> int:
    """Point-to-point transfers on the busiest stage's critical path: ``2 * v * (m + p - 1)``.

    1F1B (``v = 1``): one activation forward and one gradient backward per slot, ``m + p - 1``
    slots. Interleaved: each micro-batch crosses ``v`` times as many stage boundaries, ``v``
    times the transfers. Against the action lists of :mod:`mindscience.distributed.pipeline`
    (their busiest rank's exchange steps): 1F1B within one transfer; interleaved on 4 stages,
    ``v = 2``, 28 / 44 / 76 against 32 / 60 / 124 for ``m`` = 4 / 8 / 16, because a chunk's
    send and the next receive pair with different neighbours and do not merge into one
    exchange (docs/BENCHMARKS.md, "Step-time model against the measurement").

        >>> pipeline_transfers(4, 8), pipeline_transfers(4, 8, 2), pipeline_transfers(1, 8)
        (22, 44, 0)
    """
    return 2 * virtual_stages * (microbatches + pp - 1) if pp > 1 else 0


def step_time(model: ModelSpec, training: TrainingSpec, cluster: ClusterSpec, tp: int, cp: int, pp: int, dp: int,
              crossing: dict | None = None, rows: list[dict] | None = None, runtime=None,
              flops: dict | None = None, ep: int = 1, etp: int | None = None,
              ranks_per_node: int | None = None) -> dict:
    """The step time of one layout and its exposed breakdown.

    Args:
        model: The model.
        training: The training, as the library runs it (:func:`~.runtime.what_runs`).
        cluster: The devices.
        tp: Tensor-parallel size.
        cp: Context-parallel size.
        pp: Pipeline-parallel size.
        dp: Data-parallel size.
        crossing: ``{group key: spans nodes}`` for ``tp``, ``cp``, ``pp`` and ``dp-cp``
            (from :func:`~.comm.crossing_flags`); missing keys stay inside a node.
        rows: :func:`~.comm.traffic` of these sizes, when the caller has it already.
        runtime: :class:`~.runtime.Runtime` of :func:`~.runtime.what_runs` (None: no
            pipeline re-run forward, ``fully_shard`` per parameter), for the compute and,
            without ``rows``, the traffic.
        flops: :func:`stage_slot_flops` of the same arguments, when the caller has it.
        ep: The expert-parallel size of a MoE model. Its breakdown gains ``ep_s``, the
            token dispatch (the ``ep`` all-to-alls and ``etp`` gathers, all exposed), and
            ``dp_s`` also reduces the expert gradients over ``edp`` (crossing keys
            ``ep``, ``etp``, ``edp``).
        etp: The expert tensor-parallel size (None: tp).
        ranks_per_node: Ranks sharing one node's cores (None: the whole world), for
            :meth:`~.spec.ClusterSpec.oversubscription`.

    Returns:
        ``{"step_time_s", "breakdown": {compute_s, bubble_s, tp_s, cp_s, pp_s, dp_s},
        "tokens_per_s", "mfu", "model_flops_per_step", "microbatches", "virtual_stages",
        "pipeline_bubble", "slot_s", "dp_reduce_s", "oversubscription", "operators"}``
        (``dp_reduce_s``: the whole dp-cp traffic, of which ``dp_s`` is exposed;
        ``oversubscription``: the factor every term was slowed by; ``operators``:
        :func:`step_operators` of the busiest rank).
    """
    crossing = crossing or {}
    world = tp * cp * pp * dp
    m = num_microbatches(training, dp, world)
    v = training.virtual_pipeline_stages if pp > 1 else 1
    flops = stage_slot_flops(model, training, tp, cp, pp, runtime) if flops is None else flops
    rows = traffic(model, training, tp, cp, pp, dp, runtime, flops["stage"], ep, etp) if rows is None else rows
    # Ranks sharing cores run `slow` times slower: compute, launches and collectives alike.
    slow = cluster.oversubscription(world if ranks_per_node is None else min(ranks_per_node, world))
    rate = cluster.effective_flops
    launch = cluster.op_overhead_us * 1e-6
    ops = step_operators(model, training, tp, cp, pp, dp, flops["stage"], runtime)
    forward_s = slow * (flops["forward"] / rate + ops["forward"] * launch)
    backward_s = slow * (flops["backward"] / rate + ops["backward"] * launch)
    slot = forward_s + backward_s
    compute = m * slot + slow * ops["optimizer"] * launch
    bubble = m * slot * pipeline_bubble(pp, m, v) if pp > 1 else 0.0

    def seconds(group, ops=None):
        return slow * collective_seconds(rows, group, cluster, bool(crossing.get(group)), ops)

    tp_s, cp_s = seconds("tp"), seconds("cp")
    pp_s = 0.0
    if pp > 1:
        bandwidth, _ = _link(cluster, bool(crossing.get("pp")))
        latency = cluster.collective_latency_s("send_recv", 2, bool(crossing.get("pp")))
        sp = training.sequence_parallel and tp > 1
        message = model.seq_length // cp * training.micro_batch_size * model.hidden_size
        message = message * BYTES[training.precision]["activation"] // (tp if sp else 1)
        pp_s = slow * pipeline_transfers(pp, m, v) * (latency + message / bandwidth)
    dp_reduce = seconds("dp-cp") + seconds("edp")
    grads = seconds("dp-cp", ("all_reduce", "reduce_scatter")) + seconds("edp", ("all_reduce", "reduce_scatter"))
    gathers = dp_reduce - grads
    if training.zero_stage < 3:
        # overlap_grad_reduce: the buckets reduce during the last micro-batch's backward;
        # overlap_param_gather: the updated weights' gather during the first one's forward.
        dp_s = (hidden_behind(grads, backward_s) if training.overlap_grad_reduce else grads) \
            + (hidden_behind(gathers, forward_s) if training.overlap_param_gather else gathers)
    else:
        dp_s = _fsdp_exposed(model, training, tp, pp, dp * cp, m, runtime, flops["stage"], seconds,
                             forward_s, backward_s)
    breakdown = {"compute_s": compute, "bubble_s": bubble, "tp_s": tp_s, "cp_s": cp_s, "pp_s": pp_s, "dp_s": dp_s}
    if model.is_moe:
        breakdown[MOE_TERM] = seconds("ep") + seconds("etp")
    total = sum(breakdown.values())
    samples = m * training.micro_batch_size * dp
    model_flops = samples * model_flops_per_sample(model)
    return {
        "step_time_s": total,
        "breakdown": breakdown,
        "tokens_per_s": samples * model.seq_length / total,
        "mfu": model_flops / total / (world * cluster.peak_tflops * 1e12),
        "model_flops_per_step": model_flops,
        "microbatches": m,
        "virtual_stages": v,
        "pipeline_bubble": pipeline_bubble(pp, m, v),
        "slot_s": slot,
        "dp_reduce_s": dp_reduce,
        "oversubscription": slow,
        "operators": ops,
    }


def _fsdp_exposed(model, training, tp, pp, d, m, runtime, stage, seconds, forward_s, backward_s) -> float:
    """Exposed seconds of ZeRO-3's dp-cp traffic (the dense weights; expert rows over edp as at stage 2).

    Without prefetching (``fully_shard`` before units, or ``fsdp_prefetch`` off) every
    gather and reduce-scatter is exposed. With it, per micro-batch the forward's gathers
    (one per unit) hide behind the forward but for the first unit's, and the backward's
    (the second gather of resharded units, the per-unit reduce-scatters) behind the
    backward but for one unit's (:func:`hidden_behind`).
    """
    dense = seconds("dp-cp")
    experts = seconds("edp")
    if runtime is None or not runtime.fsdp_units or not training.fsdp_prefetch or d <= 1:
        return dense + experts
    counts = stage_counts(model, tp, pp, d, training)
    leaves, root = stage_units(model, tp, pp, d, training)[counts.index(max(counts))]
    units = len(leaves) + (1 if root[0] else 0)
    gathers = fsdp_gathers(runtime, runtime.stage_recompute and pp > 1)
    # The forward gathers every unit once; the backward the leaves again (gathers - 1 times).
    gather_s = seconds("dp-cp", ("all_gather",)) / m
    again = gather_s * (gathers - 1) * len(leaves) / max(1, gathers * len(leaves) + (1 if root[0] else 0))
    scatter_s = seconds("dp-cp", ("reduce_scatter",)) / m
    exposed = hidden_behind(gather_s - again, forward_s, units) + hidden_behind(again + scatter_s, backward_s, units)
    return m * exposed + experts
