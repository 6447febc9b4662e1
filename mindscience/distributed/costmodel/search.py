"""``msdist suggest``: every layout of a world that fits a model, fastest training step first.

The search enumerates every ``(tp, cp, pp)`` whose product divides the world (``dp`` is
the rest; ``fix`` pins some of them), and for each micro-batch size asked for drops the
choices that break a model constraint (counted under the first broken one) or whose
busiest stage does not fit the device. For each remaining size it tries every order that
places the ranks differently (:func:`distinct_orders`): an order changes only which
groups span nodes, so the traffic is computed once per size and micro-batch size and each
order re-prices it. Each size keeps its fastest order and micro-batch size (ties: the
default ``tp-cp-dp-pp``, then the earliest permutation, then the smaller micro-batch).
Candidates are sorted by the estimated step time (:func:`~.steptime.step_time`: compute,
pipeline bubble and exposed communication), then by peak memory.

Example: a 16-layer model on 16 devices, 8 per node, 16 samples per step. Pure data
parallelism would all-reduce every gradient across both nodes after a single
micro-batch; pp = 2 keeps the gradients inside a node for a 50 % bubble of the one
stage's compute, and deeper pipelines only idle more::

    >>> from mindscience.distributed.costmodel.spec import ModelSpec, Workload
    >>> m = ModelSpec(num_layers=16, hidden_size=1024, num_attention_heads=16,
    ...               seq_length=2048, vocab_size=32000)
    >>> ranked = suggest(Workload(model=m), world_size=16)["candidates"]
    >>> sorted((c["tp"], c["cp"], c["dp"], c["pp"]) for c in ranked[:2])
    [(1, 1, 8, 2), (2, 1, 4, 2)]
    >>> [c["pp"] for c in ranked].index(8) > 10    # the old first choice, pp = 8
    True
"""

from __future__ import annotations

import itertools
from dataclasses import replace

from ..topology.layout import DEFAULT_ORDER, Layout
from ..topology.plan import DEFAULT_HCCL_BUFFSIZE_MB
from .comm import GROUPS, crossing_flags, timed, traffic
from .constraints import dense_violations, expert_violations
from .errors import ModelError
from .report import communicator_bytes
from .memory import stage_rows
from .moe_spec import dispatch_notes
from .runtime import what_runs
from .spec import DEFAULT_DEVICES_PER_NODE, GIB, Workload
from .steptime import stage_slot_flops, step_time

MEMORY = "does not fit device memory"
AXES = ("tp", "cp", "dp", "pp")
EXPERT_AXES = ("ep", "etp")  # a MoE model's expert axes, searched per size (issue 36)


def size_choices(world_size: int, fix: dict | None = None):
    """Every ``(tp, cp, pp, dp)`` with ``tp * cp * pp * dp == world_size`` (and the sizes in ``fix``)."""
    fix = fix or {}
    divisors = [d for d in range(1, world_size + 1) if world_size % d == 0]
    for tp in divisors if "tp" not in fix else [fix["tp"]]:
        for cp in (d for d in divisors if (world_size // tp) % d == 0 and fix.get("cp", d) == d):
            for pp in (d for d in divisors if (world_size // (tp * cp)) % d == 0 and fix.get("pp", d) == d):
                dp = world_size // (tp * cp * pp)
                if fix.get("dp", dp) == dp:
                    yield tp, cp, pp, dp


def check_fix(fix: dict | None, world_size: int) -> dict:
    """Validate pinned axis sizes (``--fix tp=8,cp=1``).

    Raises:
        ModelError: an unknown axis, a size that is not a positive integer, or sizes
            whose product does not divide the world.
    """
    fix = dict(fix or {})
    for axis, size in fix.items():
        if axis not in AXES + EXPERT_AXES:
            raise ModelError(f"--fix {axis}={size!r} is invalid: expected axes among {', '.join(AXES + EXPERT_AXES)}, "
                             "e.g. --fix tp=8,cp=1 or --fix ep=8.")
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ModelError(f"--fix {axis}={size!r} is invalid: expected a positive integer size.")
    experts = fix.get("ep", 1) * fix.get("etp", 1)
    if world_size % experts:
        raise ModelError(f"--fix {','.join(f'{a}={n}' for a, n in fix.items() if a in EXPERT_AXES)} is invalid: "
                         f"ep*etp = {experts} does not divide --world {world_size}.")
    dense = {a: n for a, n in fix.items() if a in AXES}
    product = 1
    for size in dense.values():
        product *= size
    if world_size % product:
        raise ModelError(f"--fix {','.join(f'{a}={n}' for a, n in fix.items())} is invalid: the product "
                         f"{product} does not divide --world {world_size}.")
    if len(dense) == 4 and product != world_size:
        raise ModelError(f"--fix {','.join(f'{a}={n}' for a, n in fix.items())} is invalid: tp*cp*dp*pp = "
                         f"{product}, expected the world size {world_size}.")
    return fix


def expert_choices(model, tp: int, pp: int, world_size: int, fix: dict) -> list[tuple[int, int]]:
    """The ``(ep, etp)`` a size tries: ep a divisor of the experts, etp 1 or tp, ``etp*ep*pp | world``.

    A dense model has one: ``(1, tp)`` (no expert axes). ``fix`` pins ``ep`` and/or ``etp``.

        >>> from mindscience.distributed.costmodel.spec import ModelSpec
        >>> m = ModelSpec(num_layers=2, hidden_size=8, num_attention_heads=2, seq_length=8, vocab_size=0,
        ...               num_moe_experts=8)
        >>> expert_choices(m, 2, 1, 8, {})
        [(1, 1), (1, 2), (2, 1), (2, 2), (4, 1), (4, 2), (8, 1)]
    """
    if not model.is_moe:
        return [(1, tp)]
    experts = model.num_moe_experts
    out = []
    for ep in (d for d in range(1, experts + 1) if experts % d == 0 and fix.get("ep", d) == d):
        for etp in dict.fromkeys((1, tp)):
            if fix.get("etp", etp) == etp and world_size % (etp * ep * pp) == 0:
                out.append((ep, etp))
    return out


def distinct_orders(sizes: dict) -> list[str]:
    """Orders that place ranks differently: one per arrangement of the axes larger than 1.

    Size-1 axes do not move any rank, so each arrangement is written with them last, and
    the default order's own arrangement as the default order (listed first).

        >>> distinct_orders({"tp": 2, "cp": 1, "dp": 1, "pp": 4})
        ['tp-cp-dp-pp', 'pp-tp-cp-dp']
    """
    axes = DEFAULT_ORDER.split("-")
    big = tuple(a for a in axes if sizes[a] > 1)
    rest = tuple(a for a in axes if sizes[a] == 1)
    return [DEFAULT_ORDER if perm == big else "-".join(perm + rest) for perm in itertools.permutations(big)]


def _gib(n: float) -> str:
    return f"{n / GIB:.1f} GiB"


def _closest(workload: Workload, best: dict, sizes: tuple, buffers: int, experts: tuple = (1, None)) -> dict:
    """Why the lowest-memory valid size misses the device, and what would save how much."""
    model, training, device = workload.model, workload.training, workload.cluster.device_memory_bytes
    stage = max(best["stages"], key=lambda s: s["total_bytes"])
    parts = ", ".join(f"{k.replace('_bytes', '')} {stage[k] / GIB:.1f}" for k in (
        "weights_bytes", "gradients_bytes", "optimizer_bytes", "activations_bytes", "gathered_bytes",
        "communicator_bytes") if stage.get(k) or k != "gathered_bytes")
    why = (f"stage {stage['stage']} needs {_gib(stage['total_bytes'])} ({parts} GiB) of "
           f"{_gib(device)}: {_gib(stage['total_bytes'] - device)} over")
    hints = []
    tries = []
    if sizes[1] * sizes[3] > 1:
        for z in range(training.zero_stage + 1, 4):
            tries.append((f"training.zero_stage: {z}", replace(training, zero_stage=z)))
    for mode in ("selective", "full")[("none", "selective", "full").index(training.recompute):]:
        tries.append((f"training.recompute: {mode}", replace(training, recompute=mode)))
    for label, other in tries:
        priced, runtime, _ = what_runs(other, *sizes)
        peak = max(s["total_bytes"] for s in stage_rows(model, priced, *sizes, buffers, runtime, *experts))
        hints.append(f"{label} would need {_gib(peak)}")
    hints.append("or more devices, or devices with more memory (--device-memory-gb)")
    tp, cp, pp, dp = sizes
    ep, etp = experts[0], tp if experts[1] is None else experts[1]
    return {"tp": tp, "cp": cp, "dp": dp, "pp": pp, "ep": ep, "etp": etp, "order": DEFAULT_ORDER,
            "peak_bytes": best["peak"], "fits": False,
        "peak_stage": stage["stage"], "over_bytes": stage["total_bytes"] - device, "why": why, "hints": hints}


def interleaving_note(num_layers: int, v: int, world_size: int, fix: dict, rejected: dict) -> str:
    """Why a search with ``v`` virtual stages ranked no pipeline (pp > 1), and which v would work.

    ``rejected`` counts the reasons the pp > 1 sizes were dropped.

        >>> interleaving_note(16, 3, 64, {}, {"num_layers % (pp*virtual_pipeline_stages)": 12})
        ... # doctest: +NORMALIZE_WHITESPACE
        'virtual stages v=3: no layout with pp > 1 was priced (num_layers % (pp*virtual_pipeline_stages): 12
        sizes), so only pp=1 layouts, which have no pipeline to interleave, are ranked. num_layers=16 %
        (pp*v) == 0 holds for v = 2, 4, 8 with a pp > 1 of 64 devices.'
    """
    def sizes(n: int) -> str:
        return f"{n} size{'s' if n > 1 else ''}"

    interleaving = {r: n for r, n in rejected.items() if "virtual_pipeline_stages" in r or "(interleaved)" in r}
    why = [f"{reason}: {sizes(n)}" for reason, n in sorted(interleaving.items(), key=lambda kv: -kv[1])]
    others = sum(rejected.values()) - sum(interleaving.values())
    if others:
        why.append(f"{sizes(others)} for other constraints or memory")
    depths = [p for p in range(2, world_size + 1) if world_size % p == 0 and fix.get("pp", p) == p]
    good = sorted({w for p in depths if num_layers % p == 0 for w in range(2, num_layers // p + 1)
                   if num_layers % (p * w) == 0})
    hint = (f" num_layers={num_layers} % (pp*v) == 0 holds for v = {', '.join(map(str, good[:6]))} with a pp > 1 "
            f"of {world_size} devices." if good else
            f" No v > 1 divides num_layers={num_layers} into equal chunks for a pp > 1 of {world_size} devices.")
    return (f"virtual stages v={v}: no layout with pp > 1 was priced ({', '.join(why)}), so only pp=1 "
            "layouts, which have no pipeline to interleave, are ranked." + hint)


def _general(notes: list) -> list:
    """A candidate's notes without its sizes (``pp=4: ...`` -> ``pp > 1: ...``), so that the
    summary says each behaviour once."""
    out = []
    for note in notes:
        head, sep, rest = note.partition(": ")
        out.append(f"pp > 1: {rest}" if sep and head.startswith("pp=") else note)
    return out


def _price(model, training, cluster, sizes: tuple, orders: list, runtime=None, experts: tuple = (1, None),
           ranks_per_node: int | None = None) -> tuple:
    """The fastest ``(order, comm, flags, timing)`` of one size and training over ``orders``.

    ``orders`` holds ``(order, crossing flags)`` pairs; the first wins ties. ``experts``: ``(ep, etp)``.
    ``ranks_per_node``: ranks sharing a node's cores (:func:`~.steptime.step_time`).
    """
    flops = stage_slot_flops(model, training, *sizes[:3], runtime)
    rows = traffic(model, training, *sizes, runtime, flops["stage"], *experts)
    best = None
    for order, flags in orders:
        timing = step_time(model, training, cluster, *sizes, crossing=flags, rows=rows, runtime=runtime,
                           flops=flops, ep=experts[0], etp=experts[1], ranks_per_node=ranks_per_node)
        if best is None or timing["step_time_s"] < best[2]["step_time_s"]:
            best = (order, flags, timing)
    order, flags, timing = best
    return order, timed(rows, flags, cluster), flags, timing


def suggest(workload: Workload, world_size: int, devices_per_node: int | None = None,
            top: int | None = None, buffsize_mb: int = DEFAULT_HCCL_BUFFSIZE_MB, fix: dict | None = None,
            micro_batch_sizes=None, virtual_stages: int | None = None, zero_stages=None) -> dict:
    """Rank the layouts of ``world_size`` devices that fit ``workload``, fastest step first.

    Args:
        workload: The model, training and cluster (``cluster.device_memory_gb`` decides
            what fits, ``peak_tflops``/``compute_efficiency``/bandwidths/latencies the time).
        world_size: Devices.
        devices_per_node: Devices per node; default ``cluster.devices_per_node``, else
            8 (or the world when smaller).
        top: Keep the best ``top`` candidates (None: all).
        buffsize_mb: HCCL_BUFFSIZE for the communicator memory.
        fix: Pinned axis sizes, e.g. ``{"tp": 8, "cp": 1}``; ``ep``/``etp`` pin the expert
            axes of a MoE model (otherwise each size tries every ep dividing the experts and
            etp in {1, tp}, :func:`expert_choices`, and keeps its fastest).
        micro_batch_sizes: Micro-batch sizes to try (default: the training's); each
            candidate keeps its fastest. Without a ``global_batch_size`` the global batch
            is ``max(micro_batch_sizes) * world_size`` for all of them, so every candidate
            trains the same samples per step.
        virtual_stages: Model chunks per pipeline rank (the interleaved schedule);
            default the training's ``virtual_pipeline_stages``.
        zero_stages: ZeRO stages to try (default: the training's ``zero_stage``); each
            candidate keeps its fastest (ties: the lower peak memory, then the lower stage).

    Returns:
        ``{"world_size", "devices_per_node", "device_memory_bytes", "candidates": [{"tp",
        "cp", "dp", "pp", "ep", "etp", "edp" (the expert axes; ep 1 and etp = tp for a dense
        model), "order", "micro_batch_size", "zero_stage", "peak_bytes", "fits",
        "step_time_s", "breakdown", "tokens_per_s", "mfu", "est_time_s" (communication),
        "bottleneck", "cross_node": {"tp", "cp"}, "pipeline_bubble", "virtual_stages"},
        ...], "valid": count before ``top``, "rejected": {reason: count}, "closest": None
        or the lowest-memory size that breaks no constraint, with "why" and "hints",
        "notes": [lines worth telling the user, e.g. that virtual stages ruled out every
        pipeline, or how the library runs an option of the ranked layouts]}``. Each
        candidate carries its own ``notes`` (:func:`~.runtime.what_runs`); the top-level
        list holds each distinct note of the shown candidates once. Candidates are best first.

    Raises:
        ModelError: no model, bad ``fix`` or micro-batch sizes. LayoutError: a bad world
            or devices per node.
    """
    model, training, cluster = workload.model, workload.training, workload.cluster
    if model is None:
        raise ModelError("no model to suggest layouts for: pass --model FILE or a preset name.")
    if devices_per_node is None:
        devices_per_node = cluster.devices_per_node
    if devices_per_node is None and isinstance(world_size, int) and not isinstance(world_size, bool):
        devices_per_node = min(world_size, DEFAULT_DEVICES_PER_NODE) if world_size > 0 else 1
    Layout(world_size=world_size, devices_per_node=devices_per_node)  # validates both
    fix = check_fix(fix, world_size)
    if not model.is_moe and (fix.get("ep", 1) > 1 or "etp" in fix):
        raise ModelError(f"--fix {','.join(f'{a}={fix[a]}' for a in EXPERT_AXES if a in fix)} is invalid: model "
                         f"{model.name or ''} is dense (no num_moe_experts), so there are no experts to split; "
                         "drop ep/etp from --fix.")
    sizes_b = list(dict.fromkeys(micro_batch_sizes or [training.micro_batch_size]))
    for b in sizes_b:
        if isinstance(b, bool) or not isinstance(b, int) or b < 1:
            raise ModelError(f"micro-batch size {b!r} is invalid: expected positive integers, e.g. "
                             "--micro-batch-sizes 1,2,4.")
    stages_z = list(dict.fromkeys(zero_stages if zero_stages is not None else [training.zero_stage]))
    for z in stages_z:
        if isinstance(z, bool) or z not in (0, 1, 2, 3):
            raise ModelError(f"zero stage {z!r} is invalid: expected stages among 0, 1, 2, 3, e.g. "
                             "--zero-stages 0,1,2,3.")
    if not stages_z:
        raise ModelError("no zero stage to try: expected stages among 0, 1, 2, 3, e.g. --zero-stages 0,1,2,3.")
    if virtual_stages is not None:
        training = replace(training, virtual_pipeline_stages=virtual_stages)
    gbs = training.global_batch_size
    if gbs is None and micro_batch_sizes:
        gbs = max(sizes_b) * world_size
    trainings = [replace(training, micro_batch_size=b, global_batch_size=gbs, zero_stage=z)
                 for b in sizes_b for z in stages_z]
    device = cluster.device_memory_bytes
    candidates, rejected, lowest = [], {}, None
    pipeline_rejected = {}  # reasons the pp > 1 sizes were dropped, for the interleaving note
    dense_fix = {a: n for a, n in fix.items() if a in AXES}
    for tp, cp, pp, dp in size_choices(world_size, dense_fix):
        sizes = {"tp": tp, "cp": cp, "dp": dp, "pp": pp}
        best, reason = None, None
        choices = expert_choices(model, tp, pp, world_size, fix)
        if not choices:
            reason = "num_moe_experts % ep"
        # The dense constraints once per size and training; the expert ones per (ep, etp).
        dense = [dense_violations(model, train, tp, cp, pp, dp) for train in trainings]
        dense_flags = {}  # order -> the dense keys' crossing flags, shared by every (ep, etp)
        for ep, etp in choices:
            layout = buffers = orders = None
            experts_broken = expert_violations(model, tp, cp, pp, dp, ep, etp) if model.is_moe else []
            for train, broken in zip(trainings, dense):
                broken = broken + experts_broken
                if broken:
                    reason = reason or broken[0][0]
                    continue
                if layout is None:
                    layout = _expert_layout(world_size, tp, cp, pp, devices_per_node, ep, etp, model.is_moe)
                    buffers = communicator_bytes(layout, buffsize_mb)
                priced, runtime, notes = what_runs(train, tp, cp, pp, dp)
                notes = notes + dispatch_notes(model, priced)
                stages = stage_rows(model, priced, tp, cp, pp, dp, buffers, runtime, ep, etp)
                peak = max(s["total_bytes"] for s in stages)
                if peak > device:
                    reason = MEMORY
                    if lowest is None or peak < lowest[0]["peak"]:
                        lowest = ({"peak": peak, "stages": stages}, (tp, cp, pp, dp), buffers, train, (ep, etp))
                    continue
                if orders is None:
                    orders = _orders(layout, sizes, model.is_moe, dense_flags)
                order, comm, flags, timing = _price(model, priced, cluster, (tp, cp, pp, dp), orders, runtime,
                                                    (ep, etp), min(devices_per_node, world_size))
                if best is None or (timing["step_time_s"], peak) < (best["step_time_s"], best["peak_bytes"]):
                    best = _candidate(sizes, order, train, notes, stages, peak, timing, comm, flags, pp, ep, etp,
                                      world_size)
        if best is None:
            rejected[reason] = rejected.get(reason, 0) + 1
            if pp > 1:
                pipeline_rejected[reason] = pipeline_rejected.get(reason, 0) + 1
        else:
            candidates.append(best)
    return _finish(workload, world_size, devices_per_node, device, fix, sizes_b, stages_z, top, candidates,
                   rejected, pipeline_rejected, lowest, training)


def _expert_layout(world_size, tp, cp, pp, devices_per_node, ep, etp, moe):
    """The default-order layout of a size with its expert axes (no expert keywords for a dense model)."""
    if not moe:
        return Layout(world_size=world_size, tp=tp, cp=cp, pp=pp, devices_per_node=devices_per_node)
    return Layout(world_size=world_size, tp=tp, cp=cp, pp=pp, devices_per_node=devices_per_node, ep=ep, etp=etp)


def _orders(layout, sizes: dict, moe: bool, dense_flags: dict) -> list:
    """``[(order, crossing flags)]`` of the placements worth pricing (one inside a node).

    With expert axes an order may be refused (it must end in pp unless ``etp*ep == tp*cp``):
    such orders are skipped. ``dense_flags`` caches the dense keys' flags per order.
    """
    placements = distinct_orders(sizes) if layout.num_nodes > 1 else [layout.order]
    folded = moe and (layout.ep > 1 or layout.etp != layout.tp) and layout.etp * layout.ep != layout.tp * layout.cp
    out = []
    for o in placements:
        if folded and not o.endswith("pp") and o != layout.order:
            continue  # the topology refuses it (edp != dp needs an order ending in pp): skip the attempt
        try:
            placed = replace(layout, order=o) if o != layout.order else layout
        except ValueError:  # LayoutError: this order cannot place the expert axes
            continue
        flags = crossing_flags(placed, experts=moe, dense=dense_flags.get(o))
        dense_flags.setdefault(o, {key: flags[key] for key in GROUPS})
        out.append((o, flags))
    return out


def _candidate(sizes, order, train, notes, stages, peak, timing, comm, flags, pp, ep, etp, world_size) -> dict:
    return {**sizes, "ep": ep, "etp": etp, "edp": world_size // (etp * ep * pp), "order": order,
            "micro_batch_size": train.micro_batch_size, "zero_stage": train.zero_stage, "notes": notes,
            "stage_layers": [st["layers"] for st in stages],
            "peak_bytes": peak, "fits": True,
            "step_time_s": timing["step_time_s"], "breakdown": timing["breakdown"],
            "tokens_per_s": timing["tokens_per_s"], "mfu": timing["mfu"],
            "est_time_s": comm["est_time_s"], "bottleneck": comm["bottleneck"],
            "cross_node": {"tp": flags["tp"], "cp": flags["cp"], **({"ep": flags["ep"]} if "ep" in flags else {})},
            "pipeline_bubble": timing["pipeline_bubble"] if pp > 1 else 0.0,
            "virtual_stages": timing["virtual_stages"], "microbatches": timing["microbatches"]}


def _finish(workload, world_size, devices_per_node, device, fix, sizes_b, stages_z, top, candidates, rejected,
            pipeline_rejected, lowest, training) -> dict:
    """Sort the candidates and assemble :func:`suggest`'s answer."""
    model = workload.model
    candidates.sort(key=lambda c: (c["step_time_s"], c["peak_bytes"], c["pp"], c["cp"], c["tp"], c["ep"], c["etp"]))
    shown = candidates[:top] if top else candidates
    notes = list(dict.fromkeys(note for c in shown for note in _general(c["notes"])))
    if training.virtual_pipeline_stages > 1 and candidates and all(c["pp"] == 1 for c in candidates):
        notes.append(interleaving_note(model.num_layers, training.virtual_pipeline_stages, world_size, fix,
                                       pipeline_rejected))
    closest = None
    if not candidates and lowest is not None:
        best, sizes, buffers, train, experts = lowest
        closest = _closest(replace(workload, training=train), best, sizes, buffers, experts)
    return {
        "world_size": world_size,
        "moe": model.is_moe,
        "devices_per_node": devices_per_node,
        "device_memory_bytes": device,
        "fix": fix,
        "micro_batch_sizes": sizes_b,
        "zero_stages": stages_z,
        "candidates": shown,
        "valid": len(candidates),
        "rejected": rejected,
        "closest": closest,
        "notes": notes,
    }
