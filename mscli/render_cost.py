"""Rendering of the cost model: memory and communication tables (``plan --model``), ``suggest``.

Like :mod:`mscli.render`, these functions take the plain data the commands computed.
"""

from __future__ import annotations

from rich.table import Table
from rich.text import Text

from .render import HEAD_ROWS, _elided, stderr_console, stdout_console

GIB = 1024**3
MIB = 1024**2


def human_bytes(n: float) -> str:
    """``1.5 GiB``, ``312 MiB``, ``0 B``."""
    if n >= GIB:
        return f"{n / GIB:.1f} GiB"
    if n >= MIB:
        return f"{n / MIB:.0f} MiB"
    return f"{n:.0f} B" if n < 1024 else f"{n / 1024:.0f} KiB"


def human_count(n: int) -> str:
    for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return str(n)


def human_seconds(s: float) -> str:
    if s >= 1:
        return f"{s:.2f} s"
    return f"{s * 1e3:.2f} ms" if s >= 1e-3 else f"{s * 1e6:.0f} us"


def _fits(ok: bool) -> Text:
    return Text("yes", style="green") if ok else Text("NO", style="bold red")


def memory_table(estimate: dict, show_all: bool = False) -> Table:
    model, memory = estimate["model"], estimate["memory"]
    training = model["training"]
    device = memory["device_memory_bytes"]
    title = (f"memory per rank: {model['name']} ({human_count(model['parameters'])} parameters), "
             f"{training['precision']}, recompute {training['recompute']}, "
             f"{'' if training['sequence_parallel'] else 'no '}sequence parallel, "
             f"ZeRO stage {training.get('zero_stage', 1 if training['distributed_optimizer'] else 0)}, "
             f"{model['num_microbatches']} micro-batches/step; device {human_bytes(device)}")
    table = Table(title=title, title_justify="left", caption_justify="left", show_edge=False, pad_edge=False)
    gathered = any(s.get("gathered_bytes") for s in memory["stages"])
    experts = any("expert_bytes" in s for s in memory["stages"])
    for column in ("stage", "layers", "params", "weights", "grads", "optimizer", "activations",
                   *(("gathered",) if gathered else ()), "comm buffers", "total", *(("of which experts",)
                                                                                   if experts else ()), "fits"):
        table.add_column(column, justify="left" if column == "fits" else "right", no_wrap=True)
    kinds = ("weights_bytes", "gradients_bytes", "optimizer_bytes", "activations_bytes",
             *(("gathered_bytes",) if gathered else ()), "communicator_bytes", "total_bytes")
    first, hidden, last = _elided(memory["stages"], HEAD_ROWS // 2, show_all)

    def add(s):
        table.add_row(
            str(s["stage"]), str(s["layers"]), human_count(s["parameters"]),
            *(human_bytes(s[k]) for k in kinds),
            *((human_bytes(s.get("expert_bytes", 0)),) if experts else ()),
            _fits(s["total_bytes"] <= device),
        )

    for stage in first:
        add(stage)
    if hidden:
        table.add_row("...", f"{hidden} more stages (use --all)", *[""] * (len(kinds) + 2 + experts), style="dim")
    for stage in last:
        add(stage)
    verdict = "fits" if memory["fits"] else "does NOT fit"
    runtime = model.get("runtime") or {}
    how = ("the pipeline runtime's stage inputs in flight + one micro-batch of a stage"
           if runtime.get("stage_recompute") else "Korthikanti et al. 2022 with 1F1B micro-batches in flight")
    table.caption = (f"peak {human_bytes(memory['peak_bytes'])} per rank {verdict} in "
                     f"{human_bytes(device)}; weights/grads/optimizer: bytes per parameter of the ZeRO stage "
                     f"(padded shards); activations: {how}"
                     f"{'; gathered: ZeRO-3 weights gathered for a micro-batch' if gathered else ''} "
                     "(docs/COST_MODEL.md)")
    return table


def communication_table(estimate: dict, cluster: dict) -> Table:
    comm = estimate["communication"]
    table = Table(title="communication per step (busiest rank; ring bus factors as nccl-tests; no overlap)",
                  title_justify="left", caption_justify="left", show_edge=False, pad_edge=False)
    for column, justify in (("group", "left"), ("op", "left"), ("n", "right"), ("calls", "right"),
                            ("message", "right"), ("sent", "right"), ("link", "left"), ("est time", "right")):
        table.add_column(column, justify=justify, no_wrap=True)
    for row in comm["per_step"]:
        link = (Text(f"inter-node {cluster['inter_node_gbps']:g} GB/s", style="yellow") if row["crosses_nodes"]
                else f"intra-node {cluster['intra_node_gbps']:g} GB/s")
        table.add_row(row["group"], row["op"], str(row["group_size"]), str(row["count"]),
                      human_bytes(row["message_bytes"]), human_bytes(row["bytes"]), link,
                      human_seconds(row["est_time_s"]))
    if comm["bottleneck"]:
        table.caption = (f"total {human_seconds(comm['est_time_s'])} per step; bottleneck: "
                         f"{comm['bottleneck']}; pipeline bubble (p-1)/(v*m) = "
                         f"{estimate['model']['pipeline_bubble']:.1%}")
    else:
        table.caption = "no communication: every axis has size 1"
    return table


TERMS = (("compute_s", "compute"), ("bubble_s", "pipeline bubble"), ("tp_s", "tp collectives"),
         ("cp_s", "cp collectives"), ("pp_s", "pp sends"), ("dp_s", "dp-cp gradients (exposed)"),
         ("ep_s", "ep dispatch (all-to-all, etp)"))  # ep_s: MoE models only


def human_rate(n: float) -> str:
    """``1.23 M``, ``456 K``, ``12.3`` (per second)."""
    for unit, size in (("G", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.3g} {unit}"
    return f"{n:.3g}"


def cluster_text(cluster: dict, sources: dict | None = None) -> Text:
    """The cluster values an estimate used and, grouped, where each came from (``--calibrate``)."""
    name = cluster.get("device") or "generic device"
    text = Text(f"cluster: {name}, {cluster['peak_tflops']:g} TFLOPS peak x {cluster['compute_efficiency']:.3g} "
                f"efficiency; intra-node {cluster['intra_node_gbps']:.3g} GB/s, {cluster['intra_node_latency_us']:.3g} "
                f"us per call; inter-node {cluster['inter_node_gbps']:.3g} GB/s, "
                f"{cluster['inter_node_latency_us']:.3g} us per call")
    by_source: dict[str, list] = {}
    for key, source in (sources or {}).items():
        by_source.setdefault(source, []).append(key)
    if by_source:
        text.append("\nsources: " + "; ".join(f"{source}: {', '.join(keys)}" for source, keys in by_source.items()),
                    style="dim")
    return text


def time_table(estimate: dict) -> Table:
    """The step-time estimate of one layout: each exposed term and its share."""
    time, model = estimate["time"], estimate["model"]
    total = time["step_time_s"]
    table = Table(title="step time (busiest stage)", title_justify="left", caption_justify="left",
                  show_edge=False, pad_edge=False)
    for column, justify in (("term", "left"), ("seconds", "right"), ("share", "right")):
        table.add_column(column, justify=justify, no_wrap=True)
    for key, label in TERMS:
        if key not in time["breakdown"]:
            continue
        value = time["breakdown"][key]
        table.add_row(label, human_seconds(value), f"{value / total:.1%}" if total else "-")
    table.add_row(Text("step", style="bold"), Text(human_seconds(total), style="bold"), "100%")
    return table


def time_summary(estimate: dict) -> Text:
    """One line under the step-time table: the totals a person compares layouts by."""
    time, model = estimate["time"], estimate["model"]
    return Text(f"{human_seconds(time['step_time_s'])} per step: {human_rate(time['tokens_per_s'])} tokens/s, "
                f"MFU {time['mfu']:.1%}; {model['num_microbatches']} micro-batches, pipeline bubble (p-1)/(v*m) = "
                f"{model['pipeline_bubble']:.1%} (docs/COST_MODEL.md, \"Step time\")")


def moe_table(estimate: dict) -> Table:
    """The mixture-of-experts rows of ``plan --model``: experts, expert axes, expert memory, dispatch."""
    moe = estimate["model"]["moe"]
    table = Table(title="mixture of experts (docs/COST_MODEL.md, \"Mixture of experts\")", title_justify="left",
                  show_edge=False, pad_edge=False, show_header=False)
    table.add_column("what", justify="left", no_wrap=True)
    table.add_column("value", justify="left")
    table.add_row("experts", f"{moe['num_moe_experts']} routed, top-{moe['moe_router_topk']}, in "
                  f"{moe['moe_layers']} MoE layers; {human_count(moe['active_parameters'])} active parameters of "
                  f"{human_count(estimate['model']['parameters'])}")
    table.add_row("expert axes", f"ep={moe['ep']} etp={moe['etp']} edp={moe['edp']}: {moe['local_experts']} "
                  "expert(s) per rank")
    table.add_row("expert memory", f"{human_bytes(moe['expert_bytes'])} per rank of the peak stage "
                  f"({human_count(moe['expert_parameters_per_rank'])} expert parameters; optimizer state "
                  "sharded over edp at ZeRO >= 1)")
    table.add_row("all-to-all", f"{moe['all_to_all_calls']} calls, {human_bytes(moe['all_to_all_bytes'])} sent per "
                  f"step; dispatch time {human_seconds(moe['dispatch_s'])} (ep all-to-alls + etp gathers, "
                  f"imbalance {moe['imbalance']:g})")
    return table


def cost_view(data: dict, show_all: bool = False) -> list:
    """The renderables ``msdist plan --model`` adds (nothing without a model)."""
    if "memory" not in data:
        return []
    moe = [moe_table(data)] if "moe" in data["model"] else []
    return [memory_table(data, show_all), communication_table(data, data["model"]["cluster"]), *moe, time_table(data),
            time_summary(data), cluster_text(data["model"]["cluster"], data["model"].get("cluster_sources"))]


def _rejected_text(result: dict) -> str:
    return ", ".join(f"{reason}: {n}" for reason, n in sorted(result["rejected"].items(), key=lambda kv: -kv[1]))


def breakdown_text(candidate: dict) -> str:
    """``compute 1.2 s + bubble 40 ms + tp 0.3 s + ...`` (only the non-zero terms)."""
    parts = [f"{key[:-2]} {human_seconds(candidate['breakdown'][key])}" for key, _ in TERMS
             if candidate["breakdown"].get(key, 0) > 0]
    return " + ".join(parts) or "0"


def render_suggest(result: dict, model_name: str) -> None:
    """The ranked candidates; nothing when none fits (:func:`nothing_fits_message` says why)."""
    candidates = result["candidates"]
    if not candidates:
        return
    nodes = result["world_size"] // result["devices_per_node"]
    title = (f"msdist suggest: {model_name} on {result['world_size']} devices ({nodes} node(s) x "
             f"{result['devices_per_node']}), {human_bytes(result['device_memory_bytes'])} per device: "
             f"{result['valid']} layout(s) fit, best {len(candidates)} shown")
    table = Table(title=title, title_justify="left", caption_justify="left", show_edge=False, pad_edge=False)
    show_mbs = len(result.get("micro_batch_sizes") or ()) > 1
    show_zero = len(result.get("zero_stages") or ()) > 1
    show_ep = result.get("moe", False)
    columns = ["#", "tp", "cp", "dp", "pp"] + (["ep", "etp"] if show_ep else []) + ["order"] + (
        ["mbs"] if show_mbs else []) + (
        ["zero"] if show_zero else []) + [
        "step time", "tokens/s", "MFU", "bubble", "peak mem", "bottleneck", "crossing"]
    for column in columns:
        table.add_column(column, justify="left" if column in ("order", "bottleneck", "crossing")
                         else "right", no_wrap=True)
    for i, c in enumerate(candidates, 1):
        crossing = [k for k in ("tp", "cp", "ep") if c["cross_node"].get(k)]
        table.add_row(str(i), str(c["tp"]), str(c["cp"]), str(c["dp"]), str(c["pp"]),
                      *([str(c["ep"]), str(c["etp"])] if show_ep else []), c["order"],
                      *([str(c["micro_batch_size"])] if show_mbs else []),
                      *([str(c["zero_stage"])] if show_zero else []),
                      human_seconds(c["step_time_s"]), human_rate(c["tokens_per_s"]), f"{c['mfu']:.1%}",
                      f"{c['pipeline_bubble']:.1%}", human_bytes(c["peak_bytes"]), c["bottleneck"] or "-",
                      Text(", ".join(crossing), style="yellow") if crossing else "-")
    rejected = _rejected_text(result)
    table.caption = Text(
        "ranked by estimated step time (compute + pipeline bubble + exposed communication), then peak memory; "
        f"bottleneck: the group communicating longest. #1: {breakdown_text(candidates[0])}"
        + (f"; rejected sizes: {rejected}" if rejected else ""))
    console = stdout_console()
    console.print(table)
    if "cluster" in result:
        console.print(cluster_text(result["cluster"], result.get("cluster_sources")))


def nothing_fits_message(result: dict) -> str:
    """One line: why no layout was suggested and what is closest."""
    world = result["world_size"]
    closest = result["closest"]
    if closest is None:
        return (f"no (tp, cp, pp) of {world} devices meets the model's constraints (rejected sizes: "
                f"{_rejected_text(result)}): change the device count or the model's shape.")
    c = closest
    experts = f" ep={c['ep']} etp={c['etp']}" if result.get("moe") else ""
    return (f"no layout of {world} devices fits {human_bytes(result['device_memory_bytes'])} per device "
            f"(rejected sizes: {_rejected_text(result)}). Closest: tp={c['tp']} cp={c['cp']} dp={c['dp']} "
            f"pp={c['pp']}{experts}, {c['why']}. Try: " + "; ".join(c["hints"]) + ".")


def warn_nothing_fits(message: str) -> None:
    stderr_console().print(Text("msdist: ", style="bold red") + Text(message), soft_wrap=True)
