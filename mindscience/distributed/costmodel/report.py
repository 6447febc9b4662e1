"""The estimates of one layout for one workload: what ``msdist plan LAYOUT --model M`` adds.

Example:
    >>> from mindscience.distributed.topology import Layout
    >>> from mindscience.distributed.costmodel.spec import ModelSpec, Workload
    >>> small = ModelSpec(num_layers=4, hidden_size=256, num_attention_heads=8,
    ...                   seq_length=512, vocab_size=1024)
    >>> report = estimate(Layout(world_size=8, tp=2, pp=2), Workload(model=small))
    >>> [s["layers"] for s in report["memory"]["stages"]], report["memory"]["fits"]
    ([2, 2], True)
    >>> [(r["group"], r["op"]) for r in report["communication"]["per_step"]]
    [('tp', 'all_gather'), ('tp', 'reduce_scatter'), ('pp', 'send_recv'), ('dp-cp', 'all_reduce')]
"""

from __future__ import annotations

from dataclasses import asdict

from ..topology.layout import Layout
from ..topology.plan import DEFAULT_HCCL_BUFFSIZE_MB, RUNTIME_KEYS, memory_estimate
from .comm import crossing_flags, timed, traffic
from .constraints import check
from .errors import ModelError
from .moe_spec import dispatch_notes
from .memory import num_microbatches, pipeline_bubble, stage_rows, total_parameters
from .params import active_parameters
from .params import rank_layers
from .runtime import what_runs
from .spec import Workload

ARCHITECTURE = ("normalization", "activation", "position_embedding", "tie_embeddings", "bias", "dropout")
from .steptime import stage_slot_flops, step_time

MIB = 1024**2


def communicator_bytes(layout: Layout, buffsize_mb: int = DEFAULT_HCCL_BUFFSIZE_MB) -> int:
    """HCCL buffers of the communicators the runtime creates per rank (as ``msdist plan`` counts them)."""
    return memory_estimate(layout, RUNTIME_KEYS, buffsize_mb)["buffer_mb_per_rank"] * MIB


def expert_axes(layout) -> tuple[int, int]:
    """``(ep, etp)`` of a layout: its expert axes (issue 36), ep 1 and etp = tp without them."""
    ep = getattr(layout, "ep", 1) or 1
    etp = getattr(layout, "etp", None)
    return ep, layout.tp if etp is None else etp


def moe_summary(model, training, layout, stages: list[dict], rows: list[dict], timing: dict) -> dict:
    """The MoE rows of ``plan --model``: experts, the expert axes, expert memory and the dispatch.

    ``expert_bytes``: the routed experts' weights, gradients and optimizer state on the
    rank of the peak stage; ``all_to_all_bytes``/``all_to_all_s``: the ep rows of the step
    (sent bytes, seconds), ``dispatch_s``: ``ep_s`` (all-to-alls and etp gathers).
    """
    ep, etp = expert_axes(layout)
    peak = max(stages, key=lambda s: s["total_bytes"])
    a2a = [r for r in rows if r["group"] == "ep"]
    bandwidth_s = timing["breakdown"].get("ep_s", 0.0)
    return {
        "num_moe_experts": model.num_moe_experts,
        "moe_router_topk": model.moe_router_topk,
        "moe_layers": model.num_moe_layers,
        "local_experts": model.num_moe_experts // ep,
        "active_parameters": active_parameters(model),
        "ep": ep, "etp": etp, "edp": layout.world_size // (etp * ep * layout.pp),
        "expert_parameters_per_rank": peak.get("expert_parameters", 0),
        "expert_bytes": peak.get("expert_bytes", 0),
        "all_to_all_calls": sum(r["count"] for r in a2a),
        "all_to_all_bytes": sum(r["bytes"] for r in a2a),
        "dispatch_s": bandwidth_s,
        "imbalance": training.moe_imbalance,
    }


def memory_report(stages: list[dict], device_memory_bytes: int) -> dict:
    """``{"stages", "peak_bytes", "device_memory_bytes", "fits"}`` from :func:`stage_rows`."""
    peak = max(s["total_bytes"] for s in stages)
    return {"stages": stages, "peak_bytes": peak, "device_memory_bytes": device_memory_bytes,
            "fits": peak <= device_memory_bytes}


def estimate(layout: Layout, workload: Workload, buffsize_mb: int = DEFAULT_HCCL_BUFFSIZE_MB,
             mode: str = "pynative") -> dict:
    """Per-stage memory and per-step communication of ``layout`` training ``workload``.

    ``mode``: the execution mode priced (:func:`~.runtime.what_runs`): ``"pynative"``
    (the default, ``plan``/``suggest``) or ``"jit"`` (``msdist train --mode jit``).

    Returns:
        ``{"model": {...}, "memory": {"stages": [...], "peak_bytes", "device_memory_bytes",
        "fits"}, "communication": {"per_step": [...], "est_time_s", "bottleneck"}, "time":
        {"step_time_s", "breakdown", "tokens_per_s", "mfu", ...}, "notes": [...]}``
        (:func:`~.steptime.step_time`). Priced as the library runs it
        (:func:`~.runtime.what_runs`): ``model.training`` is the configured training,
        ``model.priced_training`` the one priced, ``notes`` says why they differ.

    Raises:
        ModelError: the workload has no model.
        ModelConstraintError: the layout breaks a model constraint.
    """
    model, training, cluster = workload.model, workload.training, workload.cluster
    if model is None:
        raise ModelError(
            "no model to estimate: pass --model FILE or a preset name, or add a 'model:' section "
            "to the layout file.")
    check(model, training, layout, workload.source)
    sizes = (layout.tp, layout.cp, layout.pp, layout.dp)
    ep, etp = expert_axes(layout)
    configured = training
    training, runtime, notes = what_runs(training, *sizes, mode=mode)
    notes = notes + dispatch_notes(model, training)
    stages = stage_rows(model, training, *sizes, communicator_bytes(layout, buffsize_mb), runtime, ep, etp)
    busiest = stage_slot_flops(model, training, layout.tp, layout.cp, layout.pp, runtime)["stage"]
    rows = traffic(model, training, *sizes, runtime, busiest, ep, etp)
    flags = crossing_flags(layout, experts=model.is_moe and hasattr(layout, "ep"))
    communication = timed(rows, flags, cluster)
    timing = step_time(model, training, cluster, *sizes, crossing=flags, rows=rows, runtime=runtime, ep=ep, etp=etp,
                       ranks_per_node=min(layout.devices_per_node or layout.world_size, layout.world_size))
    microbatches = num_microbatches(training, layout.dp, layout.world_size)
    summary = {
        "name": model.name,
        "source": workload.source,
        "parameters": total_parameters(model),
        "architecture": {k: getattr(model, k) for k in ARCHITECTURE},
        "num_microbatches": microbatches,
        "pipeline_bubble": pipeline_bubble(layout.pp, microbatches, timing["virtual_stages"]),
        "zero_stage": training.zero_stage,
        "stage_layers": rank_layers(model, training, layout.pp),
        "training": asdict(configured),
        "priced_training": asdict(training),
        "runtime": asdict(runtime),
        "cluster": asdict(cluster),
    }
    if model.is_moe:
        summary["moe"] = moe_summary(model, training, layout, stages, rows, timing)
    time = {k: timing[k] for k in ("step_time_s", "breakdown", "tokens_per_s", "mfu")}
    time.update({k: timing[k] for k in ("model_flops_per_step", "slot_s", "dp_reduce_s", "oversubscription")})
    return {"model": summary, "memory": memory_report(stages, cluster.device_memory_bytes),
            "communication": communication, "time": time, "notes": notes}
